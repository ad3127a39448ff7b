"""The fake clock of the timing tests (``tests/virtual_time.py``): a sleep takes no real time and
exactly its length of loop time; a thread's work is waited for without the clock jumping past
the timers that are pending meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

from tests.virtual_time import VirtualTimeLoop


def test_sleeps_jump_and_order_is_kept() -> None:
    loop = VirtualTimeLoop()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        woke.append((name, loop.time()))

    async def main() -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(sleeper("late", 3600.0))
            group.create_task(sleeper("early", 0.25))

    began = time.monotonic()
    wall = loop.wall_ns()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert time.monotonic() - began < 5  # an hour of loop time, at once
    assert woke == [("early", 0.25), ("late", 3600.0)]
    assert loop.wall_ns() - wall == 3_600_000_000_000


def test_a_thread_at_work_holds_the_clock() -> None:
    loop = VirtualTimeLoop()
    release = threading.Event()

    def work() -> float:
        release.wait(10)
        return loop.time()

    async def main() -> tuple[float, bool]:
        timer = asyncio.ensure_future(asyncio.sleep(60))
        thread = asyncio.ensure_future(asyncio.to_thread(work))
        loop.call_soon(lambda: threading.Timer(0.2, release.set).start())
        seen = await thread
        done = timer.done()
        timer.cancel()
        return seen, done

    try:
        seen, timer_done = loop.run_until_complete(main())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
    assert seen == 0.0
    assert not timer_done  # the 60 s timer did not fire while the thread worked
