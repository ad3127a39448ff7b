"""When a sink that gathers batches into micro-batches need not wait any longer (the Spark
bridge's ``Batcher``, the file sink): a pure rule, no clock of its own.

A sink gathers the batches readers hand it for up to its ``max_age`` (or until it has
``max_rows``), so that one write carries many batches. A reader that waits only for its batches
to commit — its query ended at the partition's end or at the run's end bound, or it drains
before it stops — says so (``Sink.flush``; the reader core's ``FlushBatches``,
docs/design.md#reading-a-partition): nothing more comes from it, and a partition's children are
read only once it is finished. Once **every** reader with a batch in the gathered micro-batch
has said so, nothing more is coming for it and waiting out its age only delays the children:
it is due now. While any of them still reads, it is not: a reader that ends early does not cut
a small micro-batch of its own while the others' rows still stream in (each write has a fixed
cost). What joins the micro-batch after that moment, before it is cut, rides along.
"""

from __future__ import annotations

__all__ = ["Flushes"]


class Flushes:
    """The partitions with a batch in the gathered micro-batch, and whether each one's reader
    flushed since its last batch joined."""

    def __init__(self) -> None:
        self._flushed: dict[str, bool] = {}
        self._reading = 0  # partitions whose reader did not flush

    def added(self, token: str) -> None:
        """A batch of ``token`` joined: its reader reads on (until it flushes again)."""
        if self._flushed.get(token) is not False:
            self._reading += 1
        self._flushed[token] = False

    def flushed(self, token: str) -> bool:
        """The reader of ``token`` flushed: whether now every partition gathered has (False
        when none of ``token`` is gathered: nothing changes)."""
        if self._flushed.get(token) is False:
            self._flushed[token] = True
            self._reading -= 1
            return self._reading == 0
        return False

    def done(self) -> bool:
        """Whether something is gathered and every partition's reader flushed."""
        return bool(self._flushed) and self._reading == 0

    def clear(self) -> None:
        """The micro-batch was cut (or dropped): nothing is gathered."""
        self._flushed.clear()
        self._reading = 0

    def validate(self) -> None:
        assert self._reading == sum(1 for f in self._flushed.values() if not f), self._reading
