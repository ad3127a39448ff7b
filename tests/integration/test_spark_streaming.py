"""The Structured Streaming path against local Spark with the generic layout (the typed one:
test_spark_streaming_typed.py): the bridge spools Arrow files, the ``shoal`` Python data source
serves them to a streaming query writing parquet, and the bridge acks only what Spark's
checkpoint committed. Three tasks over a simulated stream: the output
equals the stream exactly."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from runtime.spark import SparkBridge, SparkConfig, read_output
from runtime.spark.output import write_default
from runtime.spark.streaming import committed_seq, spool_files
from tests.fixtures.spark import Cluster, output_rows, spark, wait_for
from tests.helpers import assert_catches_a_double, exactly

pytestmark = [pytest.mark.spark, pytest.mark.slow]
__all__ = ["spark"]  # the module-scoped session fixture


@pytest.mark.asyncio
@pytest.mark.timeout(150)
async def test_streaming_source_output_equals_the_stream(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = SparkConfig(
        output_dir=str(out),
        path="streaming",
        output_layout="generic",  # the typed layout: test_spark_streaming_typed.py
        max_rows=20_000,
        max_age_s=0.5,
        trigger_interval_s=0.5,
    )
    async with SparkBridge(config, spark=spark) as bridge:
        cluster = Cluster(bridge, seed=21)
        total = len(cluster.expected())
        async with AsyncExitStack() as stack:
            await cluster.start(stack)
            await wait_for(lambda: bridge.stats().rows_committed >= total, 90, "every row")
        stats = bridge.stats()
    assert stats.batches_failed == 0
    assert stats.rows_committed == total
    # Spark's file sink, read through its own log: exactly the stream, nothing twice.
    df = read_output(spark, str(out), dedupe=False)
    assert df.count() == total
    rows = output_rows(read_output(str(out), dedupe=False))
    exactly(cluster.expected())(rows)
    assert_catches_a_double(exactly(cluster.expected()), rows)
    # acked spool files are deleted; the checkpoint committed every one
    spool = out / "_spool"
    assert not spool_files(spool)
    assert committed_seq(out / "_checkpoint") >= 0


@pytest.mark.asyncio
@pytest.mark.timeout(150)
async def test_streaming_query_failing_a_batch_is_restarted_from_its_checkpoint(
    spark: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    calls: Counter[int] = Counter()
    failed: list[int] = []

    def flaky(df: Any, batch_id: int) -> None:
        calls[batch_id] += 1
        if not failed and batch_id >= 1 and not df.isEmpty():
            failed.append(batch_id)
            raise RuntimeError("injected failure of a streaming micro-batch")
        write_default(df, str(out / "data"), f"s-{batch_id:010d}")

    config = SparkConfig(
        output_dir=str(out),
        path="streaming",
        max_rows=20_000,
        max_age_s=0.5,
        trigger_interval_s=0.5,
        retry_backoff_s=0.1,
    )
    async with SparkBridge(config, foreach_batch=flaky, spark=spark) as bridge:
        cluster = Cluster(bridge, seed=22)
        total = len(cluster.expected())
        async with AsyncExitStack() as stack:
            await cluster.start(stack)
            await wait_for(lambda: bridge.stats().rows_committed >= total, 90, "every row")
        stats = bridge.stats()
    assert len(failed) == 1
    assert calls[failed[0]] == 2, "Spark re-ran the failed batch with the same id"
    assert stats.attempts_failed >= 1
    assert stats.batches_failed == 0
    rows = output_rows(read_output(str(out / "data"), dedupe=False))
    exactly(cluster.expected())(rows)
    assert_catches_a_double(exactly(cluster.expected()), rows)
