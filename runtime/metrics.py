"""Prometheus metrics and health endpoints of a shoal process.

The runtime describes itself as a :class:`Sample` (plain frozen records, no client library); the
same sample feeds the live progress display and the metrics. :class:`MetricsServer` serves, on
one asyncio HTTP listener inside the runtime's own event loop:

* ``/metrics`` – the Prometheus text format of a private ``CollectorRegistry``: a collector
  turns the newest :class:`Sample` into metric families at scrape time (gauges and counters per
  task and per partition), plus histograms of rebalance durations (:meth:`observe_rebalance`)
  and of the event loop's lag (:meth:`observe_loop_lag`, measured by :mod:`runtime.looplag`);
* ``/healthz`` – 200 while the event loop answers, no component has failed, no task that was
  ready has been out of the heartbeat group longer than ``stuck_after_s``, and neither the sink
  has failed every batch nor the source every query for longer than ``failing_after_s``
  (:func:`liveness`), else 503: such a process should be restarted (or its sink or source fixed);
  a quarantined partition (docs/operations.md, Quarantined partitions) makes it answer 200
  ``degraded: ...``: a restart does not help, an operator releases it;
* ``/readyz`` – 200 once every task of the process has joined, replayed the sync topic and
  holds an epoch that lists it, and while it makes progress (the sink's and the source's last
  attempts did not all fail since their last success); 503 with the reason otherwise (and while
  shutting down).

The failure streaks are kept by :class:`FailureStreak`, a pure record the shells feed with the
outcome of every sink batch and source query (the time passed in).

Every metric is prefixed ``shoal_`` and labelled ``task`` (and ``partition``, ``kind``,
``actor`` where it says so); see ``docs/operations.md`` for the list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("shoal.metrics")

__all__ = [
    "FailureStreak",
    "MetricsServer",
    "Sample",
    "TaskSample",
    "build_registry",
    "describe_error",
    "failing",
    "liveness",
    "readiness",
]


class FailureStreak:
    """Whether every attempt (sink batch, source query) failed since some time: the start of the
    streak is the first failure after the last success. Pure: the caller passes ``now``
    (monotonic seconds)."""

    def __init__(self) -> None:
        self.since: float | None = None  # first failure after the last success
        self.failures = 0  # in the current streak
        self.last_error = ""

    def success(self, now: float) -> None:
        del now
        self.since = None
        self.failures = 0

    def failure(self, now: float, error: str) -> None:
        if self.since is None:
            self.since = now
        self.failures += 1
        self.last_error = error

    def failing_for(self, now: float) -> float:
        """Seconds every attempt has failed (0 while the last attempt since a failure worked)."""
        return 0.0 if self.since is None else max(1e-6, now - self.since)


def describe_error(exc: BaseException, limit: int = 200) -> str:
    """``Type: message`` on one line, cut at ``limit`` characters, for health reasons."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class TaskSample(msgspec.Struct, frozen=True, kw_only=True):
    """One task, as the runtime sees it at one moment."""

    task_id: str
    ready: bool = False
    member: bool = False
    out_of_group_s: float = 0.0  # since a ready task was last a member (0 while it is one)
    leader: str = ""
    generation: int = -1
    epoch: int = -1
    owned: int = 0
    reading: int = 0
    stuck: int = 0  # owned partitions not read for a while though they should be
    records_read: int = 0
    records_delivered: int = 0
    lag_us: dict[str, int] = {}  # partition token -> now minus its committed watermark
    rebalances: int = 0
    rebalancing: bool = False
    sync_messages: int = 0
    sync_bytes: int = 0
    errors: dict[str, int] = {}  # kind -> count
    mailboxes: dict[str, int] = {}  # actor name -> depth
    # owned partitions parked by the quarantine rule: token -> "at <watermark>: <error>"
    quarantined: dict[str, str] = {}


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """The whole process at one moment."""

    at: float  # monotonic seconds
    tasks: tuple[TaskSample, ...] = ()
    errors: dict[str, int] = {}  # process-level errors by kind (sink, source, ...)
    failed: str | None = None  # a component failed for good: the process is unhealthy
    stopping: bool = False
    sink_rows: int = 0  # rows the sink committed (written)
    sink_inflight: int = 0  # batches (Spark: micro-batches) handed over and not committed yet
    sink_commit_latency_s: float = 0.0  # Spark: oldest put of the last micro-batch to commit
    records_filtered: int = 0  # data-change records dropped by --tables/--exclude-tables/...
    records_filtered_by: dict[str, int] = {}  # records_filtered by rule (protocol/filters.py)
    records_columns_stripped: int = 0  # kept records with columns taken out (--exclude-columns)
    # the connector's completeness watermark (protocol/completeness.py), microseconds; -1: none
    low_watermark_us: int = -1
    # the connector's snapshot (protocol/snapshot.py): partitions done and in all (0, 0: none)
    snapshot_done: int = 0
    snapshot_total: int = 0
    sink_failing_s: float = 0.0  # every batch handed to the sink failed for this long (0: not)
    sink_error: str = ""  # the last sink failure of that streak
    source_failing_s: float = 0.0  # every source query failed for this long (0: not)
    source_error: str = ""
    # quarantined partitions of the whole connector (its CIM): the completeness mark is held
    # back by them (protocol/completeness.py, held_by)
    held_by: tuple[str, ...] = ()


