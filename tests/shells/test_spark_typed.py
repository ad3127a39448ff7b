"""The Spark bridge's typed default output (runtime/spark/typed_output.py): each table of a
micro-batch in its own directory, written by pyarrow on the driver (no Spark job per table, nor
per batch), committed through the atomic committer; a restarted bridge resumes de-duplication
from the typed files. Runs without a JVM: the session is a stand-in that counts the jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from protocol.commit import STAGING_DIR
from protocol.records import ColumnType, DataChange, Mod
from runtime.ports import SinkBatch
from runtime.spark import SparkBridge, SparkConfig, read_output
from runtime.spark.bridge import _layout
from runtime.typed_files import read_table, table_dirs

ID = ColumnType("Id", '{"code":"INT64"}', True, 1)
AMOUNT = ColumnType("Amount", '{"code":"NUMERIC"}', False, 2)


class _Frame:
    def count(self) -> int:
        return 1


class _CountingSpark:
    """Stands in for a session: counts the DataFrames (jobs) the bridge asks for."""

    def __init__(self) -> None:
        self.frames = 0

    def createDataFrame(self, table: object) -> _Frame:
        self.frames += 1
        return _Frame()


def rec(ts: int, table: str) -> DataChange:
    mod = Mod(f'{{"Id":"{ts}"}}', '{"Amount":"1.25"}', '{"Amount":null}')
    return DataChange(ts, "0", f"tx{ts}", True, table, (ID, AMOUNT), (mod,), "UPDATE")


def _config(out: Path) -> SparkConfig:
    return SparkConfig(output_dir=str(out), max_rows=10_000, max_age_s=0.05)


@pytest.mark.asyncio
async def test_many_tables_cost_no_spark_job(tmp_path: Path) -> None:
    out = tmp_path / "data"
    tables = [f"T{i:03d}" for i in range(200)]
    records = tuple(rec(100 + i, t) for i, t in enumerate(tables))
    spark = _CountingSpark()
    async with SparkBridge(_config(out), spark=spark) as bridge:
        assert bridge.layout == "typed"
        warm_frames = spark.frames
        await (await bridge.put(SinkBatch("p", records[:150], 250)))
        await (await bridge.put(SinkBatch("q", records[150:], 400)))
        assert spark.frames == warm_frames  # no Spark job for the output at all
        position = await bridge.durable_position("p")
    assert position is not None
    assert position.ts == 250
    check_tables(out, tables)
    # a new bridge over the same output learns what is there: a re-put writes nothing twice
    async with SparkBridge(_config(out), spark=_CountingSpark()) as again:
        await (await again.put(SinkBatch("p", records[:150], 250)))
        assert again.stats().rows_deduplicated == 150
    assert read_output(str(out), dedupe=False).num_rows == 200


def check_tables(out: Path, tables: list[str]) -> None:
    assert [p.name for p in table_dirs(out)] == tables
    assert not any(p.is_file() for p in (out / STAGING_DIR).rglob("*"))
    one = read_table(out, "T007").to_pylist()
    assert [(r["Id"], str(r["Amount"]), r["_old_Amount"], r["_partition_token"]) for r in one] == [
        (107, "1.250000000", None, "p")
    ]


def test_the_layout_is_typed_where_it_can_be_written() -> None:
    assert _layout(SparkConfig(), has_foreach=False) == "typed"
    assert _layout(SparkConfig(path="streaming"), has_foreach=False) == "generic"
    assert _layout(SparkConfig(output_dir="s3a://b/o"), has_foreach=False) == "generic"
    assert _layout(SparkConfig(output_layout="generic"), has_foreach=False) == "generic"
    with pytest.raises(ValueError, match="typed"):
        _layout(SparkConfig(path="streaming", output_layout="typed"), has_foreach=False)
    kw: dict[str, Any] = {"output_dir": "hdfs://nn/out", "output_layout": "typed"}
    with pytest.raises(ValueError, match="typed"):
        _layout(SparkConfig(**kw), has_foreach=False)
