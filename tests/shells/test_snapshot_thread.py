"""``runtime.spanner.snapshot_source.in_thread``: a snapshot partition's blocking read taken a
chunk at a time in a thread pool, with heartbeats at T while a chunk takes long (so the reader
does not take a slow partition, or one waiting for a thread, for a stalled query), closed
cleanly when the reader stops early, and its errors passed on."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from protocol.records import Heartbeat
from runtime.spanner.snapshot_source import in_thread

BEAT = Heartbeat(1_000)


class Chunks:
    """A blocking read of ``n`` chunks, each taking ``delays[i]`` seconds; remembers the
    threads it ran in and whether it was closed."""

    def __init__(self, delays: list[float], fail_at: int = -1) -> None:
        self.delays = delays
        self.fail_at = fail_at
        self.threads: set[str] = set()
        self.closed = False
        self.second = threading.Event()  # the second chunk is being read

    def __call__(self) -> Iterator[int]:
        try:
            for i, delay in enumerate(self.delays):
                self.threads.add(threading.current_thread().name)
                if i == 1:
                    self.second.set()
                time.sleep(delay)
                if i == self.fail_at:
                    raise RuntimeError(f"chunk {i} failed")
                yield i
        finally:
            self.closed = True


@pytest.mark.asyncio
async def test_chunks_in_order_from_the_pool_with_heartbeats_while_one_is_slow() -> None:
    read = Chunks([0.0, 0.4, 0.0])
    with ThreadPoolExecutor(2, thread_name_prefix="snap") as pool:
        got = [item async for item in in_thread(pool, read, 0.1, BEAT)]
    assert [g for g in got if g != BEAT] == [0, 1, 2]
    beats = got.index(1) - got.index(0) - 1
    assert beats >= 2  # the slow chunk: a heartbeat every 0.1 s of its 0.4 s
    assert got[-1] == 2
    assert BEAT not in (got[0], got[-1])
    assert read.threads
    assert all(t.startswith("snap") for t in read.threads)
    assert read.closed


@pytest.mark.asyncio
async def test_closed_early_it_waits_for_the_chunk_in_flight_then_closes_the_read() -> None:
    read = Chunks([0.0, 0.3, 0.0])
    with ThreadPoolExecutor(1) as pool:
        items = in_thread(pool, read, 5.0, BEAT)
        assert await anext(items) == 0

        async def next_item() -> int | Heartbeat:
            return await anext(items)

        task = asyncio.create_task(next_item())
        await asyncio.to_thread(read.second.wait)  # chunk 1 is being read
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await items.aclose()
        assert read.closed  # not "generator already executing": closed after chunk 1 was in


@pytest.mark.asyncio
async def test_an_error_of_the_read_reaches_the_reader() -> None:
    read = Chunks([0.0, 0.0], fail_at=1)
    with ThreadPoolExecutor(1) as pool:
        got: list[int | Heartbeat] = []
        with pytest.raises(RuntimeError, match="chunk 1 failed"):
            got.extend([item async for item in in_thread(pool, read, 5.0, BEAT)])
        items = in_thread(pool, Chunks([0.0, 0.0], fail_at=1), 5.0, BEAT)
        assert await anext(items) == 0
        with pytest.raises(RuntimeError, match="chunk 1 failed"):
            await anext(items)
    assert got == []
