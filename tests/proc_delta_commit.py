"""A writer of micro-batches into one Delta table, in its own process, for the lake tests
(concurrent writers, a crash right after a commit, a SIGKILL between data files and commit).

Usage: ``python -m tests.proc_delta_commit STORE TABLE APP FIRST COUNT [options]``: writes
``COUNT`` micro-batches numbered ``FIRST``, ``FIRST+1``, ... (the version of application
transaction ``APP``), each one parquet data file of ``--rows`` rows with ids
``--id-base + batch * rows + i``, then commits it through :class:`DeltaCommitter`. Prints one
JSON line per batch: ``{"batch": n, "version": v, "already": b, "attempts": a}`` after its
commit, ``{"written": n, "files": [...]}`` after its data files, and ``{"ready": true}`` once
started. Options:

* ``--no-txn``: commit without the application transaction (the control).
* ``--kill-after-commit N``: SIGKILL itself right after batch ``N`` committed, before saying so.
* ``--hang-before-commit N``: after writing batch ``N``'s data files, say so and wait to be
  killed (the test SIGKILLs it).
* ``--extra-from N``: from batch ``N`` on, the rows have one more column, ``extra_<APP tail>``.
* ``--wait-stdin``: wait for a line on stdin before the first batch (to start writers together).
* ``--log-debug``: log everything at DEBUG to stderr as the runtime does, the credentials in
  the environment masked; ``--log-unmasked``: the same without masking (the control). Either
  also runs the committer's start-up check.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sys

import pyarrow as pa

from runtime import logs
from runtime.lake.delta import DeltaCommitter, write_data_file
from runtime.lake.store import Store, open_store


def batch_table(batch: int, rows: int, id_base: int, extra: str | None) -> pa.Table:
    start = id_base + batch * rows
    ids = list(range(start, start + rows))
    columns: dict[str, pa.Array] = {
        "id": pa.array(ids, pa.int64()),
        "name": pa.array([f"row-{i}" for i in ids], pa.string()),
        "ts": pa.array(
            [dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i) for i in ids],
            pa.timestamp("us", tz="UTC"),
        ),
    }
    if extra is not None:
        columns[extra] = pa.array([float(i) for i in ids], pa.float64())
    return pa.table(columns)


def say(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("table")
    p.add_argument("app")
    p.add_argument("first", type=int)
    p.add_argument("count", type=int)
    p.add_argument("--rows", type=int, default=5)
    p.add_argument("--id-base", type=int, default=0)
    p.add_argument("--no-txn", action="store_true")
    p.add_argument("--kill-after-commit", type=int, default=-1)
    p.add_argument("--hang-before-commit", type=int, default=-1)
    p.add_argument("--extra-from", type=int, default=-1)
    p.add_argument("--wait-stdin", action="store_true")
    p.add_argument("--log-debug", action="store_true")
    p.add_argument("--log-unmasked", action="store_true")
    args = p.parse_args()
    if args.log_debug or args.log_unmasked:
        secrets = () if args.log_unmasked else Store.secret_values()
        logs.configure("debug", secrets=secrets)

    store = open_store(args.store)
    committer = DeltaCommitter(store)
    if args.log_debug or args.log_unmasked:
        committer.check()
    extra = f"extra_{args.app.rsplit('/', 1)[-1]}"
    say({"ready": True})
    if args.wait_stdin:
        sys.stdin.readline()
    for batch in range(args.first, args.first + args.count):
        with_extra = 0 <= args.extra_from <= batch
        data = batch_table(batch, args.rows, args.id_base, extra if with_extra else None)
        f = write_data_file(store, args.table, data)
        say({"written": batch, "files": [f.path]})
        if batch == args.hang_before_commit:
            sys.stdin.readline()  # the test kills this process here
            os.kill(os.getpid(), signal.SIGKILL)
        result = committer.commit(
            args.table,
            [f],
            data.schema,
            app=args.app,
            version=None if args.no_txn else batch,
            metadata={"shoal.batch": f"b{batch}", "shoal.connector": "test"},
        )
        if result.already:
            committer.discard(args.table, [f])
        if batch == args.kill_after_commit:
            os.kill(os.getpid(), signal.SIGKILL)
        say(
            {
                "batch": batch,
                "version": result.version,
                "already": result.already,
                "attempts": result.attempts,
                "columns_added": list(result.columns_added),
            }
        )


if __name__ == "__main__":
    main()
