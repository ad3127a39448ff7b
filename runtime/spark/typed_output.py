"""The Spark bridge's typed default output (``SparkConfig.output_layout = "typed"``): the typed
per-table changelog of ``runtime.typed``, one directory per table (``<table>/batch=<id>/``).

A micro-batch is turned into its wire table and its tables' specs off the event loop when it is
cut (:class:`TypedBatch`), then written by Spark in **one job whatever the number of tables**
(``runtime.spark.datasource``): the executors convert the rows into each table's typed rows and
write the files under the committer's staging directory, the driver writes the receipt of the
files it committed. The staged tables are then committed by the same atomic committer as the
generic layout (``runtime.commit``: ``_staging/<id>/<table>/``, manifest, one rename per table
directory, progress files), so the output stays exactly once. The output directory must be a
file system this process and Spark's executors both write (local, or shared with the cluster);
Spark reads it as any parquet directory (docs/reading-output.md). The file sink
(``--sink files``) writes the same layout with pyarrow in its own process.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protocol.commit import STAGING_DIR
from protocol.records import DataChange
from runtime.commit import Committer
from runtime.spark.datasource import Receipt, write_staged_typed
from runtime.typed import TableSpec, TypedError, wire_table
from runtime.typed_files import read_changes

__all__ = ["TypedBatch", "typed_tails"]


class TypedBatch:
    """One micro-batch for the typed output, built when it is cut: its wire table and its
    tables' specs (``error``: why they could not be built; raised when the batch is written, so
    it fails like a failed Spark batch). ``receipt``: what the last write staged."""

    def __init__(self, fresh: Sequence[tuple[str, Sequence[DataChange]]], rows: int) -> None:
        self.num_rows = rows
        self.wire: Any = None
        self.specs: dict[str, TableSpec] = {}
        self.error: TypedError | None = None
        self.receipt: Receipt | None = None
        try:
            self.wire, self.specs = wire_table(fresh)
        except TypedError as exc:
            self.error = exc

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(self, spark: Any, staging: Path) -> list[str]:
        """One Spark job: the tables under ``staging``; the tables written."""
        try:
            receipt = write_staged_typed(spark, self.wire, str(staging), self.specs)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.receipt = receipt
        missing = sorted(set(self.specs) - set(receipt.tables))
        if missing:
            shutil.rmtree(staging, ignore_errors=True)
            raise TypedError(f"Spark's typed write staged no file of tables {missing[:10]}")
        return receipt.tables

    def stage(self, spark: Any, committer: Committer, identity: str) -> list[tuple[str, str]]:
        """Write the tables through Spark under the committer's staging directory of
        ``identity``; the moves to commit (none, and no Spark job, without rows)."""
        self._check()
        if not self.num_rows:
            return []
        tables = self._write(spark, committer.staging(identity))
        staged = committer.staged(identity)
        return [(f"{staged}/{t}", f"{t}/batch={identity}") for t in tables]

    def write_in_place(self, spark: Any, output_dir: str, name: str) -> None:
        """Without atomic commits: write each table's ``batch=<name>`` directory through Spark
        (a re-run of the same batch replaces its own directories), each by one rename."""
        self._check()
        if not self.num_rows:
            return
        root = Path(output_dir)
        staging = root / STAGING_DIR / name
        shutil.rmtree(staging, ignore_errors=True)
        try:
            for table in self._write(spark, staging):
                target = root / table / f"batch={name}"
                if target.exists():
                    shutil.rmtree(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                (staging / table).rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def typed_tails(output_dir: str) -> list[tuple[str, tuple[int, str, str]]]:
    """(partition token, identity) of the newest commit timestamp of each partition in a typed
    output, to resume de-duplication (the bridge's ``resume_dedupe``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    changes = read_changes(output_dir)
    if changes.num_rows == 0:
        return []
    ts = pc.cast(changes.column("_commit_ts"), pa.int64()).to_pylist()
    tokens = changes.column("_partition_token").to_pylist()
    txns = changes.column("_server_transaction_id").to_pylist()
    seqs = changes.column("_record_sequence").to_pylist()
    newest: dict[str, int] = {}
    for token, micros in zip(tokens, ts, strict=True):
        newest[token] = max(newest.get(token, micros), micros)
    out = {
        (token, (micros, txn, seq))
        for token, micros, txn, seq in zip(tokens, ts, txns, seqs, strict=True)
        if micros == newest[token]
    }
    return sorted(out)
