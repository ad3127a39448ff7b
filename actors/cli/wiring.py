"""The parts of one shoal process, built from its options: the wiring of ``actors/cli/run.py``.

Each function builds one part and enters it in the run's :class:`~contextlib.AsyncExitStack`
(so the run closes them in reverse), reporting through the callbacks it is given (``say`` a
line to the operator, ``count_error`` a counted error); none decides when the run ends or
stops (that is :class:`~actors.cli.run.Pipeline`'s lifecycle and ``protocol/ending.py``):

* :func:`check_output_dir`, :func:`check_output_store` – the output can be written, before
  anything starts;
* :func:`start_kafka` – the embedded broker (unless ``kafka.bootstrap_servers`` names a real
  Kafka), and :func:`reach` – a Kafka client entered with retries for ``connect_timeout``;
* :func:`start_source` – the simulator, the emulator with its write load, or Spanner (and the
  change stream's own options); :func:`snapshot_routing`, :func:`bound_and_filter` – the source
  as the tasks read it; :func:`warn_empty` – what makes the run read nothing, said at start;
* :func:`start_sink` – the file, Spark or Kafka sink;
* :func:`make_tasks` – one :class:`LocalTask` (a ``TaskNode`` over its own sync log, gate and
  counting sink) per task id (:func:`default_task_ids`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from actors.cli.config import (
    ConfigError,
    ShoalConfig,
    SimOptions,
    query_window,
    task_count,
    trail,
)
from actors.cli.ports import RunFailed
from actors.cli.sinks import CountingSink
from actors.cli.sinks import spark_config as build_spark_config
from actors.embed import GatedSource
from actors.node import NodeConfig, TaskNode
from actors.task import wall_micros
from protocol.filters import RecordFilter
from protocol.messages import SnapshotItem
from protocol.records import ChangeRecord
from protocol.stream_options import StreamOptions, start_refusal
from runtime.files.sink import FileSink
from runtime.ports import ChangeStreamSource, Membership, Sink, Unrecoverable

if TYPE_CHECKING:
    from runtime.filtered import FilteredSource
    from runtime.kafka import KafkaConfig, KafkaSyncLog
    from runtime.kafka.broker import EmbeddedBroker
    from runtime.sim.stream import StreamModel, StreamParams
    from runtime.spanner.config import SpannerConfig
    from runtime.spanner.loadgen import LoadGenerator
    from runtime.spanner.snapshot_source import SpannerSnapshots

log = logging.getLogger("shoal.runtime")

Say = Callable[[str], None]
CountError = Callable[[str], None]


class LocalTask:
    """One task node of this process and what the run tracks about it."""

    def __init__(
        self, node: TaskNode, sink: CountingSink, gate: GatedSource, log: KafkaSyncLog
    ) -> None:
        self.node = node
        self.sink = sink
        self.gate = gate
        self.sync_log = log
        self.rebalance_since: float | None = None
        self.rebalances = 0
        self.done = asyncio.Event()  # drained and final state confirmed (or gave up)
        self.drained = False

    @property
    def task_id(self) -> str:
        return self.node.task_id


class SourceParts(msgspec.Struct, kw_only=True):
    """The source :func:`start_source` built and what the run keeps of it."""

    source: ChangeStreamSource
    spanner: SpannerConfig | None = None  # a Spanner source's settings (the emulator's too)
    stream_options: StreamOptions | None = None  # the change stream's own options, if read
    model: StreamModel | None = None  # the simulated stream's model
    clock: Callable[[], int] | None = None  # the simulated stream's clock
    stream_start: int | None = None  # where the simulated stream begins
    loadgen: LoadGenerator | None = None  # the emulator's write load


class SinkParts(msgspec.Struct, kw_only=True):
    """The sink :func:`start_sink` built (not wrapped yet) and its concrete kind."""

    sink: Sink
    file_sink: FileSink | None = None
    bridge: Any = None  # runtime.spark.SparkBridge with --sink spark


def default_task_ids(config: ShoalConfig) -> list[str]:
    """``--task-id``; else ``task-<i>`` on the embedded broker; else, on a shared Kafka, ids
    unique to this process (``<host>-<pid>``, ``-<i>`` when it runs several)."""
    run = config.run
    if run.task_id is not None:
        return [run.task_id]
    count = task_count(config)
    if config.kafka.bootstrap_servers is None:
        return [f"task-{i}" for i in range(count)]
    base = f"{socket.gethostname()}-{os.getpid()}"
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


# -- Kafka ---------------------------------------------------------------------------------------
async def start_kafka(
    stack: AsyncExitStack, config: ShoalConfig, run_dir: Path, say: Say
) -> tuple[str, EmbeddedBroker | None]:
    """The bootstrap servers, and the embedded broker when this run starts one (its log in
    ``run_dir``)."""
    if config.kafka.bootstrap_servers is not None:
        return config.kafka.bootstrap_servers, None
    from runtime.kafka.broker import EmbeddedBroker

    broker = EmbeddedBroker(log_path=run_dir / "broker.log")
    await stack.enter_async_context(broker)
    say(
        f"embedded broker at {broker.bootstrap} (while this runs: python -m actors.runtime "
        f"status --kafka-bootstrap-servers {broker.bootstrap} "
        f"--connector {config.run.connector})"
    )
    return broker.bootstrap, broker


async def reach(
    stack: AsyncExitStack,
    make: Callable[[], Any],
    what: str,
    *,
    timeout_s: float,
    stop: asyncio.Event,
    count_error: CountError,
) -> Any:
    """Enter ``make()`` as a context, retrying a transient failure with exponential backoff
    for at most ``timeout_s`` seconds (``connect_timeout``); then fail with the last error."""
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    attempt = 0
    while True:
        attempt += 1
        try:
            return await stack.enter_async_context(make())
        except Exception as exc:
            from runtime.kafka.errors import bad_setting_in, is_transient, refusal_in

            left = deadline - time.monotonic()
            refused = refusal_in(exc)
            if refused is not None:  # a certificate, a listener, a login: retrying cannot help
                raise RunFailed(str(refused)) from exc
            bad = bad_setting_in(exc)
            if bad is not None:  # a TLS file, a sync topic of several partitions
                raise ConfigError(str(bad)) from exc
            if not is_transient(exc) or left <= 0 or stop.is_set():
                raise RunFailed(f"{what} unreachable after {attempt} attempt(s): {exc}") from exc
            count_error("connect_retry")
            wait = min(delay, left)
            log.warning("%s: %s; retrying in %.1fs (attempt %d)", what, exc, wait, attempt)
            await asyncio.sleep(wait)
            delay = min(delay * 2, 8.0)


# -- the source ----------------------------------------------------------------------------------
async def start_source(
    stack: AsyncExitStack,
    config: ShoalConfig,
    *,
    start_at: int | None,
    cap: Callable[[], int | None],
    say: Say,
    count_error: CountError,
    kill_on_abort: list[Callable[[], None]],
) -> SourceParts:
    """The source ``run.source`` names. ``cap``: where the run closed the simulated stream
    (None: open); ``kill_on_abort`` gets the emulator's kill."""
    match config.run.source:
        case "sim":
            return sim_source(config.sim, start_at, cap)
        case "emulator":
            return await _emulator_source(stack, config, say, count_error, kill_on_abort)
        case "spanner":
            from runtime.spanner.config import SpannerConfig
            from runtime.spanner.reader import SpannerSource

            s = config.spanner
            spanner = SpannerConfig(
                project=s.project or "",
                instance=s.instance or "",
                database=s.database or "",
                change_stream=s.change_stream or "",
                credentials_file=s.credentials_file,
                emulator_host=s.emulator_host,
                heartbeat_ms=s.heartbeat_ms,
                query_window_s=query_window(s, emulator=s.emulator_host is not None),
                trail_s=trail(s, emulator=s.emulator_host is not None),
                rpc_priority=s.rpc_priority,
                database_role=s.database_role,
            )
            source = await SpannerSource.connect(spanner)
            stack.push_async_callback(source.close)
            await source.detect_dialect(spanner.database)
            options = await read_stream_options(source, spanner.change_stream, say, count_error)
            return SourceParts(source=source, spanner=spanner, stream_options=options)


