"""``python -m bench chaos``: tasks as separate processes, killed, restarted and frozen, against
the embedded Kafka-compatible broker and the Cloud Spanner emulator with partition churn.

* The harness starts the broker and the emulator (partitions end every ``--churn-s`` seconds:
  real splits and merges), then ``--tasks`` processes of ``python -m actors.runtime`` (one task
  each, ``--source spanner`` at the emulator, ``--sink files`` into one shared directory).
* Once an epoch is settled, a seeded load generator commits transactions for ``--duration``
  seconds, while every few seconds a random fault hits: ``kill -9`` of a task (restarted a few
  seconds later under the same id), ``kill -9`` of the current leader, or ``SIGSTOP`` of a task
  for longer than its session timeout and ``SIGCONT`` after (a zombie).
* An observer replays the sync topic into its own CIM all along: it counts epochs (rebalances)
  and the longest time any live partition's committed watermark stood still ("unread").
* At the end the load stops, the tasks catch up and are stopped with SIGTERM (graceful drain);
  the parquet output, read raw as a plain reader sees it (no de-duplication; files under
  directories starting with ``_`` or ``.`` are skipped, as Spark and pyarrow skip them), is
  compared with what the load generator committed: ``lost`` (committed, never delivered),
  ``duplicates`` (changes delivered more often than committed) and
  ``duplicates_dropped_by_identity`` (raw rows whose identity (commit timestamp, transaction id,
  record sequence, mod index) an earlier row already had: what a reader would have to
  de-duplicate) must all be 0: the output is exactly-once (docs/design.md#exactly-once-output).
* When records were lost (or with ``--reread``), the run's stretch of the stream is read again,
  one plain query per partition over the past (``reread``): ``missing`` counts what even that
  read lacks, ``lost_but_served`` what it has of what shoal lost.

Last line: ``{"scenario": "chaos", "committed": .., "delivered": .., "lost": .., "duplicates":
.., "duplicates_dropped_by_identity": .., "max_unread_s": .., "rebalances": .., "unread_stretches":
{"stretches": .., "p50_s": .., "p99_s": .., "over_12s": ..}, ..}`` (a stretch: the time between
two moves of one live partition's watermark). ``--quick`` runs two minutes of faults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import aclosing
from pathlib import Path
from typing import Any

from protocol import messages
from protocol.cim import Cim

CONNECTOR = "chaos"
LONG_S = 12.0  # an unread stretch longer than this is told in full (the goal's bound)


class TaskProcess:
    """One ``python -m actors.runtime`` task process."""

    def __init__(self, task_id: str, args: list[str], logs: Path) -> None:
        self.task_id = task_id
        self.args = args
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.stopped = False  # SIGSTOPped

    def start(self) -> None:
        self.starts += 1
        log = open(self.logs / f"{self.task_id}.{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actors.runtime", "--task-id", self.task_id, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.stopped:
            self.signal(signal.SIGCONT)
            self.stopped = False
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def terminate(self, timeout: float) -> int | None:
        if self.stopped:
            self.signal(signal.SIGCONT)
            self.stopped = False
        self.signal(signal.SIGTERM)
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


class Observer:
    """Replays the sync topic into a CIM: epochs, leader, and how long watermarks stood still."""

    def __init__(self) -> None:
        self.cim = Cim()
        self.epochs = 0
        self.bad = 0
        self.advanced: dict[str, float] = {}  # token -> when its watermark last moved
        self.watermark: dict[str, int] = {}
        self.max_unread_s = 0.0
        # every stretch a live partition's watermark stood still, in seconds, once it moved on
        # (while measuring): the worst is one number; how often a stretch is long is these
        self.stalls: list[float] = []
        self.long: list[tuple[str, float, float]] = []  # (token, from, to) of those over 12 s
        self.worst = ""
        self.t0 = time.monotonic()
        self.faults: list[tuple[float, str, str]] = []  # (seconds into the run, kind, task)
        self.measuring = True
        self.worst_at = 0.0  # seconds into the run when the worst stall ended or was seen
        self.worst_from = 0.0  # seconds into the run when the worst partition last advanced
        # what the sync topic said about each partition (who holds it, how; who it is offered
        # to) and the epochs, with seconds into the run: the worst stall's story is cut from it
        self.holders: dict[str, str] = {}
        self.history: dict[str, list[tuple[float, str]]] = {}
        self.epoch_log: list[tuple[float, int, str, tuple[str, ...]]] = []

    def apply(self, offset: int, payload: bytes) -> None:
        try:
            message = messages.decode(payload)
        except messages.SyncDecodeError:
            self.bad += 1
            return
        before = self.cim.epoch
        self.cim.apply(offset, message)
        now = time.monotonic()
        if self.cim.epoch != before:
            self.epochs += 1
            self.epoch_log.append(
                (round(now - self.t0, 1), self.cim.epoch, self.cim.leader, self.cim.members)
            )
        live: set[str] = set()
        holders: dict[str, list[str]] = {}
        for task, view in self.cim.tasks.items():
            member = task in self.cim.members
            for token, part in view.partitions.items():
                holders.setdefault(token, []).append(
                    f"{task}{'' if member else '(gone)'}:{part.status}@{part.watermark}"
                )
            for token, share in view.share.items():
                holders.setdefault(token, []).append(
                    f"{task}->{share.target}:{share.kind}{':released' if share.released else ''}"
                )
        for token, said in holders.items():
            text = " ".join(sorted(said))
            if self.holders.get(token) != text:
                self.holders[token] = text
                self.history.setdefault(token, []).append((round(now - self.t0, 1), text))
        for task in self.cim.members:
            for token, part in self.cim.view(task).partitions.items():
                if part.status == "finished":
                    continue
                live.add(token)
                if part.watermark > self.watermark.get(token, -1):
                    self.watermark[token] = part.watermark
                    if token in self.advanced and self.measuring:
                        self.stalls.append(now - self.advanced[token])
                        if now - self.advanced[token] > LONG_S:
                            self.long.append((token, self.advanced[token] - self.t0, now - self.t0))
                    self.advanced[token] = now
                self.advanced.setdefault(token, now)
        for token in list(self.advanced):
            if token not in live and self._finished(token):
                del self.advanced[token]

    def _finished(self, token: str) -> bool:
        found = self.cim.find(token)
        return found is None or found.status == "finished"

    def sample(self) -> None:
        if not self.measuring:
            return  # the run is over (tasks are being stopped): nothing is read any more
        now = time.monotonic()
        for token, at in self.advanced.items():
            if now - at > self.max_unread_s:
                self.max_unread_s = now - at
                self.worst = token
                self.worst_at = round(now - self.t0, 1)
                self.worst_from = round(at - self.t0, 1)

    def stall_summary(self, over: float = 12.0) -> dict[str, float | int]:
        """How long watermarks stood still between two moves: how many stretches, their median
        and 99th percentile, and how many were longer than ``over`` seconds."""
        stalls = sorted(self.stalls)
        if not stalls:
            return {"stretches": 0, "p50_s": 0.0, "p99_s": 0.0, f"over_{over:g}s": 0}

        def at(q: float) -> float:
            return round(stalls[min(len(stalls) - 1, int(q * len(stalls)))], 1)

        return {
            "stretches": len(stalls),
            "p50_s": at(0.5),
            "p99_s": at(0.99),
            f"over_{over:g}s": sum(1 for x in stalls if x > over),
        }

    def worst_story(self) -> list[str]:
        """What happened around the worst stall, in order: the worst partition's holders as the
        sync topic named them, the faults and the epochs, from 15 s before it began to its end."""
        return self.story(self.worst, self.worst_from, self.worst_at)

    def long_stories(self, limit: int = 8) -> list[list[str]]:
        """The story (:meth:`story`) of each stretch over 12 s, the longest first."""
        longest = sorted(self.long, key=lambda s: s[1] - s[2])[:limit]
        return [
            [f"{token[:12]}: {round(hi - lo, 1)} s", *self.story(token, round(lo, 1), round(hi, 1))]
            for token, lo, hi in longest
        ]

    def story(self, token: str, start: float, end: float) -> list[str]:
        """What happened to ``token`` from 15 s before ``start`` to ``end`` (seconds into the
        run): its holders as the sync topic named them, the faults and the epochs."""
        lo, hi = start - 15.0, end + 1.0
        lines = [(t, f"partition: {text}") for t, text in self.history.get(token, [])]
        lines += [(t, f"fault: {kind} {task}") for t, kind, task in self.faults]
        lines += [
            (t, f"epoch {epoch}: leader {leader}, members {' '.join(members)}")
            for t, epoch, leader, members in self.epoch_log
        ]
        return [f"{t:7.1f} {text}" for t, text in sorted(lines) if lo <= t <= hi]


async def observe(bootstrap: str, observer: Observer, stop: asyncio.Event) -> None:
    from runtime.kafka import KafkaConfig, KafkaSyncLog

    config = KafkaConfig.embedded(bootstrap)
    async with KafkaSyncLog(config, CONNECTOR) as log, aclosing(log.read(0)) as reader:
        reading = asyncio.ensure_future(anext(reader))
        while not stop.is_set():
            done, _ = await asyncio.wait({reading}, timeout=0.5)
            if done:
                offset, payload = reading.result()
                observer.apply(offset, payload)
                reading = asyncio.ensure_future(anext(reader))
            observer.sample()
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await reading


def read_output(directory: Path) -> tuple[Counter[tuple[int, str, str, int]], int, int]:
    """(delivered (commit_ts, table, mod_type, key) after de-duplication, rows, duplicate rows
    dropped by identity) of the output under ``directory`` (the tasks' ``--output-dir``), in
    either layout (``bench.output``)."""
    from bench.output import read_changes

    seen: set[tuple[int, str, str, int]] = set()
    out: Counter[tuple[int, str, str, int]] = Counter()
    rows = dropped = 0
    for change in read_changes(directory / "data"):
        rows += 1
        if change.identity in seen:
            dropped += 1
            continue
        seen.add(change.identity)
        out[(change.commit_ts, change.table, change.mod_type, change.key)] += 1
    return out, rows, dropped


async def chaos(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from runtime.kafka.broker import EmbeddedBroker
    from runtime.spanner.emulator import SpannerEmulator
    from runtime.spanner.loadgen import LoadGenerator

    rng = random.Random(args.seed)
    output = work / "output"
    logs = work / "logs"
    logs.mkdir(parents=True)
    emulator = SpannerEmulator(partition_alive_s=args.churn_s)
    await asyncio.to_thread(emulator.start)
    out: dict[str, Any] = {}
    try:
        async with EmbeddedBroker() as broker:
            cfg = emulator.config
            task_args = [
                "--connector", CONNECTOR,
                "--source", "spanner",
                "--spanner-emulator-host", emulator.host,
                "--spanner-project", cfg.project,
                "--spanner-instance", cfg.instance,
                "--spanner-database", cfg.database,
                "--spanner-change-stream", cfg.change_stream,
                "--sink", "files",
                "--output-dir", str(output),
                "--kafka-bootstrap-servers", broker.bootstrap,
                "--kafka-session-timeout-ms", str(args.session_timeout_ms),
                "--kafka-heartbeat-interval-ms", str(args.heartbeat_interval_ms),
                "--progress", "off",
                "--log-level", args.task_log_level,
                "--drain-timeout", "20",
                "--stuck-after-s", "20",
            ]  # fmt: skip
            if args.query_window_s is not None:
                task_args += ["--spanner-query-window-s", str(args.query_window_s)]
            tasks = [TaskProcess(f"c{i}", task_args, logs) for i in range(args.tasks)]
            observer = Observer()
            stop_observing = asyncio.Event()
            emulator_cores: list[float] = []
            async with asyncio.TaskGroup() as tg:
                tg.create_task(observe(broker.bootstrap, observer, stop_observing))
                tg.create_task(sample_cpu(emulator.pid, emulator_cores, stop_observing))
                for t in tasks:
                    t.start()
                deadline = time.monotonic() + 90
                while observer.cim.epoch < 0 or len(observer.cim.members) < args.tasks:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"no settled epoch with {args.tasks} members after 90 s "
                            f"(members {observer.cim.members}); logs in {logs}"
                        )
                    await asyncio.sleep(0.5)
                out["settled_s"] = round(time.monotonic() - (deadline - 90), 1)
                await asyncio.sleep(2.0)
                loader = await LoadGenerator.connect(cfg, emulator.tables, seed=args.seed)
                try:
                    load = tg.create_task(loader.run(args.rate, duration_s=args.duration))
                    if args.no_faults:
                        await asyncio.sleep(args.duration)
                        faults: Counter[str] = Counter()
                    else:
                        faults = await inject_faults(tasks, observer, rng, args.duration)
                    committed = await load
                    out["faults"] = faults
                    out["commits"] = committed
                    # Heal: every task running, then let them catch up past the last commit.
                    for t in tasks:
                        if t.stopped:
                            t.signal(signal.SIGCONT)
                            t.stopped = False
                        if not t.alive():
                            t.start()
                    expected = loader.expected_mods()
                    last_commit = max((c.commit_ts for c in loader.committed), default=0)
                    caught = await catch_up(observer, last_commit, args.catch_up_s)
                    observer.sample()
                    observer.measuring = False
                    out["caught_up"] = caught
                    if not caught:
                        out["cim_when_not_caught_up"] = describe(observer.cim, last_commit)
                finally:
                    await loader.close()
                exits = [t.terminate(30) for t in tasks]
                out["exit_codes"] = exits
                stop_observing.set()
            delivered, rows, dropped = read_output(output)
            lost = expected - delivered
            if loader.committed and (lost or args.reread):
                # Did the emulator serve what shoal lost? Read the run's stretch of the stream
                # again, one plain query per partition (no windows, nobody else reading).
                first_commit = min(c.commit_ts for c in loader.committed)
                out["reread"] = await reread(
                    cfg, first_commit - 1_000_000, last_commit, expected, lost
                )
            extra = delivered - expected
            out.update(
                committed=sum(expected.values()),
                delivered=sum(delivered.values()),
                rows_written=rows,
                duplicates_dropped_by_identity=dropped,
                lost=sum(lost.values()),
                duplicates=sum(extra.values()),
                lost_examples=[list(k) for k in list(lost)[:5]],
                max_unread_s=round(observer.max_unread_s, 1),
                unread_stretches=observer.stall_summary(),
                worst_partition=observer.worst[:12],
                worst_unread_seen_at_s=observer.worst_at,
                worst_unread_from_s=observer.worst_from,
                worst_unread_story=observer.worst_story(),
                long_unread_stories=observer.long_stories(),
                fault_log=observer.faults,
                rebalances=observer.epochs,
                bad_sync_messages=observer.bad,
                task_starts={t.task_id: t.starts for t in tasks},
                emulator_cores_per_minute=emulator_cores,
            )
    finally:
        await asyncio.to_thread(emulator.stop)
    return out


async def reread(
    cfg: Any,
    start_ts: int,
    end_ts: int,
    expected: Counter[tuple[int, str, str, int]],
    lost: Counter[tuple[int, str, str, int]],
) -> dict[str, Any]:
    """Read ``[start_ts, end_ts]`` of the emulator's change stream again after the run, every
    partition with one query to its end (``walk_stream``), and compare with what was committed:
    ``missing`` (committed, not served by this read either: the emulator's doing) and, of what
    shoal lost, how many this read did serve (``lost_but_served``: shoal's doing) with the
    partition that served each."""
    from runtime.spanner.loadgen import expected_from_records
    from runtime.spanner.reader import SpannerSource, walk_stream

    served_by: dict[tuple[int, str, str, int], str] = {}

    def note(token: str, batch: Any) -> None:
        for key in expected_from_records([r for r in batch if hasattr(r, "mods")]):
            if key in lost:
                served_by[key] = token

    t0 = time.monotonic()
    async with await SpannerSource.connect(cfg) as source:
        walked = await walk_stream(source, start_ts, end_ts, concurrency=8, on_batch=note)
    served = expected_from_records(walked.data)
    missing = expected - served
    return {
        "seconds": round(time.monotonic() - t0, 1),
        "partitions": len(walked.partitions),
        "records": len(walked.data),
        "missing": sum(missing.values()),
        "missing_examples": [list(k) for k in list(missing)[:5]],
        "extra": sum((served - expected).values()),
        "lost_but_served": sum((lost & served).values()),
        "lost_served_by": [[*k, v] for k, v in served_by.items()][:5],
    }


async def sample_cpu(pid: int, out: list[float], stop: asyncio.Event) -> None:
    """The cores process ``pid`` used in each minute until ``stop`` (the emulator's: its
    partition queries scan the change stream's whole table every 100 ms, so its cost grows with
    the data written, docs/benchmarks.md)."""
    from bench.common import cpu_seconds

    while not stop.is_set():
        c0, t0 = cpu_seconds(pid), time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 60.0)
        out.append(round((cpu_seconds(pid) - c0) / (time.monotonic() - t0), 2))


async def inject_faults(
    tasks: list[TaskProcess], observer: Observer, rng: random.Random, duration: float
) -> Counter[str]:
    """Random faults for ``duration`` seconds; returns what was done."""
    done: Counter[str] = Counter()
    observer.faults = []
    end = time.monotonic() + duration
    pending: list[tuple[float, str, TaskProcess]] = []  # (when, action, task)
    next_fault = time.monotonic() + rng.uniform(4, 8)
    while time.monotonic() < end:
        now = time.monotonic()
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            _, action, task = item
            if action == "restart" and not task.alive():
                task.start()
            elif action == "cont" and task.stopped:
                task.signal(signal.SIGCONT)
                task.stopped = False
        if now >= next_fault:
            busy = {p[2].task_id for p in pending}
            idle = [t for t in tasks if t.alive() and t.task_id not in busy and not t.stopped]
            if len(idle) >= 2:
                kind = rng.choice(["kill", "kill", "kill-leader", "pause"])
                if kind == "kill-leader" and observer.cim.leader in {t.task_id for t in idle}:
                    victim = next(t for t in idle if t.task_id == observer.cim.leader)
                else:
                    kind = "kill" if kind == "kill-leader" else kind
                    victim = rng.choice(idle)
                if kind == "pause":
                    victim.signal(signal.SIGSTOP)
                    victim.stopped = True
                    pending.append((now + rng.uniform(5, 9), "cont", victim))
                else:
                    victim.kill()
                    pending.append((now + rng.uniform(2, 6), "restart", victim))
                done[kind] += 1
                observer.faults.append((round(now - observer.t0, 1), kind, victim.task_id))
            next_fault = now + rng.uniform(6, 12)
        await asyncio.sleep(0.2)
    return done


async def catch_up(observer: Observer, last_commit: int, timeout: float) -> bool:
    """Until every unfinished partition the CIM knows is owned by a member (no offer waiting)
    and its resume point (committed watermark, else its start) is past the last commit: a child
    partition that started after the last commit holds none of the load, read or not (with
    churn, new ones keep appearing; their watermark is 0 until their first commit)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cim = observer.cim
        unfinished: dict[str, int] = {}
        owned: set[str] = set()
        for task, view in cim.tasks.items():
            for token, part in view.partitions.items():
                if part.status != "finished":
                    unfinished[token] = max(unfinished.get(token, -1), part.resume_ts())
                    if part.status == "owned" and task in cim.members:
                        owned.add(token)
            for token, offer in view.share.items():
                if cim.find(token) is None or cim.find(token).status != "finished":  # type: ignore[union-attr]
                    unfinished.setdefault(token, offer.partition.resume_ts())
        if unfinished and set(unfinished) <= owned and min(unfinished.values()) > last_commit:
            return True
        await asyncio.sleep(1.0)
    return False


def describe(cim: Cim, last_commit: int) -> dict[str, Any]:
    """The observer's CIM, briefly: who holds what, how far behind the last commit."""
    return {
        "epoch": cim.epoch,
        "leader": cim.leader,
        "members": list(cim.members),
        "tasks": {
            task: {
                "partitions": {
                    t[:12]: [p.status, round((last_commit - p.resume_ts()) / 1e6, 1)]
                    for t, p in view.partitions.items()
                },
                "offers": {t[:12]: [o.target, o.kind, o.released] for t, o in view.share.items()},
            }
            for task, view in cim.tasks.items()
        },
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench chaos", description=__doc__)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--rate", type=float, default=20.0, help="commits per second")
    parser.add_argument("--churn-s", type=int, default=6, help="emulator partition lifetime")
    parser.add_argument("--catch-up-s", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--no-faults", action="store_true", help="baseline: the load, no faults")
    parser.add_argument("--task-log-level", default="warning", help="log level of the tasks")
    parser.add_argument(
        "--session-timeout-ms",
        type=int,
        default=4000,
        help="the tasks' group session timeout (default: what the embedded broker gets)",
    )
    parser.add_argument(
        "--heartbeat-interval-ms",
        type=int,
        default=500,
        help="the tasks' heartbeat interval (default: what the embedded broker gets)",
    )
    parser.add_argument(
        "--query-window-s",
        type=float,
        default=None,
        help="the tasks' --spanner-query-window-s (default: theirs, 5 s against the emulator)",
    )
    parser.add_argument(
        "--reread",
        action="store_true",
        help="read the stream again after the run and compare (always done when records are lost)",
    )
    parser.add_argument("--quick", action="store_true", help="two minutes of faults")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = 120.0
    if args.tasks < 2:
        parser.error("--tasks must be at least 2")
    work = Path(tempfile.mkdtemp(prefix="shoal-chaos-"))
    try:
        import uvloop

        result = uvloop.run(chaos(args, work))
    except Exception as exc:
        print(f"chaos: {type(exc).__name__}: {exc} (work directory kept: {work})", file=sys.stderr)
        return 1
    for key, value in result.items():
        if key == "worst_unread_story":
            print(f"{key:>32}:", *value, sep="\n    ")
        elif key == "long_unread_stories":
            print(f"{key:>32}:")
            for story in value:
                print(*story, sep="\n    ")
        else:
            print(f"{key:>32}: {value}")
    print(
        json.dumps(
            {
                "scenario": "chaos",
                **{
                    k: result[k]
                    for k in (
                        "committed",
                        "delivered",
                        "lost",
                        "duplicates",
                        "duplicates_dropped_by_identity",
                        "max_unread_s",
                        "rebalances",
                    )
                },
                "unread_stretches": result["unread_stretches"],
                "faults": dict(result["faults"]),
                "caught_up": result["caught_up"],
                **({"reread": result["reread"]} if "reread" in result else {}),
            }
        )
    )
    if not args.keep and result["lost"] == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory kept: {work}", file=sys.stderr)
    clean = result["lost"] == result["duplicates"] == result["duplicates_dropped_by_identity"] == 0
    return 0 if clean else 1