def failing(sample: Sample) -> list[str]:
    """Why the process makes no progress now: a sink or source whose attempts all failed since
    their last success (empty when neither)."""
    out = []
    if sample.sink_failing_s > 0:
        out.append(
            f"the sink has failed every batch for {sample.sink_failing_s:.0f}s "
            f"(last: {sample.sink_error})"
        )
    if sample.source_failing_s > 0:
        out.append(
            f"the source has failed every query for {sample.source_failing_s:.0f}s "
            f"(last: {sample.source_error})"
        )
    return out


SampleProvider = Callable[[], Sample]


class _SampleCollector(Collector):
    def __init__(self, provider: SampleProvider) -> None:
        self._provider = provider

    def collect(self) -> Iterator[Any]:
        sample = self._provider()
        t = ("task",)
        owned = GaugeMetricFamily("shoal_owned_partitions", "Partitions the task owns", labels=t)
        reading = GaugeMetricFamily(
            "shoal_reading_partitions", "Partitions the task reads now", labels=t
        )
        read = CounterMetricFamily(
            "shoal_records_read", "Change records handed to the sink", labels=t
        )
        delivered = CounterMetricFamily(
            "shoal_records_delivered", "Change records whose batch the sink committed", labels=t
        )
        lag = GaugeMetricFamily(
            "shoal_partition_lag_seconds",
            "Now minus the partition's committed watermark",
            labels=("task", "partition"),
        )
        max_lag = GaugeMetricFamily(
            "shoal_max_lag_seconds", "Largest partition lag of the task", labels=t
        )
        epoch = GaugeMetricFamily("shoal_epoch", "Epoch in the task's CIM", labels=t)
        generation = GaugeMetricFamily(
            "shoal_generation", "Heartbeat-group generation the task is in", labels=t
        )
        leader = GaugeMetricFamily(
            "shoal_is_leader", "1 when the task is the group leader", labels=t
        )
        member = GaugeMetricFamily("shoal_is_member", "1 while the task is a member", labels=t)
        out_of_group = GaugeMetricFamily(
            "shoal_out_of_group_seconds",
            "Seconds since the (ready) task was last a group member; 0 while it is one",
            labels=t,
        )
        stuck = GaugeMetricFamily(
            "shoal_stuck_partitions",
            "Owned partitions whose watermark stood still too long though nothing should keep "
            "them from being read (details in the task's log)",
            labels=t,
        )
        rebalances = CounterMetricFamily(
            "shoal_rebalances", "Rebalances of the heartbeat group seen by the task", labels=t
        )
        sync_messages = CounterMetricFamily(
            "shoal_sync_messages", "Messages the task appended to the sync topic", labels=t
        )
        sync_bytes = CounterMetricFamily(
            "shoal_sync_bytes", "Bytes the task appended to the sync topic", labels=t
        )
        errors = CounterMetricFamily("shoal_errors", "Errors by kind", labels=("task", "kind"))
        quarantined = GaugeMetricFamily(
            "shoal_quarantined_partitions",
            "Partitions the task owns that the quarantine rule parked (read by nobody until "
            "released: docs/operations.md)",
            labels=t,
        )
        mailbox = GaugeMetricFamily(
            "shoal_mailbox_depth",
            "Messages waiting in an actor's mailbox",
            labels=("task", "actor"),
        )
        for task in sample.tasks:
            key = [task.task_id]
            owned.add_metric(key, task.owned)
            reading.add_metric(key, task.reading)
            read.add_metric(key, task.records_read)
            delivered.add_metric(key, task.records_delivered)
            for token, us in task.lag_us.items():
                lag.add_metric([task.task_id, token], us / 1e6)
            max_lag.add_metric(key, max(task.lag_us.values(), default=0) / 1e6)
            epoch.add_metric(key, task.epoch)
            generation.add_metric(key, task.generation)
            leader.add_metric(key, 1.0 if task.leader == task.task_id else 0.0)
            member.add_metric(key, 1.0 if task.member else 0.0)
            out_of_group.add_metric(key, task.out_of_group_s)
            stuck.add_metric(key, task.stuck)
            quarantined.add_metric(key, len(task.quarantined))
            rebalances.add_metric(key, task.rebalances)
            sync_messages.add_metric(key, task.sync_messages)
            sync_bytes.add_metric(key, task.sync_bytes)
            for kind, n in sorted(task.errors.items()):
                errors.add_metric([task.task_id, kind], n)
            for actor, depth in sorted(task.mailboxes.items()):
                mailbox.add_metric([task.task_id, actor], depth)
        for kind, n in sorted(sample.errors.items()):
            errors.add_metric(["", kind], n)
        sink_rows = CounterMetricFamily("shoal_sink_rows", "Rows the sink committed")
        sink_rows.add_metric([], sample.sink_rows)
        inflight = GaugeMetricFamily(
            "shoal_sink_inflight_batches", "Batches handed to the sink and not committed yet"
        )
        inflight.add_metric([], sample.sink_inflight)
        latency = GaugeMetricFamily(
            "shoal_sink_commit_latency_seconds",
            "Spark: from the oldest record of the last micro-batch being handed over to its commit",
        )
        latency.add_metric([], sample.sink_commit_latency_s)
        filtered = CounterMetricFamily(
            "shoal_records_filtered",
            "Change records dropped by the table and mod-type filters (re-reads counted again); "
            "their commit timestamps still advance the watermarks",
        )
        filtered.add_metric([], sample.records_filtered)
        by_rule = CounterMetricFamily(
            "shoal_records_filtered_by_rule",
            "shoal_records_filtered by the rule that dropped them: table, mod_type, "
            "system_transaction, transaction_tag",
            labels=["rule"],
        )
        for rule, count in sorted(sample.records_filtered_by.items()):
            by_rule.add_metric([rule], count)
        stripped = CounterMetricFamily(
            "shoal_records_columns_stripped",
            "Kept change records whose columns --exclude-columns took out (re-reads counted again)",
        )
        stripped.add_metric([], sample.records_columns_stripped)
        complete = GaugeMetricFamily(
            "shoal_low_watermark_seconds",
            "The connector's completeness watermark (Unix seconds): every change committed at or "
            "before it is durably in the output (absent until the connector has partitions)",
        )
        if sample.low_watermark_us >= 0:
            complete.add_metric([], sample.low_watermark_us / 1e6)
        snapshot = GaugeMetricFamily(
            "shoal_snapshot_partitions",
            "Partitions of the connector's snapshot (docs/mirror.md), by state: done (read to "
            "their end) and total (absent without a snapshot)",
            labels=["state"],
        )
        if sample.snapshot_total:
            snapshot.add_metric(["done"], sample.snapshot_done)
            snapshot.add_metric(["total"], sample.snapshot_total)
        sink_failing = GaugeMetricFamily(
            "shoal_sink_failing_seconds",
            "Seconds every batch handed to the sink has failed (0 once one commits)",
        )
        sink_failing.add_metric([], sample.sink_failing_s)
        source_failing = GaugeMetricFamily(
            "shoal_source_failing_seconds",
            "Seconds every change-stream query has failed (0 once one answers)",
        )
        source_failing.add_metric([], sample.source_failing_s)
        ready = GaugeMetricFamily("shoal_ready", "1 when /readyz answers 200")
        ready.add_metric([], 1.0 if readiness(sample)[0] else 0.0)
        yield from (
            owned,
            reading,
            read,
            delivered,
            lag,
            max_lag,
            epoch,
            generation,
            leader,
            member,
            out_of_group,
            stuck,
            quarantined,
            rebalances,
            sync_messages,
            sync_bytes,
            errors,
            mailbox,
            sink_rows,
            inflight,
            latency,
            filtered,
            by_rule,
            stripped,
            complete,
            snapshot,
            sink_failing,
            source_failing,
            ready,
        )


