"""A node says when its state may have changed (``TaskNode(on_change=)``): once it is ready, and
after its core handled each event, so the run (``actors/cli/run.py``) looks at its end again
instead of polling. The real node over the in-memory ports."""

from __future__ import annotations

import asyncio

import pytest

from actors.node import NodeConfig, TaskNode
from protocol.task import TaskConfig
from runtime.ports import Membership
from runtime.sim.memory import MemoryGroup, MemorySink, MemorySyncLog
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_node_says_it_changed_when_ready_and_when_it_joined() -> None:
    params = StreamParams(seed=1, roots=0)
    group = MemoryGroup(rebalance_delay=0.05, session_timeout=60.0)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    seen: list[tuple[bool, bool]] = []  # (ready, a member) at each call
    joined = asyncio.Event()
    node: TaskNode | None = None

    def changed() -> None:
        assert node is not None
        member = node.task is not None and node.task.core.member
        seen.append((node.ready.is_set(), member))
        if member:
            joined.set()

    node = TaskNode(
        NodeConfig(task=TaskConfig(task_id="solo"), stream_start=params.start_ts),
        sync_log=MemorySyncLog(),
        join=join,
        source=SimulatedSource(StreamModel(params)),
        sink=MemorySink(),
        on_change=changed,
    )
    async with node:
        assert (True, False) in seen  # said once ready, before it joined
        async with asyncio.timeout(10):
            await joined.wait()  # said again once the core took its assignment
        assert node.task is not None
        assert node.task.out_of_group_since is None  # (the fact the run reads was updated first)
