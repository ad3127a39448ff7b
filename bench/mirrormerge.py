"""``python -m bench mirrormerge [--quick]``: what merging one micro-batch into a Delta mirror
table costs (runtime/lake/mirror.py), as the table grows, at a fixed batch size.

A table of ``N`` rows (for each ``--sizes``; key ``Id`` INT64, a STRING, an INT64 and a
TIMESTAMP column) is filled by batches of ``--fill-batch`` INSERT rows; then ``--batches``
batches of ``--batch`` rows each are merged, timed, in two key layouts:

* ``clustered``: each batch updates a contiguous range of keys (ascending ids, one partition's
  key range) plus ``--batch // 10`` new keys above the table's largest;
* ``spread``: each batch updates keys drawn at random from the whole table.

Printed per size and layout: rows merged per second (batch rows / wall time of
``apply_batch``: reading the touched rows, the core's merge, delta-rs's merge and commit), the
data files read to find the touched rows and the files in the table, and the merge's own
``num_target_rows_copied`` from the commit's metrics (the untouched rows delta-rs rewrote with
the changed ones; its ``num_target_files_scanned`` is kept in the JSON but read 0 in runs where
files were rewritten, so it is not printed). Cost that grows with the batch, not the table, shows as files read and rows
copied that stay flat as ``N`` grows. The last line is JSON.

Local directory (``--dir``, default a temporary one); table files are capped by
``delta.targetFileSize`` (``--target-file-mb``) so that a file holds a bounded key range.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from protocol.records import ColumnType, DataChange, Mod
from runtime.lake.mirror import MirrorWriter
from runtime.lake.store import open_store

COLUMNS = (
    ColumnType("Id", '{"code":"INT64"}', True, 1),
    ColumnType("Name", '{"code":"STRING"}', False, 2),
    ColumnType("Count", '{"code":"INT64"}', False, 3),
    ColumnType("At", '{"code":"TIMESTAMP"}', False, 4),
)


def record(ts: int, mod_type: str, ids: list[int], rng: random.Random) -> DataChange:
    mods = tuple(
        Mod(
            f'{{"Id":"{i}"}}',
            f'{{"Name":"name-{i}-{rng.randrange(10**6)}","Count":"{rng.randrange(10**9)}",'
            f'"At":"2026-01-01T00:00:{i % 60:02d}.{ts % 10**6:06d}Z"}}',
            "{}",
        )
        for i in ids
    )
    return DataChange(ts, "0", f"tx{ts}", True, "T", COLUMNS, mods, mod_type)  # type: ignore[arg-type]


def measure(
    root: Path, size: int, layout: str, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    store = open_store(root / f"{layout}-{size}")
    writer = MirrorWriter(store)
    ts = 1
    for version, start in enumerate(range(0, size, args.fill_batch), start=1):
        ids = list(range(start, min(size, start + args.fill_batch)))
        writer.apply_batch("T", [record(ts, "INSERT", ids, rng)], app="fill", version=version)
        ts += 1
    dt = DeltaTable(store.uri_for("T"))
    dt.alter.set_table_properties(
        {"delta.targetFileSize": str(args.target_file_mb * 1024 * 1024)}, raise_if_not_exists=False
    )
    if args.compact:
        dt.optimize.compact(target_size=args.target_file_mb * 1024 * 1024)
    top = size
    out: dict[str, Any] = {"size": size, "layout": layout, "runs": []}
    for b in range(args.batches):
        if layout == "clustered":
            start = rng.randrange(0, max(1, size - args.batch))
            ids = list(range(start, min(size, start + args.batch)))
            new = list(range(top, top + args.batch // 10))
            top += len(new)
            records = [record(ts, "UPDATE", ids, rng), record(ts + 1, "INSERT", new, rng)]
        else:
            ids = sorted(rng.sample(range(size), min(size, args.batch)))
            records = [record(ts, "UPDATE", ids, rng)]
        ts += 2
        rows = sum(len(r.mods) for r in records)
        began = time.perf_counter()
        result = writer.apply_batch("T", records, app="bench", version=b + 1)
        seconds = time.perf_counter() - began
        dt = DeltaTable(store.uri_for("T"))
        metrics = dt.history(1)[0].get("operationMetrics", {})
        out["runs"].append(
            {
                "rows": rows,
                "seconds": round(seconds, 3),
                "rows_per_s": round(rows / seconds),
                "files_read": result.files_read,
                "files_total": result.files_total,
                "merge_files_scanned": metrics.get("num_target_files_scanned"),
                "merge_rows_copied": metrics.get("num_target_rows_copied"),
            }
        )
    best = max(r["rows_per_s"] for r in out["runs"])
    out["rows_per_s_best"] = best
    out["rows_per_s_median"] = sorted(r["rows_per_s"] for r in out["runs"])[len(out["runs"]) // 2]
    shutil.rmtree(root / f"{layout}-{size}", ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench mirrormerge", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="sizes 10k and 50k, 2 batches")
    parser.add_argument("--sizes", default="10000,200000")
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--fill-batch", type=int, default=10_000)
    parser.add_argument("--target-file-mb", type=int, default=1)
    parser.add_argument(
        "--compact", action="store_true", help="compact the filled table to the target size"
    )
    parser.add_argument("--layouts", default="clustered,spread")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.batches = "10000,50000", 2
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="mirrormerge-", dir=args.dir))
    rng = random.Random(args.seed)
    results = []
    try:
        for layout in args.layouts.split(","):
            for size in sizes:
                r = measure(root, size, layout, args, rng)
                results.append(r)
                last = r["runs"][-1]
                print(
                    f"{layout:9s} table {size:>7d} rows, batch {last['rows']}: "
                    f"{r['rows_per_s_median']:>7d} rows/s (median; best {r['rows_per_s_best']}), "
                    f"files read {last['files_read']}/{last['files_total']}, delta-rs merge "
                    f"copied {last['merge_rows_copied']} untouched rows",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"scenario": "mirrormerge", "batch": args.batch, "results": results}))
    return 0