def liveness(
    sample: Sample, stuck_after_s: float, failing_after_s: float = float("inf")
) -> tuple[bool, str]:
    """(alive, reason): nothing failed for good, no task has been out of the heartbeat group
    for longer than ``stuck_after_s`` (a rebalance takes seconds; a task that cannot rejoin, for
    example because its Kafka client is wedged, holds no partitions and never will), and neither
    the sink nor the source has failed every attempt for longer than ``failing_after_s``."""
    if sample.failed is not None:
        return False, f"failed: {sample.failed}"
    if sample.sink_failing_s > failing_after_s or sample.source_failing_s > failing_after_s:
        return False, "; ".join(failing(sample))
    for task in sample.tasks:
        if task.out_of_group_s > stuck_after_s:
            return False, (
                f"task {task.task_id} has been out of the group for {task.out_of_group_s:.0f}s"
            )
    parked = [
        f"{token} ({why})" for task in sample.tasks for token, why in task.quarantined.items()
    ]
    if parked:
        # alive (a restart does not help): an operator releases them (docs/operations.md)
        return True, "degraded: quarantined partitions: " + "; ".join(sorted(parked))
    return True, "ok"


def readiness(sample: Sample) -> tuple[bool, str]:
    """(ready, reason): every task joined and holds an epoch that lists it."""
    if sample.failed is not None:
        return False, f"failed: {sample.failed}"
    if sample.stopping:
        return False, "shutting down"
    stalled = failing(sample)
    if stalled:
        return False, "not making progress: " + "; ".join(stalled)
    if not sample.tasks:
        return False, "no task started yet"
    for task in sample.tasks:
        if not task.ready:
            return False, f"task {task.task_id} is still replaying the sync topic"
        if not task.member:
            return False, f"task {task.task_id} is not a group member"
        if task.epoch < 0:
            return False, f"task {task.task_id} has no epoch yet"
    return True, "ready"


