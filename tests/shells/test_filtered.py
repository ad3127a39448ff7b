"""The source wrappers: ``FilteredSource`` (dropped records become heartbeats, so watermarks
advance and nothing kept is lost or doubled through the unchanged partition reader) and
``BoundedSource`` (``[start_at, end_at]``: a query ends at the end, a partition that starts
after it has nothing to read)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

import pytest

from actors.kernel import Supervisor
from actors.reader import PartitionReader
from protocol.filters import RecordFilter
from protocol.records import ChangeRecord, ChildPartitions, DataChange, Heartbeat, ModType
from protocol.task import ReaderFinished, TaskEvent
from runtime.bounded import BoundedSource
from runtime.filtered import FilteredSource
from runtime.ports import ChangeStreamSource, Sink, SinkBatch
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams

T0 = 1_700_000_000_000_000


def rec(ts: int, table: str, seq: str = "0", mod_type: ModType = "INSERT") -> DataChange:
    return DataChange(ts, seq, f"tx{ts}", False, table, (), (), mod_type)


class Scripted(ChangeStreamSource):
    """A partition whose records are ``records``, sent one per batch from ``start_ts``
    (inclusive) up to ``end_ts``; then the query ends (no children). Remembers its queries."""

    def __init__(self, records: Sequence[ChangeRecord]) -> None:
        self.records = list(records)
        self.queries: list[tuple[str | None, int, int | None]] = []

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        self.queries.append((token, start_ts, end_ts))
        for r in self.records:
            ts = r.commit_ts if isinstance(r, DataChange) else getattr(r, "timestamp", 0)
            if ts >= start_ts and (end_ts is None or ts <= end_ts):
                yield [r]
                await asyncio.sleep(0)


class FlakySink(Sink):
    """Commits every batch, except that it fails the ``fail_at``-th put (1-based) once."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.puts = 0
        self.committed: list[SinkBatch] = []

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        self.puts += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.puts == self.fail_at:
            future.set_exception(RuntimeError("sink down (injected)"))
        else:
            self.committed.append(batch)
            future.set_result(None)
        return future


async def _read(source: Scripted | FilteredSource, sink: FlakySink) -> ReaderFinished:
    events: list[TaskEvent] = []
    async with Supervisor("test") as sup:
        reader = PartitionReader(
            "p", T0, source=source, sink=sink, report=events.append, permit=lambda: True
        )
        await sup.spawn(reader)
        async with asyncio.timeout(10):
            while not any(isinstance(e, ReaderFinished) for e in events):
                await asyncio.sleep(0.01)
    (finished,) = [e for e in events if isinstance(e, ReaderFinished)]
    return finished


@pytest.mark.asyncio
async def test_dropped_records_become_heartbeats_in_place_and_are_counted() -> None:
    records: list[ChangeRecord] = [rec(T0 + 1, "Orders"), rec(T0 + 2, "Audit"), Heartbeat(T0 + 3)]
    source = FilteredSource(Scripted(records), RecordFilter.parse(None, "audit", None))
    got = [b async for b in source.query("p", T0, None)]
    assert got == [[rec(T0 + 1, "Orders")], [Heartbeat(T0 + 2)], [Heartbeat(T0 + 3)]]
    stats = source.statistics()
    assert (stats.records_kept, stats.records_filtered) == (1, 1)


@pytest.mark.asyncio
async def test_a_partition_with_everything_filtered_still_moves_its_watermark() -> None:
    records = [rec(T0 + i, "Audit") for i in range(1, 6)]
    sink = FlakySink()
    finished = await _read(
        FilteredSource(Scripted(records), RecordFilter.parse("Orders", None, None)), sink
    )
    assert finished.watermark == T0 + 5  # not stuck at the start
    assert all(not b.records for b in sink.committed)


