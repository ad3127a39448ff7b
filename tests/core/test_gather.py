"""protocol/gather.py: a gathered micro-batch is due once every reader in it flushed."""

from __future__ import annotations

from protocol.gather import Flushes


def test_due_only_once_every_partition_gathered_flushed() -> None:
    f = Flushes()
    assert not f.done()  # nothing gathered
    f.added("a")
    f.added("b")
    f.added("a")  # a second batch of a: still one partition
    assert not f.flushed("x")  # nothing of x gathered
    assert not f.flushed("a")
    assert not f.done()
    assert f.flushed("b")  # the last one: now
    assert f.done()
    assert not f.flushed("b")  # again: no new transition
    f.validate()


def test_a_batch_after_a_flush_reads_on() -> None:
    """A reader that flushed and then hands more (its batch failed, the query restarted)
    reads on again until it flushes again."""
    f = Flushes()
    f.added("a")
    assert f.flushed("a")
    f.added("a")
    assert not f.done()
    assert f.flushed("a")
    f.clear()
    assert not f.done()
    f.validate()
