"""One shoal process: Kafka (embedded or real), a change-stream source, a sink, N task nodes,
metrics and progress, and the way it ends. :class:`Pipeline` holds the run's lifecycle; the parts
are built by ``actors/cli/wiring.py``, and why the run ends is ``protocol/ending.py``'s rule.

:class:`Pipeline` runs in phases:

1. **start** – the embedded broker (unless ``kafka.bootstrap_servers`` names a real Kafka), the
   source (simulator, emulator with a write load, or Spanner), the sink, the metrics server, then
   every task node in its own task (``TaskNode`` over ``KafkaSyncLog`` + ``KafkaMembership``);
2. **run** – until ``protocol.ending.decide`` says so: ``duration`` passed, ``max_records`` were
   delivered, ``end_at`` was read to, or a stop was requested (SIGINT/SIGTERM), unless a part
   failed for good first; the progress display and the rebalance tracker sample every node;
3. **catch up** (bounded runs of the simulator or the emulator) – the stream is closed at the
   current time (the simulator's clock stops, the write load ends) and the run waits until the
   sink committed every record produced up to then, so the output equals what was produced;
4. **drain** – every task stops taking new work (:class:`GatedSource` makes every further read
   wait), its readers let in-flight batches commit and report their final watermark, which the
   task publishes to the sync topic; the run waits until each task reads its final state back;
5. **leave** – the nodes leave the group and stop, then the sink, the source and the broker.

Phases 3–5 together are bounded by ``drain_timeout``. The result is a :class:`RunSummary`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, assert_never, cast

from actors.cli import wiring
from actors.cli.completeness import OutputRecords, rfc3339
from actors.cli.config import (
    ConfigError,
    ShoalConfig,
    end_micros,
    is_url,
    kafka_config,
    record_filter,
    secret_values,
    start_micros,
)
from actors.cli.ports import Ledger, RunFailed, WatchedSource
from actors.cli.progress import PartitionEnd, Progress, RunSummary
from actors.cli.selfcheck import CommitTally, Sums, expect, missing_from
from actors.cli.summary import summarize
from actors.cli.wiring import (
    LocalTask,
    check_output_dir,
    check_output_store,
    default_task_ids,
    stream_params,
)
from actors.embed import drain_node
from actors.node import EmptyWindow, SnapshotConflict, StartConflict
from actors.task import wall_micros
from protocol import ending, epochs
from protocol.cim import final_states
from protocol.completeness import held_by, low_watermark
from protocol.messages import SnapshotItem
from protocol.records import DataChange
from protocol.retry import may_drive
from protocol.stream_options import StreamOptions
from runtime.files.sink import FileSink
from runtime.filtered import FilterStats
from runtime.logs import mask
from runtime.looplag import LoopLag, watch_loop
from runtime.metrics import FailureStreak, MetricsServer, Sample, TaskSample
from runtime.ports import (
    ChangeStreamSource,
    Sink,
    Unrecoverable,
)

if TYPE_CHECKING:
    from runtime.kafka import KafkaConfig

# (imported from here by the entry point and the tests)
__all__ = [
    "Ledger",
    "Pipeline",
    "RunFailed",
    "WatchedSource",
    "check_output_dir",
    "check_output_store",
    "default_task_ids",
    "stream_params",
]

log = logging.getLogger("shoal.runtime")

# How the run waits for its end (``protocol/ending.py`` decides): it looks again when a fact may
# have changed (a stop, a delivery, a port's failure, a task's step), at most once per _SETTLE_S
# (a busy run's changes come in streams), at the next time a fact changes by time alone, and at
# least every _FALLBACK_S for the facts nothing announces (a sync log's failure, the broker's exit).
_SETTLE_S = 0.05
_FALLBACK_S = 1.0

_ERROR_COUNTERS = (
    "reader_failed",
    "publish_failed",
    "membership_lost",
    "evicted",
    "quarantined",
    "quarantine_released",
)


class Pipeline:
    def __init__(
        self,
        config: ShoalConfig,
        *,
        stop: asyncio.Event,
        out: TextIO,
        live: bool = False,
        sink: Sink | None = None,
        source: ChangeStreamSource | None = None,
    ) -> None:
        """``sink`` and ``source``, when given, replace the ones ``config`` names (an embedding
        application's own ports, or a test's)."""
        self.config = config
        self._secrets = secret_values(config)  # masked in the health reasons
        self._given_sink = sink
        self._given_source = source
        self.stop = stop
        self.out = out
        self.progress: Progress | None = None
        if config.run.progress == "on" or (config.run.progress == "auto" and live):
            self.progress = Progress(out, live=live)
        self.tasks: list[LocalTask] = []
        self.metrics: MetricsServer | None = None
        self.loop_lag = LoopLag()
        self.errors: dict[str, int] = {}
        self.warnings: dict[str, int] = {}  # runs that will produce nothing, and the like
        self.failed: str | None = None
        self.stopping = False
        self.started_at = time.monotonic()
        self._now: Callable[[], int] = wall_micros
        self._cap: int | None = None  # simulated stream closed at this time
        self._model: Any = None
        self._loadgen: Any = None
        self._load_stop = asyncio.Event()
        self._draining = asyncio.Event()
        self._changed = asyncio.Event()  # a fact of the run's end may have changed
        self._stream_start: int | None = None
        self._kill_on_abort: list[Callable[[], None]] = []
        self._expected_records: int | None = None
        self._expected_rows: int | None = None
        self._ledger: Ledger | None = None
        self._file_sink: FileSink | None = None
        self._source: WatchedSource | None = None
        self._bootstrap = ""
        self._bridge: Any = None  # runtime.spark.SparkBridge with --sink spark
        self._broker: Any = None  # runtime.kafka.broker.EmbeddedBroker, when this run started it
        self._bounded = config.run.duration is not None or config.run.max_records is not None
        self._start_at = start_micros(config.run)  # None: now
        self._end_at = end_micros(config.run)  # None: no end
        self._filter = record_filter(config)
        self._filtered: Any = None  # runtime.filtered.FilteredSource, with a filter
        # a Spanner source's settings (its snapshots are read through them), and its snapshots
        self._spanner_config: Any = None  # runtime.spanner.config.SpannerConfig
        # the change stream's own options, read once at start (None: not read or no stream)
        self.stream_options: StreamOptions | None = None
        self._snapshots: Any = None  # runtime.spanner.snapshot_source.SpannerSnapshots
        # the output (a directory or an object store's URI) and a local directory for run
        # files (the embedded broker's log): the output directory itself when it is local
        self._output_url = is_url(config.run.output_dir)
        self.output_dir = (
            Path(tempfile.mkdtemp(prefix="shoal-run-"))
            if self._output_url
            else Path(config.run.output_dir)
        )
        # the connector's own records beside a file or Spark output (runtime/output_state.py)
        self._records = OutputRecords(config.run.connector, self.count_error)

    # -- the sample every observer reads ---------------------------------------------------------
    def sample(self) -> Sample:
        now = self._now()
        tasks = []
        for t in self.tasks:
            node = t.node
            if node.task is None:
                tasks.append(TaskSample(task_id=t.task_id))
                continue
            st = node.status()
            errors = {k: v for k, v in st.counters.items() if k in _ERROR_COUNTERS}
            errors.update({k: v for k, v in st.counters.items() if k.startswith("sync_bad.")})
            sink = t.sink.statistics()
            if sink.batches_failed:
                errors["sink_batch_failed"] = sink.batches_failed
            membership = node.membership
            rebalancing = epochs.rebalancing(
                membership is not None and membership.rebalance_in_progress,
                st.member,
                st.epoch,
                st.generation,
            )
            stats = t.sync_log.statistics() if t.sync_log is not None else None
            if stats is not None and stats.fragments_dropped:
                errors["sync_fragments_dropped"] = stats.fragments_dropped
            tasks.append(
                TaskSample(
                    task_id=t.task_id,
                    ready=node.ready.is_set(),
                    member=st.member,
                    out_of_group_s=st.out_of_group_s if node.ready.is_set() else 0.0,
                    stuck=st.stuck,
                    leader=st.leader,
                    generation=st.generation,
                    epoch=st.epoch,
                    owned=st.owned,
                    reading=st.reading,
                    records_read=sink.records_read,
                    records_delivered=sink.records_delivered,
                    lag_us={tok: max(0, now - wm) for tok, wm in st.watermarks.items() if wm > 0},
                    quarantined=st.quarantined,
                    rebalances=t.rebalances,
                    rebalancing=rebalancing,
                    sync_messages=stats.appends if stats is not None else 0,
                    sync_bytes=stats.appended_bytes if stats is not None else 0,
                    errors=errors,
                    mailboxes={m.name: m.depth for m in st.mailboxes},
                )
            )
        rows, inflight, latency = self._sink_figures()
        filtered = FilterStats(0, 0) if self._filtered is None else self._filtered.statistics()
        at = time.monotonic()
        sink_health = self._ledger.health if self._ledger is not None else FailureStreak()
        source_health = self._source.health if self._source is not None else FailureStreak()
        complete = -1
        snapshot = (0, 0)
        held: tuple[str, ...] = ()
        for t in self.tasks:
            if t.node.task is not None and t.node.ready.is_set():
                found = low_watermark(t.node.task.core.cim, self._end_at)
                complete = -1 if found is None else found
                snapshot = t.node.task.core.cim.snapshot.progress()
                held = held_by(t.node.task.core.cim)
                break
        return Sample(
            at=at,
            low_watermark_us=complete,
            held_by=held,
            snapshot_done=snapshot[0],
            snapshot_total=snapshot[1],
            tasks=tuple(tasks),
            errors=dict(self.errors),
            failed=self.failed,
            stopping=self.stopping,
            sink_rows=rows,
            sink_inflight=inflight,
            sink_commit_latency_s=latency,
            records_filtered=filtered.records_filtered,
            records_filtered_by=filtered.filtered_by,
            records_columns_stripped=filtered.columns_stripped,
            sink_failing_s=sink_health.failing_for(at),
            sink_error=mask(sink_health.last_error, self._secrets),
            source_failing_s=source_health.failing_for(at),
            source_error=mask(source_health.last_error, self._secrets),
        )

    def _sink_figures(self) -> tuple[int, int, float]:
        """(rows committed, batches in flight, last commit latency) of the shared sink."""
        if self._bridge is not None:
            spark = self._bridge.stats()
            return spark.rows_committed, spark.inflight, spark.last_commit_latency_s
        if self._file_sink is not None:
            files = self._file_sink.statistics()
            return files.rows, len(self._file_sink.waiting()), 0.0
        ledger = self._ledger
        return (ledger.rows if ledger is not None else 0), 0, 0.0

    def abort(self) -> None:
        """Kill the child processes this run started (the broker, the emulator) at once; for
        a second signal, just before the process exits without draining."""
        for kill in reversed(self._kill_on_abort):
            try:
                kill()
            except Exception as exc:
                sys.stderr.write(f"shoal: could not stop a child process: {exc}\n")

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def warn(self, kind: str, text: str) -> None:
        """One warning line in the log, counted in the summary's warnings by ``kind``."""
        self.warnings[kind] = self.warnings.get(kind, 0) + 1
        log.warning("%s", text)

    # -- the run ---------------------------------------------------------------------------------
    async def run(self) -> RunSummary:
        cfg = self.config
        reason = "error"
        caught_up: bool | None = None
        drained = False
        partitions: tuple[PartitionEnd, ...] = ()
        final: Sample | None = None
        # a bad --output-dir: before the broker and Spark
        if self._output_url:
            await asyncio.to_thread(check_output_store, self._sink_dir())
        else:
            check_output_dir(self.output_dir)
        async with AsyncExitStack() as stack:
            await self._start_parts(stack)
            self._say(
                f"shoal: connector {cfg.run.connector!r}, {len(self.tasks)} task(s), "
                f"source {cfg.run.source}, sink {cfg.run.sink} -> {self._sink_dir()}"
            )
            async with asyncio.TaskGroup() as group:
                nodes = [
                    group.create_task(self._run_task(t), name=f"node:{t.task_id}")
                    for t in self.tasks
                ]
                sampler = group.create_task(self._sample_loop(), name="sampler")
                observe = self.metrics.observe_loop_lag if self.metrics is not None else None
                lag_watch = group.create_task(
                    watch_loop(self.loop_lag, observe=observe), name="loop-lag"
                )
                if self._loadgen is not None:
                    group.create_task(self._load_loop(), name="loadgen")
                relay = group.create_task(self._relay_stop(), name="stop-relay")
                reason = await self._wait_for_end()
                try:
                    async with asyncio.timeout(cfg.run.drain_timeout):
                        if reason == "end-at":
                            caught_up = await self._window_complete()
                        elif self._bounded and reason != "signal" and self._alone():
                            caught_up = await self._catch_up()
                        self.stopping = True
                        self._load_stop.set()
                        for t in self.tasks:
                            t.gate.close()
                        self._draining.set()
                        await asyncio.gather(*(t.done.wait() for t in self.tasks))
                        drained = all(t.drained for t in self.tasks)
                except TimeoutError:
                    self.count_error("drain_timeout")
                    self._say(
                        f"shoal: the drain took longer than {cfg.run.drain_timeout:.0f}s; "
                        "stopping anyway (a restart resumes from the last published state)"
                    )
                final = self.sample()
                await self._records.record_mark(final.low_watermark_us, final.held_by, final=True)
                partitions = self._partitions()
                self._draining.set()
                for t, node in zip(self.tasks, nodes, strict=True):
                    t.gate.close()
                    if not t.done.is_set():
                        node.cancel()  # gave up on its drain: leave the group now
                self._load_stop.set()
                sampler.cancel()
                lag_watch.cancel()
                relay.cancel()
            self._say("shoal: tasks left the group")
        return self._summary(reason, caught_up, drained, partitions, final or self.sample())

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            self.out.write(text + "\n")
            self.out.flush()

    def _sink_dir(self) -> str:
        if self.config.run.sink == "kafka":
            return self._output_topic()
        if self._output_url:
            return f"{self.config.run.output_dir.rstrip('/')}/data"
        return str(self.output_dir / "data")

    def _output_topic(self) -> str:
        return self.config.kafka.output_topic or f"{self.config.run.connector}_output"

    # -- components ------------------------------------------------------------------------------
    async def _start_parts(self, stack: AsyncExitStack) -> None:
        """Kafka (first: fail fast, before starting Spark), the output's recorded start, the
        sink (Spark takes seconds: before the stream), the source, the metrics server and the
        task nodes (``actors/cli/wiring.py`` builds each), entered in ``stack``."""
        cfg = self.config
        bootstrap, broker = await wiring.start_kafka(stack, cfg, self.output_dir, self._say)
        self._bootstrap = bootstrap
        if broker is not None:
            self._broker = broker
            self._kill_on_abort.append(broker.kill)
        kafka = kafka_config(cfg, bootstrap)
        from runtime.kafka import KafkaSyncLog

        first_log = await wiring.reach(
            stack,
            lambda: KafkaSyncLog(kafka, cfg.run.connector),
            f"Kafka at {kafka.bootstrap_servers}",
            timeout_s=cfg.run.connect_timeout,
            stop=self.stop,
            count_error=self.count_error,
        )
        await self._check_output_start()  # before Spark: a refused start fails at once
        sink = await self._start_sink(stack, kafka)
        raw_source = await self._start_source(stack)
        routed = raw_source
        if self._spanner_config is not None:
            routed, self._snapshots = wiring.snapshot_routing(
                stack,
                raw_source,
                self._spanner_config,
                keeps_table=self._filter.keeps_table,
                chunk_rows=cfg.run.snapshot_chunk_rows,
                item=self._snapshot_item,
                done=self._snapshot_done,
            )
        bounded, self._filtered = wiring.bound_and_filter(
            routed,
            cfg,
            start_at=self._start_at,
            end_at=self._end_at,
            keep=self._filter,
            stream_options=self.stream_options,
            stream=self._spanner_config.change_stream if self._spanner_config else "",
        )
        source = self._source = WatchedSource(bounded, changed=self._notice)
        await wiring.warn_empty(
            raw_source,
            cfg,
            keep=self._filter,
            start_at=self._start_at,
            now=self._now(),
            warn=self.warn,
        )
        if cfg.run.metrics_port is not None:
            self.metrics = await stack.enter_async_context(
                MetricsServer(
                    self.sample,
                    cfg.run.metrics_host,
                    cfg.run.metrics_port,
                    stuck_after_s=cfg.run.health_out_of_group_s,
                    failing_after_s=cfg.health.failing_s,
                )
            )
            self._say(f"metrics: {self.metrics.url}/metrics (and /healthz, /readyz)")
        self.tasks = await wiring.make_tasks(
            stack,
            cfg,
            kafka,
            source,
            sink,
            first_log,
            stream_start=self._task_stream_start(),
            start_at=self._start_at,
            end_at=self._end_at,
            output_start=self._records.started_before,
            stream_options=self.stream_options,
            snapshots=self._snapshots,
            on_change=self._notice,
            loop_lag=self.loop_lag.recent,
        )

    async def _start_source(self, stack: AsyncExitStack) -> ChangeStreamSource:
        """The given source, else the one the options name; what the run keeps of it."""
        if self._given_source is not None:
            return self._given_source
        parts = await wiring.start_source(
            stack,
            self.config,
            start_at=self._start_at,
            cap=lambda: self._cap,
            say=self._say,
            count_error=self.count_error,
            kill_on_abort=self._kill_on_abort,
        )
        self._spanner_config = parts.spanner
        self.stream_options = parts.stream_options
        self._model = parts.model
        self._loadgen = parts.loadgen
        if parts.clock is not None:
            self._now = parts.clock
        if parts.stream_start is not None:
            self._stream_start = parts.stream_start
        return parts.source

    async def _start_sink(self, stack: AsyncExitStack, kafka: KafkaConfig) -> Sink:
        """The given sink, else the one the options name, wrapped in the run's :class:`Ledger`:
        with the tally of what was committed, per partition, for the self-check of a simulated
        stream or the emulator's write load only (on a real database nothing reads it)."""
        if self._given_sink is not None:
            self._ledger = Ledger(self._given_sink, check=self._bounded, changed=self._notice)
            return self._ledger
        parts = await wiring.start_sink(
            stack,
            self.config,
            kafka,
            sink_dir=self._sink_dir(),
            output_topic=self._output_topic(),
            permit=self._leased,
            leads=self._leads,
            mark=self._records.mark,
            say=self._say,
        )
        self._file_sink, self._bridge = parts.file_sink, parts.bridge
        checks = self.config.run.source != "spanner" or self._given_source is not None
        check = checks and (self._bounded or self._end_at is not None)
        self._ledger = Ledger(parts.sink, check=check, changed=self._notice)
        return self._ledger

    def _task_stream_start(self) -> int:
        """Where the tasks start a connector the sync topic has no start of: ``start_at``; else
        where the output remembers this connector first started (a sync topic that is new, an
        embedded broker's after a restart, starts there too, and each partition resumes from
        its progress file, rather than at "now" with a gap before it); else the simulated
        stream's start; else -1 (now)."""
        if self._start_at is not None:
            return self._start_at
        recorded = self._records.start_recorded
        if recorded is not None:
            return recorded.start_us
        return self._stream_start if self._stream_start is not None else -1

    def _snapshot_item(self, token: str) -> tuple[SnapshotItem, int] | None:
        """A snapshot partition's description, from any task's consolidated state."""
        for t in self.tasks:
            task = t.node.task
            if task is None:
                continue
            state = task.core.cim.snapshot
            item = state.item(token)
            if item is not None and state.plan is not None:
                return item, state.plan.chunk_rows
        return None

    def _snapshot_done(self, token: str) -> bool:
        """Whether any task's consolidated state records the snapshot partition done."""
        return any(
            t.node.task is not None and t.node.task.core.cim.snapshot.done(token)
            for t in self.tasks
        )

    def _leased(self) -> bool:
        """Whether every task of this process that reads partitions holds a valid lease: the
        file sink checks it right before each commit point (a micro-batch may hold any of
        their partitions), so a zombie whose lease ran out commits nothing
        (docs/design.md#exactly-once-output)."""
        return all(
            task.permit()
            for task in (t.node.task for t in self.tasks)
            if task is not None and task.readers
        )

    def _leads(self) -> bool:
        """Whether a task of this process leads the heartbeat group now (with a valid lease):
        its process drives the shared retry queue (one driver among the processes)."""
        return may_drive(
            (task.core.me, task.core.leader, task.permit())
            for task in (t.node.task for t in self.tasks)
            if task is not None
        )

    # -- phases ----------------------------------------------------------------------------------
    async def _run_task(self, t: LocalTask) -> None:
        try:
            await self._run_node(t)
        except StartConflict as exc:
            raise ConfigError(self._conflict(exc)) from exc
        except SnapshotConflict as exc:
            raise ConfigError(
                f"snapshot (--snapshot): connector {self.config.run.connector!r} already started "
                f"at {rfc3339(exc.recorded)} and its sync topic records no snapshot; a "
                "snapshot is taken only when a connector first starts: leave --snapshot off to "
                "resume it, or start a new connector (--connector) with --snapshot"
            ) from exc
        except EmptyWindow as exc:
            run = self.config.run
            start = "now" if self._start_at is None else run.start_at
            raise ConfigError(
                f"end_at {run.end_at}: connector {run.connector!r} has not started yet and "
                f"would start at {rfc3339(exc.stream_start)} (start_at {start}), after its end: "
                "nothing to read; give a start_at before end_at, or a later end_at"
            ) from exc

    def _conflict(self, exc: StartConflict, where: str = "its sync topic") -> str:
        run = self.config.run
        return (
            f"start_at {run.start_at}: connector {run.connector!r} already started at "
            f"{rfc3339(exc.recorded)} ({where} records it) and resumes from its "
            "watermarks; give that start or leave start_at unset to resume, or reset the "
            "connector (see docs/operations.md, Resetting a connector)"
        )

    async def _check_output_start(self) -> None:
        """A file or Spark output remembers where its connector first started
        (``runtime/output_state.py``): a different explicit start is refused (exit 2) as the
        sync topic's record is, on any broker; the first start is recorded."""
        if self._given_sink is not None or self.config.run.sink == "kafka":
            return
        records = self._records
        conflict = await records.open(
            self._sink_dir(), start_at=self._start_at, snapshot=self.config.run.snapshot
        )
        if conflict is not None:
            assert records.state is not None
            where = f"its output's {records.state.start_file}"
            raise ConfigError(self._conflict(StartConflict(conflict.start_us, -1), where))

    async def _run_node(self, t: LocalTask) -> None:
        async with t.node:
            await self._drain_requested(t)
            try:
                await self._drain(t)
            finally:
                t.done.set()
            # Leave only once every task drained: a task that left early would have its
            # partitions planned onto a task that is still reading.
            await asyncio.gather(*(o.done.wait() for o in self.tasks))

    async def _drain_requested(self, t: LocalTask) -> None:
        await self._draining.wait()

    async def _drain(self, t: LocalTask) -> None:
        """Readers stop and commit what is in flight; the task's final state is read back."""
        t.drained = await drain_node(t.node, t.gate)

    def _notice(self) -> None:
        """A fact of the run's end may have changed: :meth:`_wait_for_end` looks again."""
        self._changed.set()

    async def _relay_stop(self) -> None:
        await self.stop.wait()
        self._notice()

    async def _wait_for_end(self) -> str:
        """Until ``protocol.ending.decide`` says the run ends (its reason) or fails: then stop
        the run (exit 1, with the message; a port's own exception). It looks again as
        ``_SETTLE_S`` and ``_FALLBACK_S`` say."""
        run = self.config.run
        deadline = None if run.duration is None else time.monotonic() + run.duration
        while True:
            self._changed.clear()
            looked_at = time.monotonic()
            match ending.decide(self._end_facts(looked_at, deadline)):
                case ending.Fail(message, cause):
                    self.failed = message
                    port = self._port_failure()
                    if cause == "port" and port is not None:
                        raise port
                    raise RunFailed(message)
                case ending.End(reason):
                    return reason
                case ending.KeepGoing(wake_at):
                    wait = _FALLBACK_S
                    if wake_at is not None:
                        wait = max(0.0, min(wait, wake_at - time.monotonic()))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await self._changed.wait()
                    settle = _SETTLE_S - (time.monotonic() - looked_at)
                    if self._changed.is_set() and settle > 0 and not self.stop.is_set():
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(settle):
                                await self.stop.wait()
                case never:
                    assert_never(never)

    def _end_facts(self, now: float, deadline: float | None) -> ending.Facts:
        """What ``protocol.ending.decide`` needs to know, now."""
        port = self._port_failure()
        broker = self._broker
        code = broker.exit_code() if broker is not None else None
        return ending.Facts(
            now=now,
            stop_requested=self.stop.is_set(),
            stopping=self.stopping,
            deadline=deadline,
            delivered=self._delivered(),
            max_records=self.config.run.max_records,
            read_to_end=None if self._end_at is None else self._read_to_end(),
            port_failure=None if port is None else str(port),
            broker_pid=broker.pid if code is not None else None,
            broker_exit_code=code,
            out_of_group_since=tuple(
                t.node.task.out_of_group_since
                if t.node.ready.is_set() and t.node.task is not None
                else None
                for t in self.tasks
            ),
            unreachable_limit_s=self.config.kafka.unreachable_limit_s,
            kafka=self._bootstrap,
        )

    def _port_failure(self) -> Unrecoverable | None:
        """The first port that failed for good: the sink, the source, a task's sync log."""
        for port in (self._ledger, self._source, *(t.sync_log for t in self.tasks)):
            fatal = None if port is None else port.fatal
            if fatal is not None:
                return fatal
        return None

    def _read_to_end(self) -> bool:
        """With ``end_at``: every task of this process is a member of the group and its CIM
        shows every partition of the connector finished (``protocol/bounds.py``). Each process
        decides alone, from the sync topic they all replay. (A member: a process restarted
        after the end knows from its replay that nothing is left, but drains cleanly, and
        leaves the group, only once it joined.)"""
        return bool(self.tasks) and all(
            t.node.ready.is_set()
            and t.node.task is not None
            and t.node.task.core.member
            and t.node.nothing_left()
            for t in self.tasks
        )

    async def _window_complete(self) -> bool | None:
        """After an ``end-at`` ending of a simulated stream read by this process alone:
        whether the sink holds every record of ``[start, end_at]`` the filter keeps, as the
        stream model alone says. None where that is not known (other sources, shared runs)."""
        ledger, model, end = self._ledger, self._model, self._end_at
        if ledger is None or ledger.tally is None or model is None or end is None:
            return None
        if not self._alone():
            return None
        # per partition sums, off the loop: a backlog of a million records, listed whole on
        # the loop, held a gigabyte and stalled it for 47 s (bench catchup)
        expected = await self._expected(end)
        self._expect(expected)
        self._cap = end
        return await self._in_output(expected)

    async def _expected(self, until: int) -> dict[str, Sums]:
        """The sums per partition of :meth:`_model_window`, off the loop. The model's topology
        is made on the loop first, as far as any reader's query can take it (a round past the
        cap), so that the thread and the readers never both add rounds to it."""
        model = self._model
        model.generate_until(until + 2 * model.params.round_us)
        return await asyncio.to_thread(lambda: expect(self._model_window(until)))

    def _model_window(self, until: int) -> Iterator[tuple[str, DataChange]]:
        """The simulated stream's records the tasks read up to ``until`` (from ``--start-at``,
        else the stream's start, through the filter), with their partition tokens."""
        model = self._model
        start = self._start_at if self._start_at is not None else model.params.start_ts
        keeps = self._filter.keeps
        for token, record in model.expected_by_partition(until):
            if record.commit_ts >= start and keeps(record):
                yield token, record

    def _expect(self, expected: dict[str, Sums]) -> None:
        self._expected_records = sum(s.records for s in expected.values())
        self._expected_rows = sum(s.rows for s in expected.values())

    async def _in_output(self, expected: dict[str, Sums]) -> bool:
        """Whether the output holds every record of ``expected``: the sink committed each of
        them once in this run (the ledger's sums), or else, for the partitions whose sums
        differ, each is found in the output itself — an earlier run of the same connector may
        have written them (a re-run of a finished bounded run, a restart after a stop)."""
        tally = cast(CommitTally, cast(Ledger, self._ledger).tally)
        differ = tally.differs(expected)
        if not differ:
            return True
        if self._given_sink is not None or self.config.run.sink == "kafka":
            return False  # no output to read back
        cap = self._cap
        assert cap is not None

        def look() -> bool:
            # the identities of the whole output: this path only (the slow one)
            present = self._read_output_ids()
            return next(missing_from(self._model_window(cap), differ, present), None) is None

        return await asyncio.to_thread(look)

    def _read_output_ids(self) -> set[tuple[int, str, str]]:
        """The identities of the records in the file or Spark output. Reads the whole output:
        for the simulated stream's self-check only."""
        from runtime.files.typed import output_identities

        try:
            return output_identities(self._sink_dir())
        except (OSError, ValueError) as exc:
            self.count_error("output_read")
            log.warning("could not read the output at %s back: %r", self._sink_dir(), exc)
            return set()

    def _alone(self) -> bool:
        """Only this process reads the stream (embedded broker): it can wait for all of it.
        With a shared Kafka other processes hold part of the stream; a bounded run drains."""
        return self.config.kafka.bootstrap_servers is None

    def _delivered(self) -> int:
        return sum(t.sink.records_delivered for t in self.tasks)

    async def _catch_up(self) -> bool:
        """Close the stream at the current time and wait until the sink holds all of it."""
        ledger = self._ledger
        assert ledger is not None
        start, end, keeps = self._start_at, self._end_at, self._filter.keeps_change
        if self._model is not None:
            self._cap = cap = self._now() if end is None else min(self._now(), end)
            tally = ledger.tally
            assert tally is not None  # a bounded run of the simulated stream keeps it
            # what the tasks read: the stream up to the cap, from --start-at, through the filter
            expected = await self._expected(cap)
            self._expect(expected)
            self._say(f"shoal: stream closed; catching up on {self._expected_records} records")
            look_at, look_every = time.monotonic() + 2.0, 2.0
            while not tally.complete(expected):
                if self.stop.is_set():
                    return False
                if time.monotonic() >= look_at:  # perhaps an earlier run wrote the rest
                    if await self._in_output(expected):
                        return True
                    look_every *= 2  # the output is read whole: ever more rarely
                    look_at = time.monotonic() + look_every
                await asyncio.sleep(0.1)
            return True
        if self._loadgen is not None:
            self._load_stop.set()
            await asyncio.sleep(0.2)  # the commit in flight, if any
            produced = [
                c
                for c in self._loadgen.committed
                if (start is None or c.commit_ts >= start)
                and (end is None or c.commit_ts <= end)
                and keeps(c.table, c.mod_type)
            ]
            rows = sum(len(c.keys) for c in produced)
            self._expected_rows = rows
            self._expected_records = len(produced)
            self._say(f"shoal: write load stopped; catching up on {rows} rows")
            while ledger.distinct_rows < rows:
                if self.stop.is_set():
                    return False
                await asyncio.sleep(0.1)
            return True
        return True

    async def _load_loop(self) -> None:
        loadgen = self._loadgen
        interval = 1.0 / self.config.spanner.load_rate
        while not self._load_stop.is_set():
            try:
                await loadgen.commit_one()
            except Exception as exc:
                self.count_error("loadgen")
                log.warning("write load: commit failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._load_stop.wait()

    async def _sample_loop(self) -> None:
        interval = self.config.run.progress_interval
        next_draw = time.monotonic()
        while True:
            sample = self.sample()
            self._track_rebalances(sample)
            await self._records.record_mark(sample.low_watermark_us, sample.held_by)
            if self._records.start_missing:
                await self._record_start()
            if self.progress is not None and time.monotonic() >= next_draw:
                self.progress.update(sample)
                next_draw += interval
            await asyncio.sleep(0.1)

    async def _record_start(self) -> None:
        """Record the connector's start in the output once the sync topic has one (a start of
        "now" is fixed by the first leader)."""
        for t in self.tasks:
            task = t.node.task
            if task is not None and t.node.ready.is_set() and task.core.cim.stream_start >= 0:
                await self._records.record_start(task.core.cim.stream_start)
                return

    def _track_rebalances(self, sample: Sample) -> None:
        by_id = {s.task_id: s for s in sample.tasks}
        for t in self.tasks:
            s = by_id.get(t.task_id)
            if s is None:
                continue
            if s.rebalancing and t.rebalance_since is None:
                t.rebalance_since = sample.at
            elif not s.rebalancing and t.rebalance_since is not None and s.epoch >= 0:
                took = sample.at - t.rebalance_since
                t.rebalance_since = None
                t.rebalances += 1
                if self.metrics is not None:
                    self.metrics.observe_rebalance(t.task_id, took)
                if s.leader == s.task_id:
                    self._say(
                        f"rebalance: epoch {s.epoch} settled in {took:.1f}s, leader {s.leader}"
                    )

    # -- the end ---------------------------------------------------------------------------------
    def _partitions(self) -> tuple[PartitionEnd, ...]:
        """Every partition's final state, from the CIMs of this process's tasks."""
        cims = [t.node.task.core.cim for t in self.tasks if t.node.task is not None]
        return tuple(
            PartitionEnd(f.token, f.status, f.watermark, f.owner) for f in final_states(cims)
        )

    def _summary(
        self,
        reason: str,
        caught_up: bool | None,
        drained: bool,
        partitions: tuple[PartitionEnd, ...],
        final: Sample,
    ) -> RunSummary:
        return summarize(
            self.config,
            final,
            reason=reason,
            caught_up=caught_up,
            drained=drained,
            partitions=partitions,
            output_dir=self._sink_dir(),
            seconds=time.monotonic() - self.started_at,
            ledger=self._ledger,
            file_sink=self._file_sink,
            bridge=self._bridge,
            produced_records=self._expected_records,
            produced_rows=self._expected_rows,
            stream_start=self._stream_start,
            stream_end=self._cap,
            rebalances=max((t.rebalances for t in self.tasks), default=0),
            loop_lag=self.loop_lag,
            warnings=self.warnings,
        )
