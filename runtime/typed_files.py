"""Files of the typed per-table changelog (``runtime.typed``): writing a micro-batch's tables
into its staging directory, and reading a layout back with pyarrow (tests, the CLI's counts).

Layout under the output directory::

    <table>/batch=<id>/part-00000.parquet   one file per table and micro-batch
    _staging/ _shoal/                       the committer's (runtime/commit.py): not output

A micro-batch's tables are written by pyarrow on the driver, all of them in one pass without
any Spark job (hundreds of tables cost hundreds of small files, not hundreds of jobs), under
``_staging/<id>/<table>/``; the committer renames each to ``<table>/batch=<id>``. A table
directory holds files of different schemas once a column was added: read it with schema
merging (Spark: ``option("mergeSchema", "true")``; pyarrow: :func:`read_table`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from protocol.commit import STAGING_DIR
from runtime.typed import METADATA

__all__ = [
    "GENERIC_KEY_COLUMNS",
    "encode_parquet",
    "generic_rows",
    "is_typed_layout",
    "read_changes",
    "read_table",
    "table_dirs",
    "write_tables",
]

GENERIC_KEY_COLUMNS = {
    "_commit_ts": "commit_ts",
    "_server_transaction_id": "server_transaction_id",
    "_record_sequence": "record_sequence",
    "_mod_index": "mod_index",
    "_partition_token": "partition_token",
    "_mod_type": "mod_type",
}
"""Typed metadata column → the generic layout's column of the same meaning."""

_WRITERS = 2  # threads encoding one micro-batch's table files


def encode_parquet(table: pa.Table) -> pa.Buffer:
    """One table file's bytes (pyarrow's defaults: snappy), encoded in memory to be written by
    one call."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue()


def write_tables(
    staging: Path, batch: str, tables: Mapping[str, pa.Table]
) -> list[tuple[str, str]]:
    """Write each table of a micro-batch under ``staging`` (``_staging/<batch>`` of the output)
    and return the committer's moves (staged, final), relative to the output directory.

    Each table's directory is ``staging/<table>``, renamed as a whole to ``<table>/batch=<id>``:
    one directory created per table and none left to remove after the renames but ``staging``
    itself. Creating and above all removing directories are the costly file-system operations
    of a many-table micro-batch (docs/benchmarks.md, "Many tables")."""
    staging.mkdir(parents=True, exist_ok=True)

    def write(name: str) -> None:
        # encoded in memory and written by one call, not by pyarrow's writer in many small
        # pieces: 300 small tables staged in 0.54-1.12 s instead of 0.65-1.18 s here, with
        # less CPU (docs/benchmarks.md, "Many tables")
        data = encode_parquet(tables[name])
        directory = staging / name
        directory.mkdir()
        (directory / "part-00000.parquet").write_bytes(memoryview(data))

    if len(tables) <= 1:
        for name in tables:
            write(name)
    else:  # pyarrow encodes without the GIL: big tables encode side by side
        with ThreadPoolExecutor(_WRITERS, thread_name_prefix="shoal-typed-write") as pool:
            for done in pool.map(write, tables):
                assert done is None
    return [(f"{STAGING_DIR}/{batch}/{name}", f"{name}/batch={batch}") for name in tables]


def table_dirs(root: str | os.PathLike[str]) -> list[Path]:
    """The table directories of a typed layout (not ``_``/``.`` names, not ``table=``)."""
    base = Path(root)
    if not base.is_dir():
        return []
    return sorted(
        p
        for p in base.iterdir()
        if p.is_dir() and not p.name.startswith(("_", ".")) and "=" not in p.name
    )


def is_typed_layout(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds typed tables (and no generic ``table=<t>`` directories)."""
    base = Path(root)
    return bool(table_dirs(base)) and not any(base.glob("table=*"))


def _files(directory: Path) -> Iterator[Path]:
    for path in sorted(directory.rglob("*.parquet")):
        if not any(part.startswith((".", "_")) for part in path.relative_to(directory).parts):
            yield path


def read_table(root: str | os.PathLike[str], table: str) -> pa.Table:
    """Every committed row of ``table``, the files' schemas merged (a column missing from an
    older file is null there), with a ``batch`` column; the rows in file order."""
    directory = Path(root) / table
    parts = []
    for path in _files(directory):
        data = pq.read_table(path)
        batch = path.parent.name.removeprefix("batch=")
        parts.append(data.append_column("batch", pa.array([batch] * data.num_rows, pa.string())))
    if not parts:
        raise FileNotFoundError(f"no committed files of table {table} under {root}")
    schema = pa.unify_schemas([p.schema for p in parts])
    return pa.concat_tables([_conform(p, schema) for p in parts])


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    columns = [
        table.column(f.name) if f.name in table.schema.names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def read_changes(root: str | os.PathLike[str]) -> pa.Table:
    """The metadata columns of every table's rows, with ``table`` and ``batch`` columns."""
    schema = pa.schema([*METADATA, ("table", pa.string()), ("batch", pa.string())])
    names = [name for name, _ in METADATA]
    parts = []
    for directory in table_dirs(root):
        for path in _files(directory):
            data = pq.read_table(path, columns=names)
            n = data.num_rows
            data = data.append_column("table", pa.array([directory.name] * n, pa.string()))
            batch = path.parent.name.removeprefix("batch=")
            parts.append(data.append_column("batch", pa.array([batch] * n, pa.string())))
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts)


def generic_rows(root: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Each committed row of a typed layout as a dict with the generic layout's row key names
    too: ``table``, ``commit_ts`` (int microseconds), ``server_transaction_id``,
    ``record_sequence``, ``mod_index``, ``partition_token``, ``mod_type`` and ``record_id``
    (``<commit_ts>/<server_transaction_id>/<record_sequence>/<mod index>``)."""
    changes = read_changes(root)
    ts = changes.column("_commit_ts").cast(pa.int64()).to_pylist()
    columns = {name: changes.column(name).to_pylist() for name in changes.schema.names}
    for i, micros in enumerate(ts):
        row = {name: values[i] for name, values in columns.items()}
        for typed, generic in GENERIC_KEY_COLUMNS.items():
            row[generic] = row[typed]
        row["commit_ts"] = micros
        row["record_id"] = (
            f"{micros}/{row['server_transaction_id']}/{row['record_sequence']}/{row['mod_index']}"
        )
        yield row
