"""Spark writes the typed per-table changelog (runtime/spark/datasource.py, the bridge's typed
layout): one Spark job per micro-batch whatever the number of tables, the files written by
Spark's Python workers (not this process), the same tables as the in-process path, and the
files of a failed task attempt never committed. Real local Spark (``local[2,2]``: a task may
fail once and be retried, as on a cluster); one session for the module."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protocol.commit import STAGING_DIR
from protocol.records import ColumnType, DataChange, Mod
from runtime.files.typed import read_table, table_dirs
from runtime.ports import SinkBatch
from runtime.spark import SparkBridge, SparkConfig, read_output
from runtime.spark.datasource import (
    RECEIPT,
    Receipt,
    TaskWritten,
    TypedChangelog,
    TypedWriter,
    write_staged_typed,
)
from runtime.spark.session import java_executable, start_session
from runtime.typed import typed_tables, wire_table
from tests.fixtures.typed_records import all_types_entries, comparable
from tests.helpers import assert_catches_a_double, assert_no_row_twice

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    if java_executable() is None:
        pytest.skip("local Spark needs Java (JAVA_HOME or java on PATH)")
    local_dir = tempfile.mkdtemp(prefix="shoal-spark-test-")
    session = start_session(
        master="local[2,2]",  # two cores; a task may fail once and run again
        remote=None,
        app_name="shoal-typed-writes",
        conf={"spark.ui.showConsoleProgress": "false"},
        local_dir=local_dir,
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    shutil.rmtree(local_dir, ignore_errors=True)


def _staged(receipt: Receipt) -> dict[str, pa.Table]:
    """Each table's rows from the files the receipt lists, in task order."""
    out: dict[str, list[pa.Table]] = {}
    for f in receipt.files:
        out.setdefault(f.table, []).append(pq.read_table(f.path))
    return {name: pa.concat_tables(parts) for name, parts in out.items()}


@pytest.mark.timeout(300)
def test_spark_writes_the_tables_the_in_process_path_builds(spark: Any, tmp_path: Path) -> None:
    """Records of every Spanner type through Spark: the staged files hold exactly the tables
    ``typed_tables`` builds in this process (schema and values), written in one Spark job by
    Spark's Python workers, listed by the receipt and nothing else staged."""
    entries = all_types_entries(copies=40)  # ~600 rows: both tasks get some
    expected = typed_tables(entries)
    wire, specs = wire_table(entries)
    staging = tmp_path / "stage"
    receipt = write_staged_typed(spark, wire, str(staging), specs)
    assert receipt.spark_jobs == 1
    assert receipt.rows == wire.num_rows
    assert len(receipt.tasks) == 2, receipt.tasks
    assert {t.pid for t in receipt.tasks}.isdisjoint({os.getpid()})
    got = _staged(receipt)
    assert sorted(got) == sorted(expected) == receipt.tables
    for name, table in expected.items():
        assert comparable(got[name]) == comparable(table), name
    on_disk = sorted(str(p) for p in staging.rglob("*") if p.is_file())
    assert on_disk == sorted([*(f.path for f in receipt.files), str(staging / RECEIPT)])


