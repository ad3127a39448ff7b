"""The Spark bridge against local Spark: three task nodes read a simulated stream into the
default parquet sink; the output equals the stream exactly, also when a task is killed and when
Spark fails micro-batches (retried, or failed back to the readers, which re-read)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from protocol.records import DataChange
from runtime.ports import SinkBatch
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spark import SparkBridge, SparkConfig, read_output
from runtime.spark.output import write_default
from tests.fixtures.spark import Cluster, output_rows, spark, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow]
__all__ = ["spark"]  # the module-scoped session fixture


def _config(out: Path, **kwargs: Any) -> SparkConfig:
    return SparkConfig(
        output_dir=str(out),
        max_rows=20_000,
        max_age_s=0.5,
        **{"output_layout": "generic", **kwargs},
    )


async def _run_to_end(cluster: Cluster, bridge: SparkBridge, timeout: float = 60.0) -> None:
    total = len(cluster.expected())
    await wait_for(
        lambda: bridge.stats().rows_committed >= total, timeout, f"{total} rows committed"
    )


def _assert_exact(out: Path, cluster: Cluster) -> None:
    rows = output_rows(read_output(str(out), dedupe=False))
    duplicated = [k for k, n in Counter(rows).items() if n > 1]
    assert not duplicated, f"{len(duplicated)} rows written twice, e.g. {duplicated[:2]}"
    expected = cluster.expected()
    assert len(set(expected)) == len(expected)
    missing = set(expected) - set(rows)
    extra = set(rows) - set(expected)
    assert not missing, f"{len(missing)} rows missing, e.g. {sorted(missing)[:2]}"
    assert not extra, f"{len(extra)} unexpected rows, e.g. {sorted(extra)[:2]}"


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_three_tasks_output_equals_the_stream(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    async with SparkBridge(_config(out), spark=spark) as bridge:
        cluster = Cluster(bridge, seed=11)
        async with AsyncExitStack() as stack:
            await cluster.start(stack)
            await _run_to_end(cluster, bridge)
        stats = bridge.stats()
    assert stats.batches_failed == 0
    assert stats.inflight == 0
    assert stats.rows_committed == len(cluster.expected())
    _assert_exact(out, cluster)
    # Spark reads the same output, partitioned by table.
    df = read_output(spark, str(out))
    assert df.count() == len(cluster.expected())
    assert {r["table"] for r in df.select("table").distinct().collect()} == set(
        cluster.params.tables
    )


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_killed_task_loses_nothing_and_writes_nothing_twice(
    spark: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    async with SparkBridge(_config(out), spark=spark) as bridge:
        cluster = Cluster(bridge, seed=12)
        async with AsyncExitStack() as stack:
            await cluster.start(stack)
            await wait_for(
                lambda: (
                    bridge.stats().batches_committed >= 2
                    and bool(cluster.nodes[0].task and cluster.nodes[0].task.readers)
                ),
                40,
                "n0 reading and two micro-batches committed",
            )
            await cluster.kill(0)
            await _run_to_end(cluster, bridge)
        stats = bridge.stats()
    survivors = cluster.nodes[1:]
    assert any(n.status().counters.get("picked_up", 0) for n in survivors)
    assert stats.batches_failed == 0
    _assert_exact(out, cluster)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_failed_micro_batch_is_retried_and_watermarks_wait(
    spark: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    failing = threading.Event()
    release = threading.Event()
    attempts: Counter[int] = Counter()
    fail_id = 3

    def flaky(df: Any, batch_id: int) -> None:
        attempts[batch_id] += 1
        if batch_id == fail_id and attempts[batch_id] == 1:
            failing.set()
            release.wait(10)
            raise RuntimeError("injected Spark failure")
        write_default(df, str(out), f"run-{batch_id:010d}")

    config = _config(out, retry_backoff_s=0.2)
    async with SparkBridge(config, foreach_batch=flaky, spark=spark) as bridge:
        cluster = Cluster(bridge, seed=13)
        async with AsyncExitStack() as stack:
            await cluster.start(stack)
            await wait_for(failing.is_set, 40, "the failing attempt")
            # While Spark fails the batch, no reader passes its first record in that batch.
            floor = _first_record_ts(bridge, fail_id)
            for _ in range(20):
                await asyncio.sleep(0.05)
                committed = cluster.committed()
                for token, first_ts in floor.items():
                    assert committed.get(token, -1) < first_ts, token
            release.set()
            await _run_to_end(cluster, bridge)
        stats = bridge.stats()
    assert attempts[fail_id] == 2
    assert stats.attempts_failed == 1
    assert stats.batches_failed == 0
    _assert_exact(out, cluster)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_micro_batch_failing_every_attempt_is_re_read(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    attempts: Counter[int] = Counter()
    armed = threading.Event()
    failed: list[int] = []

    def broken(df: Any, batch_id: int) -> None:
        attempts[batch_id] += 1
        if armed.is_set() and (not failed or failed[0] == batch_id) and df.count() > 0:
            failed[:1] = [batch_id]
            raise RuntimeError("injected permanent Spark failure")
        write_default(df, str(out), f"run-{batch_id:010d}")

    config = _config(out, max_attempts=2, retry_backoff_s=0.1)
    async with SparkBridge(config, foreach_batch=broken, spark=spark) as bridge:
        cluster = Cluster(bridge, seed=14, seconds=30.0)
        async with AsyncExitStack() as stack:
            await cluster.start(stack)
            # Fail once the partitions have settled (not during the first hand-offs).
            await wait_for(cluster.balanced, 20, "the partitions spread over three tasks")
            armed.set()
            await _run_to_end(cluster, bridge)
        stats = bridge.stats()
    assert len(failed) == 1
    assert attempts[failed[0]] == 2
    assert stats.batches_failed == 1
    assert stats.puts_failed > 0
    _assert_exact(out, cluster)


def _first_record_ts(bridge: SparkBridge, batch_id: int) -> dict[str, int]:
    """Per token, the oldest record of micro-batch ``batch_id`` (read from its entries)."""
    entries: tuple[SinkBatch, ...] = bridge.entries_of(batch_id)
    out: dict[str, int] = {}
    for entry in entries:
        for r in entry.records:
            out[entry.token] = min(out.get(entry.token, r.commit_ts), r.commit_ts)
    return out


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_restart_does_not_write_what_the_last_run_wrote(spark: Any, tmp_path: Path) -> None:
    """A run wrote records its readers never saw acked (it crashed); the next run's readers
    re-read them from the published watermark: the output keeps one copy."""
    out = tmp_path / "out"
    model = StreamModel(StreamParams(seed=31, roots=1, records_per_s=50))
    token = model.root_record().children[0].token
    start = model.params.start_ts
    stream = model.records(token, start, start + 2_000_000)
    records = [r for r in stream if isinstance(r, DataChange)]
    assert len(records) > 40
    first, replay = records[:30], records[20:]
    for part in (first, replay):
        async with SparkBridge(_config(out), spark=spark) as bridge:
            future = await bridge.put(SinkBatch(token, tuple(part), part[-1].commit_ts))
            await asyncio.wait_for(future, 60)
    expected = {
        (r.commit_ts, r.server_transaction_id, r.record_sequence, i)
        for r in records
        for i in range(len(r.mods))
    }
    rows = output_rows(read_output(str(out), dedupe=False))
    keys = [row[:4] for row in rows]
    assert len(keys) == len(set(keys)), "a re-read record was written twice"
    assert set(keys) == expected
    assert bridge.stats().rows_deduplicated == sum(len(r.mods) for r in records[20:30])
