"""``python -m bench report``: run every scenario and write a report directory.

Each scenario runs as its own process (``python -m bench <scenario> [--quick]``), with a time
limit; its output is kept in ``<dir>/<scenario>.log`` and its last line (one JSON object) goes
into the summary. ``<dir>/summary.md`` has the table of figures against the goals, and PNG plots
(matplotlib): the rebalance timeline (partitions owned per task over time, with the moments tasks
join, die or leave), throughput over time, and the delivery-delay distribution, from the
``timeline`` scenario. A scenario that fails or is missing is reported as such, not hidden.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (scenario, quick arguments, full arguments, time limit in seconds)
SCENARIOS: list[tuple[str, list[str], list[str], int]] = [
    ("sim", ["--seeds", "200"], ["--seeds", "10000"], 7200),
    ("rebalance", ["--quick"], [], 900),
    ("spanner", ["--quick"], [], 900),
    ("e2e", ["--quick"], [], 900),
    ("dlq", ["--quick"], [], 900),
    ("scale", ["--quick"], [], 1800),
    ("capacity", ["--quick"], [], 900),
    ("timeline", ["--quick"], [], 600),
    ("chaos", ["--quick"], [], 1800),
    ("backfill", ["--quick"], [], 900),
    ("outputstate", ["--quick"], [], 900),
    ("lake", ["--quick"], [], 2400),
]

# (scenario, figure, goal text, check)
GOALS: list[tuple[str, str, str, Any]] = [
    ("sim", "passed", "all seeds pass", lambda r: r.get("passed") == r.get("seeds")),
    ("rebalance", "protocol_overhead_s", "<= 0.5 s beyond Kafka's group time", lambda v: v <= 0.5),
    ("e2e", "ratio", ">= 0.8 of raw Spark", lambda v: v >= 0.8),
    ("e2e", "latency_p50_s", "< 1 s", lambda v: v < 1.0),
    ("e2e", "floor_ratio", ">= 0.7 of Spark's own floor", lambda v: v >= 0.7),
    ("e2e", "spark_jobs_per_batch", "0.9-1.0", lambda v: v is not None and 0.9 <= v <= 1.0),
    ("dlq", "healthy_ratio", "healthy keys unaffected (~1.0)", lambda v: v >= 0.9),
    ("dlq", "lost", "0", lambda v: v == 0),
    ("scale", "replay_s", "< 2 s", lambda v: v < 2.0),
    ("scale", "rss_per_partition_kb", "< 20 KB per idle partition", lambda v: v < 20),
    ("capacity", "cap_respected", "reads exactly the cap", lambda v: v is True),
    ("timeline", "missing", "0", lambda v: v == 0),
    ("chaos", "lost", "0", lambda v: v == 0),
    ("chaos", "duplicates", "0 after de-duplication", lambda v: v == 0),
    ("backfill", "lost", "0", lambda v: v == 0),
    ("backfill", "extra", "0", lambda v: v == 0),
    ("backfill", "outside_window", "0", lambda v: v == 0),
    ("backfill", "exited_by_itself", "exits 0 by itself at --end-at", lambda v: v is True),
    ("outputstate", "lost", "0", lambda v: v == 0),
    ("outputstate", "duplicates", "0", lambda v: v == 0),
    ("outputstate", "false_complete", "0 rows claimed by a mark and missing", lambda v: v == 0),
    (
        "outputstate",
        "mark_below_end",
        "0 finished runs with a mark below --end-at",
        lambda v: v == 0,
    ),
    ("outputstate", "rerun_exit", "a re-run of a finished run exits 0", lambda v: v == 0),
    ("outputstate", "silent_stuck", "0", lambda v: v == 0),
    ("outputstate", "refused_start_ok", "refused on every broker", lambda v: v is True),
    ("lake", "lost", "0", lambda v: v == 0),
    ("lake", "duplicates", "0", lambda v: v == 0),
    ("lake", "killed", ">= 1 run SIGKILLed mid-run", lambda v: v >= 1),
    ("lake", "exited_by_itself", "every run exits 0 by itself", lambda v: v is True),
    ("lake", "spark_jobs_per_batch", "0.9-1.0", lambda v: v is not None and 0.9 <= v <= 1.0),
    ("lake", "floor_ratio", ">= 0.8 of Spark's floor into the store", lambda v: v >= 0.8),
]


def run_scenario(name: str, args: list[str], limit: int, out: Path) -> dict[str, Any]:
    log_path = out / f"{name}.log"
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path[1:2]])}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench", name, *args],
            capture_output=True,
            text=True,
            timeout=limit,
            env=env,
            check=False,
        )
        stdout, output, code = proc.stdout, proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        raw = (exc.stdout or b"") + (exc.stderr or b"")
        output = raw.decode() if isinstance(raw, bytes) else raw
        stdout, code = "", -1
        output += f"\n[report] timed out after {limit} s"
    log_path.write_text(output)
    result: dict[str, Any] = {"_exit": code, "_seconds": round(time.perf_counter() - started, 1)}
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                result.update(json.loads(line))
            except json.JSONDecodeError as exc:
                result["_error"] = f"last JSON line unreadable: {exc}"
            break
    else:
        tail = output.strip().splitlines()[-1:] or ["no output"]
        result.setdefault("_error", tail[0][:300])
    return result


def plots(timeline: Path, out: Path) -> list[str]:
    """Draw the timeline scenario's series; return the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(timeline.read_text())
    samples = data["samples"]
    events = data["events"]
    names = sorted({n for s in samples for n in s["owned"]})
    ts = [s["t"] for s in samples]
    written = []

    fig, ax = plt.subplots(figsize=(9, 4))
    for name in names:
        ax.step(ts, [s["owned"].get(name, 0) for s in samples], where="post", label=name)
    for at, what in events:
        ax.axvline(at, color="grey", linestyle=":", linewidth=0.8)
        ax.text(at, ax.get_ylim()[1] * 0.95, what, rotation=90, fontsize=7, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("partitions owned")
    ax.set_title("Rebalance timeline: partitions owned per task")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "rebalance_timeline.png", dpi=110)
    plt.close(fig)
    written.append("rebalance_timeline.png")

    fig, ax = plt.subplots(figsize=(9, 3.5))
    rates = [
        (b["t"], (b["rows"] - a["rows"]) / max(1e-9, b["t"] - a["t"]))
        for a, b in itertools.pairwise(samples)
    ]
    ax.plot([r[0] for r in rates], [r[1] for r in rates], linewidth=1)
    for at, _ in events:
        ax.axvline(at, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("records/s delivered")
    ax.set_title("Throughput over time (timeline scenario)")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)
    written.append("throughput.png")

    delays = data.get("delays_s") or []
    if delays:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(delays, bins=50)
        ax.set_xlabel("commit timestamp to delivery (s)")
        ax.set_ylabel("records (sampled)")
        ax.set_title("Delivery delay distribution (timeline scenario)")
        fig.tight_layout()
        fig.savefig(out / "latency.png", dpi=110)
        plt.close(fig)
        written.append("latency.png")
    return written


