"""The partition reader actor: a hand-off drain whose in-flight batch the sink fails stops
cleanly at the last committed watermark (the next owner re-reads from there)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence

import pytest

from actors.kernel import Supervisor
from actors.reader import PartitionReader
from protocol.records import ChangeRecord, DataChange, Heartbeat, Mod
from protocol.task import ReaderFailed, ReaderStopped, StopReason, TaskEvent
from runtime.ports import ChangeStreamSource, Sink, SinkBatch
from runtime.sim.memory import MemorySink
from tests.helpers import wait_for

T0 = 1_700_000_000_000_000


class SteadySource(ChangeStreamSource):
    """One data record every 10 ms, then a heartbeat."""

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        ts = start_ts
        while True:
            ts += 1000
            record = DataChange(
                commit_ts=ts,
                record_sequence="00000000",
                server_transaction_id=f"tx{ts}",
                is_last_record_in_transaction_in_partition=True,
                table="T",
                column_types=(),
                mods=(Mod('{"Id":1}', "{}", "{}"),),
                mod_type="INSERT",
            )
            yield [record, Heartbeat(ts)]
            await asyncio.sleep(0.01)


class SlowFailingSink(Sink):
    """Commits the first batches at once; from the third on, fails each after 0.2 s."""

    def __init__(self) -> None:
        self.puts = 0

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        self.puts += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.puts < 3:
            future.set_result(None)
        else:
            asyncio.get_running_loop().call_later(
                0.2, future.set_exception, RuntimeError("sink down (injected)")
            )
        return future


@pytest.mark.asyncio
async def test_a_drain_whose_batch_the_sink_fails_stops_at_the_committed_watermark() -> None:
    events: list[TaskEvent] = []
    sink = SlowFailingSink()
    async with Supervisor("test") as sup:
        reader = PartitionReader(
            "p1",
            T0,
            source=SteadySource(),
            sink=sink,
            report=events.append,
            permit=lambda: True,
            drain_timeout=2.0,
        )
        await sup.spawn(reader)
        # two batches committed, the third in the sink (to fail): then the drain is asked for
        await wait_for(lambda: sink.puts >= 3, 5, "the third batch handed to the sink")
        reader.request_stop("handoff", drain=True)
        await wait_for(
            lambda: any(isinstance(e, ReaderStopped) for e in events), 5, "the reader's stop"
        )
    stopped = [e for e in events if isinstance(e, ReaderStopped)]
    assert len(stopped) == 1
    # the two committed batches, and nothing the sink failed
    assert stopped[0].watermark == T0 + 2000


class SteadySink(Sink):
    """Commits every batch at once, and keeps them."""

    def __init__(self) -> None:
        self.batches: list[SinkBatch] = []

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        self.batches.append(batch)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


@pytest.mark.asyncio
async def test_a_lapsed_lease_and_a_stop_together_report_one_stop_once_the_reader_is_dead() -> None:
    """The lease lapses while the task also asks the reader to stop. The reader must report
    its end once, and only when it is no longer alive: the core restarts a stopped partition
    at once, and a reader that still looked alive made the task drop that restart."""
    events: list[tuple[TaskEvent, bool]] = []
    permitted = [True]
    reader: PartitionReader

    def permit() -> bool:
        if not permitted[0]:
            reader.request_stop("not-permitted", drain=False)  # the core's stop, at once
        return permitted[0]

    async with Supervisor("test") as sup:
        reader = PartitionReader(
            "p1",
            T0,
            source=SteadySource(),
            sink=SteadySink(),
            report=lambda e: events.append((e, reader.alive)),
            permit=permit,
        )
        await sup.spawn(reader)
        await wait_for(lambda: reader.committed > T0, 5, "a batch committed")
        permitted[0] = False
        await wait_for(lambda: not reader.alive, 5, "the reader ended")
        await wait_for(
            lambda: any(isinstance(e, ReaderStopped) for e, _ in events), 5, "its stop reported"
        )
    # the supervisor has ended: the reader can report nothing more
    stops = [(e, alive) for e, alive in events if isinstance(e, ReaderStopped)]
    assert len(stops) == 1, stops
    assert stops[0][1] is False  # reported once dead
    assert stops[0][0].watermark > T0


class StallingSource(ChangeStreamSource):
    """Each query sends one heartbeat, then nothing at all (a stalled stream)."""

    def __init__(self) -> None:
        self.queries: list[int] = []
        self.closed = 0

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        self.queries.append(start_ts)
        try:
            yield [Heartbeat(start_ts + 1000)]
            await asyncio.Event().wait()
        finally:
            self.closed += 1


async def _read_until(
    source: ChangeStreamSource,
    done: Callable[[], bool],
    *,
    stall_timeout: float,
    max_backoff: float,
    within: float,
) -> list[TaskEvent]:
    """Read partition ``p1`` from ``source`` until ``done()``, then stop; what it reported."""
    events: list[TaskEvent] = []
    async with Supervisor("test") as sup:
        reader = PartitionReader(
            "p1",
            T0,
            source=source,
            sink=SteadySink(),
            report=events.append,
            permit=lambda: True,
            stall_timeout=stall_timeout,
            max_backoff=max_backoff,
        )
        await sup.spawn(reader)
        async with asyncio.timeout(within):
            while not done():
                await asyncio.sleep(0.02)
        reader.request_stop(StopReason.NOT_WANTED, drain=False)
    return events


@pytest.mark.asyncio
async def test_a_stalled_query_is_restarted_from_the_committed_watermark() -> None:
    """The full chaos run found emulator partition streams silent for over 90 s while their
    readers waited: a query that sends nothing, not even a heartbeat, within ``stall_timeout``
    is abandoned (its stream closed) and started again from the committed watermark."""
    source = StallingSource()
    events = await _read_until(
        source, lambda: len(source.queries) >= 3, stall_timeout=0.2, max_backoff=0.05, within=5
    )
    failures = [e for e in events if isinstance(e, ReaderFailed)]
    assert len(failures) >= 2
    assert "nothing from the source for 0.2s" in failures[0].error
    assert source.queries[0] == T0
    assert source.queries[1] == T0 + 1000  # from the heartbeat it had committed
    assert source.closed >= 2  # the stalled streams were closed, not left open


class SilentSource(ChangeStreamSource):
    """Each query sends nothing at all (an overloaded emulator's first answer not coming)."""

    def __init__(self) -> None:
        self.queries = 0

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        self.queries += 1
        await asyncio.Event().wait()
        yield []


@pytest.mark.asyncio
async def test_stalls_in_a_row_wait_longer_each_time() -> None:
    """A query restarted for a stall starts a new wait for the source's first answer; a slow
    source (the overloaded emulator) would never answer within a fixed timeout, and each
    restart loads it more. So each stall in a row doubles the wait, up to eight times."""
    source = SilentSource()
    events = await _read_until(
        source, lambda: source.queries >= 6, stall_timeout=0.05, max_backoff=0.01, within=10
    )
    waits = [e.error.split("for ")[1].split("s ")[0] for e in events if isinstance(e, ReaderFailed)]
    assert waits[:5] == ["0.05", "0.1", "0.2", "0.4", "0.4"]


@pytest.mark.asyncio
async def test_a_reader_resumes_from_the_sinks_newer_position() -> None:
    """The memory sink keeps each partition's position; a new reader of the partition, given
    an older one by its task, starts from the sink's and writes nothing twice."""
    sink = MemorySink()
    first = await _read_until_committed(sink, T0, 3)
    position = await sink.durable_position("p1")
    assert position is not None
    assert position.ts >= first
    before = dict(sink.rows)
    await _read_until_committed(sink, T0, position.ts + 2000)
    assert all(count == 1 for count in sink.rows.values())  # raw commits: none twice
    assert before.keys() < sink.rows.keys()  # and the second reader wrote new rows


async def _read_until_committed(sink: MemorySink, start: int, until: int) -> int:
    events: list[TaskEvent] = []
    async with Supervisor("test") as sup:
        reader = PartitionReader(
            "p1", start, source=SteadySource(), sink=sink, report=events.append, permit=lambda: True
        )
        await sup.spawn(reader)
        async with asyncio.timeout(5):
            while reader.committed < (until if until > T0 else T0 + until * 1000):
                await asyncio.sleep(0.01)
        reader.request_stop(StopReason.HANDOFF, drain=True)
    return reader.committed


@pytest.mark.asyncio
async def test_a_lease_that_runs_out_after_the_chunk_was_permitted_hands_the_sink_nothing() -> None:
    """The permit read when a chunk is handled held; by the time its batch is put into the sink
    it no longer does (a pause landed in between: the zombie delivery a node test saw once).
    The permit is asked again right before the put: the batch fails instead, and the reader
    stops at the committed position without the sink ever seeing a batch."""
    events: list[TaskEvent] = []
    asked = [0]

    def permit() -> bool:
        asked[0] += 1
        return asked[0] == 1  # the first chunk's check only

    sink = SteadySink()
    async with Supervisor("test") as sup:
        reader = PartitionReader(
            "p1",
            T0,
            source=SteadySource(),
            sink=sink,
            report=events.append,
            permit=permit,
            max_backoff=0.05,
        )
        await sup.spawn(reader)
        async with asyncio.timeout(5):
            while reader.alive:
                await asyncio.sleep(0.01)
    assert sink.batches == []
    stops = [e for e in events if isinstance(e, ReaderStopped)]
    assert [s.watermark for s in stops] == [T0]
    assert any("no longer read" in e.error for e in events if isinstance(e, ReaderFailed))
