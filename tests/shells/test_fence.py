"""The fence of abandoned batches (docs/design.md#exactly-once-output, rule 4) on the real
reader shell and file sink: a reader stopped for a hand-off whose drain times out fences the
batches it still has in the sink before its end is reported; the new owner (another file sink
over the same output, as another process) reads them again; when the old sink later reaches
their commit point it is refused (counted, logged, nothing written), and the output holds each
row once. The control: the same run with a sink that cannot fence writes them twice."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

import pytest

from actors.kernel import Supervisor
from actors.reader import PartitionReader
from protocol.events import ReaderCommitted, ReaderStopped, StopReason, TaskEvent
from protocol.records import ChangeRecord, ColumnType, DataChange, Heartbeat, Mod
from runtime.files.sink import FileSink, read_rows
from runtime.ports import ChangeStreamSource, Sink, SinkBatch

T0 = 1_700_000_000_000_000
N = 40
_ID = ColumnType("Id", '{"code":"INT64"}', True, 1)


def _record(i: int) -> DataChange:
    ts = T0 + 1000 * i
    mod = Mod(f'{{"Id":{i}}}', "{}", "{}")
    return DataChange(ts, "00000000", f"tx{ts}", True, "T", (), (mod,), "INSERT")


def _typed(i: int) -> DataChange:
    """A record with its key's column type (the typed layout needs it)."""
    ts = T0 + 1000 * i
    mod = Mod(f'{{"Id":"{i}"}}', "{}", "{}")
    return DataChange(ts, "0", f"tx{ts}", True, "T", (_ID,), (mod,), "INSERT")


class Source(ChangeStreamSource):
    """Records 1..N in chunks of 5, then a heartbeat at the last one every 10 ms."""

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        records = [_record(i) for i in range(1, N + 1) if T0 + 1000 * i >= start_ts]
        for i in range(0, len(records), 5):
            yield records[i : i + 5]
            await asyncio.sleep(0.005)
        while True:
            yield [Heartbeat(T0 + 1000 * N)]
            await asyncio.sleep(0.01)


class Slow(FileSink):
    """The file sink, slower than any drain: it writes only by age or when closed (it does
    not take the flush hint a draining reader gives)."""

    async def flush(self, token: str) -> None:
        return


class Unfenced(Sink):
    """The file sink as a sink that cannot fence (the control)."""

    def __init__(self, inner: FileSink) -> None:
        self.inner = inner

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        return await self.inner.put(batch)


