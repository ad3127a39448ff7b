"""Actors: the async shells around the protocol cores."""
