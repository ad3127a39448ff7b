"""Task nodes (the real actors around the real cores) reading a MUTABLE_KEY_RANGE stream over
the in-memory ports (``runtime/sim/mutable.py``, ``MutableSource``): the roots come from the
root query's partition start, announced partitions are registered and read, destinations hold
at their move-ins, a node leaves and hands its partitions over; every write reaches the sink
exactly once and every key's writes in timestamp order. Each check has its control."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack

import pytest

from actors.node import NodeConfig, TaskNode
from protocol.records import DataChange
from protocol.task import TaskConfig
from runtime.ports import Membership
from runtime.sim.memory import MemoryGroup, MemorySink, MemorySyncLog
from runtime.sim.mutable import (
    MutableSource,
    MutableStreamModel,
    MutableStreamParams,
    key_order_violations,
)
from tests.helpers import assert_catches_a_double
from tests.sim.test_nodes_memory import _exactly_once


async def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_three_nodes_read_a_mutable_stream_in_key_order_exactly_once() -> None:
    start = 1_700_000_000_000_000
    params = MutableStreamParams(
        seed=5, roots=4, start_ts=start, moves_per_round=3.0, new_p=0.5, end_p=0.3,
        writes_per_s=4.0, churn_until=start + 24_000_000,
    )  # fmt: skip
    model = MutableStreamModel(params)
    source = MutableSource(model, speedup=4.0)
    log = MemorySyncLog()
    group = MemoryGroup(rebalance_delay=0.1, session_timeout=2.0)
    sink = MemorySink(commit_delay=0.01)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    def node(name: str) -> TaskNode:
        task = TaskConfig(
            task_id=name, answer_timeout=500_000, publish_interval=100_000, mutable=True
        )
        config = NodeConfig(task=task, stream_start=start)
        return TaskNode(config, sync_log=log, join=join, source=source, sink=sink)

    nodes = [node(f"n{i}") for i in range(3)]
    async with AsyncExitStack() as stack:
        for n in nodes:
            await stack.enter_async_context(n)
        await _wait_for(lambda: source.now() > start + 12_000_000, 30)
        await nodes[0].__aexit__(None, None, None)  # leaves: its partitions are handed over
        survivors = nodes[1:]
        await _wait_for(lambda: source.now() > start + 30_000_000, 30)
        horizon = source.now() - 2_000_000
        expected = {r.identity for r in model.expected(horizon)}
        await _wait_for(lambda: expected <= sink.rows.keys(), 30)
        holds = sum(n.task.core.counters["move_in_holds"] for n in survivors if n.task)
    assert model.moves > 10
    assert len(model.partitions) > params.roots  # partitions were announced ...
    assert holds > 0  # destinations waited at their move-ins
    committed = [r.identity for b in sink.batches for r in b.records]
    _exactly_once(committed, expected)
    assert_catches_a_double(lambda rows: _exactly_once(rows, expected), committed)
    batches = [b.records for b in sink.batches]
    assert key_order_violations(batches) == []
    # the control: the same check sees one key's two writes committed the other way round
    writes = [r for b in batches for r in b]
    first = writes[0]
    later = next(r for r in writes if r.mods[0].keys == first.mods[0].keys and r is not first)
    assert isinstance(later, DataChange)
    assert key_order_violations([[later, first]]) == [
        (first.mods[0].keys, first.commit_ts, later.commit_ts)
    ]
