"""Reading the streaming path's output as Spark's own reader does: only the files the file
sink's log (``_spark_metadata``) names, so files of a micro-batch that never committed (its
JVM died mid-write) are not read, and the raw read holds each change once."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from runtime.spark import read_output
from runtime.spark.output import streaming_sink_files
from runtime.spark.rows import arrow_schema


def _rows(ts: int, n: int) -> pa.Table:
    schema = arrow_schema().remove(arrow_schema().get_field_index("table"))
    columns = {}
    for field in schema:
        if field.name == "commit_ts" or pa.types.is_integer(field.type):
            columns[field.name] = pa.array([ts + i for i in range(n)], field.type)
        else:
            columns[field.name] = pa.array([f"{field.name}-{ts + i}" for i in range(n)])
    return pa.table(columns, schema=schema)


def _log(path: Path, entries: list[tuple[Path, str]]) -> None:
    lines = ["v1"] + [
        json.dumps({"path": f.as_uri(), "size": 1, "isDir": False, "action": action})
        for f, action in entries
    ]
    path.write_text("\n".join(lines))


def test_only_the_files_the_sink_log_names_are_read(tmp_path: Path) -> None:
    out = tmp_path / "out"
    part = out / "table=Singers"
    part.mkdir(parents=True)
    files = [part / f"part-{i}.parquet" for i in range(4)]
    for i, f in enumerate(files):
        pq.write_table(_rows(1000 * i, 3), f)
    meta = out / "_spark_metadata"
    meta.mkdir()
    _log(meta / "9.compact", [(files[0], "add"), (files[1], "add")])
    _log(meta / "10", [(files[2], "add"), (files[1], "delete")])
    (meta / ".11.tmp").write_text("v1\n{not json")  # Spark's half-written next entry
    # files[3]: written by a micro-batch that never committed

    assert streaming_sink_files(out) == [files[0], files[2]]
    table = read_output(out, dedupe=False)
    assert sorted(table.column("commit_ts").to_pylist()) == [0, 1, 2, 2000, 2001, 2002]
    assert set(table.column("table").to_pylist()) == {"Singers"}


def test_an_empty_sink_log_reads_nothing_and_no_log_reads_every_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "table=Singers").mkdir(parents=True)
    pq.write_table(_rows(0, 2), out / "table=Singers" / "part-0.parquet")
    assert streaming_sink_files(out) is None
    assert read_output(out, dedupe=False).num_rows == 2
    (out / "_spark_metadata").mkdir()
    assert streaming_sink_files(out) == []
    assert read_output(out, dedupe=False).num_rows == 0
