"""Rung 1 and 2 of the test ladder: each pure core's rules as exact outputs and command lists."""
