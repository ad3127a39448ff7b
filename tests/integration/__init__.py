"""Rung 5: real parts: the embedded Kafka-compatible broker, the Spanner emulator, local PySpark, the command line."""
