"""Adapters between shoal's actors and the outside world: Kafka, Spanner, Spark, launchers,
configuration and metrics. The in-memory ports used by the deterministic simulator live here too."""
