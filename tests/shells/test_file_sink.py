"""The parquet file sink (``--sink files``) drops re-reads by the one de-duplication rule: a
partition re-read from its watermark inclusive writes each record once."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.records import DataChange, Mod
from runtime.files.sink import FileSink, read_rows
from runtime.ports import SinkBatch


def rec(ts: int, seq: str) -> DataChange:
    mod = Mod(keys='{"id": 1}', new_values="{}", old_values="{}")
    return DataChange(ts, seq, f"txn{ts}", False, "T", (), (mod,), "INSERT")


@pytest.mark.asyncio
async def test_a_re_read_partition_is_written_once(tmp_path: Path) -> None:
    first = (rec(10, "0"), rec(20, "0"), rec(20, "1"))
    # the reader failed after committing 20 and re-reads from 20 inclusive; one record at 20
    # is new, and so is 30; another partition has its own tail
    again = (rec(20, "0"), rec(20, "1"), rec(20, "2"), rec(30, "0"))
    async with FileSink(tmp_path, max_age_s=0.01) as sink:
        await (await sink.put(SinkBatch("p", first, 20)))
        await (await sink.put(SinkBatch("p", again, 30)))
        await (await sink.put(SinkBatch("q", first, 20)))
        stats = sink.statistics()
    rows = sorted(
        (r["partition_token"], r["commit_ts"], r["record_sequence"]) for r in read_rows(tmp_path)
    )
    assert rows == [
        ("p", 10, "0"),
        ("p", 20, "0"),
        ("p", 20, "1"),
        ("p", 20, "2"),
        ("p", 30, "0"),
        ("q", 10, "0"),
        ("q", 20, "0"),
        ("q", 20, "1"),
    ]
    assert stats.duplicates_dropped == 2


def _rows(n: int, at: int) -> tuple[DataChange, ...]:
    return tuple(rec(at + i, "0") for i in range(n))


@pytest.mark.asyncio
@pytest.mark.parametrize("max_buffered", [None, 40])
async def test_readers_are_paced_by_what_the_sink_commits(
    tmp_path: Path, max_buffered: int | None
) -> None:
    """By default the sink accepts two micro-batches' rows (``2 * max_rows``): one being written,
    one gathering; a put past that waits until the write commits, so a reader on a backlog is
    held to the sink's pace instead of buffering ahead of it. The control: a larger
    ``max_buffered_rows`` takes the third batch at once."""
    import asyncio
    import threading

    release = threading.Event()
    async with FileSink(
        tmp_path, max_rows=4, max_age_s=0.5, max_buffered_rows=max_buffered
    ) as sink:
        commit = sink._commit_batch

        def slow_commit(*args: object, **kwargs: object) -> None:
            release.wait(10)
            commit(*args, **kwargs)  # type: ignore[arg-type]

        sink._commit_batch = slow_commit  # type: ignore[method-assign]
        first = await sink.put(SinkBatch("p", _rows(4, 10), 13))  # full: its write starts
        second = await sink.put(SinkBatch("q", _rows(4, 10), 13))  # gathers meanwhile
        third = asyncio.create_task(sink.put(SinkBatch("r", _rows(1, 10), 10)))
        await asyncio.sleep(0.3)
        assert third.done() == (max_buffered is not None)
        release.set()
        await first
        await asyncio.wait_for(third, 5)
        await second
        await third.result()
    assert len(list(read_rows(tmp_path))) == 9


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_micro_batch_is_written_once_every_reader_of_it_flushed(tmp_path: Path) -> None:
    """With an age of an hour, the micro-batch is written as soon as every reader with a batch
    in it said it waits only for its commit (Sink.flush), not before."""
    import asyncio

    async with FileSink(tmp_path, max_age_s=3600, layout="generic") as sink:
        p = await sink.put(SinkBatch("p", (rec(10, "0"),), 10))
        q = await sink.put(SinkBatch("q", (rec(11, "0"),), 11))
        await sink.flush("r")  # nothing of r is buffered: nothing changes
        await sink.flush("p")  # q still reads
        await asyncio.sleep(0.2)
        assert not p.done()
        assert not q.done()
        await sink.flush("q")
        async with asyncio.timeout(10):
            await p
            await q
    assert len(list(read_rows(tmp_path))) == 2