def build_registry(provider: SampleProvider) -> tuple[CollectorRegistry, Histogram]:
    """A private registry reading ``provider`` at scrape time, and the rebalance histogram."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SampleCollector(provider))
    histogram = Histogram(
        "shoal_rebalance_duration_seconds",
        "From a task seeing a rebalance start until its CIM holds the new epoch",
        labelnames=("task",),
        buckets=(0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60),
        registry=registry,
    )
    return registry, histogram


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` over HTTP/1.1 (one request per connection).

    ``async with MetricsServer(provider, host, port) as server:``; ``server.port`` is the bound
    port (useful with ``port=0``)."""

    def __init__(
        self,
        provider: SampleProvider,
        host: str = "127.0.0.1",
        port: int = 0,
        stuck_after_s: float = 120.0,
        failing_after_s: float = float("inf"),
    ) -> None:
        self._provider = provider
        self.stuck_after_s = stuck_after_s
        self.failing_after_s = failing_after_s
        self._host = host
        self._port = port
        self.registry, self._rebalance = build_registry(provider)
        self._loop_lag = Histogram(
            "shoal_event_loop_lag_seconds",
            "How much later than asked the event loop woke a 100 ms timer (a stall delays every "
            "actor of the process, heartbeats and lease checks included)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4),
            registry=self.registry,
        )
        self._server: asyncio.Server | None = None
        self.requests = 0

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the metrics server is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def observe_rebalance(self, task_id: str, seconds: float) -> None:
        self._rebalance.labels(task=task_id).observe(seconds)

    def observe_loop_lag(self, seconds: float) -> None:
        self._loop_lag.observe(seconds)

    async def __aenter__(self) -> MetricsServer:
        try:
            self._server = await asyncio.start_server(self._serve, self._host, self._port)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot serve metrics on {self._host}:{self._port}: {exc.strerror}"
            ) from exc
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                request = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            parts = request.decode("latin-1").split()
            method, path = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            status, ctype, body = self.respond(method, path.split("?", 1)[0])
            self.requests += 1
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + (body if method != "HEAD" else b""))
            await writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            log.debug("metrics request dropped: %r", exc)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError as exc:
                log.debug("metrics connection closed badly: %r", exc)

    def respond(self, method: str, path: str) -> tuple[str, str, bytes]:
        """(status line, content type, body) for one request."""
        text = "text/plain; charset=utf-8"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", text, b"only GET\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/healthz":
            ok, reason = liveness(self._provider(), self.stuck_after_s, self.failing_after_s)
            return ("200 OK" if ok else "503 Service Unavailable"), text, f"{reason}\n".encode()
        if path == "/readyz":
            ok, reason = readiness(self._provider())
            return ("200 OK" if ok else "503 Service Unavailable"), text, f"{reason}\n".encode()
        return "404 Not Found", text, b"try /metrics, /healthz or /readyz\n"
