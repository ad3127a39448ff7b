"""Three task nodes read the Cloud Spanner emulator's churning change stream while the load
generator writes: every committed mutation is delivered exactly once (the records handed to the
sink, counted raw: a record delivered twice is an extra mod), and a child partition (a merge's included) is first read only after all its parents finished.

The coordination runs over the in-memory group and sync log (the Kafka path has its own tests);
the change stream is the real emulator through the project's reader. Skipped, with the reason,
where the emulator binary is absent.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from contextlib import AsyncExitStack
from typing import Any

import pytest

from actors.node import NodeConfig, TaskNode
from protocol.records import ChangeRecord, ChildPartitions
from protocol.task import TaskConfig
from runtime.ports import ChangeStreamSource, Membership
from runtime.sim.memory import MemoryGroup, MemorySink, MemorySyncLog
from runtime.spanner.loadgen import LoadGenerator, expected_from_records
from runtime.spanner.reader import SpannerSource
from tests.fixtures.spanner import churn_emulator

__all__ = ["churn_emulator"]  # the fixture, imported for pytest

Mods = Counter[tuple[int, str, str, int]]


def _compare(expected: Mods, delivered: Sequence[Any]) -> tuple[Mods, Mods]:
    """What was committed and never delivered, and what was delivered beyond what was committed
    (never committed, or delivered more often): every delivered record counts, duplicates too."""
    got = expected_from_records(delivered)
    return expected - got, got - expected


class LedgerSource(ChangeStreamSource):
    """The Spanner source, noting when each partition query starts and when one runs to its end
    (its child-partitions records seen), and each child's parents."""

    def __init__(self, inner: SpannerSource) -> None:
        self.inner = inner
        self.first_start: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.parents: dict[str, tuple[str, ...]] = {}

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        if token is not None:
            self.first_start.setdefault(token, time.monotonic())
        ended = False
        async for batch in self.inner.query(token, start_ts, end_ts):
            for record in batch:
                if isinstance(record, ChildPartitions) and token is not None:
                    ended = True
                    for child in record.children:
                        self.parents[child.token] = tuple(child.parent_tokens)
            yield batch
        if ended and token is not None:
            self.finished.setdefault(token, time.monotonic())


@pytest.mark.spanner
@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_three_tasks_read_the_churning_emulator_exactly_once(churn_emulator: Any) -> None:
    config = churn_emulator.config
    source = await SpannerSource.connect(config)
    ledger = LedgerSource(source)
    loader = await LoadGenerator.connect(config, churn_emulator.tables, seed=3)
    log = MemorySyncLog()
    group = MemoryGroup(rebalance_delay=0.2, session_timeout=3.0)
    sink = MemorySink(commit_delay=0.01)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    start = int(time.time() * 1_000_000)

    def node(name: str) -> TaskNode:
        task = TaskConfig(task_id=name, answer_timeout=500_000, publish_interval=200_000)
        return TaskNode(
            NodeConfig(task=task, stream_start=start),
            sync_log=log,
            join=join,
            source=ledger,
            sink=sink,
        )

    try:
        async with AsyncExitStack() as stack:
            nodes = [await stack.enter_async_context(node(f"s{i}")) for i in range(3)]
            await loader.run(30.0, duration_s=10.0)
            expected = loader.expected_mods()
            deadline = time.monotonic() + 60
            while True:
                delivered = [r for b in list(sink.batches) for r in b.records]
                missing, extra = _compare(expected, delivered)
                if not missing or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            statuses = [n.status() for n in nodes]
    finally:
        await source.close()
        await loader.close()

    assert expected, "the load generator committed nothing"
    assert not missing, f"{sum(missing.values())} committed mods never delivered"
    assert not extra, f"{sum(extra.values())} mods delivered twice or never committed: {extra}"
    assert max(sink.rows.values()) == 1, "a record committed to the sink twice"
    # The control: the same delivery with one record handed over twice fails the check.
    doubled = [*delivered, delivered[len(delivered) // 2]]
    assert _compare(expected, doubled)[1], "a doubled record went unnoticed"
    # the partitions churned and the tasks shared them
    children = {t: p for t, p in ledger.parents.items() if t in ledger.first_start}
    assert children, "no child partition was read: the stream did not churn"
    readers = Counter(s.task_id for s in statuses if s.counters.get("picked_up", 0))
    assert len(readers) >= 2, f"one task read everything: {[s.counters for s in statuses]}"
    for child, parents in children.items():
        for parent in parents:
            assert parent in ledger.finished, f"{child} read while parent {parent} never ended"
            assert ledger.finished[parent] <= ledger.first_start[child], (
                f"{child} read before its parent {parent} finished"
            )
    merges = sum(1 for p in children.values() if len(p) > 1)
    print(f"children read: {len(children)}, of them merges: {merges}")
