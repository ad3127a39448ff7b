"""The Spark bridge's typed default output (``SparkConfig.output_layout = "typed"``): the typed
per-table changelog of ``runtime.typed``, one directory per table — ``<table>/batch=<id>/``
(parquet, the default table format) or one Delta table per table (``SparkConfig.table_format
= "delta"``).

A micro-batch is turned into its wire table and its tables' specs off the event loop when it is
cut (:class:`TypedBatch`), then written by Spark in **one job whatever the number of tables**
(``runtime.spark.datasource``): the executors convert the rows into each table's typed rows and
write the files, the driver writes the receipt of the files it committed. The micro-batch is
then committed by the same committer as the generic layout (``runtime.files.commit``), so the output
stays exactly once:

* parquet: the files are staged under ``_staging/<connector>/<id>/<table>/``; the manifest moves
  each table directory into place (one rename on a file system, a copy on an object store) and
  records the partitions' progress;
* Delta: the files are written straight into each table's directory (invisible until
  committed), and the manifest's Delta commits — one per table, carrying the micro-batch as an
  idempotent application transaction, with the completeness watermark in the commit info —
  make them visible, on any store.

The output may be a directory this process and Spark's executors both write (local, or shared
with the cluster) or an object store (``s3://``, ``gs://``; every process reaches it through
pyarrow's file systems with its own credential chain). Spark reads it as any parquet
directory, or as Delta tables (docs/reading-output.md). The file sink (``--sink files``) writes
the same layout with pyarrow in its own process.
"""

from __future__ import annotations

import functools
import json
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.commit import STAGING_DIR, DataFile
from protocol.records import DataChange
from runtime.files.commit import Committer, TableWrite
from runtime.files.typed import read_changes
from runtime.spark.datasource import (
    Receipt,
    streamed_receipt,
    wire_chunks,
    with_write,
    write_staged_typed,
)
from runtime.typed import TableSpec, TypedError, wire_table

if TYPE_CHECKING:
    import pyarrow as pa

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
        self.staged: str | None = None  # the streaming path: staging directory, write id
        self.write_id: str | None = None
        try:
            self.wire, self.specs = wire_table(fresh)
        except TypedError as exc:
            self.error = exc

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(
        self,
        spark: Any,
        staging: str,
        drop: Callable[[], None],
        *,
        tables_uri: str | None = None,
        batch: str = "",
    ) -> Receipt:
        """One Spark job: the tables under ``staging`` (or into ``tables_uri``'s Delta tables,
        the receipt under ``staging``); ``drop()`` removes what it staged if it fails."""
        try:
            receipt = write_staged_typed(
                spark, self.wire, staging, self.specs, tables_uri=tables_uri, batch=batch
            )
        except BaseException:
            drop()
            raise
        self.receipt = receipt
        missing = sorted(set(self.specs) - set(receipt.tables))
        if missing:
            drop()
            raise TypedError(f"Spark's typed write staged no file of tables {missing[:10]}")
        return receipt

    def stage(
        self, spark: Any, committer: Committer, identity: str, table_format: str = "parquet"
    ) -> tuple[list[tuple[str, str]], list[TableWrite]]:
        """Write the tables through Spark for the committer's batch ``identity`` (none, and no
        Spark job, without rows): parquet, under its staging directory (on any store), and
        the moves to commit; ``delta``, straight into each Delta table's directory (only the
        receipt staged), and the Delta commits (``runtime.files.commit.Committer.commit``'s
        ``tables=``: each table's data files and its schema)."""
        self._check()
        if not self.num_rows:
            return [], []
        store = committer.store
        staged = committer.prepare_staging(identity)
        if table_format != "delta":
            receipt = self._write(spark, store.uri_for(staged), lambda: store.delete_tree(staged))
        else:
            receipt = self._write(
                spark,
                store.uri_for(staged),
                lambda: store.delete_tree(staged),
                tables_uri=store.uri_for(),
                batch=identity,
            )
        return self._commit_args(receipt, staged, identity, table_format)

    def _commit_args(
        self, receipt: Receipt, staged: str, identity: str, table_format: str
    ) -> tuple[list[tuple[str, str]], list[TableWrite]]:
        """What the committer commits of the files ``receipt`` lists: the moves of the staged
        table directories (parquet), or each Delta table's data files and schema."""
        missing = sorted(set(self.specs) - set(receipt.tables))
        if missing:
            raise TypedError(f"Spark's typed write staged no file of tables {missing[:10]}")
        if table_format != "delta":
            return [(f"{staged}/{t}", f"{t}/batch={identity}") for t in receipt.tables], []
        files: dict[str, list[DataFile]] = {}
        for f in receipt.files:
            files.setdefault(f.table, []).append(
                DataFile(
                    path=f.path.rpartition("/")[2],
                    size=f.bytes,
                    num_records=f.rows,
                    modification_time_ms=f.modified_ms,
                    stats=f.stats or json.dumps({"numRecords": f.rows}),
                )
            )
        return [], [(t, files[t], self.specs[t].schema()) for t in sorted(files)]

    # --- the streaming path: Spark's streaming query writes, the bridge commits -------------

    def spool_table(
        self, committer: Committer, identity: str, table_format: str, chunks: int
    ) -> pa.Table:
        """The chunks (``runtime.spark.datasource.wire_chunks``, ``chunks`` of them) that the
        streaming path spools for this micro-batch, each carrying where and how its task writes
        (``with_write``: under the committer's staging directory of batch ``identity``, emptied
        first; Delta data files straight into the tables). :meth:`streamed` then gives what to
        commit once Spark's checkpoint holds the micro-batch."""
        self._check()
        store = committer.store
        self.staged = committer.prepare_staging(identity)
        self.write_id = uuid.uuid4().hex
        delta = table_format == "delta"
        wire = with_write(
            self.wire,
            self.specs,
            staging=store.uri_for(self.staged),
            write_id=self.write_id,
            tables=store.uri_for() if delta else None,
            batch=identity,
        )
        return wire_chunks(wire, chunks)

    def streamed(
        self, committer: Committer, identity: str, table_format: str
    ) -> tuple[list[tuple[str, str]], list[TableWrite]]:
        """After Spark's streaming query committed this micro-batch (spooled by
        :meth:`spool_table`): the receipt its driver-side commit wrote (it must hold every
        row), every file of runs Spark did not count deleted, and what the committer commits
        (as :meth:`stage`)."""
        if not self.num_rows:
            return [], []
        assert self.staged is not None
        assert self.write_id is not None
        store = committer.store
        delta = table_format == "delta"
        self.receipt = streamed_receipt(
            store.uri_for(self.staged),
            self.write_id,
            self.num_rows,
            tables_uri=store.uri_for() if delta else None,
            tables=sorted(self.specs),
            batch=identity,
        )
        return self._commit_args(self.receipt, self.staged, identity, table_format)

    def write_unlisted_delta_files(self, spark: Any, root: str) -> Receipt:
        """Write the tables as Delta data files into ``root``'s table directories, committing
        nothing (to warm Spark's Python workers up for the Delta path)."""
        self._check()
        staging = f"{root}/{STAGING_DIR}/warm"
        return self._write(spark, staging, lambda: None, tables_uri=root, batch="warm")

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
            drop = functools.partial(shutil.rmtree, staging, ignore_errors=True)
            for table in self._write(spark, str(staging), drop).tables:
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
