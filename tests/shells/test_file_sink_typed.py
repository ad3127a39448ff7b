"""The parquet file sink's typed layout (the default): one directory per table, the table's
columns in their types, every micro-batch committed by the atomic committer (one rename per
table directory, the partitions' progress files), a column added mid-stream in later files."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protocol.commit import STAGING_DIR
from protocol.records import ColumnType, DataChange, Mod
from runtime.files.sink import FileSink, read_rows
from runtime.files.typed import read_changes, read_table, table_dirs
from runtime.ports import SinkBatch

ID = ColumnType("Id", '{"code":"INT64"}', True, 1)
WHEN = ColumnType("When", '{"code":"TIMESTAMP"}', False, 2)
EXTRA = ColumnType("Extra", '{"code":"BOOL"}', False, 3)


def rec(ts: int, table: str, key: int, cols: tuple[ColumnType, ...] = (ID, WHEN)) -> DataChange:
    new = '{"When":"2024-01-02T03:04:05.000006Z"' + (',"Extra":true}' if EXTRA in cols else "}")
    mod = Mod(keys=f'{{"Id":"{key}"}}', new_values=new, old_values="{}")
    return DataChange(ts, "0", f"txn{ts}", True, table, cols, (mod,), "INSERT")


def batch_dirs(root: Path, table: str) -> list[str]:
    return sorted(p.name for p in (root / table).iterdir())


@pytest.mark.asyncio
async def test_many_tables_one_directory_each_committed_once(tmp_path: Path) -> None:
    tables = [f"T{i:03d}" for i in range(120)]
    first = tuple(rec(10 + i, t, i) for i, t in enumerate(tables))
    later = (rec(500, "T000", 1000, (ID, WHEN, EXTRA)),)
    async with FileSink(tmp_path, max_age_s=0.01) as sink:
        await (await sink.put(SinkBatch("p", first, 200)))
        await (await sink.put(SinkBatch("p", later, 600)))
        # the same records again (a re-read): dropped, nothing new is written
        await (await sink.put(SinkBatch("p", first, 200)))
        assert sink.committer.batches == 3
    assert (await FileSink(tmp_path).durable_position("p")) is not None
    check_many_tables(tmp_path, tables)


def check_many_tables(tmp_path: Path, tables: list[str]) -> None:
    assert [p.name for p in table_dirs(tmp_path)] == tables
    assert not any(p.is_file() for p in (tmp_path / STAGING_DIR).rglob("*"))
    assert len(batch_dirs(tmp_path, "T000")) == 2  # two micro-batches wrote T000
    assert len(batch_dirs(tmp_path, "T001")) == 1
    t0 = read_table(tmp_path, "T000")
    assert t0.schema.field("Id").type == pa.int64()
    assert t0.schema.field("When").type == pa.timestamp("us", tz="UTC")
    assert t0.schema.field("Extra").type == pa.bool_()  # added later: null in the older file
    rows = sorted((r["Id"], r["Extra"]) for r in t0.to_pylist())
    assert rows == [(0, None), (1000, True)]
    older = next(
        p for p in (tmp_path / "T000").rglob("*.parquet") if "Extra" not in pq.read_schema(p).names
    )
    assert older.exists()
    assert t0.column("When").to_pylist()[0] == dt.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC)
    assert read_changes(tmp_path).num_rows == 121
    ids = sorted(r["record_id"] for r in read_rows(tmp_path))
    assert len(ids) == len(set(ids)) == 121


@pytest.mark.asyncio
async def test_the_generic_layout_stays_available(tmp_path: Path) -> None:
    async with FileSink(tmp_path, max_age_s=0.01, layout="generic") as sink:
        await (await sink.put(SinkBatch("p", (rec(10, "A", 1), rec(11, "B", 2)), 20)))
    check_generic(tmp_path)


def check_generic(tmp_path: Path) -> None:
    assert [p.name.split("=")[0] for p in tmp_path.iterdir() if not p.name.startswith("_")] == [
        "batch"
    ]
    rows = list(read_rows(tmp_path))
    assert sorted(r["table"] for r in rows) == ["A", "B"]
    assert rows[0]["new_values"].startswith('{"When"')


@pytest.mark.parametrize("killed", ["before the manifest", "after the manifest"])
def test_a_killed_typed_commit_is_all_or_nothing(tmp_path: Path, killed: str) -> None:
    """A process killed before its commit point leaves no table of the batch visible; one killed
    right after it (the manifest written, no table renamed) has every table put in place by the
    next committer over the directory. Same batch, same staged files, only the kill differs."""
    from protocol.commit import Manifest, Move, PartitionPosition, next_position
    from runtime.files.commit import Committer
    from runtime.files.typed import write_tables
    from runtime.typed import typed_tables

    records = [rec(10 + i, f"T{i}", i) for i in range(5)]
    committer = Committer(tmp_path, fsync=False, clock=lambda: 1e12)  # staged files look old
    staging = committer.staging("b1")
    moves = write_tables(staging, committer.staged("b1"), "b1", typed_tables([("p", records)]))
    if killed == "after the manifest":
        position = next_position(None, records, 100)
        manifest = Manifest(
            "b1",
            committer.staged("b1"),
            tuple(Move(s, f) for s, f in moves),
            (PartitionPosition("p", position),),
        )
        committer._write_manifest(manifest)
    assert table_dirs(tmp_path) == []  # nothing visible before recovery, either way
    again = Committer(tmp_path, fsync=False, clock=lambda: 1e12)
    again.recover()
    if killed == "after the manifest":
        assert [p.name for p in table_dirs(tmp_path)] == [f"T{i}" for i in range(5)]
        assert again.committed("p") is not None
        assert read_changes(tmp_path).num_rows == 5
    else:
        assert table_dirs(tmp_path) == []
        assert again.committed("p") is None
    assert not any(p.is_file() for p in (tmp_path / STAGING_DIR).rglob("*"))


@pytest.mark.asyncio
async def test_a_value_that_does_not_fit_fails_only_its_partitions_batches(
    tmp_path: Path,
) -> None:
    """A micro-batch of several partitions' batches, one with a value no INT64 holds: only that
    partition's batches fail (and its next one is refused until it re-reads from before the
    bad record); the others are committed (docs/design.md#poison-partitions)."""
    good_a = (rec(10, "T", 1), rec(11, "T", 2))
    good_c = (rec(12, "U", 3),)
    mod = Mod(keys='{"Id":"not a number"}', new_values="{}", old_values="{}")
    bad = DataChange(13, "0", "txn13", True, "T", (ID, WHEN), (mod,), "INSERT")
    async with FileSink(tmp_path, max_age_s=0.2, validate=True) as sink:
        futures = [
            await sink.put(SinkBatch("a", good_a, 11)),
            await sink.put(SinkBatch("b", (bad,), 13)),
            await sink.put(SinkBatch("c", good_c, 12)),
        ]
        await asyncio.wait(futures)
        assert futures[0].exception() is None
        assert futures[2].exception() is None
        error = futures[1].exception()
        assert error is not None
        assert "typed conversion failed" in str(error)
        later = await sink.put(SinkBatch("b", (rec(20, "T", 9),), 20))
        with pytest.raises(Exception, match="re-read from before it"):
            await later
        # the re-read from before the bad record is taken (and fails on it again)
        again = await sink.put(SinkBatch("b", (bad,), 13))
        with pytest.raises(Exception, match="does not fit"):
            await again
    assert await FileSink(tmp_path).durable_position("b") is None
    assert await FileSink(tmp_path).durable_position("a") is not None
    rows = sorted(r["Id"] for t in ("T", "U") for r in read_table(tmp_path, t).to_pylist())
    assert rows == [1, 2, 3]
