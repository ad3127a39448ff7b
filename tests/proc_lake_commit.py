"""One micro-batch committed through :class:`runtime.files.commit.Committer` over a store (a local
directory or ``s3://``), in its own process, SIGKILLed at a chosen step of the commit.

Usage: ``python -m tests.proc_lake_commit STORE LAYOUT BATCH [--kill-at STEP]``. ``LAYOUT``:
``delta`` (data files written into tables ``A`` and ``B``, committed as one Delta transaction
each) or ``parquet`` (staged under the committer's staging directory, then moved into
``<table>/batch=<n>/``). Batch ``n`` holds rows ``n*10 .. n*10+9`` per table and partition
``p``'s records up to timestamp ``n*10+9``. ``STEP``: ``manifest`` (right after the commit
point), ``CommitTable`` / ``Copy`` / ``Rename`` / ``WriteProgress`` (before the first operation
of that kind), ``CommitTable-2`` / ``Copy-2`` (before the second). Prints ``{"committed": n}``
when done.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from protocol.commit import Manifest
from protocol.records import DataChange
from runtime.files.commit import Committer
from runtime.lake.delta import write_data_file
from runtime.lake.store import open_store

TABLES = ("A", "B")


def records(batch: int) -> tuple[DataChange, ...]:
    return tuple(
        DataChange(batch * 10 + i, "0", f"t{batch}-{i}", False, "T", (), (), "INSERT")
        for i in range(10)
    )


def rows(batch: int, table: str) -> pa.Table:
    ids = list(range(batch * 10, batch * 10 + 10))
    return pa.table({"id": pa.array(ids, pa.int64()), "table": [table] * len(ids)})


def arm(step: str) -> None:
    """SIGKILL this process at ``step`` of the commit."""
    kind, _, nth_text = step.partition("-")
    nth = int(nth_text or 1)
    if kind == "manifest":
        real_write = Committer._write_manifest

        def write_manifest(self: Committer, manifest: Manifest) -> None:
            real_write(self, manifest)
            os.kill(os.getpid(), signal.SIGKILL)

        Committer._write_manifest = write_manifest  # type: ignore[method-assign]
        return
    real_do = Committer._do
    seen = 0

    def do(self: Committer, op: Any) -> None:
        nonlocal seen
        if type(op).__name__ == kind:
            seen += 1
            if seen == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        real_do(self, op)

    Committer._do = do  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("layout", choices=("delta", "parquet"))
    p.add_argument("batch", type=int)
    p.add_argument("--kill-at", default="")
    args = p.parse_args()
    store = open_store(args.store)
    committer = Committer(store, connector="lake", apply_threads=1)
    committer.recover()
    if args.kill_at:
        arm(args.kill_at)
    batch = args.batch
    name = f"b{batch}"
    entries = [("p", records(batch), batch * 10 + 9)]
    if args.layout == "delta":
        tables = []
        for table in TABLES:
            data = rows(batch, table)
            tables.append((table, [write_data_file(store, table, data)], data.schema))
        committer.commit(name, [], entries, tables=tables, metadata={"shoal.test": batch})
    else:
        staged = committer.prepare_staging(name)
        moves = []
        for table in TABLES:
            rel = f"{staged}/{table}/batch={name}"
            with store.open_output_stream(f"{rel}/part-00000.parquet") as sink:
                pq.write_table(rows(batch, table), sink)
            moves.append((rel, f"{table}/batch={name}"))
        committer.commit(name, moves, entries)
    sys.stdout.write(json.dumps({"committed": batch}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
