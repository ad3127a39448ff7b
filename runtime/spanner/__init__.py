"""Everything Spanner-side: the emulator launcher, the connection config, the fast change-record
decoder, the change-stream reader (``SpannerSource``) and a write-load generator for tests and
benchmarks.

Imports of the Google client happen inside these modules only; the rest of the runtime talks to
``runtime.ports.ChangeStreamSource``.
"""
