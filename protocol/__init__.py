"""Shoal's protocol: wire messages and every rule of the design documents as pure, synchronous cores.

Nothing in this package awaits, does I/O, reads a clock or uses global randomness: time comes in as
``now`` (integer microseconds) and randomness from an injected ``random.Random``.
"""
