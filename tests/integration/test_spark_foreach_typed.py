"""``SparkConfig.foreach_batch_frames = "typed"`` against local Spark: a ``foreach_batch`` gets
each table of the micro-batch as a typed DataFrame, with the columns and types Spark reads from
the typed layout the default output writes for the same records, and the same rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from runtime.spark import SparkBridge, SparkConfig, TypedFrames
from tests.fixtures.spark import spark
from tests.proc_spark_delta import micro_batches

pytestmark = [pytest.mark.spark, pytest.mark.slow]
__all__ = ["spark"]  # the module-scoped session fixture


def _batch_dirs(table: Path) -> list[Path]:
    """A typed table's ``batch=<id>`` directories, by their first commit timestamp."""

    def first(directory: Path) -> int:
        data = pq.read_table(directory, columns=["_commit_ts"]).column("_commit_ts")
        return int(pc.min(data.cast(pa.int64())).as_py())

    return sorted(table.glob("batch=*"), key=first)


def _rows(df: Any) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in df.collect())


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_foreach_batch_gets_each_table_as_a_typed_dataframe(
    spark: Any, tmp_path: Path
) -> None:
    batches = micro_batches()  # three tables; T0 gains a column in the second
    got: list[tuple[int, str, dict[str, Any]]] = []

    def foreach_batch(frames: TypedFrames, batch_id: int, identity: str) -> None:
        got.append((batch_id, identity, {n: (df.schema, _rows(df)) for n, df in frames.items()}))

    config = SparkConfig(output_dir=str(tmp_path / "unused"), foreach_batch_frames="typed")
    async with SparkBridge(config, foreach_batch=foreach_batch, spark=spark) as bridge:
        for batch in batches:
            await (await bridge.put(batch))
    # the same records through the default output (the typed layout), read back by Spark
    out = tmp_path / "typed"
    async with SparkBridge(SparkConfig(output_dir=str(out)), spark=spark) as bridge:
        for batch in batches:
            await (await bridge.put(batch))

    with_rows = [g for g in got if g[2]]
    assert len(with_rows) == 2
    assert len({identity for _, identity, _ in with_rows}) == 2
    for i, (_, _, frames) in enumerate(with_rows):
        assert sorted(frames) == ["T0", "T1", "T2"]
        for name, (schema, rows) in frames.items():
            # the default output's micro-batch i of the table (by their first commit)
            written = spark.read.parquet(str(_batch_dirs(out / name)[i]))
            assert schema == written.schema, name  # the typed layout's columns and types
            assert rows == _rows(written), name
            assert len(rows) == sum(r.table == name for r in batches[i].records)
    second = with_rows[1][2]
    assert "Note" in second["T0"][0].fieldNames()
    assert "Note" not in second["T1"][0].fieldNames()


def test_typed_frames_are_refused_where_they_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="foreach_batch_frames"):
        SparkBridge(SparkConfig(path="streaming", foreach_batch_frames="typed"))