def sim_source(sim: SimOptions, start_at: int | None, cap: Callable[[], int | None]) -> SourceParts:
    """The simulated stream: it begins at ``--sim-start-ts``, else at ``start_at``, else now,
    and runs ``speedup`` times as fast as the wall clock, up to ``cap()`` once the run closed it."""
    from runtime.sim.source import SimulatedSource
    from runtime.sim.stream import StreamModel

    if sim.start_ts is not None:
        start = sim.start_ts
    elif start_at is not None:
        start = start_at
    else:
        start = wall_micros()
    model = StreamModel(stream_params(sim, start))
    speed = sim.speedup

    def clock() -> int:
        now = start + int((wall_micros() - start) * speed)
        closed = cap()
        return now if closed is None else min(now, closed)

    return SourceParts(
        source=SimulatedSource(model, clock=clock, poll_s=0.05),
        model=model,
        clock=clock,
        stream_start=start,
    )


def stream_params(sim: SimOptions, start: int) -> StreamParams:
    """The simulated stream of ``[sim]`` options starting at ``start`` (Unix micros)."""
    from runtime.sim.stream import StreamParams

    return StreamParams(
        seed=sim.seed,
        roots=sim.roots,
        start_ts=start,
        round_us=int(sim.round_s * 1e6),
        split_p=sim.split_p,
        move_p=sim.move_p,
        merge_p=sim.merge_p,
        records_per_s=sim.records_per_s,
    )


