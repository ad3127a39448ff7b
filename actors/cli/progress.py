"""The live progress display and the end-of-run summary.

:class:`Progress` turns successive :class:`runtime.metrics.Sample` values into text:

* on a terminal (``live=True``) it redraws a small table in place: per task its partitions
  (owned / reading), records/s, records delivered, the largest lag, the epoch and a ``*`` for
  the leader; rebalances are printed above the table as they happen;
* otherwise it prints one line per interval and one line per rebalance, fit for a log file.

While the sink fails every batch or the source every query, both say so and why
(``NOT MAKING PROGRESS: ...``, :func:`runtime.metrics.failing`); a partition the quarantine
rule parked is named too (``QUARANTINED: ...``, docs/operations.md).

Pure formatting: it never reads a clock (the sample carries its time) and writes only to the
stream it was given.
"""

from __future__ import annotations

from typing import TextIO

import msgspec

from runtime.metrics import Sample, TaskSample, failing

__all__ = ["Progress", "RunSummary", "format_summary", "format_table"]


def _lag(us: int) -> str:
    s = us / 1e6
    return f"{s:.1f}s" if s < 100 else f"{s / 60:.0f}m"


def format_table(sample: Sample, rates: dict[str, float]) -> list[str]:
    rows = [
        f"{'task':<14} {'owned':>5} {'read':>5} {'rec/s':>8} {'delivered':>10} {'max lag':>8} "
        f"{'epoch':>5} {'leader':>6}"
    ]
    for t in sample.tasks:
        lag = _lag(max(t.lag_us.values(), default=0)) if t.lag_us else "-"
        state = "*" if t.leader == t.task_id else ("" if t.member else "(out)")
        if t.rebalancing:
            state += " rebal"
        rows.append(
            f"{t.task_id:<14} {t.owned:>5} {t.reading:>5} {rates.get(t.task_id, 0.0):>8.0f} "
            f"{t.records_delivered:>10} {lag:>8} {t.epoch:>5} {state:>6}"
        )
    total = sum(rates.values())
    delivered = sum(t.records_delivered for t in sample.tasks)
    owned = sum(t.owned for t in sample.tasks)
    rows.append(f"{'all':<14} {owned:>5} {'':>5} {total:>8.0f} {delivered:>10}")
    sink = f"sink: {sample.sink_rows} rows committed, {sample.sink_inflight} batch(es) in flight"
    if sample.sink_commit_latency_s:
        sink += f", last commit {sample.sink_commit_latency_s:.1f}s after its oldest record"
    rows.append(sink)
    if sample.snapshot_total:
        rows.append(f"snapshot: {_snapshot(sample)}")
    rows.extend(f"NOT MAKING PROGRESS: {why}" for why in failing(sample))
    rows.extend(f"QUARANTINED: {why}" for why in _quarantined(sample))
    return rows


def _quarantined(sample: Sample) -> list[str]:
    return [
        f"{token} on {t.task_id} {why}"
        for t in sample.tasks
        for token, why in sorted(t.quarantined.items())
    ]


def _snapshot(sample: Sample) -> str:
    done, total = sample.snapshot_done, sample.snapshot_total
    return f"{done}/{total} partitions done" + (" (complete)" if done >= total else "")


class Progress:
    def __init__(self, stream: TextIO, *, live: bool) -> None:
        self._stream = stream
        self._live = live
        self._last: Sample | None = None
        self._drawn = 0

    def update(self, sample: Sample) -> None:
        events: list[str] = []
        rates = self._rates(sample)
        self._last = sample
        if self._live:
            out = []
            if self._drawn:
                out.append(f"\x1b[{self._drawn}F\x1b[J")  # up and clear what we drew
            out += [e + "\n" for e in events]
            table = format_table(sample, rates)
            out += [r + "\n" for r in table]
            self._stream.write("".join(out))
            self._drawn = len(table)
        else:
            for e in events:
                self._stream.write(e + "\n")
            parts = [
                f"{t.task_id}: {t.owned}p {rates.get(t.task_id, 0.0):.0f}/s "
                f"lag {_lag(max(t.lag_us.values(), default=0))} e{t.epoch}"
                f"{'*' if t.leader == t.task_id else ''}"
                for t in sample.tasks
            ]
            delivered = sum(t.records_delivered for t in sample.tasks)
            stalled = "".join(f" | NOT MAKING PROGRESS: {why}" for why in failing(sample))
            stalled += "".join(f" | QUARANTINED: {why}" for why in _quarantined(sample))
            snapshot = f" | snapshot {_snapshot(sample)}" if sample.snapshot_total else ""
            self._stream.write(
                f"progress: delivered {delivered} | {' | '.join(parts)}{snapshot}{stalled}\n"
            )
        self._stream.flush()

    def message(self, text: str) -> None:
        """A line above the live table (or just a line)."""
        if self._live and self._drawn:
            self._stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0
        self._stream.write(text + "\n")
        self._stream.flush()

    def _rates(self, sample: Sample) -> dict[str, float]:
        last = self._last
        if last is None or sample.at <= last.at:
            return {}
        before = {t.task_id: t.records_delivered for t in last.tasks}
        dt = sample.at - last.at
        return {
            t.task_id: (t.records_delivered - before.get(t.task_id, 0)) / dt for t in sample.tasks
        }


