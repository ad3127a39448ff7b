"""Rung 4: the seeded many-task simulation (and the in-memory node cluster it stands beside)."""
