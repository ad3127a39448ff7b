"""Rung 3: hypothesis state machines over the synchronous cores."""