class PartitionEnd(msgspec.Struct, frozen=True):
    token: str
    status: str  # owned | finished | incoming
    watermark: int
    owner: str


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a run did; printed at the end and written by ``--summary-json``."""

    connector: str
    source: str
    sink: str
    output_dir: str
    seconds: float
    tasks: tuple[TaskSample, ...]
    records_read: int
    records_delivered: int
    rows_written: int | None  # rows the sink wrote (files sink), if it knows
    produced_records: int | None  # records the source produced up to the end (when known)
    produced_rows: int | None
    stream_start: int | None  # the simulated stream's start (Unix micros)
    stream_end: int | None  # bounded simulated runs: the stream time the run caught up to
    caught_up: bool | None
    drained: bool
    reason: str  # why it stopped: duration, max-records, signal, error
    partitions: tuple[PartitionEnd, ...] = ()
    epoch: int = -1
    leader: str = ""
    rebalances: int = 0
    errors: dict[str, int] = {}
    records_filtered: int = 0  # dropped by the record filters (protocol/filters.py)
    records_filtered_by: dict[str, int] = {}  # records_filtered by rule (table, mod_type, ...)
    records_columns_stripped: int = 0  # kept records with columns taken out (--exclude-columns)
    warnings: dict[str, int] = {}  # e.g. filters that match no table, a start in the future
    # --sink spark: micro-batches with rows written by Spark's typed write, the Spark jobs they
    # ran, and the seconds from the first record handed to Spark to the last commit
    spark_writes: int | None = None
    spark_jobs: int | None = None
    sink_write_s: float | None = None
    # of those seconds, summed over the micro-batches: building them ("prepare"), Spark's write
    # ("write") and the commit ("commit"; Delta commits, progress files, manifest), and of the
    # commit: "commit_check" (before its commit point), "commit_manifest", "commit_apply" (Delta
    # commits, progress files and the clean-up) and of that "commit_clean" (staging, manifest)
    sink_phase_s: dict[str, float] = {}
    # the connector's snapshot at the end (docs/mirror.md): partitions done and in all
    snapshot_done: int = 0
    snapshot_total: int = 0
    # how late the event loop woke a 100 ms timer over the run (runtime/looplag.py): the 99th
    # percentile of the last 10 minutes and the largest
    loop_lag_p99_s: float = 0.0
    loop_lag_max_s: float = 0.0


def format_summary(s: RunSummary) -> str:
    rate = s.records_delivered / s.seconds if s.seconds > 0 else 0.0
    lines = [
        f"shoal run summary ({s.reason}, {s.seconds:.1f}s, connector {s.connector!r})",
        f"  source {s.source} -> sink {s.sink} ({s.output_dir})",
        f"  records read {s.records_read}, delivered {s.records_delivered} ({rate:.0f}/s)",
    ]
    if s.produced_records is not None:
        lines.append(
            f"  produced by the source: {s.produced_records} records, {s.produced_rows} rows"
            + (f"; caught up: {'yes' if s.caught_up else 'NO'}" if s.caught_up is not None else "")
        )
    if s.rows_written is not None:
        lines.append(f"  rows written: {s.rows_written}")
    if s.spark_writes:
        lines.append(f"  Spark jobs: {s.spark_jobs} for {s.spark_writes} micro-batches with rows")
    if s.records_filtered:
        rules = ", ".join(f"{k} {v}" for k, v in s.records_filtered_by.items() if v)
        lines.append(
            f"  records filtered out: {s.records_filtered}" + (f" ({rules})" if rules else "")
        )
    if s.records_columns_stripped:
        lines.append(f"  records with columns taken out: {s.records_columns_stripped}")
    if s.snapshot_total:
        done = s.snapshot_done == s.snapshot_total
        lines.append(
            f"  snapshot: {s.snapshot_done}/{s.snapshot_total} partitions done"
            + (" (complete)" if done else "")
        )
    lines.append(
        f"  epoch {s.epoch}, leader {s.leader or '-'}, rebalances seen {s.rebalances}, "
        f"partitions {sum(1 for p in s.partitions if p.status != 'finished')} live / "
        f"{sum(1 for p in s.partitions if p.status == 'finished')} finished"
    )
    lines.extend(
        f"  {t.task_id}: {t.owned} partitions at the end, {t.records_delivered} delivered"
        for t in s.tasks
    )
    if s.errors:
        lines.append("  errors: " + ", ".join(f"{k}={v}" for k, v in sorted(s.errors.items())))
    if s.warnings:
        lines.append("  warnings: " + ", ".join(f"{k}={v}" for k, v in sorted(s.warnings.items())))
    lines.append(
        f"  event loop lag: p99 {s.loop_lag_p99_s * 1000:.0f} ms, "
        f"max {s.loop_lag_max_s * 1000:.0f} ms"
    )
    lines.append(f"  drained cleanly: {'yes' if s.drained else 'NO'}")
    return "\n".join(lines)
