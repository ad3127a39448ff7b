"""The Spark bridge's default output commits each micro-batch atomically with its partitions'
positions (docs/design.md#exactly-once-output): against local Spark, ``committed(token)``
answers the batch's position, a bridge killed half-way through a commit is finished by the
next one over the same directory, and neither pyarrow nor Spark ever reads staged rows;
``foreach_batch`` gets the deterministic batch identity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import AnalysisException

from protocol.commit import STAGING_DIR, Rename, batch_identity
from protocol.dedup import Position
from protocol.records import DataChange, Mod
from runtime.files.commit import Committer
from runtime.ports import SinkBatch
from runtime.spark import BridgeError, SparkBridge, SparkConfig, read_output
from tests.fixtures.spark import spark
from tests.helpers import assert_catches_a_double, exactly

pytestmark = [pytest.mark.spark, pytest.mark.slow]
__all__ = ["spark"]  # the module-scoped session fixture


def rec(ts: int, seq: str = "0", table: str = "A", key: int = 1) -> DataChange:
    mod = Mod(keys=f'{{"id": {key}}}', new_values="{}", old_values="{}")
    return DataChange(ts, seq, f"txn{ts}", False, table, (), (mod,), "INSERT")


P = SinkBatch("p", (rec(10), rec(20, "0", "B"), rec(20, "1")), 20)
Q = SinkBatch("q", (rec(15, table="B", key=2),), 18)
P_POSITION = Position(20, (("txn20", "0"), ("txn20", "1")))


def _config(out: Path) -> SparkConfig:
    return SparkConfig(output_dir=str(out), max_rows=100, max_age_s=0.05, output_layout="generic")


def _keys(table: Any) -> list[tuple[Any, ...]]:
    cols = ("partition_token", "commit_ts", "record_sequence")
    return sorted(zip(*(table.column(c).to_pylist() for c in cols), strict=True))


EXPECTED = [("p", 10, "0"), ("p", 20, "0"), ("p", 20, "1"), ("q", 15, "0")]


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_positions_are_committed_and_a_killed_commit_is_finished_by_the_next_bridge(
    spark: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # a bridge killed after its manifest, before its renames (every later step dies too)
    with pytest.MonkeyPatch.context() as mp:
        real = Committer._do

        def do(self: Committer, op: Any) -> None:
            if isinstance(op, Rename) or getattr(self, "_dead", False):
                self._dead = True  # type: ignore[attr-defined]
                raise OSError("killed")
            real(self, op)

        mp.setattr(Committer, "_do", do)
        async with SparkBridge(_config(out), spark=spark) as bridge:
            futures = [await bridge.put(P), await bridge.put(Q)]
            for future in futures:
                with pytest.raises(BridgeError, match="not applied yet"):
                    await future
    # staged by Spark (its _temporary commit done there), not visible to any reader
    assert any((out / STAGING_DIR).rglob("*.parquet"))
    assert not list((out / STAGING_DIR).rglob("_temporary"))
    assert read_output(str(out), dedupe=False).num_rows == 0
    with pytest.raises(AnalysisException, match="UNABLE_TO_INFER_SCHEMA"):
        read_output(spark, str(out), dedupe=False).count()  # Spark finds no parquet at all

    async with SparkBridge(_config(out), spark=spark) as bridge:  # recovers at open
        assert bridge.committer is not None
        assert bridge.committer.recovered == 1
        looked_up: list[str] = []
        real_committed = bridge.committer.committed

        def committed(token: str) -> Position | None:
            looked_up.append(token)
            return real_committed(token)

        bridge.committer.committed = committed  # type: ignore[method-assign]
        assert await bridge.durable_position("p") == P_POSITION
        assert await bridge.durable_position("q") == Position(18)
        # the same batch again, as the readers that asked re-read it: written once
        futures = [await bridge.put(P), await bridge.put(Q)]
        for future in futures:
            await future
        # each partition's position was looked up once: the cut knew it from the readers
        assert looked_up == ["p", "q"]
        # and a new one on top
        await (await bridge.put(SinkBatch("p", (rec(20, "2"), rec(30)), 30)))
        assert await bridge.durable_position("p") == Position(30, (("txn30", "0"),))
    raw = read_output(str(out), dedupe=False)
    expected = sorted([*EXPECTED, ("p", 20, "2"), ("p", 30, "0")])
    exactly(expected)(_keys(raw))  # raw rows: the recovered and re-put batches once each
    assert_catches_a_double(exactly(expected), _keys(raw))
    assert set(raw.column("table").to_pylist()) == {"A", "B"}
    assert read_output(spark, str(out), dedupe=False).count() == raw.num_rows
    assert not any(p.is_file() for p in (out / STAGING_DIR).rglob("*"))


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_foreach_batch_gets_the_batch_identity(spark: Any, tmp_path: Path) -> None:
    seen: list[tuple[int, str, int]] = []

    def foreach(df: Any, batch_id: int, identity: str) -> None:
        seen.append((batch_id, identity, df.count()))

    async with SparkBridge(_config(tmp_path), foreach_batch=foreach, spark=spark) as bridge:
        assert bridge.committer is None  # the user's write is the user's to make idempotent
        await (await bridge.put(P))
        await (await bridge.put(P))  # delivered again: dropped as a re-read, same identity
        assert await bridge.durable_position("p") is None
    assert (seen[0][1], seen[0][2]) == (batch_identity([("p", P.records)]), 3)
    assert seen[1][1] == seen[0][1]
