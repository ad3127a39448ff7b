"""Task nodes (the real actors around the real cores) with a snapshot, over the in-memory ports:
the leader plans it once at the stream's start, its partitions are read through the same
readers and sink as the stream's (``runtime/snapshot_routing.py``), a node that leaves in the
middle hands its snapshot partitions over and they resume from their committed chunks, and every
chunk reaches the sink exactly once (``MemorySink.rows`` counts every commit). A snapshot asked
of a connector that already started is refused, and a snapshot the source cannot take at T (T
too old) stops the node with the source's error."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack

import pytest

from actors.node import NodeConfig, SnapshotConflict, TaskNode
from protocol.messages import SnapshotItem, SnapshotPlan
from protocol.task import TaskConfig
from runtime.ports import Membership, Unrecoverable
from runtime.sim.memory import MemoryGroup, MemorySink, MemorySnapshots, MemorySyncLog
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams
from runtime.snapshot_routing import SnapshotRouting
from tests.helpers import assert_catches_a_double

PARAMS = StreamParams(seed=5, roots=2, split_p=0.0, merge_p=0.0, move_p=0.0, records_per_s=5)
T = PARAMS.start_ts - 1  # the snapshot's read timestamp: the stream's roots start after it


async def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


def _config(name: str, *, snapshot: bool = True, output_start: int = -1) -> NodeConfig:
    return NodeConfig(
        task=TaskConfig(
            task_id=name, answer_timeout=300_000, publish_interval=100_000, snapshot=snapshot
        ),
        stream_start=T,
        output_start=output_start,
        replay_timeout=10.0,
    )


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_snapshot_is_read_exactly_once_across_a_node_that_leaves() -> None:
    snapshots = MemorySnapshots(seed=5, partitions=6, max_chunks=60, chunk_delay=0.03)
    log = MemorySyncLog()
    group = MemoryGroup(rebalance_delay=0.1, session_timeout=2.0)
    sink = MemorySink(commit_delay=0.01)
    nodes: list[TaskNode] = []

    def lookup(token: str) -> tuple[SnapshotItem, int] | None:
        for n in nodes:
            state = n.task.core.cim.snapshot if n.task is not None else None
            item = None if state is None else state.item(token)
            if state is not None and state.plan is not None and item is not None:
                return item, state.plan.chunk_rows
        return None

    source = SnapshotRouting(
        SimulatedSource(StreamModel(PARAMS), heartbeat_ms=250), snapshots, lookup
    )

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    nodes.extend(
        TaskNode(
            _config(name), sync_log=log, join=join, source=source, sink=sink, snapshots=snapshots
        )
        for name in ("n0", "n1")
    )

    def snapshot_rows() -> list[tuple[int, str, str]]:
        return [i for i, n in sink.rows.items() for _ in range(n) if i[1].startswith("snapshot:")]

    def complete() -> bool:
        return all(
            n.task is not None
            and n.task.core.cim.snapshot.plan is not None
            and n.task.core.cim.snapshot.complete()
            for n in nodes[1:]
        )

    async with AsyncExitStack() as stack:
        for n in nodes:
            await stack.enter_async_context(n)
        await _wait_for(lambda: len(snapshot_rows()) >= 10, 20)
        assert not complete()
        await nodes[0].__aexit__(None, None, None)  # leaves in the middle of the snapshot
        await _wait_for(complete, 30)
        state = nodes[1].task.core.cim.snapshot  # type: ignore[union-attr]
        assert state.read_ts == T
        assert state.progress() == (6, 6)
    expected = sorted(r.identity for chunks in snapshots.records.values() for r in chunks)
    assert len(expected) > 60
    got = sorted(snapshot_rows())

    def every_chunk_once(rows: list[tuple[int, str, str]]) -> None:
        assert sorted(rows) == expected

    every_chunk_once(got)
    assert snapshots.planned == 1
    resumed = [t for t, n in snapshots.reads.items() if n > 1]
    assert resumed, snapshots.reads  # partitions the leaving node was reading, read again
    assert_catches_a_double(every_chunk_once, got)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_snapshot_is_refused_to_a_connector_that_already_started() -> None:
    snapshots = MemorySnapshots(seed=5, partitions=2, max_chunks=2)
    log = MemorySyncLog()
    group = MemoryGroup(rebalance_delay=0.05, session_timeout=2.0)
    source = SimulatedSource(StreamModel(PARAMS), heartbeat_ms=250)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    def node(config: NodeConfig) -> TaskNode:
        return TaskNode(
            config, sync_log=log, join=join, source=source, sink=MemorySink(), snapshots=snapshots
        )

    plain = node(_config("p", snapshot=False))
    async with plain:
        await _wait_for(
            lambda: plain.task is not None and plain.task.core.cim.stream_start >= 0, 10
        )
    with pytest.raises(SnapshotConflict):  # its sync topic records a start without a snapshot
        async with node(_config("q")):
            pass
    # a new sync topic, but the output records an earlier start: refused too
    log = MemorySyncLog()
    with pytest.raises(SnapshotConflict):
        async with node(_config("r", output_start=T)):
            pass
    assert snapshots.planned == 0


class TooOld(MemorySnapshots):
    async def plan_snapshot(self, read_ts: int) -> SnapshotPlan:
        raise Unrecoverable(f"snapshot: T={read_ts} is too old (the test's source)")


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_snapshot_the_source_cannot_take_stops_the_node_with_its_error() -> None:
    group = MemoryGroup(rebalance_delay=0.05, session_timeout=2.0)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    node = TaskNode(
        _config("a"),
        sync_log=MemorySyncLog(),
        join=join,
        source=SimulatedSource(StreamModel(PARAMS), heartbeat_ms=250),
        sink=MemorySink(),
        snapshots=TooOld(seed=5, partitions=2, max_chunks=2),
    )
    with pytest.raises(BaseExceptionGroup) as caught:
        async with node:
            await asyncio.sleep(20)  # the leader's plan fails first: the node stops
    (error,) = caught.value.exceptions
    assert isinstance(error, Unrecoverable)
    assert "is too old" in str(error)
