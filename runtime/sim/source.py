"""``SimulatedSource``: the ``ChangeStreamSource`` port over the seeded ``StreamModel``.

The default source of the demo and the benchmarks. A partition query behaves like Spanner's:

- ``token=None`` returns the root partitions as one ``ChildPartitions`` record, then ends;
- a record becomes visible once the clock has passed its commit time; records come in commit
  order, in batches of at most ``max_batch``;
- when a partition carries no data for ``heartbeat_ms`` a ``Heartbeat`` is emitted at the time
  the silence reached ``heartbeat_ms`` (so a heartbeat at ``t`` promises nothing at or before
  ``t`` is still to come);
- when the partition ends, its ``ChildPartitions`` record follows its last data, and the iterator
  ends; with ``end_ts`` it ends once the clock passes ``end_ts`` (records at ``end_ts``
  included).

The clock returns model-time microseconds. By default it is the monotonic wall clock mapped onto
the model's ``start_ts`` at construction, running ``speedup`` times faster than real time; inject
any callable (a fake clock in tests) instead. Waiting polls every ``poll_s`` seconds of real time
(via an injectable ``sleep``). Record content depends only on the seed; with a deterministic clock
the batches and heartbeats are deterministic too.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable

import msgspec

from protocol.records import ChangeRecord, DataChange, Heartbeat
from runtime.ports import ChangeStreamSource, Unrecoverable
from runtime.sim.stream import PartitionInfo, StreamModel, StreamParams

__all__ = ["SimSourceStats", "SimulatedSource", "UnknownPartition"]


class UnknownPartition(Unrecoverable):
    """A partition token this simulated stream never makes: the connector's sync topic was
    written by a run of another stream (another seed or start). Retrying cannot help."""


class SimSourceStats(msgspec.Struct, frozen=True):
    queries_started: int
    queries_active: int
    batches: int
    records: int
    heartbeats: int


class SimulatedSource(ChangeStreamSource):
    """``ChangeStreamSource`` over a ``StreamModel``; see the module docstring."""

    def __init__(
        self,
        model: StreamModel,
        *,
        clock: Callable[[], int] | None = None,
        speedup: float = 1.0,
        heartbeat_ms: int = 1000,
        max_batch: int = 500,
        poll_s: float = 0.02,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        if heartbeat_ms <= 0 or max_batch < 1 or poll_s <= 0:
            raise ValueError("heartbeat_ms, max_batch and poll_s must be positive")
        self.model = model
        self._heartbeat_us = heartbeat_ms * 1000
        self._max_batch = max_batch
        self._poll_s = poll_s
        self._sleep = sleep
        if clock is None:
            origin_ns = time.monotonic_ns()
            start = model.params.start_ts

            def wall_clock() -> int:
                return start + int((time.monotonic_ns() - origin_ns) / 1000 * speedup)

            clock = wall_clock
        self._clock = clock
        self._started = 0
        self._active = 0
        self._batches = 0
        self._records = 0
        self._heartbeats = 0

    @classmethod
    def from_params(cls, params: StreamParams, **kwargs: object) -> SimulatedSource:
        return cls(StreamModel(params), **kwargs)  # type: ignore[arg-type]

    def now(self) -> int:
        """The current model time (micros)."""
        return self._clock()

    async def watched_tables(self) -> tuple[str, ...]:
        """The tables the simulated stream's records belong to."""
        return tuple(self.model.params.tables)

    def statistics(self) -> SimSourceStats:
        return SimSourceStats(
            self._started, self._active, self._batches, self._records, self._heartbeats
        )

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        """Records of ``token`` from ``start_ts`` (inclusive) on; see the module docstring."""
        model = self.model
        if token is None:
            self._started += 1
            self._batches += 1
            self._records += 1
            yield [model.root_record()]
            return
        if token not in model.partitions:
            # A token from the sync topic's replay, found by an earlier process: this process's
            # model makes partitions only as queries reach their time, and a restarted connector
            # asks for its live partitions, not for the roots. A partition starts at or after
            # the boundary that made it, and a query starts at or after the partition's start.
            model.generate_until(min(start_ts, self._clock()))
        if token not in model.partitions:
            p = model.params
            raise UnknownPartition(
                f"simulated stream: partition token {token!r} is not one of this stream's "
                f"(seed {p.seed}, start {p.start_ts}): the connector's sync topic was written "
                "by a run of another simulated stream; give the same sim.seed and sim.start_ts "
                "(or start_at) as that run, or use a new connector name"
            )
        self._started += 1
        self._active += 1
        try:
            async for batch in self._partition(token, start_ts, end_ts):
                self._batches += 1
                self._records += len(batch)
                self._heartbeats += sum(1 for r in batch if isinstance(r, Heartbeat))
                yield batch
        finally:
            self._active -= 1

    async def _partition(
        self, token: str, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        model = self.model
        info = model.info(token)
        hb = self._heartbeat_us
        window = model.params.round_us
        max_batch = self._max_batch
        first = max(start_ts, info.start_ts)
        silent_since = first - 1  # time of the last record or heartbeat emitted
        ahead: deque[DataChange] = deque()  # fetched from the model, not yet emitted
        fetched_to = first - 1  # data at or before this time is in ``ahead`` or emitted
        while True:
            limit = self._clock()
            if end_ts is not None:
                limit = min(limit, end_ts)
            model.generate_until(max(limit, first))
            out: list[ChangeRecord] = []
            data = 0
            while data < max_batch:
                if not ahead and fetched_to < limit and not _fetched_all(info, fetched_to):
                    hi = fetched_to + window
                    ahead.extend(
                        r
                        for r in model.records(token, fetched_to + 1, hi)
                        if isinstance(r, DataChange)
                    )
                    fetched_to = hi
                    continue
                if ahead and ahead[0].commit_ts <= limit:
                    rec = ahead.popleft()
                    silent_since = _heartbeats(out, silent_since, rec.commit_ts, hb)
                    out.append(rec)
                    silent_since = rec.commit_ts
                    data += 1
                    continue
                break
            caught_up = data < max_batch
            ended = (
                caught_up
                and not ahead
                and info.end_ts is not None
                and info.end_ts <= limit
                and _fetched_all(info, fetched_to)
            )
            if ended:
                assert info.end_ts is not None
                _heartbeats(out, silent_since, info.end_ts, hb)
                out.append(model.child_record(token))
            elif caught_up:
                while limit - silent_since >= hb:
                    silent_since += hb
                    out.append(Heartbeat(silent_since))
            for i in range(0, len(out), max_batch):
                yield out[i : i + max_batch]
            if ended or (caught_up and end_ts is not None and limit >= end_ts):
                return
            if caught_up:
                await self._sleep(self._poll_s)


def _fetched_all(info: PartitionInfo, fetched_to: int) -> bool:
    """Every data record of the partition is fetched (it ended and we read up to its end)."""
    return info.end_ts is not None and fetched_to >= info.end_ts - 1


def _heartbeats(out: list[ChangeRecord], silent_since: int, before: int, hb: int) -> int:
    """Append the heartbeats due in a silence from ``silent_since`` until ``before``."""
    while before - silent_since > hb:
        silent_since += hb
        out.append(Heartbeat(silent_since))
    return silent_since
