"""The run's completeness mark writer (``actors.cli.completeness.OutputRecords.record_mark``):
the write runs in a worker thread, so a slow store (an object store's PUT) does not stall the
event loop, and writes happen one at a time in the order they were due: a sample taken before
a newer mark was written never overwrites it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from actors.cli.completeness import OutputRecords
from protocol.completeness import Mark
from runtime.output_state import OutputState


class _SlowState(OutputState):
    """An output state whose mark write takes ``delay`` seconds (as a PUT to a far store)."""

    def __init__(self, root: Path, delay: float) -> None:
        super().__init__(str(root), "shoal")
        self.delay = delay
        self.threads: list[int] = []
        self.written: list[int] = []

    def write_mark(self, mark: Mark) -> None:
        self.threads.append(threading.get_ident())
        time.sleep(self.delay)
        super().write_mark(mark)
        self.written.append(mark.low_watermark_us)


@pytest.mark.asyncio
async def test_a_slow_mark_write_leaves_the_event_loop_running(tmp_path: Path) -> None:
    records = OutputRecords("shoal", count_error=lambda kind: None)
    state = records.state = _SlowState(tmp_path, delay=0.3)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async with asyncio.TaskGroup() as group:
        ticker = group.create_task(tick())
        await records.record_mark(1_000, final=True)
        ticker.cancel()
    assert state.written == [1_000]
    assert state.threads
    assert threading.get_ident() not in state.threads
    assert ticks >= 10, f"the loop ran only {ticks} times during a 0.3 s write"
    assert records.written == 1_000
    read = state.read_mark()
    assert read is not None
    assert read.low_watermark_us == 1_000


@pytest.mark.asyncio
async def test_a_late_older_sample_does_not_overwrite_a_newer_mark(tmp_path: Path) -> None:
    records = OutputRecords("shoal", count_error=lambda kind: None)
    state = records.state = _SlowState(tmp_path, delay=0.2)
    # the final mark is due first; a sample taken earlier (a lower watermark) arrives while it
    # is being written, and is decided only after it ended
    final = asyncio.create_task(records.record_mark(2_000, final=True))
    await asyncio.sleep(0.05)
    await records.record_mark(1_500, final=True)
    await final
    assert state.written == [2_000]
    read = state.read_mark()
    assert read is not None
    assert read.low_watermark_us == 2_000


@pytest.mark.asyncio
async def test_a_failed_write_is_counted_and_tried_again(tmp_path: Path) -> None:
    errors: list[str] = []
    records = OutputRecords("shoal", count_error=errors.append)
    state = records.state = _SlowState(tmp_path, delay=0.0)
    broken = True
    write = state.write_mark

    def flaky(mark: Mark) -> None:
        if broken:
            raise OSError("the store went away")
        write(mark)

    state.write_mark = flaky  # type: ignore[method-assign]
    await records.record_mark(3_000, final=True)
    assert errors == ["completeness_write"]
    assert records.written == -1
    broken = False
    await records.record_mark(3_000, final=True)
    assert state.written == [3_000]
    assert records.written == 3_000
