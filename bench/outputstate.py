"""``python -m bench outputstate``: the output directory's own state, through the real command
line (issue 32): one connector's progress never hides another's rows, the documented reset
re-reads, a different start on a started connector is refused on every broker, the completeness
mark reaches ``--end-at`` and never claims missing rows, a re-run of a finished bounded run
exits 0 at once, and a broken progress file stops the run loudly.

Every run is a subprocess of ``python -m actors.runtime`` (``--source sim`` with every
simulator option given explicitly, a fixed ``--sim-seed`` and ``--sim-start-ts``, ``--sink
files`` (or ``--sink spark``), explicit ``--start-at`` / ``--end-at``), its output in a log file
under the work directory. Either on the embedded broker (no ``--kafka-bootstrap-servers``: the
run starts its own, which forgets everything when the run ends) or on a *persistent* broker: an
embedded broker the bench starts itself and passes to every run of that kind, so the connectors'
sync topics outlive the runs.

**The oracle** is the seeded stream model alone (``runtime.sim.stream.StreamModel``, built here
from the same numbers the bench passes on the command line), with the bench's own window and
table filter: the rows of ``[start, end]`` (both inclusive) of the listed tables, one per mod,
each known by its identity ``(commit_ts, server_transaction_id, record_sequence, mod_index)``.
Nothing the command line computes or prints (its summary, its filter, its stream parameters) is
used as the oracle. The output is read back with pyarrow as a plain reader sees it (each table
directory's committed parquet files, names starting with ``_`` or ``.`` skipped, nothing
de-duplicated) and each expected row counted present 0, 1 or more times.

Scenarios (windows in stream time; ``T0 < T1 < E < E2``, each ``--window-s`` apart):

1. ``two_connectors/<broker>/<order>``: ``--connector ca --tables Albums`` and ``--connector cb
   --tables Singers``, same ``[T0, E]``, ``--sim-roots``, ``--output-dir``; one after the other
   and at the same time, on the embedded and on the persistent broker. Both tables' rows of the
   window must be there once (a run refused at start, exit 2, promises nothing).
2. ``reset/<broker>``: ``--connector orders --start-at T1``, then ``--connector orders-2
   --start-at T0``, same output and ``--end-at E`` (docs/operations.md, "Resetting a
   connector"): ``[T0, T1)`` must be there once; the overlap ``[T1, E]`` once or twice (twice is
   documented: ``overlap_twice``, not a duplicate).
3. ``different_start/<broker>``: a connector started at ``T1``, then the same connector with
   ``--start-at T0``: must be refused (exit 2). A run that accepts it and exits 0 promised
   ``[T0, E]``; without those rows it skipped a window (``silent_skips``).
4. Every run: the connector's completeness file (``<data>/_shoal/<connector>/completeness.json``,
   else the shared ``<data>/_shoal/completeness.json`` when it names this connector) is read
   right after the run. A bounded run that exits 0 (not stopped by the bench) must leave
   ``low_watermark_us >= --end-at`` (else ``mark_below_end``; no mark counts too); a mark
   must not claim rows the oracle expects for that run's window and filter and the output lacks
   (``false_complete``: such rows with ``commit_ts <= mark``). Refused runs (exit 2) claim
   nothing and are not checked. A connector's mark lower than the one seen after its previous
   run on that output is told (``mark_went_back``), not failed: it claims less, nothing false.
5. ``rerun/embedded``: a bounded run from ``--window-s`` seconds ago to ``--live-s`` seconds
   ahead, SIGTERMed once its first micro-batch is committed, then the same command (it finishes
   the window), then the same command again: that last one must exit 0 promptly
   (``rerun_exit``, ``rerun_seconds``); the window must be there exactly once.
6. ``corrupt_progress/<kind>``: after a bounded run ``[T0, T1]``, one file under
   ``<data>/_shoal/**/progress/`` (the one with the highest position) is truncated to half its
   bytes (``half``) or emptied (``empty``), then the same connector runs with ``--end-at E2``:
   it must stop with a non-zero exit and a message naming the file within
   ``--stuck-timeout-s`` (or repair it and finish with every row). ``silent_stuck`` counts runs
   that hang (killed at the timeout) or end without naming the file while rows are missing or
   the exit is not 0.

``lost``: expected rows missing, over every window a run promised (a run not refused at start,
in 1, 2, 3 and 5; in 6 the first run's window, and the second's if it exits 0).
``duplicates``: promised rows present more than once where that is not documented.

Last line: ``{"scenario": "outputstate", "lost": .., "duplicates": .., "false_complete": ..,
"mark_below_end": .., "rerun_exit": .., "rerun_seconds": .., "silent_stuck": ..,
"refused_start_ok": .., "silent_skips": .., "mark_went_back": .., "sim": {..}, "windows":
{..}, "scenarios": {..}, "failed_logs": [..], "seconds": ..}`` (``rerun_exit``: the exit code,
``"killed"`` at the timeout; ``failed_logs``: the log files of the runs that failed a check);
exit 0 only when all of them hold (``mark_went_back`` is told only). ``--scenarios`` runs some
of them only. ``--quick``: 10 s windows and one corrupt-progress kind (``half``): 3–5 minutes
on 2 cores. ``--sink spark`` runs the same through a local Spark (a minute or more per run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from bench.procs import start_time, tree

if TYPE_CHECKING:
    from runtime.sim.stream import StreamModel

__all__ = [
    "Key",
    "Oracle",
    "Sim",
    "false_complete",
    "histogram",
    "mark_below_end",
    "read_mark",
    "read_output",
]

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("two_connectors", "reset", "different_start", "rerun", "corrupt_progress")
Key = tuple[int, str, str, int]
"""A row's identity: (commit_ts micros, server_transaction_id, record_sequence, mod_index)."""
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_PERSISTENT_KAFKA = ("--kafka-session-timeout-ms", "3000", "--kafka-heartbeat-interval-ms", "1000")