async def _wait(predicate: object, what: str, timeout: float = 20.0) -> None:
    assert callable(predicate)
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def _hand_off(out: Path, fence: bool) -> tuple[Slow, list[TaskEvent]]:
    """The old owner reads with a sink that holds everything (it commits only when closed),
    is stopped for a hand-off whose drain times out, and reports its end; then the new owner
    reads the partition from the released position into its own sink over ``out``. The old
    sink is closed last: its late commit of the abandoned batches."""
    old_events: list[TaskEvent] = []
    old = Slow(out, max_rows=10_000, max_age_s=3600, fsync=False, layout="generic")
    async with old:
        sink: Sink = old if fence else Unfenced(old)
        async with Supervisor("old") as sup:
            reader = PartitionReader(
                "p",
                T0,
                source=Source(),
                sink=sink,
                report=old_events.append,
                permit=lambda: True,
                drain_timeout=0.2,
            )
            await sup.spawn(reader)
            await _wait(lambda: old.statistics().buffered_rows >= N, "the old owner's batches")
            reader.request_stop(StopReason.HANDOFF, drain=True)
            await _wait(lambda: not reader.alive, "the old owner's end")
        (released,) = [e for e in old_events if isinstance(e, ReaderStopped)]
        assert released.watermark == T0  # nothing committed: the drain timed out
        new_events: list[TaskEvent] = []
        async with FileSink(out, max_age_s=0.02, fsync=False, layout="generic") as new:
            start = await new.durable_position("p")
            assert start is None  # the old owner's batches are not in the output
            async with Supervisor("new") as sup:
                successor = PartitionReader(
                    "p",
                    released.watermark,
                    tail=released.tail,
                    source=Source(),
                    sink=new,
                    report=new_events.append,
                    permit=lambda: True,
                )
                await sup.spawn(successor)
                await _wait(lambda: successor.committed >= T0 + 1000 * N, "the new owner")
                successor.request_stop(StopReason.HANDOFF, drain=True)
        assert any(isinstance(e, ReaderCommitted) for e in new_events)
    return old, old_events


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_late_commit_of_a_fenced_batch_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    old, _ = await _hand_off(tmp_path, fence=True)
    stats = old.statistics()
    assert stats.fenced_refused == 1
    assert stats.rows == 0
    assert stats.failures == 1
    assert "refused at its commit point" in caplog.text
    assert "fenced" in caplog.text
    rows = Counter(r["record_id"] for r in read_rows(tmp_path))
    assert len(rows) == N
    assert set(rows.values()) == {1}


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_control_without_a_fence_the_late_commit_writes_twice(tmp_path: Path) -> None:
    old, _ = await _hand_off(tmp_path, fence=False)
    assert old.statistics().fenced_refused == 0
    rows = Counter(r["record_id"] for r in read_rows(tmp_path))
    assert len(rows) == N
    assert set(rows.values()) == {2}  # the hole the fence closes


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_refused_micro_batch_holds_back_its_partitions_until_they_re_read(
    tmp_path: Path,
) -> None:
    """After a micro-batch is refused (here: it holds a fenced batch of p), a later batch of a
    partition it held (q) is refused too until q's reader re-reads from before the refused
    records: committing it would move q's recorded position past records never written."""
    # a micro-batch is cut at two rows (and never by age)
    sink = FileSink(
        tmp_path, max_rows=2, max_age_s=3600, fsync=False, layout="generic", validate=True
    )
    async with sink:
        p1 = SinkBatch("p", (_record(1),), T0 + 1000)
        first = await sink.put(p1)
        assert await sink.fence([p1]) == [False]
        second = await sink.put(SinkBatch("q", (_record(2),), T0 + 2000))  # cut now: refused
        await _wait(lambda: first.done() and second.done(), "the refused micro-batch")
        assert first.exception() is not None
        assert second.exception() is not None
        assert sink.statistics().fenced_refused == 1
        later = await sink.put(SinkBatch("q", (_record(3),), T0 + 3000))
        heartbeat = await sink.put(SinkBatch("q", (), T0 + 4000))
        assert later.exception() is not None
        assert heartbeat.exception() is not None
        assert await sink.durable_position("q") is None  # not moved past the refused record
        # q's reader re-reads from before it (a new reader of q would ask the position first,
        # as just done, which closes the gap too: it resumes from what is committed)
        await (await sink.put(SinkBatch("q", (_record(2), _record(3)), T0 + 4000)))
        position = await sink.durable_position("q")
    assert position is not None
    assert position.ts == T0 + 4000
    rows = Counter(r["commit_ts"] for r in read_rows(tmp_path))
    assert rows == Counter({T0 + 2000: 1, T0 + 3000: 1})


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_partition_back_from_another_process_is_not_held_back(tmp_path: Path) -> None:
    """A gap a refused batch left in one sink does not outlive its reader: the partition was
    read on elsewhere (another sink over the output wrote the refused records); when a new
    reader here asks for its position and goes on from there, its batches are accepted."""
    here = FileSink(
        tmp_path, max_rows=2, max_age_s=3600, fsync=False, layout="generic", validate=True
    )
    async with here:
        p1 = SinkBatch("p", (_record(1),), T0 + 1000)
        first = await here.put(p1)
        assert await here.fence([p1]) == [False]
        second = await here.put(SinkBatch("p", (_record(2),), T0 + 2000))
        await _wait(lambda: first.done() and second.done(), "the refused micro-batch")
        assert first.exception() is not None
        assert second.exception() is not None
        async with FileSink(tmp_path, max_age_s=0.02, fsync=False, layout="generic") as there:
            await (await there.put(SinkBatch("p", (_record(1), _record(2)), T0 + 2000)))
        position = await here.durable_position("p")  # a new reader of p here
        assert position is not None
        assert position.ts == T0 + 2000
        later = await here.put(SinkBatch("p", (_record(3),), T0 + 3000))  # written at close
    await later
    rows = Counter(r["commit_ts"] for r in read_rows(tmp_path))
    assert rows == Counter({T0 + 1000: 1, T0 + 2000: 1, T0 + 3000: 1})
