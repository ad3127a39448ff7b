"""The Spark bridge's typed default output (``SparkConfig.output_layout = "typed"``): the typed
per-table changelog of ``runtime.typed``, one directory per table (``<table>/batch=<id>/``).

A micro-batch's typed tables are built off the event loop when it is cut (:class:`TypedBatch`)
and written by pyarrow on the driver, every table in one pass, with no Spark job at all: a
Spark write costs a job (~0.2–0.6 s fixed) per distinct schema, so a stream over hundreds of
tables would cost hundreds of jobs per micro-batch (docs/benchmarks.md has the figures). The
files are staged and committed by the same atomic committer as the generic layout
(``runtime.commit``: ``_staging/<id>/<table>/``, manifest, one rename per table
directory, progress files), so the output stays exactly once. The output directory must be a
file system this process writes (local, or shared with the cluster); Spark reads it as any
parquet directory (docs/reading-output.md).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protocol.commit import STAGING_DIR
from protocol.records import DataChange
from runtime.commit import Committer
from runtime.typed import TypedError, typed_tables
from runtime.typed_files import read_changes, write_tables

__all__ = ["TypedBatch", "typed_tails"]


class TypedBatch:
    """One micro-batch's typed tables, built when it is cut (``error``: why they could not be;
    raised when the batch is written, so it fails like a failed Spark batch)."""

    def __init__(self, fresh: Sequence[tuple[str, Sequence[DataChange]]], rows: int) -> None:
        self.num_rows = rows
        self.tables: dict[str, Any] = {}
        self.error: TypedError | None = None
        try:
            self.tables = typed_tables(fresh)
        except TypedError as exc:
            self.error = exc

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def stage(self, committer: Committer, identity: str) -> list[tuple[str, str]]:
        """Write the tables under the committer's staging directory of ``identity``; the moves
        to commit (none without rows)."""
        self._check()
        if not self.num_rows:
            return []
        staging = committer.staging(identity)
        try:
            return write_tables(staging, committer.staged(identity), identity, self.tables)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def write_in_place(self, output_dir: str, name: str) -> None:
        """Without atomic commits: write each table's ``batch=<name>`` directory (a re-run of
        the same batch replaces its own directories), each by one rename."""
        self._check()
        if not self.num_rows:
            return
        root = Path(output_dir)
        staging = root / STAGING_DIR / name
        shutil.rmtree(staging, ignore_errors=True)
        try:
            for staged, final in write_tables(staging, f"{STAGING_DIR}/{name}", name, self.tables):
                target = root / final
                if target.exists():
                    shutil.rmtree(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                (root / staged).rename(target)
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