def summary(results: dict[str, dict[str, Any]], images: list[str], quick: bool) -> str:
    lines = [
        "# shoal benchmark report",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M:%S')} on {os.cpu_count()} CPUs; "
        f"{'quick' if quick else 'full'} scenarios. Every figure below was measured in this run.",
        "",
        "## Goals",
        "",
        "| scenario | figure | measured | goal | met |",
        "|---|---|---|---|---|",
    ]
    for scenario, figure, goal, check in GOALS:
        result = results.get(scenario, {})
        if scenario == "sim":
            value: Any = f"{result.get('passed')}/{result.get('seeds')}"
            met = check(result) if "passed" in result else None
        else:
            value = result.get(figure)
            met = None if value is None else bool(check(value))
        mark = {True: "yes", False: "**no**", None: "not measured"}[met]
        lines.append(f"| {scenario} | {figure} | {value} | {goal} | {mark} |")
    lines += ["", "## Scenarios", ""]
    for name, result in results.items():
        status = "ok" if result.get("_exit") == 0 else f"exit {result.get('_exit')}"
        lines.append(f"### {name} ({status}, {result.get('_seconds')} s)")
        lines.append("")
        if "_error" in result:
            lines.append(f"Error: `{result['_error']}` (full output in `{name}.log`)")
        figures = {k: v for k, v in result.items() if not k.startswith("_")}
        if figures:
            lines.append("```json")
            lines.append(json.dumps(figures, indent=1)[:4000])
            lines.append("```")
        lines.append("")
    if images:
        lines += ["## Plots", ""]
        lines += [f"![{img}]({img})" for img in images]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench report", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-report"))
    parser.add_argument("--full", action="store_true", help="full scenarios (hours), not quick")
    parser.add_argument("--only", nargs="*", help="run only these scenarios")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name, quick_args, full_args, limit in SCENARIOS:
        if args.only and name not in args.only:
            continue
        extra = full_args if args.full else quick_args
        if name == "timeline":
            extra = [*extra, "--out", str(out / "timeline.json")]
        print(f"[report] {name} {' '.join(extra)} ...", flush=True)
        results[name] = run_scenario(name, extra, limit, out)
        print(f"[report] {name}: exit {results[name]['_exit']}", flush=True)
    images: list[str] = []
    if (out / "timeline.json").exists():
        images = plots(out / "timeline.json", out)
    (out / "summary.md").write_text(summary(results, images, not args.full))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = [n for n, r in results.items() if r.get("_exit") != 0]
    print(f"[report] wrote {out / 'summary.md'}; failed or missing: {failed or 'none'}")
    print(json.dumps({"scenario": "report", "dir": str(out), "failed": failed}))
    return 0
