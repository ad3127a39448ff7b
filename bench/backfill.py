"""``python -m bench backfill``: a bounded backfill of a recorded load, measured.

* The harness starts the Cloud Spanner emulator with partition churn (partitions end every
  ``--churn-s`` to twice that many seconds: real splits and merges inside the window) and the
  embedded Kafka-compatible broker.
* A seeded load generator commits transactions for ``--load-s`` seconds at ``--rate`` commits/s
  and records each commit's timestamp. Nothing reads the stream meanwhile.
* Once the load has finished, a window ``[start, end]`` is chosen inside it: ``start`` is the
  commit timestamp of the commit a quarter into the load, ``end`` that of the commit three
  quarters into it. Both bounds are inclusive (``--start-at``, ``--end-at``) and both fall
  exactly on a commit, so an off-by-one at either end shows; commits fall before, inside and
  after the window.
* ``--processes`` processes (one by default) of ``python -m actors.runtime`` (``--tasks`` tasks
  each, one connector, ``--source spanner`` at the emulator, ``--sink files`` into one shared
  directory in the typed per-table layout, ``--start-at``, ``--end-at``, no ``--duration``) must
  each drain and exit 0 by itself once every partition reached the end. The wait is bounded
  (``--timeout-s``): past it the processes still running are killed and the run fails. With
  ``--kill-mid-read`` the first process is killed (SIGKILL) as soon as the first micro-batch is
  committed and started again with the same options: it resumes from the watermarks in the
  sync topic, and the window must still be exact.
* The output is read back as a plain reader sees it (every table directory's committed parquet
  files, no de-duplication; names starting with ``_`` or ``.`` are not data), each row's identity
  taken from its metadata columns and key: ``(_commit_ts, table, _mod_type, Id)``. It is
  compared with the load's changes whose commit timestamp is inside the window: ``lost``
  (committed in the window, not in the output), ``extra`` (in the output more often than
  committed, duplicates included) and ``outside_window`` (rows whose commit timestamp is outside
  the window) must all be 0.

Last line: ``{"scenario": "backfill", "committed": <mods inside the window>, "delivered": <rows
in the output>, "lost": .., "extra": .., "outside_window": .., "typed_tables": <tables written
with typed columns>, "exited_by_itself": bool, "seconds": ..}``; exit code 1 unless lost, extra
and outside_window are 0 and the process exited 0 by itself. ``--quick``: a 30 s load.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

CONNECTOR = "backfill"
KEY = tuple[int, str, str, int]  # (commit_ts micros, table, mod type, Id)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def rfc3339(micros: int) -> str:
    """Unix microseconds as RFC 3339 in UTC with all six fraction digits."""
    return (_EPOCH + dt.timedelta(microseconds=micros)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def choose_window(commit_times: list[int]) -> tuple[int, int]:
    """``[start, end]`` on the commits a quarter and three quarters into the load (sorted by
    time), so some commits fall before, some inside and some after."""
    times = sorted(commit_times)
    if len(times) < 4:
        raise ValueError(f"too few commits for a window inside the load: {len(times)}")
    return times[len(times) // 4], times[(3 * len(times)) // 4]


def read_typed_output(data: Path) -> tuple[Counter[KEY], int, int]:
    """The output under ``data``, read raw (``bench.output``): (rows by ``(commit_ts, table,
    mod_type, Id)``, tables written with typed columns, distinct partition tokens the rows came
    from: with churn, the window's changes come from several partitions)."""
    from bench.output import read_changes, typed_tables

    rows: Counter[KEY] = Counter()
    tokens: set[str] = set()
    for change in read_changes(data):
        rows[(change.commit_ts, change.table, change.mod_type, change.key)] += 1
        tokens.add(change.partition_token)
    return rows, typed_tables(data), len(tokens)


def compare(
    expected_all: Counter[KEY], output: Counter[KEY], start: int, end: int
) -> dict[str, Any]:
    """The output against the load's changes inside ``[start, end]`` (both inclusive)."""
    expected = Counter({k: n for k, n in expected_all.items() if start <= k[0] <= end})
    outside = sum(n for k, n in output.items() if not start <= k[0] <= end)
    lost = expected - output
    extra = output - expected
    return {
        "committed": sum(expected.values()),
        "committed_total": sum(expected_all.values()),
        "before_window": sum(n for k, n in expected_all.items() if k[0] < start),
        "after_window": sum(n for k, n in expected_all.items() if k[0] > end),
        "delivered": sum(output.values()),
        "lost": sum(lost.values()),
        "extra": sum(extra.values()),
        "outside_window": outside,
        "at_start": sum(n for k, n in output.items() if k[0] == start),  # inclusive bounds
        "at_end": sum(n for k, n in output.items() if k[0] == end),
        "lost_examples": [list(k) for k in list(lost)[:5]],
        "extra_examples": [list(k) for k in list(extra)[:5]],
    }


async def backfill(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The scenario (see the module docstring); returns its figures."""
    from runtime.kafka.broker import EmbeddedBroker
    from runtime.spanner.emulator import SpannerEmulator
    from runtime.spanner.loadgen import LoadGenerator

    started = time.monotonic()
    output = work / "output"
    logs = work / "logs"
    logs.mkdir(parents=True)
    emulator = SpannerEmulator(partition_alive_s=args.churn_s)
    await asyncio.to_thread(emulator.start)
    out: dict[str, Any] = {}
    try:
        async with EmbeddedBroker(log_path=logs / "broker.log") as broker:
            cfg = emulator.config
            loader = await LoadGenerator.connect(cfg, emulator.tables, seed=args.seed)
            try:
                out["commits"] = await loader.run(args.rate, duration_s=args.load_s)
            finally:
                await loader.close()
            start, end = choose_window([c.commit_ts for c in loader.committed])
            out["start_at"], out["end_at"] = rfc3339(start), rfc3339(end)
            out["window_s"] = round((end - start) / 1e6, 1)
            command = [
                sys.executable, "-m", "actors.runtime",
                "--connector", CONNECTOR,
                "--tasks", str(args.tasks),
                "--source", "spanner",
                "--spanner-emulator-host", emulator.host,
                "--spanner-project", cfg.project,
                "--spanner-instance", cfg.instance,
                "--spanner-database", cfg.database,
                "--spanner-change-stream", cfg.change_stream,
                "--sink", "files",
                "--output-dir", str(output),
                "--kafka-bootstrap-servers", broker.bootstrap,
                "--kafka-session-timeout-ms", "3000",
                "--kafka-heartbeat-interval-ms", "1000",
                "--start-at", out["start_at"],
                "--end-at", out["end_at"],
                "--progress", "off",
                "--log-level", args.task_log_level,
            ]  # fmt: skip
            commands = [
                [*command, "--summary-json", str(work / f"summary.{i}.json")]
                for i in range(args.processes)
            ]
            out["runs"] = await asyncio.to_thread(
                _run_bounded,
                commands,
                logs,
                args.timeout_s,
                output / "data" if args.kill_mid_read else None,
            )
            for i in range(args.processes):
                summary = work / f"summary.{i}.json"
                if summary.exists():
                    data = json.loads(summary.read_text())
                    fields = ("reason", "seconds", "rows_written", "rebalances", "errors")
                    out[f"summary.{i}"] = {k: data.get(k) for k in fields}
    finally:
        await asyncio.to_thread(emulator.stop)
    rows, typed, tokens = read_typed_output(output / "data")
    out.update(compare(loader.expected_mods(), rows, start, end))
    out["typed_tables"] = typed
    out["partitions_with_rows"] = tokens  # churn: the window's changes came from this many
    out["exited_by_itself"] = all(r["exit_code"] == 0 and not r["killed"] for r in out["runs"])
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def _run_bounded(
    commands: list[list[str]], logs: Path, timeout_s: float, kill_at: Path | None = None
) -> list[dict[str, Any]]:
    """Run the CLI processes side by side until each exits by itself, for at most ``timeout_s``
    seconds in all (then the ones still running are killed). With ``kill_at`` (the output's
    data directory): once the first micro-batch is committed there (a table directory appears),
    the first process, if still running, is killed (SIGKILL) and started again with the same
    options (it resumes from the sync topic's watermarks)."""
    began = time.monotonic()

    def start(i: int, attempt: int) -> subprocess.Popen[bytes]:
        with open(logs / f"run.{i}.{attempt}.log", "wb") as log:
            return subprocess.Popen(
                commands[i],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    procs = [start(i, 1) for i in range(len(commands))]
    restarted_at: float | None = None
    if kill_at is not None:
        from runtime.files.typed import table_dirs

        while procs[0].poll() is None and time.monotonic() < began + timeout_s:
            if table_dirs(kill_at):
                procs[0].kill()
                procs[0].wait()
                restarted_at = round(time.monotonic() - began, 1)
                procs[0] = start(0, 2)
                break
            time.sleep(0.05)
    runs = []
    for i, proc in enumerate(procs):
        killed = False
        try:
            code = proc.wait(max(0.0, began + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed = True
            proc.kill()
            code = proc.wait()
        run = {"exit_code": code, "killed": killed, "seconds": round(time.monotonic() - began, 1)}
        if i == 0 and restarted_at is not None:
            run["killed_and_restarted_at_s"] = restarted_at
        runs.append(run)
    return runs


def passed(result: dict[str, Any]) -> bool:
    """Whether the run counts as a success (the exit code's rule)."""
    return bool(
        result["lost"] == result["extra"] == result["outside_window"] == 0
        and result["exited_by_itself"]
    )


FIGURES = (
    "committed",
    "delivered",
    "lost",
    "extra",
    "outside_window",
    "typed_tables",
    "exited_by_itself",
    "seconds",
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench backfill", description=__doc__)
    parser.add_argument("--load-s", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--rate", type=float, default=20.0, help="commits per second")
    parser.add_argument("--tasks", type=int, default=2, help="tasks of each CLI process")
    parser.add_argument("--processes", type=int, default=1, help="CLI processes side by side")
    parser.add_argument("--churn-s", type=int, default=3, help="emulator partition lifetime")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on the CLI's run")
    parser.add_argument(
        "--kill-mid-read",
        action="store_true",
        help="kill -9 the first CLI process once the first micro-batch is committed and start "
        "it again with the same options: it must resume and the window stay exact",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--task-log-level", default="warning", help="log level of the CLI")
    parser.add_argument("--quick", action="store_true", help="a 30 s load")
    args = parser.parse_args(argv)
    if args.quick:
        args.load_s = 30.0
    work = Path(tempfile.mkdtemp(prefix="shoal-backfill-"))
    try:
        import uvloop

        result = uvloop.run(backfill(args, work))
    except Exception as exc:
        print(
            f"backfill: {type(exc).__name__}: {exc} (work directory kept: {work})", file=sys.stderr
        )
        return 1
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    print(json.dumps({"scenario": "backfill", **{k: result[k] for k in FIGURES}}))
    ok = passed(result)
    if not args.keep and ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory kept: {work}", file=sys.stderr)
    return 0 if ok else 1