def rfc3339(micros: int) -> str:
    """Unix microseconds as RFC 3339 in UTC with all six fraction digits."""
    return (_EPOCH + dt.timedelta(microseconds=micros)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def wall_micros() -> int:
    return time.time_ns() // 1000


# -- the oracle ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sim:
    """The simulated stream, given in full on every command line and to the oracle."""

    seed: int
    start_ts: int
    roots: int = 4
    records_per_s: float = 200.0
    round_s: float = 5.0
    split_p: float = 0.05
    move_p: float = 0.03
    merge_p: float = 0.05

    def args(self) -> list[str]:
        return [
            "--source", "sim",
            "--sim-seed", str(self.seed),
            "--sim-start-ts", str(self.start_ts),
            "--sim-roots", str(self.roots),
            "--sim-records-per-s", repr(self.records_per_s),
            "--sim-round-s", repr(self.round_s),
            "--sim-split-p", repr(self.split_p),
            "--sim-move-p", repr(self.move_p),
            "--sim-merge-p", repr(self.merge_p),
            "--sim-speedup", "1",
        ]  # fmt: skip

    def model(self) -> StreamModel:
        from runtime.sim.stream import StreamModel, StreamParams

        return StreamModel(
            StreamParams(
                seed=self.seed,
                roots=self.roots,
                start_ts=self.start_ts,
                round_us=round(self.round_s * 1e6),
                split_p=self.split_p,
                move_p=self.move_p,
                merge_p=self.merge_p,
                records_per_s=self.records_per_s,
            )
        )


class Oracle:
    """The rows of the simulated stream, from the stream model alone: one per mod of every data
    record, with its table."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self._until = -1
        self._rows: list[tuple[Key, str]] = []

    def rows(self, until: int) -> list[tuple[Key, str]]:
        """Every row committed at or before ``until`` (the model generated again when a later
        end is asked for: the same seed gives the same rows)."""
        if until > self._until:
            self._rows = [
                ((r.commit_ts, r.server_transaction_id, r.record_sequence, i), r.table)
                for r in self.sim.model().expected(until)
                for i in range(len(r.mods))
            ]
            self._until = until
        return self._rows

    def expected(self, start: int, end: int, tables: Iterable[str] | None = None) -> set[Key]:
        """The rows of ``[start, end]`` (both inclusive) of ``tables`` (names compared without
        case; None: every table)."""
        keep = None if tables is None else {t.lower() for t in tables}
        return {
            key
            for key, table in self.rows(end)
            if start <= key[0] <= end and (keep is None or table.lower() in keep)
        }


# -- reading the output --------------------------------------------------------------------------


def _data_files(table_dir: Path) -> Iterator[Path]:
    for path in sorted(table_dir.rglob("*.parquet")):
        if not any(part.startswith(("_", ".")) for part in path.relative_to(table_dir).parts):
            yield path


def read_output(data: Path) -> Counter[Key]:
    """Every committed row under ``data`` (``<output-dir>/data``, the typed layout: one
    directory per table, ``batch=<id>`` below it), raw: a row written twice counts 2."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: Counter[Key] = Counter()
    if not data.is_dir():
        return rows
    columns = ["_commit_ts", "_server_transaction_id", "_record_sequence", "_mod_index"]
    for table_dir in sorted(data.iterdir()):
        if not table_dir.is_dir() or table_dir.name.startswith(("_", ".")) or "=" in table_dir.name:
            continue
        for path in _data_files(table_dir):
            t = pq.read_table(path, columns=columns)
            rows.update(
                zip(
                    t.column("_commit_ts").cast(pa.int64()).to_pylist(),
                    t.column("_server_transaction_id").to_pylist(),
                    t.column("_record_sequence").to_pylist(),
                    t.column("_mod_index").to_pylist(),
                    strict=True,
                )
            )
    return rows


def mark_path(data: Path, connector: str) -> Path:
    """The connector's completeness file: ``_shoal/<connector>/completeness.json``, else the
    shared ``_shoal/completeness.json`` of outputs written before marks were per connector."""
    own = data / "_shoal" / connector / "completeness.json"
    return own if own.exists() else data / "_shoal" / "completeness.json"


def read_mark(data: Path, connector: str) -> int | None:
    """The connector's completeness mark (``low_watermark_us``), or None: no file, or the
    shared file names another connector."""
    path = mark_path(data, connector)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if doc.get("connector", connector) != connector:
        return None
    return int(doc["low_watermark_us"])


# -- the checks ----------------------------------------------------------------------------------


def histogram(expected: Iterable[Key], output: Counter[Key]) -> Counter[int]:
    """How many expected rows the output holds 0, 1, 2, ... times."""
    return Counter(output[key] for key in expected)


def missing(hist: Counter[int]) -> int:
    return hist[0]


def more_than(hist: Counter[int], times: int) -> int:
    """Expected rows present more than ``times`` times."""
    return sum(n for copies, n in hist.items() if copies > times)


def false_complete(expected: Iterable[Key], output: Counter[Key], mark: int | None) -> int:
    """Rows the mark claims (commit timestamp at or before it) that the output lacks."""
    if mark is None:
        return 0
    return sum(1 for key in expected if key[0] <= mark and output[key] == 0)


def mark_below_end(mark: int | None, end: int) -> bool:
    """Whether a finished bounded run left its mark short of its ``--end-at`` (or none)."""
    return mark is None or mark < end


def reset_counts(
    before: set[Key], overlap: set[Key], output: Counter[Key], *, promised: bool
) -> dict[str, int]:
    """The documented reset's rows: ``before`` (``[T0, T1)``, only the second connector reads
    it) must be there once; ``overlap`` (``[T1, end]``, both read it) once or twice, twice being
    documented. ``promised``: the second run was not refused, so ``before`` is owed."""
    hb, ho = histogram(before, output), histogram(overlap, output)
    return {
        "before_T1_present": len(before) - missing(hb),
        "before_T1": len(before),
        "overlap_once": ho[1],
        "overlap_twice": ho[2],
        "lost": (missing(hb) if promised else 0) + missing(ho),
        "duplicates": more_than(hb, 1) + more_than(ho, 2),
    }


# -- running the command line --------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One run's connector, window and table filter."""

    connector: str
    start: int
    end: int
    tables: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Broker:
    name: str  # "embedded" or "persistent"
    bootstrap: str | None = None  # None: each run starts its own broker

    def args(self) -> list[str]:
        if self.bootstrap is None:
            return []
        return ["--kafka-bootstrap-servers", self.bootstrap, *_PERSISTENT_KAFKA]

    def suffix(self, tag: str) -> str:
        """A connector-name suffix that keeps the persistent broker's topics apart per
        scenario (the embedded one forgets them with each run)."""
        return "" if self.bootstrap is None else f"-{tag}"


@dataclass
class Run:
    label: str
    spec: Spec
    log: Path
    popen: subprocess.Popen[bytes]
    began: float
    exit_code: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    terminated: bool = False  # the bench sent SIGTERM
    seen: dict[int, int] = field(default_factory=dict)  # processes below it: pid -> start time

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "connector": self.spec.connector,
            "exit": self.exit_code,
            "seconds": round(self.seconds, 1),
            **({"timed_out": True} if self.timed_out else {}),
            **({"sigterm": True} if self.terminated else {}),
        }