async def _emulator_source(
    stack: AsyncExitStack,
    config: ShoalConfig,
    say: Say,
    count_error: CountError,
    kill_on_abort: list[Callable[[], None]],
) -> SourceParts:
    from runtime.spanner.emulator import DEFAULT_TABLES, EmulatorUnavailable, SpannerEmulator
    from runtime.spanner.loadgen import LoadGenerator
    from runtime.spanner.reader import SpannerSource

    s = config.spanner
    try:
        emulator = SpannerEmulator(binary=s.emulator_path, partition_alive_s=s.emulator_churn_s)
    except EmulatorUnavailable as exc:
        raise RunFailed(f"--source emulator: {exc}") from exc
    spanner = await asyncio.to_thread(emulator.start)
    stack.callback(emulator.stop)
    kill_on_abort.append(lambda: emulator.stop(timeout_s=1.0))
    loadgen = await LoadGenerator.connect(spanner, DEFAULT_TABLES, seed=config.sim.seed)
    stack.push_async_callback(loadgen.close)
    spanner = msgspec.structs.replace(
        spanner,
        query_window_s=query_window(s, emulator=True),
        trail_s=trail(s, emulator=True),
        rpc_priority=s.rpc_priority,
        database_role=s.database_role,
    )
    source = await SpannerSource.connect(spanner)
    stack.push_async_callback(source.close)
    options = await read_stream_options(source, spanner.change_stream, say, count_error)
    return SourceParts(source=source, spanner=spanner, stream_options=options, loadgen=loadgen)


async def read_stream_options(
    source: Any, stream: str, say: Say, count_error: CountError
) -> StreamOptions | None:
    """Read the change stream's own options once (``protocol/stream_options.py``) and say
    them in one line; the first start is checked against its retention (``StartChecked``).
    Options that cannot be read are logged and counted, and the run goes on: Spanner itself
    still refuses a start it does not keep."""
    try:
        options: StreamOptions | None = await source.stream_options()
    except Exception as exc:
        count_error("stream_options")
        log.warning("could not read change stream %s's options: %r", stream, exc)
        return None
    if options is not None:
        say(f"change stream {stream}: {options.describe()}")
    return options


def snapshot_routing(
    stack: AsyncExitStack,
    source: ChangeStreamSource,
    spanner: SpannerConfig,
    *,
    keeps_table: Callable[[str], bool],
    chunk_rows: int,
    item: Callable[[str], tuple[SnapshotItem, int] | None],
    done: Callable[[str], bool],
) -> tuple[ChangeStreamSource, SpannerSnapshots]:
    """A Spanner source reads snapshot partitions too (docs/mirror.md): those of a snapshot
    this run plans (``--snapshot``) or that the connector's sync topic records from an
    earlier start. ``item`` and ``done`` answer from the tasks' consolidated state."""
    from runtime.snapshot_routing import SnapshotRouting
    from runtime.spanner.snapshot_source import SpannerSnapshots

    async def tables() -> tuple[str, ...]:
        watched = await watched_tables(source)
        if watched is None:
            raise RunFailed(
                "snapshot: the change stream's tables could not be read from the "
                "database's information schema (the log says why; a PostgreSQL-dialect "
                "database is not supported by --snapshot yet)"
            )
        return tuple(t for t in watched if keeps_table(t))

    snapshots = SpannerSnapshots(spanner, tables, chunk_rows=chunk_rows)
    stack.push_async_callback(snapshots.close)
    return SnapshotRouting(source, snapshots, item, done), snapshots


