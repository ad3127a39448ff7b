"""``Mailbox`` and ``Flag`` behave like ``asyncio.Queue`` and ``asyncio.Event`` for what the actors
use: FIFO, bounded ``put`` waits, ``*_nowait`` raise, a cancelled waiter passes its wake-up on."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.mailbox import Flag, Mailbox


@given(
    maxsize=st.integers(0, 4),
    ops=st.lists(st.one_of(st.integers(0, 99), st.none()), max_size=40),
)
def test_nowait_operations_match_asyncio_queue(maxsize: int, ops: list[int | None]) -> None:
    """None: get_nowait; a number: put_nowait. Same results, same exceptions, same sizes."""

    async def run() -> None:
        ours: Mailbox[int] = Mailbox(maxsize)
        theirs: asyncio.Queue[int] = asyncio.Queue(maxsize)
        for op in ops:
            results: list[object] = []
            for q in (ours, theirs):
                try:
                    results.append(q.get_nowait() if op is None else q.put_nowait(op))
                except (asyncio.QueueFull, asyncio.QueueEmpty) as exc:
                    results.append(type(exc))
            assert results[0] == results[1]
            assert (ours.qsize(), ours.empty(), ours.full()) == (
                theirs.qsize(),
                theirs.empty(),
                theirs.full(),
            )

    asyncio.run(run())


@pytest.mark.asyncio
async def test_put_waits_while_full_and_get_while_empty() -> None:
    box: Mailbox[str] = Mailbox(1)
    getter = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    assert not getter.done()
    await box.put("a")
    assert await getter == "a"
    box.put_nowait("b")
    putter = asyncio.ensure_future(box.put("c"))
    await asyncio.sleep(0)
    assert not putter.done()  # full: waits
    assert await box.get() == "b"
    await putter
    assert box.get_nowait() == "c"


@pytest.mark.asyncio
async def test_a_cancelled_getter_passes_its_wake_up_on() -> None:
    box: Mailbox[str] = Mailbox(4)
    first = asyncio.ensure_future(box.get())
    second = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    box.put_nowait("x")  # wakes the first getter ...
    first.cancel()  # ... which is cancelled before it runs
    assert await second == "x"
    assert first.cancelled()
    assert box.empty()


@pytest.mark.asyncio
async def test_a_cancelled_putter_leaves_no_trace() -> None:
    box: Mailbox[str] = Mailbox(1)
    box.put_nowait("a")
    putter = asyncio.ensure_future(box.put("b"))
    await asyncio.sleep(0)
    putter.cancel()
    await asyncio.sleep(0)
    assert box.get_nowait() == "a"
    assert box.empty()  # "b" was never put


@pytest.mark.asyncio
async def test_flag_wakes_every_waiter_and_can_be_cleared() -> None:
    flag = Flag()
    waiters = [asyncio.ensure_future(flag.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    flag.set()
    assert await asyncio.gather(*waiters) == [True, True, True]
    assert flag.is_set()
    assert await flag.wait()
    flag.clear()
    late = asyncio.ensure_future(flag.wait())
    await asyncio.sleep(0)
    assert not late.done()
    late.cancel()
    await asyncio.sleep(0)
    flag.set()  # a cancelled waiter is not woken (nothing raises)
    assert late.cancelled()
