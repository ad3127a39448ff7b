"""``python -m bench catchup [--quick] [--emulator-only] [--emulator-commits N]``: the command line
reading a backlog, its memory and its speed against the same pipeline on a small backlog; the
simulated stream (quick and full), then the Cloud Spanner emulator (the full run, or
``--emulator-only``).

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
resident set (``VmHWM`` of ``/proc/<pid>/status``, read every 50 ms while it runs: the high-water
mark of its own memory since its ``exec``). Not ``wait4``'s ``ru_maxrss``: Linux carries a
process's peak across ``exec`` from the parent it was spawned by, so that figure is at least
this harness's own peak (which grows as it reads each run's output back: the steady run after
a 50,000-commit backlog "peaked" at 670 MB that way). ``rate_ratio`` is the backlog's rate against the
steady one: a pipeline that reads ahead of what its sink commits buffers more the more is
waiting (memory grows, and the collector and re-reads slow it down); one paced by its sink
reads a large backlog as fast as a small one, in the same memory.

Last line: ``{"scenario": "catchup", "sink": "files", "backlog_records": .., "peak_rss_mb": ..,
"rate_ratio": .., "backlog_records_per_s": .., "steady_records_per_s": .., "steady_peak_rss_mb":
.., ...}`` with the goals (``peak_rss_mb`` < 500, ``rate_ratio`` >= 0.8) beside them, and each
run's exit code and whether its final drain finished; exit code 1 when a run lost or doubled a
record (``delivered`` against the stream's ``produced``).

**The emulator phase** (full run, or ``--emulator-only``): the harness starts the emulator
(``runtime.spanner.emulator``: a database with three tables and a change stream ``FOR ALL``,
the emulator's own partition churn), then ``--emulator-writers`` load generators at once
(``LoadGenerator.bulk``: each transaction inserts into, updates and deletes from every table, up
to nine mods) write a tenth of ``--emulator-commits`` commits (the steady window) and then
``--emulator-commits`` (default 50,000; the backlog window), as fast as the emulator commits;
``emulator_load_s`` is how long the backlog's load took. Nothing reads meanwhile. Then three
bounded runs of ``python -m actors.runtime --source spanner --sink files`` at the emulator, one
connector each, ``--start-at`` before the window's first commit and ``--end-at`` after its last,
each exiting by itself: the steady window, the backlog window, the steady window again. Each
run's output is read back raw (``bench.backfill``) and compared with the mods its window
committed: ``emulator_lost`` (committed, not delivered) and ``emulator_duplicates`` (delivered
more often than committed, or outside the window), summed over the three runs, must be 0.
``emulator_peak_rss_mb`` is the backlog run's peak memory (as above); its rate and the steady runs' are
timed as above (null when a run committed fewer than three micro-batches: a small steady window
does), and ``emulator_rate_ratio`` is the backlog's against their mean. The emulator serves a
few thousand change records a second, so these rates are the emulator's more than shoal's. The
JSON gains ``emulator_commits``, ``emulator_load_s``, ``emulator_records`` (change records the
backlog run delivered), ``emulator_mods_written`` / ``emulator_mods_delivered``,
``emulator_lost``, ``emulator_duplicates``, ``emulator_peak_rss_mb``,
``emulator_backlog_records_per_s``, ``emulator_rate_ratio``, ...; with ``--emulator-only`` only
those. Exit code 1 also when an emulator run lost or doubled a mod, 2 when the emulator is
absent."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

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
    ordered = _micro_batches(data)
    if len(ordered) < 3:
        raise SystemExit(f"too few committed micro-batches under {data} to time the run")
    rows = sum(e[1] for e in ordered)
    inside = sum(e[1] for e in ordered[1:-1])
    return ordered[-2][0] - ordered[0][0], inside / rows, len(ordered)


def _launch(
    work: Path, name: str, tasks: int, options: list[str]
) -> tuple[dict[str, Any], int, int, float]:
    """One bounded run of the command line (``--tasks tasks --sink files`` and ``options``),
    waited for: its summary, peak resident set (KiB, :func:`_high_water_kb`), exit code and
    seconds."""
    out = work / name
    summary = out / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    command = [
        sys.executable,
        *("-m", "actors.runtime", "--tasks", str(tasks), "--sink", "files"),
        *("--output-dir", str(out), "--progress", "off", "--summary-json", str(summary)),
        *options,
    ]
    started = time.monotonic()
    peak_kb = 0
    with (work / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            done, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if done:
                break
            peak_kb = max(peak_kb, _high_water_kb(proc.pid))
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if not summary.exists():
        raise SystemExit(f"the {name} run exited {proc.returncode}: see {work / f'{name}.log'}")
    return json.loads(summary.read_text()), peak_kb, proc.returncode, time.monotonic() - started


def _high_water_kb(pid: int) -> int:
    """The peak resident set (KiB) of process ``pid`` since its ``exec`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _micro_batches(data: Path) -> list[list[float]]:
    """``[commit time, rows]`` of each micro-batch committed under ``data``, oldest first."""
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
    return sorted(batches.values())


def _run(work: Path, name: str, records: int, tasks: int) -> dict[str, Any]:
    """One bounded run over ``records`` records already waiting; its figures."""
    span_us = int(records / (ROOTS * RATE) * 1e6)
    end = int(time.time() * 1e6) - 1_000_000
    start = end - span_us
    options = [
        *("--sim-roots", str(ROOTS), "--sim-records-per-s", str(RATE), "--sim-round-s", "0.5"),
        *("--sim-split-p", "0", "--sim-move-p", "0", "--sim-merge-p", "0"),
        *("--sim-start-ts", str(start), "--start-at", rfc3339(start), "--end-at", rfc3339(end)),
    ]
    s, peak_kb, returncode, seconds = _launch(work, name, tasks, options)
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
        "loop_lag_max_s": round(s["loop_lag_max_s"], 3),
        **_run_figures(s, peak_kb, returncode, seconds),
    }
    print(f"{name}: {figures}", flush=True)
    return figures


def _run_figures(
    s: dict[str, Any], peak_kb: int, returncode: int, seconds: float
) -> dict[str, Any]:
    """The figures every run reports, from its summary ``s`` and :func:`_launch`."""
    return {
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "loop_lag_p99_s": round(s["loop_lag_p99_s"], 3),
        "rebalances": s["rebalances"],
        "errors": s.get("errors", {}),
        "seconds": round(seconds, 1),
        # 1 also when every record was delivered but the final drain was cut short (a lease
        # lapsed at the end): the summary says which
        "exit_code": returncode,
        "caught_up": s["caught_up"],
        "drained": s["drained"],
    }


# --- the emulator phase -----------------------------------------------------------------------


class _Load(NamedTuple):
    """What one load committed: its mods by ``(commit_ts, table, mod_type, Id)``, its commits,
    the first and the last commit timestamp (Unix microseconds) and its seconds."""

    mods: Counter[tuple[int, str, str, int]]
    commits: int
    first_ts: int
    last_ts: int
    seconds: float


async def _load(cfg: Any, tables: Sequence[str], commits: int, writers: int, seed: int) -> _Load:
    """``commits`` transactions written by ``writers`` load generators at once, each as fast as
    the emulator commits (``LoadGenerator.bulk``: every transaction inserts into, updates and
    deletes from every table); seeds from ``seed`` on keep their keys apart."""
    from runtime.spanner.loadgen import LoadGenerator

    started = time.monotonic()
    gens = [await LoadGenerator.connect(cfg, tables, seed=seed + i) for i in range(writers)]
    try:
        shares = [commits // writers + (i < commits % writers) for i in range(writers)]
        await asyncio.gather(*(g.bulk(n) for g, n in zip(gens, shares, strict=True) if n))
    finally:
        for g in gens:
            await g.close()
    mods: Counter[tuple[int, str, str, int]] = Counter()
    for g in gens:
        mods.update(g.expected_mods())
    times = [c.commit_ts for g in gens for c in g.committed]
    return _Load(mods, commits, min(times), max(times), time.monotonic() - started)


def _emulator_run(
    work: Path, name: str, cfg: Any, tasks: int, start: int, end: int, written: Counter[Any]
) -> dict[str, Any]:
    """One bounded run of the command line over ``[start, end]`` of the emulator's stream (all
    of it already committed); its figures, its output checked against ``written``."""
    from bench.backfill import compare, read_typed_output

    options = [
        *("--connector", f"catchup-{name}", "--source", "spanner"),
        *("--spanner-emulator-host", cfg.emulator_host, "--spanner-project", cfg.project),
        *("--spanner-instance", cfg.instance, "--spanner-database", cfg.database),
        *("--spanner-change-stream", cfg.change_stream, "--log-level", "warning"),
        *("--start-at", rfc3339(start), "--end-at", rfc3339(end)),
    ]
    s, peak_kb, returncode, seconds = _launch(work, name, tasks, options)
    data = Path(s["output_dir"])
    rows, _, _ = read_typed_output(data)
    checked = compare(written, rows, start, end)
    batches = _micro_batches(data)
    delivered = s["records_delivered"]
    rate = None  # too few micro-batches to leave out the first and the last
    if len(batches) >= 3 and batches[-2][0] > batches[0][0]:
        share = sum(e[1] for e in batches[1:-1]) / sum(e[1] for e in batches)
        rate = round(delivered * share / (batches[-2][0] - batches[0][0]), 1)
    figures = {
        "mods_written": checked["committed"],
        "mods_delivered": checked["delivered"],
        "lost": checked["lost"],
        "duplicates": checked["extra"],  # rows more often than committed, or outside the window
        "outside_window": checked["outside_window"],
        "records_delivered": delivered,
        "records_read": s["records_read"],
        "records_per_s": rate,
        "micro_batches": len(batches),
        **_run_figures(s, peak_kb, returncode, seconds),
    }
    print(f"{name}: {figures}", flush=True)
    return figures


def _emulator_phase(work: Path, commits: int, tasks: int, writers: int) -> dict[str, Any]:
    """The emulator phase of the module docstring; its ``emulator_*`` figures."""
    from runtime.spanner.emulator import SpannerEmulator

    emulator = SpannerEmulator()
    emulator.start()
    try:
        cfg = emulator.config
        steady_commits = max(1, commits // 10)

        async def both() -> tuple[_Load, _Load]:
            steady = await _load(cfg, emulator.tables, steady_commits, writers, 1)
            backlog = await _load(cfg, emulator.tables, commits, writers, 1 + writers)
            return steady, backlog

        steady_load, backlog_load = asyncio.run(both())
        if backlog_load.first_ts <= steady_load.last_ts + 1:
            raise SystemExit("the backlog's commits overlap the steady ones': windows are off")
        print(
            f"emulator: {steady_commits} + {commits} commits in "
            f"{steady_load.seconds + backlog_load.seconds:.1f} s",
            flush=True,
        )
        written = steady_load.mods + backlog_load.mods
        steady_window = (steady_load.first_ts - 1, steady_load.last_ts + 1)
        backlog_window = (steady_load.last_ts + 2, backlog_load.last_ts + 1)
        steady = _emulator_run(work, "emulator-steady", cfg, tasks, *steady_window, written)
        backlog = _emulator_run(work, "emulator-backlog", cfg, tasks, *backlog_window, written)
        after = _emulator_run(work, "emulator-steady-after", cfg, tasks, *steady_window, written)
    finally:
        emulator.stop()
    runs = (steady, backlog, after)
    steady_rates = [r["records_per_s"] for r in (steady, after) if r["records_per_s"] is not None]
    steady_rate = sum(steady_rates) / len(steady_rates) if steady_rates else None
    ratio = None
    if steady_rate and backlog["records_per_s"] is not None:
        ratio = round(backlog["records_per_s"] / steady_rate, 3)
    return {
        "emulator_commits": commits,
        "emulator_load_s": round(backlog_load.seconds, 1),
        "emulator_commits_per_s": round(commits / backlog_load.seconds, 1),
        "emulator_writers": writers,
        "emulator_records": backlog["records_delivered"],
        "emulator_mods_written": backlog["mods_written"],
        "emulator_mods_delivered": backlog["mods_delivered"],
        "emulator_lost": sum(r["lost"] for r in runs),
        "emulator_duplicates": sum(r["duplicates"] for r in runs),
        "emulator_peak_rss_mb": backlog["peak_rss_mb"],
        "emulator_rate_ratio": ratio,
        "emulator_backlog_records_per_s": backlog["records_per_s"],
        "emulator_steady_records_per_s": None if steady_rate is None else round(steady_rate, 1),
        "emulator_steady_runs_records_per_s": [steady["records_per_s"], after["records_per_s"]],
        "emulator_steady_commits": steady_commits,
        "emulator_steady_load_s": round(steady_load.seconds, 1),
        "emulator_steady_records": steady["records_delivered"],
        "emulator_steady_peak_rss_mb": [steady["peak_rss_mb"], after["peak_rss_mb"]],
        "emulator_micro_batches": [r["micro_batches"] for r in runs],
        "emulator_backlog_records_read": backlog["records_read"],
        "emulator_backlog_run_s": backlog["seconds"],
        "emulator_loop_lag_p99_s": backlog["loop_lag_p99_s"],
        "emulator_rebalances": backlog["rebalances"],
        "emulator_errors": backlog["errors"],
        "emulator_exit_codes": [r["exit_code"] for r in runs],
        "emulator_drained": [r["drained"] for r in runs],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench catchup")
    parser.add_argument("--quick", action="store_true", help="1,000,000 records (default 5M)")
    parser.add_argument("--records", type=int, help="records of the backlog run")
    parser.add_argument("--tasks", type=int, default=2, help="task nodes in the process")
    parser.add_argument("--work-dir", help="keep the runs' output and logs here")
    parser.add_argument(
        "--emulator-only", action="store_true", help="only the emulator phase (not the simulated)"
    )
    parser.add_argument(
        "--emulator-commits", type=int, default=50_000, help="commits of the emulator's backlog"
    )
    parser.add_argument(
        "--emulator-writers", type=int, default=8, help="load generators committing at once"
    )
    args = parser.parse_args(argv)
    records = args.records or (1_000_000 if args.quick else 5_000_000)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="shoal-bench-catchup-"))
    work.mkdir(parents=True, exist_ok=True)
    emulator = args.emulator_only or not args.quick
    if emulator:
        from runtime.spanner.emulator import EmulatorUnavailable, find_emulator

        try:
            find_emulator()
        except EmulatorUnavailable as exc:
            print(f"catchup: {exc}", file=sys.stderr)
            return 2
    if args.emulator_only:
        result: dict[str, Any] = {"scenario": "catchup", "sink": "files", "tasks": args.tasks}
        result.update(_emulator(work, args))
        print(json.dumps(result))
        return 0 if _emulator_exact(result) else 1
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
    if emulator:
        result.update(_emulator(work, args))
        exact = exact and _emulator_exact(result)
    print(json.dumps(result))
    return 0 if exact else 1


def _emulator(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    return _emulator_phase(work, args.emulator_commits, args.tasks, args.emulator_writers)


def _emulator_exact(result: dict[str, Any]) -> bool:
    """Every committed mod of the emulator's runs delivered once, none outside their windows."""
    return bool(result["emulator_lost"] == 0 and result["emulator_duplicates"] == 0)
