"""The thin async shells and the runtime's plumbing, tested directly (kernel, mailboxes, reader, metrics, config)."""