@pytest.mark.asyncio
@pytest.mark.parametrize("order", ["dropped-first", "kept-first"])
async def test_a_kept_record_beside_a_dropped_one_at_the_same_timestamp_comes_once(
    order: str,
) -> None:
    """One commit at ``t`` touches a filtered table and a kept one. The sink fails a batch
    once, so the reader re-reads from its watermark inclusive: the kept record is delivered
    exactly once, whichever comes first (the heartbeat at ``t`` adds no identity)."""
    t = T0 + 10
    dropped, kept = rec(t, "Audit", seq="0"), rec(t, "Orders", seq="1")
    pair = [dropped, kept] if order == "dropped-first" else [kept, dropped]
    records = [rec(T0 + 5, "Orders"), *pair, rec(T0 + 20, "Orders")]
    rule = RecordFilter.parse(None, "Audit", None)
    for fail_at in (None, 2, 3):
        sink = FlakySink(fail_at)
        finished = await _read(FilteredSource(Scripted(records), rule), sink)
        delivered = [r for b in sink.committed for r in b.records]
        assert [r.identity for r in delivered] == [
            rec(T0 + 5, "Orders").identity,
            kept.identity,
            rec(T0 + 20, "Orders").identity,
        ], (order, fail_at)
        assert finished.watermark == T0 + 20
        assert finished.children == ()


@pytest.mark.asyncio
async def test_control_without_the_filter_every_record_comes_once() -> None:
    """Control of the tests above, same script and faults: no filter, all records, once."""
    t = T0 + 10
    records = [rec(T0 + 5, "Orders"), rec(t, "Audit"), rec(t, "Orders", seq="1")]
    for fail_at in (None, 2, 3):
        sink = FlakySink(fail_at)
        await _read(Scripted(records), sink)
        delivered = [r.identity for b in sink.committed for r in b.records]
        assert delivered == [r.identity for r in records], fail_at


@pytest.mark.asyncio
async def test_bounds_clamp_the_start_and_end_every_partition_query() -> None:
    inner = Scripted([rec(T0 + i, "T") for i in range(10)])
    bounded = BoundedSource(inner, start_at=T0 + 3, end_at=T0 + 6)
    got = [b async for b in bounded.query("p", T0, None)]
    assert [r.commit_ts for b in got for r in b if isinstance(r, DataChange)] == [
        T0 + 3,
        T0 + 4,
        T0 + 5,
        T0 + 6,
    ]
    assert inner.queries == [("p", T0 + 3, T0 + 6)]
    # a caller's own earlier end is kept; the root query keeps its start
    _ = [b async for b in bounded.query("p", T0 + 4, T0 + 5)]
    _ = [b async for b in bounded.query(None, T0, None)]
    assert inner.queries[1:] == [("p", T0 + 4, T0 + 5), (None, T0, T0 + 6)]
    # a partition that begins after the end: nothing, and no query at all
    assert [b async for b in bounded.query("p", T0 + 7, None)] == []
    assert len(inner.queries) == 3
    with pytest.raises(ValueError, match="before start_at"):
        BoundedSource(inner, start_at=T0 + 2, end_at=T0 + 1)


@pytest.mark.asyncio
async def test_a_simulated_partition_bounded_by_end_at_ends_there_with_no_children() -> None:
    """The simulator honours ``end_ts``: the query ends once the clock passes it, with every
    record at or before it and no child-partition record, exactly the model's records."""
    params = StreamParams(
        seed=3,
        roots=1,
        start_ts=T0,
        round_us=10_000_000,
        split_p=0.0,
        move_p=0.0,
        merge_p=0.0,
        records_per_s=200.0,
    )
    model = StreamModel(params)
    now = [T0 + 60_000_000]  # the stream is a minute old: all of the window is in the past
    source = SimulatedSource(model, clock=lambda: now[0], poll_s=0.001)
    (root,) = model.roots
    start_at, end_at = T0 + 2_000_000, T0 + 4_000_000
    bounded = BoundedSource(source, start_at=start_at, end_at=end_at)
    got = [r async for b in bounded.query(root, T0, None) for r in b]
    data = [r for r in got if isinstance(r, DataChange)]
    assert not any(isinstance(r, ChildPartitions) for r in got)
    expected = [r for r in model.expected(end_at) if r.commit_ts >= start_at]
    assert data == expected
    assert len(expected) > 100
