"""Shoal's protocol: wire messages and every rule of the design documents as pure, synchronous cores.

Nothing in this package awaits, does I/O, reads a clock or uses global randomness: time comes in as
``now`` and randomness from an injected ``random.Random``. Each core says its time unit once,
where it takes ``now``. The rebalance protocol's cores (the task, reader, CIM and lease rules) take
integer microseconds. The output-side cores take float seconds: :class:`protocol.retry.RetryCore`
(wall clock: due times are written to Kafka) and :class:`protocol.retry.DriverElection` (the
shell's monotonic clock), :mod:`protocol.output_meta` (wall clock: producers' leases),
:func:`protocol.commit.recovery_plan` (the staged directories' modification times),
:func:`protocol.completeness.mark_due` and :func:`protocol.ending.decide` (the shell's monotonic
clock). Change records' timestamps are integer Unix microseconds everywhere
(:mod:`protocol.records`).
"""
