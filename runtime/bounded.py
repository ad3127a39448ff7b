"""``BoundedSource``: a ``ChangeStreamSource`` read only inside ``[start_at, end_at]``
(``--start-at`` / ``--end-at``), so the partition reader stays unchanged.

* ``end_at``: every partition query gets ``end_ts = end_at`` (the smaller of it and the
  caller's). Spanner, the emulator and the simulator end such a query after the records at
  ``end_at`` (inclusive) when the partition lives on past it; the reader then sees a query that
  ended without child-partition records, which is how a partition *finishes with no children*.
  A query asked to start after ``end_at`` (a partition that begins after the end) returns
  nothing at once: finished too. Once every partition is finished, nothing is left to read and
  a run ends by itself (``actors/cli/run.py``).
* ``start_at``: a partition query never starts before ``start_at``. Against Spanner this changes
  nothing (the roots are asked for at ``start_at`` and every partition begins at or after its
  parent's query start); the simulator's roots begin at its stream's start, which may be
  earlier, and this keeps their older records out.

The root query (``token=None``) keeps the caller's start: it is the connector's start, which
the leader takes from the same setting (see ``protocol/task.py``, ``need_roots``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from protocol.records import ChangeRecord
from runtime.ports import ChangeStreamSource

__all__ = ["BoundedSource"]


class BoundedSource(ChangeStreamSource):
    """``inner`` read from ``start_at`` (None: no lower bound) to ``end_at`` (None: no end)."""

    def __init__(
        self, inner: ChangeStreamSource, *, start_at: int | None = None, end_at: int | None = None
    ) -> None:
        if start_at is not None and end_at is not None and end_at < start_at:
            raise ValueError(f"end_at {end_at} is before start_at {start_at}")
        self.inner = inner
        self.start_at = start_at
        self.end_at = end_at

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        start, end = start_ts, end_ts
        if token is not None and self.start_at is not None:
            start = max(start, self.start_at)
        if self.end_at is not None:
            end = self.end_at if end is None else min(end, self.end_at)
        if token is not None and end is not None and start > end:
            return  # the partition begins after the end: nothing to read, finished
        async for batch in self.inner.query(token, start, end):
            yield list(batch)