def bound_and_filter(
    source: ChangeStreamSource,
    config: ShoalConfig,
    *,
    start_at: int | None,
    end_at: int | None,
    keep: RecordFilter,
    stream_options: StreamOptions | None,
    stream: str,
) -> tuple[ChangeStreamSource, FilteredSource | None]:
    """The source as the tasks see it: read inside ``[start_at, end_at]``, an explicit
    start the database refuses reported as a bad option, and filtered records turned
    into heartbeats (the filtering source, for its figures, with a filter)."""
    from runtime.bounded import BoundedSource
    from runtime.filtered import FilteredSource

    if start_at is not None or end_at is not None:
        source = BoundedSource(source, start_at=start_at, end_at=end_at)
    if start_at is not None and config.run.source != "sim":
        source = StartChecked(source, config.run.start_at, stream_options, stream=stream)
    if keep.keeps_everything:
        return source, None
    filtered = FilteredSource(source, keep)
    return filtered, filtered


async def warn_empty(
    source: ChangeStreamSource,
    config: ShoalConfig,
    *,
    keep: RecordFilter,
    start_at: int | None,
    now: int,
    warn: Callable[[str, str], None],
) -> None:
    """Warn (one line each, counted) about what makes this run read nothing, or less than
    asked, where it is known at start: ``tables``/``exclude_tables`` patterns that match no
    table of the stream (where the source says which tables it watches: the simulator, a
    GoogleSQL change stream), a ``start_at`` still in the future (of the stream's clock,
    ``now``). (A first start after ``end_at`` is refused: ``EmptyWindow``.)"""
    run = config.run
    tables = None
    if run.tables is not None or run.exclude_tables is not None:
        tables = await watched_tables(source)
    if tables is not None:
        include, exclude = keep.unmatched(tables)
        named = [f"{p!r} (--tables)" for p in include]
        named += [f"{p!r} (--exclude-tables)" for p in exclude]
        stream = f"the stream's tables: {', '.join(tables) or 'none'}"
        said = []
        if named:
            verb = "matches" if len(named) == 1 else "match"
            said.append(f"{', '.join(named)} {verb} no table ({stream})")
        if keep.keeps_no_table(tables):
            said.append(
                "the filters keep no table"
                + ("" if named else f" ({stream})")
                + ": this run writes nothing"
            )
        if said:
            warn("filter_matches_no_table", "tables/exclude_tables: " + "; ".join(said))
    if start_at is not None and start_at > now:
        warn(
            "start_in_future",
            f"start_at {run.start_at} is {(start_at - now) / 1e6:.0f}s in the future "
            "(of the stream's clock): nothing is read until then",
        )


async def watched_tables(source: ChangeStreamSource) -> tuple[str, ...] | None:
    """The tables ``source`` says its stream carries (``watched_tables()`` of the simulator
    and the Spanner reader, asked with a bound), or None where it cannot say."""
    try:
        async with asyncio.timeout(10):
            tables = await source.watched_tables()
    except TimeoutError:
        log.info("the source did not say which tables it watches within 10s")
        return None
    return None if tables is None else tuple(tables)