class Runner:
    """Starts the command line's runs (each in its own session, its output in a log file) and
    kills every one still running, with everything below it, at :meth:`close`."""

    def __init__(self, sim: Sim, sink: str, logs: Path) -> None:
        self.sim = sim
        self.sink = sink
        self.logs = logs
        self._live: list[Run] = []
        self._names: Counter[str] = Counter()

    def command(self, spec: Spec, out: Path, broker: Broker) -> list[str]:
        tables = [] if spec.tables is None else ["--tables", ",".join(spec.tables)]
        return [
            sys.executable, "-m", "actors.runtime",
            "--connector", spec.connector,
            *self.sim.args(),
            "--sink", self.sink,
            "--output-dir", str(out),
            "--start-at", rfc3339(spec.start),
            "--end-at", rfc3339(spec.end),
            *tables,
            *broker.args(),
            "--progress", "off",
        ]  # fmt: skip

    def start(self, label: str, spec: Spec, out: Path, broker: Broker) -> Run:
        self._names[label] += 1
        name = label.replace("/", ".") + (
            f".{self._names[label]}" if self._names[label] > 1 else ""
        )
        log = self.logs / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
        )
        env["PYTHONUNBUFFERED"] = "1"
        command = self.command(spec, out, broker)
        with log.open("wb") as f:
            f.write(("$ " + " ".join(command) + "\n").encode())
            f.flush()
            popen = subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        run = Run(label, spec, log, popen, time.monotonic())
        self._live.append(run)
        return run

    def wait(self, run: Run, timeout_s: float) -> Run:
        """Wait for ``run`` to end by itself; past ``timeout_s`` it is killed (``timed_out``).
        Meanwhile every live run's processes are noted, so none outlives the bench."""
        deadline = run.began + timeout_s
        while run.exit_code is None and not run.timed_out:
            for live in self._live:
                live.seen.update(tree(live.popen.pid))
            try:
                run.exit_code = run.popen.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    run.timed_out = True
                    self._kill(run)
        run.seconds = time.monotonic() - run.began
        self._reap(run)
        if run in self._live:
            self._live.remove(run)
        return run

    def run(self, label: str, spec: Spec, out: Path, broker: Broker, timeout_s: float) -> Run:
        return self.wait(self.start(label, spec, out, broker), timeout_s)

    def terminate(self, run: Run) -> None:
        """SIGTERM the run's own process (as an operator would): it drains and exits."""
        run.terminated = True
        run.popen.send_signal(signal.SIGTERM)

    def _kill(self, run: Run) -> None:
        """SIGKILL the run and everything below it (its embedded broker leads a session of
        its own, so the run's process group is not enough)."""
        run.seen.update(tree(run.popen.pid))
        with suppress(ProcessLookupError):
            os.killpg(run.popen.pid, signal.SIGKILL)
        self._reap(run)
        run.popen.wait()

    def _reap(self, run: Run) -> None:
        """Kill what the run started and left behind (a run that ended stopped its children
        itself: normally nothing is left)."""
        for pid, started in run.seen.items():
            if start_time(pid) == started:  # that very process, not a reused pid
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for run in list(self._live):
            if run.popen.poll() is None:
                self._kill(run)
            self._reap(run)
        self._live.clear()


