"""``python -m bench faults``: the parts around shoal fail under a bounded run, one after the
other (docs/operations.md, "When the parts around shoal fail").

One ``python -m actors.runtime`` process runs the embedded default (embedded broker, three tasks,
local Spark writing parquet with atomic commits) against the Cloud Spanner emulator with a write
load (``--source emulator``; the simulated stream where the emulator is absent), with
``--output-layout generic``: there Spark writes every micro-batch, so its loss is in the path
(the default typed layout writes without Spark, and a dead JVM costs it nothing; ``--layout
typed`` runs that). Once the first
micro-batch committed, the harness injects, in turn, waiting for each to heal first:

* ``spark``: ``SIGKILL`` of the local Spark JVM (the run's child ``SparkSubmit`` process); the
  fault ends at once;
* ``broker``: ``SIGSTOP`` of the embedded broker for longer than the group session timeout, then
  ``SIGCONT`` (the tasks lose their membership and lease, stop reading, and join again);
* ``emulator``: ``SIGSTOP`` of the emulator (gateway and server) for longer than the readers'
  stall timeout, then ``SIGCONT`` (the silent queries are restarted from their committed
  positions).

``recovery_s`` of a fault: from its end to the first micro-batch committed after it (a new
``<table>/batch=<id>`` directory in the output, the default typed layout; for ``spark``, the
first after the bridge said a new session is up). ``recovered``: one came within ``--recovery-limit-s``. ``goal_s`` is twice the
relevant timeout (the session timeout, the stall timeout, Spark's measured first start).

At the end the run closes the stream and catches up (a bounded run exits 0 only with everything
written); ``committed`` is the rows the load wrote (the stream produced), ``delivered`` the
distinct rows in the output, ``lost`` their difference, ``duplicates`` raw rows written twice.

Last line: ``{"scenario": "faults", "source": .., "exit_code": .., "committed": ..,
"delivered": .., "lost": .., "duplicates": .., "faults": {"spark": {"recovered": ..,
"recovery_s": .., "goal_s": ..}, "broker": {...}, "emulator": {...}}}``. ``--quick`` takes a
few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.procs import children, cmdline, descendants, spark_jvm_pids

SESSION_TIMEOUT_S = 3.0  # the embedded broker's group session timeout (KafkaConfig.embedded)
STALL_TIMEOUT_S = 30.0  # the readers' stall timeout (task.stall_timeout_s, its default)


class Run:
    """The ``actors.runtime`` process under test and what it wrote."""

    def __init__(self, args: list[str], work: Path) -> None:
        self.work = work
        self.out = work / "out"
        self.log = work / "run.log"
        self.summary = work / "summary.json"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "actors.runtime",
                    *args,
                    *("--output-dir", str(self.out), "--summary-json", str(self.summary)),
                    *("--progress", "off"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def batches(self) -> set[str]:
        """The committed micro-batches' table directories, in either layout (typed
        ``<table>/batch=<id>``, the default; generic ``table=<name>/batch=<id>``); staged ones
        are under ``_staging``."""
        data = self.out / "data"
        return {
            p.parent.name + "/" + p.name
            for p in data.glob("*/batch=*")
            if not p.parent.name.startswith(("_", "."))
        }

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self, marker: str) -> list[int]:
        """The run's descendants whose command line holds ``marker``."""
        return [p for p in descendants(self.proc.pid) if marker in cmdline(p)]