class StartChecked(ChangeStreamSource):
    """A source whose root query (the connector's first start, at ``--start-at``) failing is
    reported as a bad ``start_at`` (exit 2) with the database's own limit, not as a crash: a
    start before the database's version retention (or the change stream's retention) is
    refused by Spanner with OUT_OF_RANGE and says which timestamps it accepts."""

    def __init__(
        self,
        inner: ChangeStreamSource,
        start_at: str,
        stream_options: StreamOptions | None = None,
        *,
        stream: str = "",
    ) -> None:
        self.inner = inner
        self.start_at = start_at
        self.stream_options = stream_options
        self.stream = stream

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        if token is not None:
            async for batch in self.inner.query(token, start_ts, end_ts):
                yield batch
            return
        if self.stream_options is not None:  # the first start: inside the stream's retention?
            refusal = start_refusal(
                start_ts,
                wall_micros(),
                self.stream_options,
                start_at=self.start_at,
                stream=self.stream,
            )
            if refusal is not None:
                raise ConfigError(refusal)
        try:
            async for batch in self.inner.query(token, start_ts, end_ts):
                yield batch
        except Unrecoverable:  # the database or stream is wrong, not the start
            raise
        except Exception as exc:
            detail = str(exc.__cause__ or exc).splitlines()[0]
            raise ConfigError(
                f"start_at {self.start_at}: the change stream refused this start: {detail}"
            ) from exc


# -- the sink ------------------------------------------------------------------------------------
async def start_sink(
    stack: AsyncExitStack,
    config: ShoalConfig,
    kafka: KafkaConfig,
    *,
    sink_dir: str,
    output_topic: str,
    permit: Callable[[], bool],
    leads: Callable[[], bool],
    mark: Callable[[], int],
    say: Say,
) -> SinkParts:
    """The sink ``run.sink`` names. ``permit``: whether every reading task holds a valid lease
    (checked before each commit point); ``leads``: whether this process drives the shared
    retry queue; ``mark``: the completeness mark last written (micros, -1: none)."""
    cfg = config
    match cfg.run.sink:
        case "files":
            file_sink = FileSink(
                sink_dir,
                permit=permit,
                layout=cfg.run.output_layout,
                connector=cfg.run.connector,
                table_format=cfg.run.table_format,
                mark=mark,
                mirror=cfg.run.mirror,
                validate=cfg.run.debug_validate,
            )
            inner = await stack.enter_async_context(file_sink)
            return SinkParts(sink=inner, file_sink=file_sink)
        case "spark":
            bridge = await _spark_sink(stack, config, kafka, permit, leads, mark, say)
            return SinkParts(sink=cast(Sink, bridge), bridge=bridge)
        case "kafka":
            from runtime.kafka.output_meta import MetaOptions
            from runtime.kafka.sink import KafkaSink, KafkaSinkConfig

            sink_config = KafkaSinkConfig(name=output_topic, partitions=cfg.kafka.output_partitions)
            # the output is a composite topic described by <output>_meta: it can grow
            # while shoal runs (``output add-storage-topic`` / ``switch-produce``)
            lease = cfg.kafka.output_lease_s
            trace = None  # its retry core's trace, beside the tasks' (protocol/trace.py)
            if cfg.run.trace_dir is not None:
                path = Path(cfg.run.trace_dir) / f"retry-{sink_config.name}.trace.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                trace = stack.enter_context(path.open("ab"))
            kafka_sink = await stack.enter_async_context(
                KafkaSink(
                    kafka,
                    sink_config,
                    driver=leads,
                    takeover_grace_s=cfg.run.rq_takeover_grace_s,
                    meta=MetaOptions(lease_ttl_s=lease, margin_s=lease / 5),
                    trace=trace,
                    validate=cfg.run.debug_validate,
                )
            )
            return SinkParts(sink=kafka_sink)
    raise ConfigError(f"sink {cfg.run.sink!r}: not a sink")  # (the options allow no other)


async def _spark_sink(
    stack: AsyncExitStack,
    config: ShoalConfig,
    kafka: KafkaConfig,
    permit: Callable[[], bool],
    leads: Callable[[], bool],
    mark: Callable[[], int],
    say: Say,
) -> Any:
    try:
        spark_module: Any = importlib.import_module("runtime.spark")
    except ImportError as exc:
        raise ConfigError(
            f"--sink spark: the Spark bridge is not available ({exc}); use --sink files"
        ) from exc
    sc = config.spark
    # Spark's Python workers must run this interpreter (the system python3 lacks shoal's
    # packages and fails with a misleading "worker failed to connect back"); a local
    # master binds to loopback.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if sc.remote is None and sc.master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = build_spark_config(config, kafka)
    where = (
        f", retry/dead-letter queues {settings.dead_letter.name}_rq/_dlq"
        if settings.dead_letter is not None
        else ""
    )
    say(f"shoal: starting Spark ({sc.remote or sc.master}, {sc.path} path{where})")
    return await stack.enter_async_context(
        spark_module.SparkBridge(settings, rq_driver=leads, permit=permit, mark=mark)
    )


