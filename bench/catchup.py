"""``python -m bench catchup [--quick]``: the command line reading a backlog, its memory and its
speed against the same pipeline on a small backlog.

Three runs of ``python -m actors.runtime --tasks N --sink files`` (the files sink, typed layout,
embedded broker) on the simulated stream, one after the other, each bounded: the stream starts
``--sim-start-ts`` in the past, ``--start-at`` there and ``--end-at`` about now, so every record
is already waiting when the run starts and the process exits by itself once it read them all.

* **steady**: a backlog of a tenth of the records (the pipeline reading as fast as it can with
  little waiting: the steady end-to-end rate of this machine, measured in the same run), once
  before the backlog and once after it (``steady-after``);
* **backlog**: ``--records`` records already waiting (quick: 1,000,000; full: 5,000,000).

Each run's rate is the records of its micro-batches committed between the first and the last
over the span from the first one's commit to the one before the last's (start-up and drain left
out, and those two micro-batches: the first was read before the span began, the last holds the
tail the sink's age limit cut; counted, the first inflated a run's rate and the last deflated it,
both most in the short run, whose five micro-batches they are two of). The steady run goes once before the backlog and once after it, and its rate is
the mean of the two: on a loaded machine the share of the cores a run gets drifts, and a few
seconds' run alone is a sample of one moment. Its peak memory is the process's own maximum
resident set (``wait4``'s ``ru_maxrss``). ``rate_ratio`` is the backlog's rate against the
steady one: a pipeline that reads ahead of what its sink commits buffers more the more is
waiting (memory grows, and the collector and re-reads slow it down); one paced by its sink
reads a large backlog as fast as a small one, in the same memory.

Last line: ``{"scenario": "catchup", "sink": "files", "backlog_records": .., "peak_rss_mb": ..,
"rate_ratio": .., "backlog_records_per_s": .., "steady_records_per_s": .., "steady_peak_rss_mb":
.., ...}`` with the goals (``peak_rss_mb`` < 500, ``rate_ratio`` >= 0.8) beside them, and each
run's exit code and whether its final drain finished; exit code 1 when a run lost or doubled a
record (``delivered`` against the stream's ``produced``)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
ROOTS = 8
RATE = 2000.0  # records per second per partition, stream time
# (the simulated stream generates its records a round at a time, and keeps a few rounds for
# re-reads: short rounds keep that stand-in for Spanner small beside what is measured)


def rfc3339(micros: int) -> str:
    return (_EPOCH + dt.timedelta(microseconds=micros)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _committed_span(data: Path) -> tuple[float, float, int]:
    """The micro-batches committed under ``data``: the seconds between the first one's commit
    and the one before the last's, the share of the rows committed in between (the second
    micro-batch to the one before the last), and how many micro-batches there were. (A
    micro-batch's files, one per table, share its ``batch=<id>`` directory; its commit is its
    newest file.) The first micro-batch was read before that span began, and the last one holds
    the stream's tail, cut by the sink's age limit rather than by its size: counting either
    skews the short steady run most, whose five micro-batches they are two of."""
    import pyarrow.parquet as pq

    batches: dict[str, list[float]] = {}  # batch id -> [commit time, rows]
    for p in data.rglob("*.parquet"):
        parts = p.relative_to(data).parts
        if any(part.startswith(("_", ".")) for part in parts):
            continue
        batch = next((part for part in parts if part.startswith("batch=")), str(p))
        entry = batches.setdefault(batch, [0.0, 0.0])
        entry[0] = max(entry[0], p.stat().st_mtime)
        entry[1] += pq.read_metadata(p).num_rows
    if len(batches) < 3:
        raise SystemExit(f"too few committed micro-batches under {data} to time the run")
    ordered = sorted(batches.values())
    rows = sum(e[1] for e in ordered)
    inside = sum(e[1] for e in ordered[1:-1])
    return ordered[-2][0] - ordered[0][0], inside / rows, len(ordered)


def _run(work: Path, name: str, records: int, tasks: int) -> dict[str, Any]:
    """One bounded run over ``records`` records already waiting; its figures."""
    out = work / name
    summary = out / "summary.json"
    span_us = int(records / (ROOTS * RATE) * 1e6)
    end = int(time.time() * 1e6) - 1_000_000
    start = end - span_us
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    command = [
        sys.executable,
        *("-m", "actors.runtime", "--tasks", str(tasks), "--sink", "files"),
        *("--output-dir", str(out), "--progress", "off", "--summary-json", str(summary)),
        *("--sim-roots", str(ROOTS), "--sim-records-per-s", str(RATE), "--sim-round-s", "0.5"),
        *("--sim-split-p", "0", "--sim-move-p", "0", "--sim-merge-p", "0"),
        *("--sim-start-ts", str(start), "--start-at", rfc3339(start), "--end-at", rfc3339(end)),
    ]
    started = time.monotonic()
    with (work / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if not summary.exists():
        raise SystemExit(f"the {name} run exited {proc.returncode}: see {work / f'{name}.log'}")
    s = json.loads(summary.read_text())
    delivered = s["records_delivered"]
    span, share, micro_batches = _committed_span(Path(s["output_dir"]))
    figures = {
        "records": s["produced_records"],
        "delivered": delivered,
        "records_read": s["records_read"],
        # the records of the micro-batches committed between the first and the last, over the
        # span from the first one's commit to the one before the last's
        "records_per_s": round(delivered * share / span, 1),
        "micro_batches": micro_batches,
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
        "loop_lag_p99_s": round(s["loop_lag_p99_s"], 3),
        "loop_lag_max_s": round(s["loop_lag_max_s"], 3),
        "rebalances": s["rebalances"],
        "errors": s.get("errors", {}),
        "seconds": round(time.monotonic() - started, 1),
        # 1 also when every record was delivered but the final drain was cut short (a lease
        # lapsed at the end): the summary says which
        "exit_code": proc.returncode,
        "caught_up": s["caught_up"],
        "drained": s["drained"],
    }
    print(f"{name}: {figures}", flush=True)
    return figures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench catchup")
    parser.add_argument("--quick", action="store_true", help="1,000,000 records (default 5M)")
    parser.add_argument("--records", type=int, help="records of the backlog run")
    parser.add_argument("--tasks", type=int, default=2, help="task nodes in the process")
    parser.add_argument("--work-dir", help="keep the runs' output and logs here")
    args = parser.parse_args(argv)
    records = args.records or (1_000_000 if args.quick else 5_000_000)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="shoal-bench-catchup-"))
    work.mkdir(parents=True, exist_ok=True)
    steady = _run(work, "steady", records // 10, args.tasks)
    backlog = _run(work, "backlog", records, args.tasks)
    steady_after = _run(work, "steady-after", records // 10, args.tasks)
    steady_rate = (steady["records_per_s"] + steady_after["records_per_s"]) / 2
    exact = all(r["delivered"] == r["records"] for r in (steady, backlog, steady_after))
    result = {
        "scenario": "catchup",
        "sink": "files",
        "tasks": args.tasks,
        "backlog_records": backlog["records"],
        "peak_rss_mb": backlog["peak_rss_mb"],
        "rate_ratio": round(backlog["records_per_s"] / steady_rate, 3),
        "backlog_records_per_s": backlog["records_per_s"],
        "steady_records_per_s": round(steady_rate, 1),
        "steady_runs_records_per_s": [steady["records_per_s"], steady_after["records_per_s"]],
        "steady_records": steady["records"],
        "steady_peak_rss_mb": steady["peak_rss_mb"],
        "micro_batches": [steady["micro_batches"], backlog["micro_batches"]],
        "steady_after_peak_rss_mb": steady_after["peak_rss_mb"],
        "backlog_records_read": backlog["records_read"],
        "loop_lag_p99_s": backlog["loop_lag_p99_s"],
        "loop_lag_max_s": backlog["loop_lag_max_s"],
        "rebalances": backlog["rebalances"],
        "errors": backlog["errors"],
        "delivered_exactly": exact,
        "exit_codes": [steady["exit_code"], backlog["exit_code"], steady_after["exit_code"]],
        "drained": [steady["drained"], backlog["drained"], steady_after["drained"]],
        "goal_peak_rss_mb": 500,
        "goal_rate_ratio": 0.8,
    }
    print(json.dumps(result))
    return 0 if exact else 1
