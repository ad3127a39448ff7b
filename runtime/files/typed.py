"""Files of the typed per-table changelog (``runtime.typed``): writing a micro-batch's tables
into its staging directory, and reading a layout back with pyarrow (tests, the CLI's counts).

Layout under the output directory::

    <table>/batch=<id>/part-00000.parquet   one file per table and micro-batch
    _staging/ _shoal/                       the committer's (runtime/files/commit.py): not output

A micro-batch's tables are written by pyarrow on the driver, all of them in one pass without
any Spark job (hundreds of tables cost hundreds of small files, not hundreds of jobs), under
``_staging/<id>/<table>/``; the committer renames each to ``<table>/batch=<id>``. A table
directory holds files of different schemas once a column was added: read it with schema
merging (Spark: ``option("mergeSchema", "true")``; pyarrow: :func:`read_table`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from runtime.typed import METADATA

if TYPE_CHECKING:
    from protocol.commit import DataFile
    from runtime.lake.store import Store

__all__ = [
    "GENERIC_KEY_COLUMNS",
    "encode_parquet",
    "generic_rows",
    "is_typed_layout",
    "read_changes",
    "read_table",
    "stage_tables",
    "table_dirs",
    "write_delta_files",
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
    staging: Path, staged: str, batch: str, tables: Mapping[str, pa.Table]
) -> list[tuple[str, str]]:
    """Write each table of a micro-batch under ``staging`` (the batch's staging directory,
    ``staged`` relative to the output) and return the committer's moves (staged, final),
    relative to the output directory.

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
    return [(f"{staged}/{name}", f"{name}/batch={batch}") for name in tables]


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


def is_delta_table(directory: Path) -> bool:
    """Whether ``directory`` is a Delta table (``--table-format delta``): it has a log."""
    return (directory / "_delta_log").is_dir()


def delta_file_name(batch: str) -> str:
    """A Delta data file's name (``--table-format delta``): ``part-<batch>-<random>.parquet``,
    so the micro-batch it belongs to can be told from it, as from ``batch=<id>`` otherwise."""
    return f"part-{batch}-{uuid.uuid4().hex[:12]}.parquet"


def _batch_of(path: Path, directory: Path) -> str:
    if path.parent == directory and path.name.startswith("part-"):  # a Delta table's file
        return path.name.removeprefix("part-").rsplit("-", 1)[0]
    return path.parent.name.removeprefix("batch=")


def _files(directory: Path) -> Iterator[Path]:
    """The committed data files of one table directory: those its Delta log names (files a
    killed writer left beside them were never committed), else every parquet file outside
    ``_``/``.`` names."""
    if is_delta_table(directory):
        from deltalake import DeltaTable

        for uri in sorted(DeltaTable(str(directory)).file_uris()):
            yield Path(uri.removeprefix("file://"))
        return
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
        batch = _batch_of(path, directory)
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
            batch = _batch_of(path, directory)
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


def output_identities(root: str | os.PathLike[str]) -> set[tuple[int, str, str]]:
    """The record identities (commit timestamp in microseconds, server transaction id, record
    sequence) of every committed row of a typed or generic output under ``root`` (names
    starting with ``_`` or ``.`` skipped: staged batches, the output's own state); ``root``
    may be an object store's URI (a typed layout there: parquet or Delta tables)."""
    import pyarrow.dataset as ds

    if "://" in str(root):
        return _store_identities(str(root))

    if is_typed_layout(root):
        changes = read_changes(root)
        ts = changes.column("_commit_ts").cast(pa.int64()).to_pylist()
        txn = changes.column("_server_transaction_id").to_pylist()
        seq = changes.column("_record_sequence").to_pylist()
    else:
        base = Path(root)
        if not base.is_dir():
            return set()
        names = ["commit_ts", "server_transaction_id", "record_sequence"]
        data = ds.dataset(
            str(base), format="parquet", exclude_invalid_files=True, ignore_prefixes=[".", "_"]
        )
        if not data.files:
            return set()
        table = data.to_table(columns=names)
        ts = table.column("commit_ts").cast(pa.int64()).to_pylist()
        txn = table.column("server_transaction_id").to_pylist()
        seq = table.column("record_sequence").to_pylist()
    return set(zip(ts, txn, seq, strict=True))


def stage_tables(
    store: Store, staged: str, batch: str, tables: Mapping[str, pa.Table]
) -> list[tuple[str, str]]:
    """:func:`write_tables` through any store (an object store has no local directory): each
    table's file under ``staged/<table>/``, the committer's moves returned."""

    def write(name: str) -> None:
        with store.open_output_stream(f"{staged}/{name}/part-00000.parquet") as sink:
            pq.write_table(tables[name], sink)

    _each(write, tables, _STORE_WRITERS)
    return [(f"{staged}/{name}", f"{name}/batch={batch}") for name in tables]


def write_delta_files(
    store: Store, batch: str, tables: Mapping[str, pa.Table]
) -> list[tuple[str, list[DataFile], pa.Schema]]:
    """``--table-format delta``: write each table's rows as one data file straight into its
    Delta table's directory (invisible until the committer's Delta commit names it) and return
    the committer's ``tables=`` argument."""
    from runtime.lake.delta import write_data_file

    written: dict[str, DataFile] = {}

    def write(name: str) -> None:
        written[name] = write_data_file(store, name, tables[name], name=delta_file_name(batch))

    _each(write, tables, _STORE_WRITERS)
    return [(name, [written[name]], tables[name].schema) for name in tables]


_STORE_WRITERS = 8  # an object store's writes wait on the network: more of them side by side


def _each(write: Callable[[str], None], names: Iterable[str], threads: int) -> None:
    names = list(names)
    if len(names) <= 1:
        for name in names:
            write(name)
        return
    with ThreadPoolExecutor(min(threads, len(names)), thread_name_prefix="shoal-write") as pool:
        for done in pool.map(write, names):
            assert done is None


_ID_COLUMNS = ["_commit_ts", "_server_transaction_id", "_record_sequence"]


def _store_identities(uri: str) -> set[tuple[int, str, str]]:
    """:func:`output_identities` of a typed layout in an object store: each Delta table's
    committed files (its log says which), each parquet table's ``batch=`` directories."""
    import pyarrow.dataset as ds

    from runtime.lake.store import open_store

    store = open_store(uri)
    found: set[tuple[int, str, str]] = set()
    for name in store.list_dirs():
        if name.startswith(("_", ".")):
            continue
        if store.exists(f"{name}/_delta_log"):
            from deltalake import DeltaTable

            dataset = DeltaTable(
                store.uri_for(name), storage_options=store.storage_options()
            ).to_pyarrow_dataset()
        else:
            dataset = ds.dataset(
                store.path(name),
                filesystem=store.fs,
                format="parquet",
                exclude_invalid_files=True,
                ignore_prefixes=[".", "_"],
            )
        table = dataset.to_table(columns=_ID_COLUMNS)
        ts = table.column("_commit_ts").cast(pa.int64()).to_pylist()
        txn = table.column("_server_transaction_id").to_pylist()
        seq = table.column("_record_sequence").to_pylist()
        found.update(zip(ts, txn, seq, strict=True))
    return found
