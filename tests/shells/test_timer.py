"""The task's timer (``TaskActor.timer_loop``): the real node over the in-memory ports, its core's
inputs read back from its trace. An idle task hands its core a tick only at a deadline: none in
an idle second when nothing is due (a 100 ms poll handed it ten), and one per leader checkpoint,
on time, when checkpoints are due every 250 ms. The trace of timer-driven ticks replays.

The node runs on a fake clock (``tests/virtual_time.py``): the event loop's time jumps to the
next timer when nothing is ready, and the clocks the task and the in-memory group read follow it
(their modules' ``time`` is patched). "On time" is then exact, whatever the machine's load: a tick comes at its
deadline, to the microsecond."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest

from actors.node import NodeConfig, TaskNode
from protocol import trace as tracing
from protocol.events import TaskTick
from protocol.messages import CheckpointMessage
from protocol.task import Publish, TaskConfig
from runtime.ports import Membership
from runtime.sim.memory import MemoryGroup, MemorySink, MemorySyncLog
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams
from tests.virtual_time import VirtualTimeLoop

T = TypeVar("T")


def _on_a_fake_clock(monkeypatch: pytest.MonkeyPatch, main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a :class:`VirtualTimeLoop`, with the clocks the task and the in-memory
    group read (``time.time_ns``, ``time.monotonic``) on its time."""
    import actors.task
    import runtime.sim.memory

    loop = VirtualTimeLoop()
    shim = SimpleNamespace(time_ns=loop.wall_ns, monotonic=loop.time)
    monkeypatch.setattr(actors.task, "time", shim)
    monkeypatch.setattr(runtime.sim.memory, "time", shim)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


async def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def _idle_second(tmp_path: Path, checkpoint_interval: int) -> list[tracing.TraceStep]:
    """A solo task over a stream without partitions, settled in its epoch: the steps of its
    core during one idle second (the first checkpoint is out already)."""
    params = StreamParams(seed=1, roots=0)
    source = SimulatedSource(StreamModel(params))
    group = MemoryGroup(rebalance_delay=0.05, session_timeout=60.0)  # lease renewal ~15 s away

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    config = NodeConfig(
        task=TaskConfig(
            task_id="solo", answer_timeout=200_000, checkpoint_interval=checkpoint_interval
        ),
        stream_start=params.start_ts,
        trace_dir=str(tmp_path),
    )
    node = TaskNode(config, sync_log=MemorySyncLog(), join=join, source=source, sink=MemorySink())
    async with node:
        assert node.task is not None
        core = node.task.core
        await _wait_for(lambda: core.cim.epoch >= 0 and core.counters["messages_published"] > 0, 10)
        # the epoch's answers and the first checkpoint are read back (on the fake clock: all
        # that is ready runs before its time moves on)
        await asyncio.sleep(0.3)
        assert node.task._trace is not None
        node.task._trace.flush()
        path = tmp_path / "solo.trace.jsonl"
        before = len(path.read_bytes().splitlines())
        await asyncio.sleep(1.0)
    lines = path.read_bytes().splitlines()
    assert tracing.mismatches(tracing.decode(lines)) == []  # timer-driven ticks replay
    return [s for s in tracing.decode(lines[before:]) if isinstance(s, tracing.TraceStep)]


@pytest.mark.timeout(30)
def test_an_idle_task_with_nothing_due_is_not_ticked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = _on_a_fake_clock(monkeypatch, _idle_second(tmp_path, checkpoint_interval=60_000_000))
    assert [s for s in steps if isinstance(s.event, TaskTick)] == []


@pytest.mark.timeout(30)
def test_ticks_come_at_the_deadlines_only_and_on_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval = 250_000
    steps = _on_a_fake_clock(monkeypatch, _idle_second(tmp_path, checkpoint_interval=interval))
    ticks = [s for s in steps if isinstance(s.event, TaskTick)]
    # one tick per checkpoint due in the second...
    assert len(ticks) == 4, [s.now for s in ticks]
    for tick in ticks:
        # ...each of which was due: it publishes the checkpoint
        assert any(
            isinstance(c, Publish) and isinstance(c.message, CheckpointMessage)
            for c in tick.commands
        ), tick
    # on time: each checkpoint's tick comes one interval after the previous one, exactly on the
    # fake clock (give or take the microsecond the loop's float time rounds to; never early: a
    # tick before it would not publish)
    gaps = [b.now - a.now for a, b in itertools.pairwise(ticks)]
    assert all(interval <= g <= interval + 1 for g in gaps), gaps
