"""The streaming path (``path="streaming"``) writing the typed per-table layout through PySpark's
streaming writer (``runtime.spark.datasource.TypedStreamWriter``), against local Spark:

* the same records written by the streaming path and by the embedded (batch) path give the
  same tables: the same files per micro-batch, the same columns and types, the same rows, in
  parquet directories and in Delta tables;
* three tasks over a simulated stream: the output holds exactly the stream (raw rows counted,
  nothing de-duplicated), with its control;
* a streaming micro-batch whose task fails after writing its files is run again by the query's
  restart from its checkpoint, and no row of it is committed twice (the failed run's files are
  kept aside; put back into the output, the same check catches them).
"""

from __future__ import annotations

import collections
import os
import shutil
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from runtime.files.typed import read_changes, read_table, table_dirs
from runtime.ports import SinkBatch
from runtime.spark import SparkBridge, SparkConfig
from runtime.spark.datasource import StreamTaskWritten, TypedStreamChangelog, TypedStreamWriter
from runtime.spark.streaming import spool_files
from tests.fixtures.spark import Cluster, spark, wait_for
from tests.helpers import assert_catches_a_double
from tests.proc_spark_delta import micro_batches

pytestmark = [pytest.mark.spark, pytest.mark.slow]
__all__ = ["spark"]  # the module-scoped session fixture

TABLES = ("T0", "T1", "T2")


def _config(out: Path, table_format: str, **kw: Any) -> SparkConfig:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "path": "streaming",
        "max_rows": 20_000,
        "max_age_s": 0.05,
        "trigger_interval_s": 0.2,
        "ack_poll_s": 0.05,
        "table_format": table_format,
    }
    return SparkConfig(**{**settings, **kw})


def _ids(out: Path) -> list[str]:
    """Every committed row, raw (duplicates kept): ``<table>/<ts>/<txn>/<seq>/<mod index>``."""
    changes = read_changes(out)
    ts = changes.column("_commit_ts").cast(pa.int64()).to_pylist()
    cols = [changes.column(c).to_pylist() for c in ("table", "_server_transaction_id")]
    seq = changes.column("_record_sequence").to_pylist()
    mod = changes.column("_mod_index").to_pylist()
    return sorted(
        f"{t}/{a}/{b}/{c}/{d}" for t, a, b, c, d in zip(cols[0], ts, cols[1], seq, mod, strict=True)
    )


def _expected(batches: list[SinkBatch]) -> list[str]:
    return sorted(
        f"{r.table}/{r.commit_ts}/{r.server_transaction_id}/{r.record_sequence}/{i}"
        for b in batches
        for r in b.records
        for i in range(len(r.mods))
    )


def _exactly(expected: list[str]) -> Any:
    def check(rows: list[str]) -> None:
        twice = [r for r, n in collections.Counter(rows).items() if n > 1]
        assert sorted(rows) == expected, f"{len(rows)} rows, {len(expected)} expected; {twice[:3]}"

    return check


def _layout(out: Path) -> dict[str, tuple[pa.Schema, list[str], list[dict[str, Any]]]]:
    """Per table: its schema, its micro-batches and its rows (sorted), as readers see them."""
    tables = {}
    for directory in table_dirs(out):
        data = read_table(out, directory.name)
        batches = sorted(set(data.column("batch").to_pylist()))
        rows = data.drop_columns(["batch"]).sort_by([("_commit_ts", "ascending")]).to_pylist()
        tables[directory.name] = (data.schema, batches, rows)
    return tables


async def _put_each(bridge: SparkBridge, batches: list[SinkBatch]) -> None:
    for batch in batches:
        await (await bridge.put(batch))


