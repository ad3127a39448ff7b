"""The Spark bridge fences through its committer (docs/design.md#exactly-once-output, rule 4),
on a real local Spark session (the typed output is written by a Spark job): a fenced batch is
refused with its micro-batch, and the gap a refused micro-batch leaves holds its partition back
only until a new reader of it starts. Moved from tests/shells/test_fence.py when the typed
output became a Spark job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.files.sink import read_rows
from runtime.ports import SinkBatch
from tests.fixtures.spark import spark
from tests.helpers import assert_catches_a_double, exactly
from tests.shells.test_fence import T0, _typed, _wait

__all__ = ["spark"]

pytestmark = pytest.mark.spark


@pytest.mark.asyncio
@pytest.mark.timeout(180)  # a Spark session starts in the fixture: 28 s under load
async def test_the_spark_bridge_refuses_a_micro_batch_holding_a_fenced_batch(
    tmp_path: Path, spark: Any
) -> None:
    """The Spark bridge fences through the same committer: a fenced batch still buffered is
    refused with its micro-batch when the old bridge commits it (at close here), after the new
    owner wrote the same records: each row is in the output once."""
    from runtime.spark import BridgeError, SparkBridge, SparkConfig

    batch = SinkBatch("p", (_typed(1), _typed(2)), T0 + 2000)
    out = tmp_path / "out"
    held = SparkConfig(output_dir=str(out), max_rows=10_000, max_age_s=3600)  # cut at close
    async with SparkBridge(held, spark=spark) as old:
        assert old.layout == "typed"
        abandoned = await old.put(batch)
        assert await old.fence([batch]) == [False]
        # the new owner (another bridge over the output, as another process) writes it
        config = SparkConfig(output_dir=str(out), max_rows=10_000, max_age_s=0.02)
        async with SparkBridge(config, spark=spark) as new:
            assert await new.durable_position("p") is None
            again = SinkBatch("p", batch.records, batch.watermark)
            await (await new.put(again))
    with pytest.raises(BridgeError, match="fenced"):
        abandoned.result()
    assert old.stats().fenced_refused == 1
    rows = [r["commit_ts"] for r in read_rows(out)]
    exactly([T0 + 1000, T0 + 2000])(rows)
    assert_catches_a_double(exactly([T0 + 1000, T0 + 2000]), rows)


@pytest.mark.asyncio
@pytest.mark.timeout(180)  # a Spark session starts in the fixture: 28 s under load
async def test_the_spark_bridge_lets_a_new_reader_of_a_refused_partition_go_on(
    tmp_path: Path, spark: Any
) -> None:
    """The bridge's gap left by a refused micro-batch (here: it held a fenced batch) holds back
    the partition's continuations, until a new reader of it asks for its position: it goes on
    from what is committed (here another bridge, as another process, wrote the records)."""
    from runtime.spark import SparkBridge, SparkConfig

    out = tmp_path / "out"
    config = SparkConfig(output_dir=str(out), max_rows=2, max_age_s=3600)
    records = [_typed(i) for i in range(1, 5)]
    async with SparkBridge(config, spark=spark) as here:
        p1 = SinkBatch("p", (records[0],), T0 + 1000)
        first = await here.put(p1)
        assert await here.fence([p1]) == [False]
        second = await here.put(SinkBatch("p", (records[1],), T0 + 2000))  # cut: refused
        await _wait(lambda: first.done() and second.done(), "the refused micro-batch")
        assert first.exception() is not None
        assert second.exception() is not None
        refused = await here.put(SinkBatch("p", (records[2],), T0 + 3000))
        assert refused.exception() is not None  # past the gap
        there = SparkConfig(output_dir=str(out), max_rows=10, max_age_s=0.02)
        async with SparkBridge(there, spark=spark) as elsewhere:
            await (await elsewhere.put(SinkBatch("p", tuple(records[:3]), T0 + 3000)))
        position = await here.durable_position("p")  # a new reader of p here
        assert position is not None
        assert position.ts == T0 + 3000
        later = await here.put(SinkBatch("p", (records[3],), T0 + 4000))  # written at close
    await later
    rows = [r["commit_ts"] for r in read_rows(out)]
    exactly([T0 + 1000 * i for i in range(1, 5)])(rows)
    assert_catches_a_double(exactly([T0 + 1000 * i for i in range(1, 5)]), rows)
