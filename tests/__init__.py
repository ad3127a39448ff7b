"""Shoal test suite."""