@pytest.mark.asyncio
@pytest.mark.timeout(400)
@pytest.mark.parametrize("table_format", ["parquet", "delta"])
async def test_the_streaming_path_writes_the_batch_paths_typed_layout(
    spark: Any, tmp_path: Path, table_format: str
) -> None:
    batches = micro_batches()  # three tables; T0 gains a column in the second
    streamed, embedded = tmp_path / "streamed", tmp_path / "embedded"
    async with SparkBridge(_config(streamed, table_format), spark=spark) as bridge:
        assert bridge.layout == "typed"
        assert bridge.committer is not None
        await _put_each(bridge, batches)
        stats = bridge.stats()
        position = await bridge.durable_position(batches[0].token)
    assert (stats.rows_committed, stats.batches_failed) == (60, 0)
    assert position is not None
    assert position.ts == batches[-1].watermark  # progress kept by the same committer
    batch_config = SparkConfig(output_dir=str(embedded), table_format=table_format)  # type: ignore[arg-type]
    async with SparkBridge(batch_config, spark=spark) as bridge:
        await _put_each(bridge, batches)

    check = _exactly(_expected(batches))
    check(_ids(streamed))
    assert_catches_a_double(check, _ids(streamed))
    got, want = _layout(streamed), _layout(embedded)
    assert sorted(got) == list(TABLES)
    for name in TABLES:
        assert got[name][0] == want[name][0], name  # the same columns and types
        assert got[name][1] == want[name][1], name  # the same micro-batch identities
        assert got[name][2] == want[name][2], name  # the same rows
    assert "Note" in got["T0"][0].names
    assert "Note" not in got["T1"][0].names
    if table_format == "delta":
        from deltalake import DeltaTable

        for name in TABLES:
            table = DeltaTable(str(streamed / name))
            # the same Delta commits as the batch path's: the first micro-batch creates the
            # table, the second is one WRITE (T0's new column merged before it)
            history = [h["operation"] for h in table.history()]
            assert history == [h["operation"] for h in DeltaTable(str(embedded / name)).history()]
            assert history[-1] == "CREATE TABLE"
            assert history[0] == "WRITE"
            on_disk = {p.name for p in (streamed / name).glob("*.parquet")}
            assert on_disk == {u.rsplit("/", 1)[-1] for u in table.file_uris()}
    else:
        for name in TABLES:
            assert sorted(p.name for p in (streamed / name).iterdir()) == [
                f"batch={b}" for b in got[name][1]
            ]
    assert not spool_files(streamed / "_spool")  # acked spool files are deleted
    assert not [p for p in (streamed / "_staging").rglob("*") if p.is_file()]


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_the_streamed_typed_output_equals_the_stream(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    async with SparkBridge(_config(out, "parquet", max_age_s=0.5), spark=spark) as bridge:
        cluster = Cluster(bridge, seed=31)
        expected = cluster.expected()
        async with AsyncExitStack() as stack:
            await cluster.start(stack)
            await wait_for(lambda: bridge.stats().rows_committed >= len(expected), 200, "rows")
    # (a micro-batch holding a batch of a reader that stopped as the tasks joined is refused
    # at its commit point, its partitions read again: the output still holds each row once)
    want = sorted(f"{r[4]}/{r[0]}/{r[1]}/{r[2]}/{r[3]}" for r in expected)
    check = _exactly(want)
    check(_ids(out))
    assert_catches_a_double(check, _ids(out))


# --- a streamed micro-batch failing after its files were written ----------------------------


def _side(staging: str) -> Path:
    """Where the failing writer keeps the failed run's files: beside the output
    (``<output>/_staging/<connector>/<batch>`` → ``<output>/../side``)."""
    return Path(staging).parents[2].parent / "side"


class _FailingStreamWriter(TypedStreamWriter):
    """The first task (of any micro-batch with rows) writes its files, keeps copies of them
    under :func:`_side` and fails: the streaming query dies with the files in place."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StreamTaskWritten:
        written = super().write(iterator)
        if written.staging is None or not written.task.files:
            return written
        side = _side(written.staging)
        side.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(side / "failed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return written  # failed once already
        with os.fdopen(fd, "w") as marker:
            for i, f in enumerate(written.task.files):
                shutil.copy(f.path, side / f"{i}-{f.table}.parquet")
                marker.write(f"{f.table} {f.path}\n")
        raise RuntimeError("this streamed task fails after writing its files")


class FailingStream(TypedStreamChangelog):
    @classmethod
    def name(cls) -> str:
        return "shoal_typed_stream_failing"

    def streamWriter(self, schema: Any, overwrite: bool) -> TypedStreamWriter:
        return _FailingStreamWriter(self.options)


@pytest.mark.asyncio
@pytest.mark.timeout(400)
@pytest.mark.parametrize("table_format", ["parquet", "delta"])
async def test_a_streamed_batch_failing_after_its_files_commits_once_after_the_restart(
    spark: Any, tmp_path: Path, table_format: str
) -> None:
    out = tmp_path / "out"
    batches = micro_batches()
    bridge = SparkBridge(_config(out, table_format, retry_backoff_s=0.1), spark=spark)
    bridge.stream_sink = FailingStream
    async with bridge:
        await _put_each(bridge, batches)
        stats = bridge.stats()
        assert bridge._stream is not None
        restarts = bridge._stream.backend.restarts
    side = tmp_path / "side"
    failed = (side / "failed").read_text().split()
    assert failed, "the task failed after writing its files"
    assert restarts == 1, "the query was restarted from its checkpoint"
    assert stats.attempts_failed >= 1
    assert stats.batches_failed == 0
    check = _exactly(_expected(batches))
    rows = _ids(out)
    check(rows)  # raw rows: nothing de-duplicated on the way
    assert_catches_a_double(check, rows)
    # the control: the failed run's files, had they been committed too, are caught
    kept = sorted(side.glob("*.parquet"))
    assert kept
    table = kept[0].name.split("-", 1)[1].removesuffix(".parquet")
    if table_format == "delta":
        extra = pq.read_table(kept[0])
        assert pc.sum(pc.is_valid(extra.column("_commit_ts"))).as_py() > 0
        doubled = sorted(
            rows
            + [
                f"{table}/{ts}/{txn}/{seq}/{mod}"
                for ts, txn, seq, mod in zip(
                    extra.column("_commit_ts").cast(pa.int64()).to_pylist(),
                    extra.column("_server_transaction_id").to_pylist(),
                    extra.column("_record_sequence").to_pylist(),
                    extra.column("_mod_index").to_pylist(),
                    strict=True,
                )
            ]
        )
    else:
        (batch_dir,) = [d for d in (out / table).iterdir() if _stamps(kept[0]) <= _stamps(d)]
        shutil.copy(kept[0], batch_dir / "part-failed-run.parquet")
        doubled = _ids(out)
    with pytest.raises(AssertionError):
        check(doubled)


def _stamps(path: Path) -> set[int]:
    """The commit timestamps of a parquet file or of the files of a directory."""
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    return {
        v for f in files for v in pq.read_table(f).column("_commit_ts").cast(pa.int64()).to_pylist()
    }