def _wait_new_batch(run: Run, before: set[str], limit_s: float, after_log: str | None) -> float:
    """Seconds until a batch not in ``before`` appears (with ``after_log``: only once the log
    holds that text); -1 if none within ``limit_s`` or the run ended."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s and run.alive():
        if after_log is not None and after_log not in run.text():
            time.sleep(0.2)
            continue
        if run.batches() - before:
            return time.monotonic() - t0
        time.sleep(0.2)
    return -1.0


def _pause(pids: list[int], seconds: float) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _result(recovery: float, goal: float) -> dict[str, Any]:
    return {
        "recovered": recovery >= 0,
        "recovery_s": round(recovery, 1) if recovery >= 0 else None,
        "goal_s": round(goal, 1),
    }


def inject(run: Run, kind: str, args: argparse.Namespace, spark_start_s: float) -> dict[str, Any]:
    before = run.batches()
    if kind == "spark":
        jvms = spark_jvm_pids(run.proc.pid)
        if len(jvms) != 1:
            return {"recovered": False, "error": f"expected one Spark JVM, found {jvms}"}
        os.kill(jvms[0], signal.SIGKILL)
        print(f"faults: SIGKILL Spark JVM {jvms[0]}", flush=True)
        # Generic: the first batch Spark wrote with the new session; typed: the next batch.
        said = "a new session is up" if args.layout == "generic" else None
        recovery = _wait_new_batch(run, before, args.recovery_limit_s, said)
        return _result(recovery, 2 * spark_start_s)
    if kind == "broker":
        pids = [p for p in children(run.proc.pid) if "tansu" in cmdline(p)]
        pause = args.broker_pause_s
        goal = 2 * SESSION_TIMEOUT_S
    else:
        pids = run.pids("cloud_spanner_emulator")
        pause = args.emulator_pause_s
        goal = 2 * STALL_TIMEOUT_S
    if not pids:
        return {"recovered": False, "error": f"no {kind} process found"}
    print(f"faults: SIGSTOP {kind} {pids} for {pause:.0f}s", flush=True)
    _pause(pids, pause)
    before = run.batches()  # what committed while it was stopped does not count
    recovery = _wait_new_batch(run, before, args.recovery_limit_s, None)
    return _result(recovery, goal)


def _output_ids(directory: Path) -> list[str]:
    """Every committed row's id (``commit/txn/seq/mod``), raw (duplicates kept), in either
    layout."""
    from runtime.files.typed import generic_rows, is_typed_layout
    from runtime.spark import KEY_COLUMNS, read_output

    if is_typed_layout(directory):
        return [row["record_id"] for row in generic_rows(directory)]
    if not any(directory.glob("table=*")):
        return []
    table = read_output(directory, dedupe=False)
    columns = [table.column(c).to_pylist() for c in KEY_COLUMNS]
    return ["/".join(str(v) for v in key) for key in zip(*columns, strict=True)]


def run_faults(args: argparse.Namespace) -> dict[str, Any]:
    from runtime.spanner.emulator import EmulatorUnavailable, find_emulator

    try:
        find_emulator()
        source = ["--source", "emulator", "--spanner-load-rate", str(args.load_rate)]
        kinds = ["spark", "broker", "emulator"]
    except EmulatorUnavailable as exc:
        print(f"faults: no emulator ({exc}); the simulated stream instead", flush=True)
        source = ["--source", "sim", "--sim-records-per-s", "20"]
        kinds = ["spark", "broker"]
    work = Path(tempfile.mkdtemp(prefix="shoal-faults-"))
    started = time.monotonic()
    run = Run(
        [
            *source,
            *("--duration", str(args.duration), "--drain-timeout", "300"),
            *("--output-layout", args.layout),
        ],
        work,
    )
    faults: dict[str, Any] = {}
    try:
        while run.alive() and not run.batches():
            if time.monotonic() - started > 400:
                raise RuntimeError(f"no batch committed in 400s: {run.text()[-3000:]}")
            time.sleep(0.5)
        spark_start_s = time.monotonic() - started
        print(f"faults: first batch after {spark_start_s:.0f}s", flush=True)
        for kind in kinds:
            time.sleep(args.gap_s)
            if not run.alive():
                faults[kind] = {"recovered": False, "error": "the run ended before the fault"}
                continue
            faults[kind] = inject(run, kind, args, spark_start_s)
            print(f"faults: {kind}: {faults[kind]}", flush=True)
        code = run.proc.wait(args.duration + 900)
    finally:
        if run.alive():
            run.proc.send_signal(signal.SIGINT)
            try:
                run.proc.wait(120)
            except subprocess.TimeoutExpired:
                run.proc.kill()
    summary: dict[str, Any] = {}
    if run.summary.exists():
        summary = json.loads(run.summary.read_text())
    ids = _output_ids(run.out / "data")
    delivered = len(set(ids))
    committed = summary.get("produced_rows") or 0
    lost = max(0, committed - delivered)
    if code != 0:
        print(run.text()[-4000:], flush=True)
    elif lost == 0 and all(f.get("recovered") for f in faults.values()):
        shutil.rmtree(work, ignore_errors=True)  # kept for a look when something went wrong
    return {
        "scenario": "faults",
        "source": source[1],
        "layout": args.layout,
        "exit_code": code,
        "caught_up": summary.get("caught_up"),
        "committed": committed,
        "delivered": delivered,
        "lost": lost,
        "duplicates": len(ids) - delivered,
        "faults": faults,
        "work_dir": str(work) if work.exists() else None,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench faults", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few minutes")
    parser.add_argument("--duration", type=float, default=None, help="the run's --duration")
    parser.add_argument("--load-rate", type=float, default=None, help="emulator commits/s")
    parser.add_argument("--gap-s", type=float, default=10.0, help="healthy time between faults")
    parser.add_argument("--broker-pause-s", type=float, default=None)
    parser.add_argument("--emulator-pause-s", type=float, default=None)
    parser.add_argument("--recovery-limit-s", type=float, default=180.0)
    parser.add_argument(
        "--layout",
        choices=["generic", "typed"],
        default="generic",
        help="the run's --output-layout (generic: Spark writes every micro-batch)",
    )
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = 200.0 if args.quick else 420.0
    if args.load_rate is None:
        args.load_rate = 10.0 if args.quick else 30.0
    if args.broker_pause_s is None:
        args.broker_pause_s = 3 * SESSION_TIMEOUT_S if args.quick else 6 * SESSION_TIMEOUT_S
    if args.emulator_pause_s is None:
        args.emulator_pause_s = STALL_TIMEOUT_S + 10 if args.quick else STALL_TIMEOUT_S + 30
    result = run_faults(args)
    print(json.dumps(result))
    return 0
