"""Pieces the in-process scenarios share: memory readings, waiting for a condition, and a
cluster of task nodes over the in-memory group, sync log and sink reading a simulated stream."""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Callable

from actors.node import NodeConfig, TaskNode
from protocol.task import TaskConfig
from runtime.ports import ChangeStreamSource, Membership, Sink
from runtime.sim.memory import MemoryGroup, MemorySink, MemorySyncLog
from runtime.sim.stream import StreamParams


def rss_mb() -> float:
    """Current resident set size (Linux /proc), in MB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 1e6


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children that were waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` every 0.1 s until it holds (True) or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


def static_stream(seed: int, partitions: int, records_per_s: float) -> StreamParams:
    """``partitions`` root partitions that never split, move or merge."""
    return StreamParams(
        seed=seed,
        roots=partitions,
        split_p=0.0,
        merge_p=0.0,
        move_p=0.0,
        records_per_s=records_per_s,
        round_us=60_000_000,
    )


class MemoryCluster:
    """Task nodes sharing one in-memory group, sync log and sink."""

    def __init__(
        self,
        source: ChangeStreamSource,
        stream_start: int,
        *,
        log: MemorySyncLog | None = None,
        sink: Sink | None = None,
        rebalance_delay: float = 0.1,
        session_timeout: float = 5.0,
    ) -> None:
        self.source = source
        self.stream_start = stream_start
        self.log = log if log is not None else MemorySyncLog()
        self.group = MemoryGroup(rebalance_delay=rebalance_delay, session_timeout=session_timeout)
        self.sink: Sink = sink if sink is not None else MemorySink(max_in_flight=100_000)

    async def _join(self, task_id: str) -> Membership:
        return self.group.join(task_id)

    def node(self, name: str, **task: int) -> TaskNode:
        config = NodeConfig(
            task=TaskConfig(task_id=name, **task),  # type: ignore[arg-type]
            stream_start=self.stream_start,
        )
        return TaskNode(
            config, sync_log=self.log, join=self._join, source=self.source, sink=self.sink
        )