# -- the tasks -----------------------------------------------------------------------------------
async def make_tasks(
    stack: AsyncExitStack,
    config: ShoalConfig,
    kafka: KafkaConfig,
    source: ChangeStreamSource,
    sink: Sink,
    first_log: KafkaSyncLog,
    *,
    stream_start: int,
    start_at: int | None,
    end_at: int | None,
    output_start: int,
    stream_options: StreamOptions | None,
    snapshots: SpannerSnapshots | None,
    on_change: Callable[[], None],
    loop_lag: Callable[[], float] | None = None,
) -> list[LocalTask]:
    """One task node per task id, each over its own sync log (the first one's already
    reached), membership, gated source and counting sink; not started yet. ``on_change``:
    called when a node's state may have changed (``TaskNode``); ``loop_lag``: the event loop's
    recent lag, which grows each membership's lease margin."""
    from runtime.kafka import KafkaMembership, KafkaSyncLog

    cfg = config
    connector = cfg.run.connector

    async def join(task_id: str) -> Membership:
        trace = None  # its member core's trace, beside its task's (protocol/trace.py)
        if cfg.run.trace_dir is not None:
            path = Path(cfg.run.trace_dir) / f"member-{task_id}.trace.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            trace = stack.enter_context(path.open("ab"))
        membership = KafkaMembership(
            kafka,
            connector,
            task_id,
            trace=trace,
            validate=cfg.run.debug_validate,
            loop_lag=loop_lag,
        )
        await membership.start()
        return membership

    tasks = []
    t = cfg.task
    for n, task_id in enumerate(default_task_ids(cfg)):
        if n == 0:
            sync_log = first_log  # reached (with retries) before anything else started
        else:
            sync_log = await stack.enter_async_context(KafkaSyncLog(kafka, connector))
        gate = GatedSource(source)
        counting = CountingSink(sink)
        node = TaskNode(
            NodeConfig(
                task=msgspec.structs.replace(
                    t.task_config(task_id),
                    snapshot=cfg.run.snapshot,
                    # a MUTABLE_KEY_RANGE stream's lifecycle (protocol/mutable.py)
                    mutable=stream_options is not None and stream_options.mutable_key_range,
                ),
                stream_start=stream_start,
                require_start=-1 if start_at is None else start_at,
                end_at=-1 if end_at is None else end_at,
                output_start=output_start,
                stuck_after=cfg.run.stuck_after_s,
                trace_dir=cfg.run.trace_dir,
                debug_validate=cfg.run.debug_validate,
            ),
            sync_log=sync_log,
            join=join,
            source=gate,
            sink=counting,
            snapshots=snapshots,
            on_change=on_change,
        )
        tasks.append(LocalTask(node, counting, gate, sync_log))
    return tasks


# -- the output, before anything starts ----------------------------------------------------------
def check_output_store(uri: str) -> None:
    """Blocking: an object-store output (``run.output_dir`` a URI) can be written, read and
    deleted in, or :class:`ConfigError` naming the option: found at start."""
    from runtime.lake.store import StoreError, open_store

    try:
        open_store(uri).check()
    except StoreError as exc:
        raise ConfigError(str(exc)) from exc


def check_output_dir(path: Path) -> None:
    """Create ``run.output_dir`` if needed and make sure this process can write there (and in
    its ``data`` directory, if there is one), or raise :class:`ConfigError` naming the option:
    found at start, not by the broker's log, the sink or Spark later. Writing is tried, not
    judged from the permission bits (which do not hold for root or a read-only mount)."""
    where = f"output_dir {str(path)!r} (--output-dir)"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where} is a file, not a directory: give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot create it ({exc.strerror or exc})") from exc
    data = path / "data"
    if data.exists() and not data.is_dir():
        raise ConfigError(f"{where}: {str(data)!r} is a file; the output goes in that directory")
    for directory in (path, data) if data.exists() else (path,):
        probe = directory / f".shoal-write-probe.{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"{where}: cannot write in {str(directory)!r} ({exc.strerror or exc})"
            ) from exc
