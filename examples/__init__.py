"""Programs that show how to use shoal; each one is run by a test."""
