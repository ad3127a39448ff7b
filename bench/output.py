"""The file sink's committed output read back as a plain reader sees it, in either layout, for
the scenarios that compare it with a recorded load (``chaos``, ``backfill``).

Raw: no de-duplication; files under names starting with ``_`` or ``.`` (staged, the sink's own
records) are not data, as Spark and pyarrow skip them. Each row is a :class:`Change`: its
identity from the metadata columns and its key from the load's tables' ``Id`` column (the typed
layout's own column, the generic layout's ``keys`` JSON). docs/reading-output.md describes both
layouts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

__all__ = ["Change", "read_changes", "typed_tables"]


class Change(NamedTuple):
    commit_ts: int  # Unix microseconds
    table: str
    mod_type: str
    key: int  # the row's Id
    server_transaction_id: str
    record_sequence: str
    mod_index: int
    partition_token: str

    @property
    def identity(self) -> tuple[int, str, str, int]:
        """What makes a row unique in the stream: (commit timestamp, transaction, record
        sequence, mod index)."""
        return (self.commit_ts, self.server_transaction_id, self.record_sequence, self.mod_index)


def read_changes(data: Path) -> Iterator[Change]:
    """Every committed row under ``data`` (``<output-dir>/data``): the typed layout's table
    directories, then the generic layout's files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runtime.files.typed import read_table, table_dirs

    typed = table_dirs(data)
    for directory in typed:
        table = read_table(data, directory.name)
        yield from (
            Change(int(ts), directory.name, str(mod), int(key), str(tx), str(seq), int(i), str(p))
            for ts, mod, key, tx, seq, i, p in zip(
                table.column("_commit_ts").cast(pa.int64()).to_pylist(),
                table.column("_mod_type").to_pylist(),
                table.column("Id").to_pylist(),
                table.column("_server_transaction_id").to_pylist(),
                table.column("_record_sequence").to_pylist(),
                table.column("_mod_index").to_pylist(),
                table.column("_partition_token").to_pylist(),
                strict=True,
            )
        )
    names = {p.name for p in typed}
    for path in sorted(data.rglob("*.parquet")) if data.is_dir() else []:
        parts = path.relative_to(data).parts
        if parts[0] in names or any(part.startswith(("_", ".")) for part in parts):
            continue
        for row in pq.read_table(path).to_pylist():
            yield Change(
                int(row["commit_ts"]),
                str(row["table"]),
                str(row["mod_type"]),
                int(json.loads(row["keys"])["Id"]),
                str(row["server_transaction_id"]),
                str(row["record_sequence"]),
                int(row["mod_index"]),
                str(row["partition_token"]),
            )


def typed_tables(data: Path) -> int:
    """How many tables under ``data`` were written with typed columns: their files hold the
    metadata columns and the table's own ``Id`` column as int64."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runtime.files.typed import table_dirs

    count = 0
    for directory in table_dirs(data):
        files = [
            p
            for p in sorted(directory.rglob("*.parquet"))
            if not any(part.startswith(("_", ".")) for part in p.relative_to(directory).parts)
        ]
        schemas = [pq.read_schema(p) for p in files]
        if schemas and all(
            "_commit_ts" in s.names and "Id" in s.names and s.field("Id").type == pa.int64()
            for s in schemas
        ):
            count += 1
    return count
