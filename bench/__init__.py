"""Benchmark harness: ``python -m bench <scenario>``."""
