"""A writer of mirror micro-batches in its own process, for the mirror tests (concurrent writers,
a SIGKILL right after a commit, a SIGKILL while a merge writes its files).

Usage: ``python -m tests.proc_mirror_apply STORE TABLE APP BATCHES [options]``: ``BATCHES`` is
a file holding a JSON list of batches (each a list of :class:`DataChange`, msgspec's JSON);
batch ``i`` (from 1) is merged into mirror table ``TABLE`` with identity (``APP``, ``i``).
Prints one JSON line per batch after its merge: ``{"batch": i, "already": b, "attempts": a,
"stale": s}``, ``{"merging": i}`` before it, and ``{"ready": true}`` once started. Options:

* ``--first N``: start at batch ``N``.
* ``--kill-after N``: SIGKILL itself right after batch ``N`` committed, before saying so.
* ``--wait-stdin``: wait for a line on stdin before the first batch (to start writers together).
* ``--block-commit N`` (local directory only): before batch ``N``, put a directory where its
  Delta commit file must go, so its merge writes its data files and then cannot commit; say
  ``{"blocked": N, "files": [...]}`` (the data files now in the table directory) and SIGKILL
  itself — a crash between a merge's files and its commit, made deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import msgspec
from deltalake import DeltaTable

from protocol.records import DataChange
from runtime.lake.mirror import MirrorWriter
from runtime.lake.store import open_store


def say(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def parquet_files(table: Path) -> list[str]:
    return sorted(f.name for f in table.iterdir() if f.suffix == ".parquet")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("table")
    p.add_argument("app")
    p.add_argument("batches", type=Path)
    p.add_argument("--first", type=int, default=1)
    p.add_argument("--kill-after", type=int, default=-1)
    p.add_argument("--wait-stdin", action="store_true")
    p.add_argument("--block-commit", type=int, default=-1)
    args = p.parse_args()
    batches = msgspec.json.decode(args.batches.read_bytes(), type=list[list[DataChange]])
    store = open_store(args.store)
    writer = MirrorWriter(store, retries=30)
    say({"ready": True})
    if args.wait_stdin:
        sys.stdin.readline()
    for i, batch in enumerate(batches, start=1):
        if i < args.first:
            continue
        say({"merging": i})
        if i == args.block_commit:
            table = Path(store.path(args.table))
            version = DeltaTable(str(table)).version() + 1
            blocker = table / "_delta_log" / f"{version:020d}.json"
            blocker.mkdir()
            try:
                MirrorWriter(store, retries=1).apply_batch(
                    args.table, batch, app=args.app, version=i
                )
            except Exception as exc:  # the commit cannot be written: the data files are
                say({"blocked": i, "error": str(exc)[:200], "files": parquet_files(table)})
                os.kill(os.getpid(), signal.SIGKILL)
            raise SystemExit("the blocked commit succeeded")
        result = writer.apply_batch(args.table, batch, app=args.app, version=i)
        if i == args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        say(
            {
                "batch": i,
                "already": result.already,
                "attempts": result.attempts,
                "stale": result.stale,
            }
        )
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: delta-rs's threads may abort it


if __name__ == "__main__":
    main()
