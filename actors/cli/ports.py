"""The run's view of its ports: each port's health (:class:`~runtime.metrics.FailureStreak`) and
whether it failed for good (``fatal``: the run then stops, ``protocol/ending.py``).

:class:`Ledger` wraps the shared sink (it also tallies what was committed, for a bounded run's
self-check, ``actors/cli/selfcheck.py``), :class:`WatchedSource` the change-stream source. Each
calls ``changed`` when a fact of the run's end may have changed (a batch settled, a port failed),
so the run looks again at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence

from actors.cli.selfcheck import CommitTally
from protocol.dedup import Position
from protocol.records import ChangeRecord
from runtime.metrics import FailureStreak, describe_error
from runtime.ports import ChangeStreamSource, Sink, SinkBatch, SinkWrapper, Unrecoverable

__all__ = ["Ledger", "RunFailed", "WatchedSource"]


class RunFailed(RuntimeError):
    """A component failed for good; the message says which and why."""


class Ledger(SinkWrapper):
    """The shared sink, tallying what it committed per partition (bounded runs of a simulated
    stream or of the emulator's write load only: their self-check, ``actors/cli/selfcheck.py``)
    and whether every batch failed since the last commit (``health``)."""

    def __init__(
        self, inner: Sink, *, check: bool, changed: Callable[[], None] | None = None
    ) -> None:
        """``changed``: called when a batch committed or the sink failed for good."""
        super().__init__(inner)
        self._changed = changed
        self.tally: CommitTally | None = CommitTally() if check else None
        self.health = FailureStreak()
        self.records = 0
        self.rows = 0
        self.fatal: Unrecoverable | None = None  # the sink failed for good: the run stops

    @property
    def duplicates(self) -> int:
        """Records committed again (with the check)."""
        return 0 if self.tally is None else self.tally.duplicates

    @property
    def distinct_rows(self) -> int:
        """Rows of the records committed for the first time (with the check)."""
        return 0 if self.tally is None else self.tally.distinct_rows

    async def durable_position(self, token: str) -> Position | None:
        try:
            return await self.inner.durable_position(token)
        except Unrecoverable as exc:  # e.g. an unreadable progress file: the run stops
            self._fail(exc)
            raise

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        try:
            future = await self.inner.put(batch)
        except Exception as exc:
            self.health.failure(time.monotonic(), describe_error(exc))
            if isinstance(exc, Unrecoverable):
                self._fail(exc)
            raise
        records, token, tally = batch.records, batch.token, self.tally
        number = tally.handed(token) if tally is not None else 0

        def done(f: asyncio.Future[None]) -> None:
            error = None if f.cancelled() else f.exception()
            if tally is not None:  # in the order handed over: a failed batch counts nothing
                tally.settled(token, number, None if f.cancelled() or error else records)
            if f.cancelled():
                return
            if error is not None:
                self.health.failure(time.monotonic(), describe_error(error))
                if isinstance(error, Unrecoverable):
                    self._fail(error)
                return
            self.health.success(time.monotonic())
            self.records += len(records)
            self.rows += sum(len(r.mods) for r in records)
            # (a task's CountingSink counts this batch in its own callback, queued after this
            # one: the run, woken through the loop, sees it counted)
            if self._changed is not None:
                self._changed()

        future.add_done_callback(done)
        return future

    def _fail(self, error: Unrecoverable) -> None:
        self.fatal = self.fatal or error
        if self._changed is not None:
            self._changed()


class WatchedSource(ChangeStreamSource):
    """A source that keeps a :class:`FailureStreak` of its queries: a batch counts as success,
    a query ending in an exception as a failure (a cancelled one as neither)."""

    def __init__(
        self, inner: ChangeStreamSource, *, changed: Callable[[], None] | None = None
    ) -> None:
        """``changed``: called when a query failed for good."""
        self.inner = inner
        self._changed = changed
        self.health = FailureStreak()
        self.fatal: Unrecoverable | None = None  # a query failed for good: the run stops

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        try:
            async for batch in self.inner.query(token, start_ts, end_ts):
                self.health.success(time.monotonic())
                yield batch
        except Exception as exc:
            self.health.failure(time.monotonic(), describe_error(exc))
            if isinstance(exc, Unrecoverable):
                self.fatal = self.fatal or exc
                if self._changed is not None:
                    self._changed()
            raise
