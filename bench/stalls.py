"""``python -m bench stalls [--quick]``: how late a shoal process's event loop runs, and whether
its stalls cost rebalances, on a quiet machine and under a CPU hog.

Two runs of the command line, one after the other (the first is the baseline of the second):
``python -m actors.runtime --tasks N --sink files --duration D`` on the simulated stream, first
alone, then with one busy-looping process per CPU beside it (the hog, at the same priority).
Each run's ``--summary-json`` gives the event loop's lag (``loop_lag_p99_s``, ``loop_lag_max_s``:
runtime/looplag.py) and the memberships its live tasks lost (``membership_lost`` and
``evicted``: each one a rebalance no task's death or arrival asked for, a lease lapsed by a
stall). The last line is JSON with the hogged run's figures (``loop_lag_p99_s``,
``needless_rebalances``) and the quiet run's beside them (``quiet_...``)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _spin(until: float) -> None:
    x = 0
    while time.monotonic() < until:
        x += 1


def _run(work: Path, name: str, tasks: int, duration_s: float) -> dict[str, Any]:
    out = work / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    summary = out / "summary.json"
    started = time.monotonic()
    with (work / f"{name}.log").open("wb") as log:
        proc = subprocess.run(
            [
                sys.executable,
                *("-m", "actors.runtime", "--tasks", str(tasks), "--sink", "files"),
                *("--duration", str(duration_s), "--output-dir", str(out)),
                *("--progress", "off", "--summary-json", str(summary)),
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=duration_s + 300,
            check=False,
        )
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run exited {proc.returncode}: see {work / f'{name}.log'}")
    s = json.loads(summary.read_text())
    errors = s.get("errors", {})
    figures = {
        "loop_lag_p99_s": round(s["loop_lag_p99_s"], 4),
        "loop_lag_max_s": round(s["loop_lag_max_s"], 4),
        "needless_rebalances": errors.get("membership_lost", 0) + errors.get("evicted", 0),
        "rebalances": s["rebalances"],
        "records_delivered": s["records_delivered"],
        "seconds": round(time.monotonic() - started, 1),
    }
    print(f"{name}: {figures}", flush=True)
    return figures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench stalls")
    parser.add_argument("--quick", action="store_true", help="30 s runs (default 120 s)")
    parser.add_argument("--tasks", type=int, default=4, help="task nodes in the process")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes")
    parser.add_argument("--work-dir", help="keep the runs' output and logs here")
    args = parser.parse_args(argv)
    duration = 30.0 if args.quick else 120.0
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="shoal-bench-stalls-"))
    work.mkdir(parents=True, exist_ok=True)
    quiet = _run(work, "quiet", args.tasks, duration)
    until = time.monotonic() + duration + 120  # outlives the run's start, run and drain
    hogs = [multiprocessing.Process(target=_spin, args=(until,)) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    try:
        hogged = _run(work, "hogged", args.tasks, duration)
    finally:
        for hog in hogs:
            hog.terminate()
            hog.join()
    result = {
        "scenario": "stalls",
        "tasks": args.tasks,
        "hogs": args.hogs,
        "duration_s": duration,
        **hogged,
        **{f"quiet_{k}": v for k, v in quiet.items()},
        "goal_loop_lag_p99_s": 0.25,
    }
    print(json.dumps(result))
    return 0