# -- the scenarios -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Windows:
    t0: int
    t1: int
    end: int
    end2: int

    def to_json(self) -> dict[str, str]:
        return {
            "T0": rfc3339(self.t0),
            "T1": rfc3339(self.t1),
            "E": rfc3339(self.end),
            "E2": rfc3339(self.end2),
        }


@dataclass
class Tally:
    lost: int = 0
    duplicates: int = 0
    false_complete: int = 0
    mark_below_end: int = 0
    silent_stuck: int = 0
    silent_skips: int = 0
    mark_went_back: int = 0  # told, not a failure: a lower mark claims less, nothing false
    failed_logs: list[str] = field(default_factory=list)
    marks: dict[tuple[Path, str], int] = field(default_factory=dict)  # the last seen

    def failed(self, run: Run) -> None:
        if str(run.log) not in self.failed_logs:
            self.failed_logs.append(str(run.log))


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, sim: Sim, windows: Windows) -> None:
        self.args = args
        self.work = work
        self.sim = sim
        self.windows = windows
        self.oracle = Oracle(sim)
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.runner = Runner(sim, args.sink, logs)
        self.tally = Tally()
        self.scenarios: dict[str, Any] = {}

    def out(self, label: str) -> Path:
        return self.work / label.replace("/", ".") / "out"

    def check_run(self, run: Run, out: Path) -> dict[str, Any]:
        """Scenario 4 after one run: the connector's mark against ``--end-at`` and the rows it
        claims. A refused run (exit 2) claims nothing."""
        detail = run.summary()
        if run.exit_code == 2:
            return detail
        data = out / "data"
        spec = run.spec
        mark = read_mark(data, spec.connector)
        expected = self.oracle.expected(spec.start, spec.end, spec.tables)
        claimed_missing = false_complete(expected, read_output(data), mark)
        detail["mark"] = None if mark is None else rfc3339(mark)
        detail["mark_minus_end_us"] = None if mark is None else mark - spec.end
        detail["false_complete"] = claimed_missing
        self.tally.false_complete += claimed_missing
        last = self.tally.marks.get((out, spec.connector))
        if mark is not None:
            if last is not None and mark < last:
                detail["mark_went_back_us"] = mark - last
                self.tally.mark_went_back += 1
            self.tally.marks[(out, spec.connector)] = mark
        bounded_done = run.exit_code == 0 and not run.terminated
        below = bounded_done and mark_below_end(mark, spec.end)
        if bounded_done:
            detail["mark_below_end"] = below
        if below:
            self.tally.mark_below_end += 1
        if claimed_missing or below or run.exit_code != 0 or run.timed_out:
            self.tally.failed(run)
        return detail

    def timeout(self, spec: Spec) -> float:
        """A bounded run's limit: the run timeout, plus the time until its end if ahead."""
        ahead = max(0.0, (spec.end - wall_micros()) / 1e6)
        return float(self.args.run_timeout_s) + ahead

    # 1 ------------------------------------------------------------------------------------------
    def two_connectors(self, broker: Broker, together: bool) -> None:
        order = "together" if together else "one_after_other"
        label = f"two_connectors/{broker.name}/{order}"
        w = self.windows
        tag = "t" if together else "s"
        a = Spec("ca" + broker.suffix(tag), w.t0, w.end, ("Albums",))
        b = Spec("cb" + broker.suffix(tag), w.t0, w.end, ("Singers",))
        out = self.out(label)
        runs: list[dict[str, Any]] = []
        if together:
            started = [self.runner.start(label, s, out, broker) for s in (a, b)]
            done = [self.runner.wait(r, self.timeout(r.spec)) for r in started]
            runs = [self.check_run(r, out) for r in done]
        else:
            done = []
            for s in (a, b):
                r = self.runner.run(label, s, out, broker, self.timeout(s))
                done.append(r)
                runs.append(self.check_run(r, out))
        output = read_output(out / "data")
        detail: dict[str, Any] = {"runs": runs}
        promised: set[Key] = set()
        for r in done:
            expected = self.oracle.expected(r.spec.start, r.spec.end, r.spec.tables)
            hist = histogram(expected, output)
            detail[f"{r.spec.connector} ({r.spec.tables[0] if r.spec.tables else '*'})"] = (
                f"{len(expected) - missing(hist)} of {len(expected)} rows"
            )
            if r.exit_code != 2:  # refused at start: promised nothing
                promised |= expected
        self._count(label, detail, promised, output, done)

    # 2 ------------------------------------------------------------------------------------------
    def reset(self, broker: Broker) -> None:
        label = f"reset/{broker.name}"
        w = self.windows
        first = Spec("orders" + broker.suffix("r"), w.t1, w.end)
        second = Spec("orders-2" + broker.suffix("r"), w.t0, w.end)
        out = self.out(label)
        done = [self.runner.run(label, s, out, broker, self.timeout(s)) for s in (first, second)]
        runs = [self.check_run(r, out) for r in done]
        output = read_output(out / "data")
        before = self.oracle.expected(w.t0, w.t1 - 1)
        overlap = self.oracle.expected(w.t1, w.end)
        counts = reset_counts(before, overlap, output, promised=done[1].exit_code != 2)
        self.tally.lost += counts["lost"]
        self.tally.duplicates += counts["duplicates"]
        if counts["lost"] or counts["duplicates"]:
            for r in done:
                self.tally.failed(r)
        self.scenarios[label] = {
            "runs": runs,
            **counts,
            "unexpected": _unexpected(output, before | overlap),
        }
        self._say(label, self.scenarios[label])

    # 3 ------------------------------------------------------------------------------------------
    def different_start(self, broker: Broker) -> bool:
        label = f"different_start/{broker.name}"
        w = self.windows
        first = Spec("restart" + broker.suffix("d"), w.t1, w.end)
        other = Spec(first.connector, w.t0, w.end)
        out = self.out(label)
        done = [self.runner.run(label, s, out, broker, self.timeout(s)) for s in (first, other)]
        runs = [self.check_run(r, out) for r in done]
        refused = done[1].exit_code == 2
        promised = self.oracle.expected(w.t1, w.end) if done[0].exit_code != 2 else set()
        if not refused:  # accepted: it promised its whole window
            promised |= self.oracle.expected(w.t0, w.end)
        output = read_output(out / "data")
        skipped = self.oracle.expected(w.t0, w.t1 - 1)
        skip_missing = missing(histogram(skipped, output))
        detail: dict[str, Any] = {"runs": runs, "refused": refused}
        if not refused:
            detail["earlier_window"] = f"{len(skipped) - skip_missing} of {len(skipped)} rows"
            self.tally.failed(done[1])
        if done[1].exit_code == 0 and skip_missing:
            self.tally.silent_skips += 1
            detail["silent_skip"] = True
        self._count(label, detail, promised, output, done)
        return refused

    # 5 ------------------------------------------------------------------------------------------
    def rerun(self) -> tuple[int | str, float]:
        label = "rerun/embedded"
        broker = Broker("embedded")
        out = self.out(label)
        now = wall_micros()
        past = int(self.args.window_s * 1e6)
        spec = Spec("rerun", max(self.windows.t0, now - past), now + int(self.args.live_s * 1e6))
        first = self.runner.start(label, spec, out, broker)
        committed = _wait_first_batch(out / "data", first, self.timeout(spec))
        if first.popen.poll() is None:
            self.runner.terminate(first)
        first = self.runner.wait(first, self.args.run_timeout_s + 30)
        runs = [{**self.check_run(first, out), "first_batch_seen": committed}]
        done = [first]
        for _ in range(2):
            r = self.runner.run(label, spec, out, broker, self.timeout(spec))
            done.append(r)
            runs.append(self.check_run(r, out))
        last = done[-1]
        output = read_output(out / "data")
        promised = self.oracle.expected(spec.start, spec.end)
        detail: dict[str, Any] = {"runs": runs, "end_at": rfc3339(spec.end)}
        self._count(label, detail, promised, output, done)
        if last.exit_code != 0:
            self.tally.failed(last)
        return ("killed" if last.exit_code is None else last.exit_code), round(last.seconds, 1)

    # 6 ------------------------------------------------------------------------------------------
    def corrupt_progress(self, kind: str) -> None:
        label = f"corrupt_progress/{kind}"
        broker = Broker("embedded")
        w = self.windows
        first = Spec("trunc", w.t0, w.t1)
        later = Spec("trunc", w.t0, w.end2)
        out = self.out(label)
        r1 = self.runner.run(label, first, out, broker, self.timeout(first))
        runs = [self.check_run(r1, out)]
        detail: dict[str, Any] = {"runs": runs}
        target = _progress_file(out / "data")
        if target is None:
            detail["error"] = "no progress file under _shoal/**/progress/ after the first run"
            self.tally.silent_stuck += 1
            self.tally.failed(r1)
            self.scenarios[label] = detail
            self._say(label, detail)
            return
        raw = target.read_bytes()
        target.write_bytes(raw[: len(raw) // 2] if kind == "half" else b"")
        detail["file"] = str(target.relative_to(out))
        detail["bytes"] = f"{len(raw)} -> {len(target.read_bytes())}"
        r2 = self.runner.run(label, later, out, broker, self.args.stuck_timeout_s)
        runs.append(self.check_run(r2, out))
        named = target.name in r2.text()
        output = read_output(out / "data")
        promised = self.oracle.expected(first.start, first.end)
        if r2.exit_code == 0:  # finished: it promised the later window too
            promised |= self.oracle.expected(later.start, later.end)
        later_missing = missing(histogram(self.oracle.expected(later.start, later.end), output))
        stuck = r2.timed_out or (not named and (r2.exit_code != 0 or later_missing > 0))
        detail["named"] = named
        detail["stuck"] = stuck
        if stuck:
            self.tally.silent_stuck += 1
            self.tally.failed(r2)
        if r2.exit_code == 0 and not named:
            detail["repair_logged"] = False
        self._count(label, detail, promised, output, [r1, r2])

    # --------------------------------------------------------------------------------------------
    def _count(
        self,
        label: str,
        detail: dict[str, Any],
        promised: set[Key],
        output: Counter[Key],
        done: list[Run],
    ) -> None:
        hist = histogram(promised, output)
        asked: set[Key] = set()
        for r in done:
            asked |= self.oracle.expected(r.spec.start, r.spec.end, r.spec.tables)
        detail["promised"] = len(promised)
        detail["lost"] = missing(hist)
        detail["duplicates"] = more_than(hist, 1)
        detail["unexpected"] = _unexpected(output, asked)
        self.tally.lost += detail["lost"]
        self.tally.duplicates += detail["duplicates"]
        if detail["lost"] or detail["duplicates"]:
            for r in done:
                self.tally.failed(r)
        self.scenarios[label] = detail
        self._say(label, detail)

    def _say(self, label: str, detail: dict[str, Any]) -> None:
        print(f"{label}:", flush=True)
        for key, value in detail.items():
            if key == "runs":
                for run in value:
                    print(f"    run {json.dumps(run)}", flush=True)
            else:
                print(f"    {key}: {value}", flush=True)


def _unexpected(output: Counter[Key], expected: set[Key]) -> int:
    """Rows in the output that no run of the scenario asked for (another table, outside every
    window)."""
    return sum(n for key, n in output.items() if key not in expected)


def _wait_first_batch(data: Path, run: Run, timeout_s: float) -> bool:
    """Wait until a micro-batch is committed (a ``<table>/batch=<id>`` directory) or the run
    ends; whether one was."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.popen.poll() is None:
        if any(p for p in data.glob("*/batch=*") if not p.parent.name.startswith(("_", "."))):
            return True
        time.sleep(0.05)
    return False


def _progress_file(data: Path) -> Path | None:
    """The progress file with the highest position (the partition the next run reads the
    longest from; the first when none reads as ``[position, ...]``)."""
    files = sorted(p for p in (data / "_shoal").glob("**/progress/*") if p.is_file())

    def position(path: Path) -> int:
        try:
            value = json.loads(path.read_bytes())
        except ValueError:
            return -1
        return int(value[0]) if isinstance(value, list) and value else -1

    return max(files, key=position) if files else None


@contextmanager
def _terminated_cleanly() -> Iterator[None]:
    """SIGTERM/SIGINT of the bench unwind it (so its runs and broker are stopped)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def outputstate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every scenario (see the module docstring); returns the figures."""
    from runtime.kafka.broker import EmbeddedBroker

    began = time.monotonic()
    step = int(args.window_s * 1e6)
    # every window but the re-run's lies in the stream's past when the runs start
    now = wall_micros()
    start_ts = args.sim_start_ts if args.sim_start_ts is not None else now - 5 * step - 10_000_000
    t0 = start_ts + 5_000_000
    windows = Windows(t0, t0 + step, t0 + 2 * step, t0 + 3 * step)
    if windows.end2 > now:
        raise ValueError(f"--sim-start-ts {start_ts}: the windows must end before now ({now})")
    sim = Sim(seed=args.sim_seed, start_ts=start_ts, roots=args.sim_roots)
    bench = Bench(args, work, sim, windows)
    print(f"work directory: {work}; sim seed {sim.seed}, start {rfc3339(start_ts)}", flush=True)
    persistent = EmbeddedBroker(log_path=work / "logs" / "persistent-broker.log")
    chosen = set(args.scenarios)
    rerun: tuple[int | str | None, float | None] = (None, None)
    refused: list[bool] = []
    try:
        brokers = [Broker("embedded")]
        if chosen & {"two_connectors", "reset", "different_start"}:
            persistent.start()
            brokers.append(Broker("persistent", persistent.bootstrap))
        for broker in brokers:
            if "two_connectors" in chosen:
                for together in (False, True):
                    bench.two_connectors(broker, together)
            if "reset" in chosen:
                bench.reset(broker)
            if "different_start" in chosen:
                refused.append(bench.different_start(broker))
        if "rerun" in chosen:
            rerun = bench.rerun()
        if "corrupt_progress" in chosen:
            for kind in args.corrupt:
                bench.corrupt_progress(kind)
    finally:
        bench.runner.close()
        persistent.stop()
    t = bench.tally
    return {
        "lost": t.lost,
        "duplicates": t.duplicates,
        "false_complete": t.false_complete,
        "mark_below_end": t.mark_below_end,
        "rerun_exit": rerun[0],
        "rerun_seconds": rerun[1],
        "silent_stuck": t.silent_stuck,
        "refused_start_ok": all(refused) if refused else None,
        "silent_skips": t.silent_skips,
        "mark_went_back": t.mark_went_back,
        "sink": args.sink,
        "scenarios_run": [s for s in SCENARIOS if s in chosen],
        "sim": asdict(sim),
        "windows": windows.to_json(),
        "scenarios": bench.scenarios,
        "failed_logs": t.failed_logs,
        "seconds": round(time.monotonic() - began, 1),
    }


def passed(result: dict[str, Any]) -> bool:
    """Every figure holds (``rerun_exit`` / ``refused_start_ok`` are None when their scenario
    was not chosen)."""
    ran = set(result["scenarios_run"])
    return bool(
        result["lost"]
        == result["duplicates"]
        == result["false_complete"]
        == result["mark_below_end"]
        == result["silent_stuck"]
        == result["silent_skips"]
        == 0
        and (result["rerun_exit"] == 0 or "rerun" not in ran)
        and (result["refused_start_ok"] is True or "different_start" not in ran)
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench outputstate", description=__doc__)
    parser.add_argument("--window-s", type=float, default=30.0, help="stream seconds per window")
    parser.add_argument("--live-s", type=float, default=20.0, help="re-run: end this far ahead")
    parser.add_argument("--sim-seed", type=int, default=32)
    parser.add_argument("--sim-roots", type=int, default=4)
    parser.add_argument(
        "--sim-start-ts",
        type=int,
        default=None,
        help="stream start, Unix micros (default: far enough back for every window)",
    )
    parser.add_argument("--sink", choices=("files", "spark"), default="files")
    parser.add_argument(
        "--corrupt",
        default="half,empty",
        help="progress-file damages to try: half (truncated), empty",
    )
    parser.add_argument(
        "--run-timeout-s",
        type=float,
        default=None,
        help="bound on one run (default: 120, --quick 90; with --sink spark 400: Spark's start)",
    )
    parser.add_argument(
        "--stuck-timeout-s",
        type=float,
        default=None,
        help="a run after a damaged progress file is killed (and counted stuck) past this "
        "(default: 90, --quick 40; with --sink spark 400)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--quick", action="store_true", help="10 s windows, one damage kind")
    args = parser.parse_args(argv)
    if args.quick:
        args.window_s, args.live_s, args.corrupt = 10.0, 10.0, "half"
    spark = args.sink == "spark"  # a local Spark takes a minute or more to start on 2 cores
    if args.run_timeout_s is None:
        args.run_timeout_s = 400.0 if spark else 90.0 if args.quick else 120.0
    if args.stuck_timeout_s is None:
        args.stuck_timeout_s = 400.0 if spark else 40.0 if args.quick else 90.0
    args.corrupt = [k for k in args.corrupt.split(",") if k]
    args.scenarios = [k for k in args.scenarios.split(",") if k]
    if bad := [k for k in args.scenarios if k not in SCENARIOS]:
        parser.error(f"--scenarios: unknown {bad}; use some of {', '.join(SCENARIOS)}")
    if bad := [k for k in args.corrupt if k not in ("half", "empty")]:
        parser.error(f"--corrupt: unknown {bad}; use half, empty")
    work = Path(tempfile.mkdtemp(prefix="shoal-outputstate-"))
    try:
        with _terminated_cleanly():
            result = outputstate(args, work)
    except SystemExit:
        print(f"outputstate: interrupted (work directory kept: {work})", file=sys.stderr)
        raise
    except Exception as exc:
        print(f"outputstate: {type(exc).__name__}: {exc} (work directory kept: {work})")
        return 1
    for key in ("lost", "duplicates", "false_complete", "mark_below_end", "rerun_exit"):
        print(f"{key:>18}: {result[key]}")
    for key in ("rerun_seconds", "silent_stuck", "refused_start_ok", "silent_skips", "seconds"):
        print(f"{key:>18}: {result[key]}")
    ok = passed(result)
    if not args.keep and ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory kept: {work}", file=sys.stderr)
    print(json.dumps({"scenario": "outputstate", **result}))
    return 0 if ok else 1
