"""Adapters between shoal's actors and the outside world: Kafka, Spanner, Spark, launchers,
configuration and metrics. The in-memory ports used by the deterministic simulator live here too.

Importing this package (or any module in it) changes nothing in the process: process-wide library
settings are applied where the client that needs them is created (see :mod:`runtime.compat`)."""