def _many(tables: int, rows: int) -> list[tuple[str, list[DataChange]]]:
    key = ColumnType("Id", '{"code":"INT64"}', True, 1)
    value = ColumnType("Amount", '{"code":"NUMERIC"}', False, 2)
    records = [
        DataChange(
            1000 + i,
            "0",
            f"tx{i}",
            True,
            f"T{i % tables:03d}",
            (key, value),
            (Mod(f'{{"Id":"{i}"}}', '{"Amount":"1.25"}', "{}"),),
            "INSERT",
        )
        for i in range(rows)
    ]
    return [("p", records)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tables", [1, 50])
def test_one_spark_job_per_micro_batch_whatever_the_number_of_tables(
    spark: Any, tmp_path: Path, tables: int
) -> None:
    entries = _many(tables, 2_000)
    wire, specs = wire_table(entries)
    receipt = write_staged_typed(spark, wire, str(tmp_path / "stage"), specs)
    assert receipt.spark_jobs == 1
    assert len(receipt.tables) == tables
    assert receipt.rows == 2_000
    # a run of whole tables per task: at most one table split between two tasks
    assert len(receipt.files) <= tables + len(receipt.tasks) - 1
    # the control: the status tracker does count jobs (two plain jobs in one group)
    sc = spark.sparkContext
    sc.setJobGroup(f"control-{tables}", "two jobs")
    try:
        spark.range(3).collect()
        spark.range(4).collect()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert len(sc.statusTracker().getJobIdsForGroup(f"control-{tables}")) == 2


def test_an_empty_micro_batch_runs_no_job(spark: Any, tmp_path: Path) -> None:
    wire, specs = wire_table([("p", [])])
    receipt = write_staged_typed(spark, wire, str(tmp_path / "stage"), specs)
    assert (receipt.spark_jobs, receipt.files) == (0, [])
    assert not (tmp_path / "stage").exists()


class _FailingWriter(TypedWriter):
    """Writes its files, then fails its first attempt of partition 0 (after noting the files
    in ``<side>/failed-<pid>``): the attempt's files stay behind, uncommitted."""

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.side = options["side"]

    def write(self, iterator: Any) -> TaskWritten:
        from pyspark import TaskContext

        written = super().write(iterator)
        ctx = TaskContext.get()
        assert ctx is not None
        if ctx.partitionId() == 0 and ctx.attemptNumber() == 0:
            paths = "\n".join(f.path for f in written.task.files)
            Path(self.side, f"failed-{os.getpid()}").write_text(paths)
            raise RuntimeError("this task attempt fails after writing its files")
        return written


class FailingOnce(TypedChangelog):
    @classmethod
    def name(cls) -> str:
        return "shoal_typed_failing_once"

    def writer(self, schema: Any, overwrite: bool) -> TypedWriter:
        return _FailingWriter(self.options)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delta", [False, True], ids=["staged", "delta"])
def test_a_failed_task_attempts_files_are_not_committed(
    spark: Any, tmp_path: Path, delta: bool
) -> None:
    """A task attempt that wrote its files and failed: its files are in no receipt and are
    deleted, under the staging location or (``delta``: written straight into the Delta
    tables' directories) in the tables."""
    entries = _many(3, 3_000)
    wire, specs = wire_table(entries)
    side = tmp_path / "side"
    side.mkdir()
    staging = tmp_path / "stage"
    receipt = write_staged_typed(
        spark,
        wire,
        str(staging),
        specs,
        source=FailingOnce,
        options={"side": str(side)},
        tables_uri=str(tmp_path / "tables") if delta else None,
        batch="b1",
    )
    failed = [p for f in side.iterdir() for p in f.read_text().split()]
    assert failed, "the failing attempt wrote nothing: the check would prove nothing"
    assert {(t.partition, t.attempt) for t in receipt.tasks} == {(0, 1), (1, 0)}
    listed = {f.path for f in receipt.files}
    assert listed.isdisjoint(failed)
    assert not any(Path(p).exists() for p in failed)  # deleted once the receipt was read
    if delta:
        assert all(Path(p).parent.parent == tmp_path / "tables" for p in failed)
        assert all(f.stats is not None for f in receipt.files)  # each add action's statistics
    got = _staged(receipt)
    expected = typed_tables(entries)
    assert {n: comparable(t) for n, t in got.items()} == {
        n: comparable(t) for n, t in expected.items()
    }


def rec(ts: int, table: str) -> DataChange:
    key = ColumnType("Id", '{"code":"INT64"}', True, 1)
    amount = ColumnType("Amount", '{"code":"NUMERIC"}', False, 2)
    mod = Mod(f'{{"Id":"{ts}"}}', '{"Amount":"1.25"}', '{"Amount":null}')
    return DataChange(ts, "0", f"tx{ts}", True, table, (key, amount), (mod,), "UPDATE")


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_the_bridge_writes_the_typed_layout_with_one_job_per_micro_batch(
    spark: Any, tmp_path: Path
) -> None:
    """The bridge's default output: 200 tables in a micro-batch, one Spark job each, committed
    atomically (each table's directory, the positions); a new bridge over the output learns
    what is there and writes nothing twice; each table holds what the in-process path builds."""
    out = tmp_path / "data"
    tables = [f"T{i:03d}" for i in range(200)]
    records = tuple(rec(100 + i, t) for i, t in enumerate(tables))
    config = SparkConfig(output_dir=str(out), max_rows=10_000, max_age_s=0.05)
    async with SparkBridge(config, spark=spark) as bridge:
        assert bridge.layout == "typed"
        await (await bridge.put(SinkBatch("p", records[:150], 250)))
        await (await bridge.put(SinkBatch("q", records[150:], 400)))
        position = await bridge.durable_position("p")
        assert bridge.typed_writes >= 1
        assert bridge.typed_write_jobs == bridge.typed_writes
    assert position is not None
    assert position.ts == 250
    assert [p.name for p in table_dirs(out)] == tables
    assert not any(p.is_file() for p in (out / STAGING_DIR).rglob("*"))
    expected = typed_tables([("p", records[:150]), ("q", records[150:])])
    for name in ("T000", "T007", "T199"):
        got = read_table(out, name).drop_columns(["batch"])
        assert comparable(got) == comparable(expected[name])
    async with SparkBridge(config, spark=spark) as again:
        await (await again.put(SinkBatch("p", records[:150], 250)))
        assert again.stats().rows_deduplicated == 150
        assert again.typed_writes == 0  # nothing left to write: no job
    written = _identities(read_output(str(out), dedupe=False))
    assert len(written) == 200  # the 200 records' rows, the re-put batch's not again
    assert_no_row_twice(written)
    assert_catches_a_double(assert_no_row_twice, written)


def _identities(table: Any) -> list[tuple[Any, ...]]:
    """Each raw row's identity (commit timestamp, transaction, record sequence, mod index)."""
    cols = ("commit_ts", "server_transaction_id", "record_sequence", "mod_index")
    return list(zip(*(table.column(c).to_pylist() for c in cols), strict=True))


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_without_atomic_commits_the_typed_layout_is_written_in_place(
    spark: Any, tmp_path: Path
) -> None:
    """``atomic_commit=False``: each micro-batch is one Spark job too, its tables renamed into
    ``<table>/batch=<run>-<batch>`` by this process; nothing staged is left behind."""
    out = tmp_path / "data"
    records = tuple(rec(100 + i, f"T{i % 7}") for i in range(70))
    config = SparkConfig(output_dir=str(out), max_rows=10_000, max_age_s=0.05, atomic_commit=False)
    async with SparkBridge(config, spark=spark) as bridge:
        assert bridge.committer is None
        await (await bridge.put(SinkBatch("p", records, 500)))
        assert bridge.typed_write_jobs == bridge.typed_writes == 1
    assert [p.name for p in table_dirs(out)] == [f"T{i}" for i in range(7)]
    assert not any(p.is_file() for p in (out / STAGING_DIR).rglob("*"))
    expected = typed_tables([("p", records)])
    for name, table in expected.items():
        assert comparable(read_table(out, name).drop_columns(["batch"])) == comparable(table)
