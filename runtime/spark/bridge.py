"""``SparkBridge``: the ``Sink`` that hands change records to Spark in micro-batches.

Partition readers ``put`` their ``SinkBatch``es; the bridge buffers them (``Batcher``) and cuts
a micro-batch at ``max_rows`` rows or ``max_age_s`` seconds (by age only while fewer than two
are in flight, so a slow sink gets fewer, bigger micro-batches: ``Batcher.due``). A cutter task drops replayed
records (the output ledger's pending tail, ``protocol.ledger``) and builds the Arrow table off the event loop; a committer task hands each
micro-batch, in order, to Spark (``createDataFrame`` from Arrow, then the default parquet sink or
the user's ``foreach_batch(df, batch_id)``), and resolves the futures of its ``SinkBatch``es
only once Spark has committed it. Readers advance their committed watermark only over resolved
futures, so a crash anywhere loses nothing. With the default output's committer the micro-batches
are pipelined (``_commit_in_order``): Spark writes the next one (its files invisible until
committed) while the committer makes the previous one visible; commits stay in order, and one
behind a micro-batch that fails commits nothing (its files are deleted) and fails with it.

* Backpressure: at most ``max_inflight_batches`` micro-batches are cut and not yet committed;
  while that many are in flight and the buffer is full, ``put`` waits.
* Retry: a micro-batch Spark fails is re-run with the same batch id (``max_attempts``, with
  backoff: ``protocol.ledger.retry_delay``); the default sink overwrites its own partitions
  (dynamic partition overwrite keyed by run and batch id), so a re-run never duplicates. After
  the last attempt its futures fail, and so does everything cut or buffered after it (those
  were de-duplicated on the assumption that the failed one commits); a later batch of an
  affected partition, a heartbeat past the failed records included, is refused until its
  reader re-reads from its committed watermark. These rules (dedup tails, gaps, the cascade,
  fence keys) are the output ledger's (``protocol.ledger``), the same as the file sink's.
* A lost session (embedded path): after a failed Spark job the bridge asks its
  ``SessionSupervisor`` (``runtime.spark.supervisor``) whether the session died (the local JVM
  exited, a Spark Connect server restarted); if so a new one is started, warmed, and the job run
  again without counting the attempt, up to ``SparkConfig.restarts`` times; if it cannot be
  replaced the bridge breaks with ``SparkLost`` (an ``Unrecoverable``: the process stops).
  A Spark job that runs past ``SparkConfig.job_timeout_s`` is cancelled and its session
  handled as a lost one (a cluster without master and executors never finishes it).
* Retry queue and dead-letter queue (docs/design.md#retry-and-dead-letter-queues, opt-in: ``SparkConfig.dead_letter``, embedded
  path only). A micro-batch that still fails after ``max_attempts`` is not failed back: the
  bridge isolates the failing rows by **bisecting the micro-batch by ordering key** (table and
  primary key; ``runtime.spark.keyed.halves``), each half run once as its own Spark batch with a
  fresh batch id (so a ``foreach_batch`` idempotent per id never overwrites one half with the
  other; it must write nothing when it raises), down to single keys; a ``foreach_batch`` that
  raises ``RowsFailed(keys)`` names them at once. What succeeds is committed; the rows of keys
  that fail alone go to the retry queue of ``runtime.kafka.retry_queue.RetryQueue`` (the Kafka sink's
  shell and topic format, here ``<name>_rq`` / ``<name>_dlq``), retried with backoff as small
  Spark batches (one row per key at a time), dead-lettered after ``policy.max_attempts``. **Per
  key order**: every later row of a key the queue holds (``RetryQueue.blocks``) is taken out of
  its micro-batch and parked behind, other keys flow on. A ``SinkBatch``'s future resolves once
  each of its rows is committed in Spark or durably in the RQ/DLQ, so watermarks never pass a
  lost row; the RQ/DLQ state lives in Kafka and a new bridge over the same topics resumes it.
  Spark jobs (micro-batches, halves, retries) run one at a time.
* The default output: parquet under ``output_dir``, partitioned by ``table`` and by ``batch``,
  one row per mod; ``read_output`` reads it back. On the embedded path (without
  ``dead_letter``) each micro-batch is committed atomically with the sink's own durable position
  (docs/design.md#exactly-once-output, ``runtime.files.commit``): Spark writes it, with its own
  ``_temporary`` commit, partitioned by table, under ``<output_dir>/_staging/<batch>/`` where no
  reader looks; the lease (``permit``) is checked; a manifest is written (the commit point); each
  staged ``table=<t>`` directory is renamed to ``table=<t>/batch=<id>`` and each partition's
  position recorded. ``<id>`` is the batch
  identity (``protocol.commit.batch_identity``), so a micro-batch written twice appears once.
  ``durable_position(token)`` answers a partition's committed position; ``fence(batches)``
  fences the batches a stopping reader abandons (docs/design.md#exactly-once-output, rule 4): a
  micro-batch holding one is refused at its commit point. The renames are done by this
  process: over Spark Connect the output must be a path this process sees as the server does
  (a shared or local file system); ``SparkConfig.atomic_commit=False`` writes straight into
  place (at-least-once; re-reads dropped by ``read_output``'s ``dedupe``).
* The default output's layout (``SparkConfig.output_layout``): **typed** (the default without
  ``dead_letter``, to a path this process writes or an ``s3://``,
  ``gs://`` or ``file://`` URI) is the typed per-table changelog: each micro-batch with rows is
  one Spark job whatever the number of tables, its executors converting the rows and writing
  every table's files (``runtime.spark.datasource``), then committed by the same atomic
  committer (``runtime.spark.typed_output``): ``<table>/batch=<id>/`` directories moved into
  place (renamed, or copied on an object store), or with ``SparkConfig.table_format = "delta"``
  one Delta table per table, the files written straight into it and made visible by one
  idempotent Delta commit per table and micro-batch (``runtime.lake.delta``; the completeness
  watermark ``mark()`` in its commit info): exactly once on an object store too. On the
  streaming path the same files are written by the streaming query's writer
  (``runtime.spark.datasource.TypedStreamWriter``) from the spooled chunks, and the bridge
  commits each micro-batch the same way once Spark's checkpoint holds it (``_ack_loop``).
  **generic** is the layout described above (the RQ/DLQ always writes it; Spark's own URLs
  such as ``s3a://`` get it, written in place; on the streaming path Spark's file sink).
* ``foreach_batch(df, batch_id)`` gets a run-local batch number; a ``foreach_batch`` taking a
  third parameter gets ``(df, batch_id, identity)`` with the deterministic batch identity,
  stable across re-delivery: key an idempotent write on it (docs/operations.md). With
  ``SparkConfig.foreach_batch_frames = "typed"`` (embedded path) ``df`` is a ``TypedFrames``:
  table name -> that table's typed DataFrame (docs/reading-output.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import msgspec

from protocol.commit import batch_identity, records_identity
from protocol.dedup import Position
from protocol.ledger import Admit, OutputLedger, retry_delay
from protocol.records import DataChange
from runtime.files.commit import CommitIncomplete, CommitRefused, Committer, TableWrite
from runtime.kafka.retry_queue import PendingSend, RetryQueue, RetryQueueError
from runtime.ports import Sink, SinkBatch
from runtime.spark.config import BridgeError, BridgeStats, ForeachBatch, SparkConfig
from runtime.spark.dead_letter import SparkDlqRecord
from runtime.spark.keyed import (
    RowsFailed,
    SparkRecord,
    decode_record,
    encode_record,
    halves,
    record_keys,
    records_table,
    spark_records,
)
from runtime.spark.output import write_default, write_staged
from runtime.spark.rows import Batcher, Cut, to_arrow, warm_records, warm_table
from runtime.spark.session import SparkStartError, abandon_start, start_session, warm
from runtime.spark.supervisor import SessionSupervisor, SparkJobTimeout, SparkLost, cancel_jobs
from runtime.spark.typed_output import TypedBatch, typed_tails

__all__ = [
    "BridgeError",
    "BridgeStats",
    "RowsFailed",
    "SparkBridge",
    "SparkConfig",
]

log = logging.getLogger("shoal.spark")

_STOP = object()
# how long a cancelled Spark job (and the cancel itself) may take to end
_CANCEL_WAIT_S = 30.0


class SparkBridge(Sink):
    """The Spark micro-batch bridge; satisfies ``runtime.ports.Sink``. One bridge serves every
    task node of a process. ``spark``: an existing session to use (not stopped on exit)."""

    def __init__(
        self,
        config: SparkConfig,
        *,
        foreach_batch: ForeachBatch | None = None,
        spark: Any = None,
        rq_driver: Callable[[], bool] | None = None,
        permit: Callable[[], bool] | None = None,
        mark: Callable[[], int] | None = None,
    ) -> None:
        if config.max_rows < 1 or config.max_age_s <= 0 or config.max_inflight_batches < 1:
            raise ValueError("max_rows, max_age_s and max_inflight_batches must be positive")
        if config.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if config.dead_letter is not None and config.path != "embedded":
            raise ValueError("dead_letter (the RQ/DLQ) works on the embedded path only")
        if config.foreach_batch_frames == "typed" and (
            config.path != "embedded" or config.dead_letter is not None
        ):
            raise ValueError(
                "foreach_batch_frames='typed' works on the embedded path without dead_letter "
                "(the streaming path's foreach_batch gets Spark's own generic DataFrame)"
            )
        self.config = config
        # several processes share the RQ/DLQ (dead_letter); this one drives it while true
        self._rq_driver = rq_driver
        self.foreach_batch = foreach_batch
        self._foreach_identity = foreach_batch is not None and _takes_identity(foreach_batch)
        # the default output's atomic commits (embedded path, no RQ): see the module docstring
        self.committer: Committer | None = None
        self.layout = _layout(config, foreach_batch is not None)
        # the connector's completeness watermark now (micros), for each Delta commit's metadata
        self._mark = mark
        if (
            foreach_batch is None
            and (config.path == "embedded" or self.layout == "typed")
            and config.dead_letter is None
            and config.atomic_commit
            and (_is_path(config.output_dir) or self.layout == "typed")
        ):
            self.committer = Committer(config.output_dir, connector=config.connector, permit=permit)
        if config.table_format == "delta" and (
            foreach_batch is not None or self.layout != "typed" or self.committer is None
        ):
            raise ValueError(
                "table_format='delta' is the typed default output committed by the bridge: "
                "without foreach_batch, dead_letter or atomic_commit=False, to a directory or an "
                "s3://, gs:// or file:// URI"
            )
        if (
            config.path == "streaming"
            and not _is_path(config.output_dir)
            and not (config.spool_dir and config.checkpoint_dir)
        ):
            raise ValueError(
                "the streaming path keeps its spool and Spark's checkpoint in directories: with "
                f"output_dir {config.output_dir} give spool_dir and checkpoint_dir"
            )
        # the streaming path's typed sink (a subclass of it in tests)
        self.stream_sink: type[Any] | None = None
        self.spark: Any = spark
        self._owns_spark = spark is None
        self.run_id = f"{time.time_ns():020d}"
        self._batcher = Batcher(config.max_rows, config.max_age_s)
        self._futures: dict[int, asyncio.Future[None]] = {}  # id(SinkBatch) → future
        # per partition: what Spark committed and what the cutter took ahead of it, the gaps
        # failed batches left, the held batches and their fence keys, the failure cascade and
        # its generation (protocol/ledger.py)
        self.ledger = OutputLedger(ahead=True)
        self._validate = config.debug_validate
        self.watermarks: dict[int, dict[str, int]] = {}  # batch id → token → watermark (recent)
        self._watermark_ids: deque[int] = deque()
        self.latencies: deque[float] = deque(maxlen=100_000)  # put → commit, per SinkBatch
        self._put_at: dict[int, float] = {}
        self._inflight_cuts: dict[int, Cut] = {}
        self._frames: dict[int, Any] = {}  # batch id → its DataFrame, built by the cutter
        self._committer_done = False
        # the streaming path: spooled cuts Spark's checkpoint has not committed yet
        self._unacked: deque[_Spooled] = deque()
        self._next_seq = 0
        self._ack_kick: asyncio.Event | None = None
        # the streaming query died for good, or the session was lost and not replaced
        self._broken: BridgeError | SparkLost | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._changed: asyncio.Condition | None = None
        self._kick: asyncio.Event | None = None
        self._group: asyncio.TaskGroup | None = None
        self._closing = False
        self._closed = False
        self._inflight = 0
        self._local_dir: str | None = None
        self._streaming: Any = None
        self._rq: RetryQueue | None = None
        self._spark_lock = asyncio.Lock()  # one Spark job at a time
        self._supervisor: SessionSupervisor | None = None  # replaces a lost session
        self._retry_sends: list[PendingSend] = []
        self._retry_kick: asyncio.Event | None = None
        self._rows_parked = self._rows_retried = self._isolation_runs = 0
        # typed micro-batches written through Spark (with a known job count) and their jobs
        self.typed_writes = self.typed_write_jobs = 0
        # seconds spent per phase of the default output's micro-batches (summed): "prepare"
        # (dropping replays, building the wire or Arrow table), "write" (the Spark job and
        # its receipt), "commit" (the committer: Delta commits, progress, manifest)
        self.phase_s: dict[str, float] = {"prepare": 0.0, "write": 0.0, "commit": 0.0}
        # when the first batch with records came and the last micro-batch with rows committed
        # (time.monotonic()): the span the output was being written
        self.first_put_at: float | None = None
        self.last_commit_at: float | None = None
        # counters
        self._puts = self._rows_in = self._rows_dedup = self._rows_committed = 0
        self._batches_committed = self._batches_failed = self._attempts_failed = 0
        self._puts_failed = self._puts_refused = 0
        self._last_latency = 0.0
        self._last_batch_id = -1

    def __repr__(self) -> str:
        where = self.config.remote or self.config.master
        return f"SparkBridge({where}, {self.config.path}, output={self.config.output_dir})"

    # --- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        cfg = self.config
        self._changed = asyncio.Condition()
        self._kick = asyncio.Event()
        if self.spark is None:
            self._local_dir = tempfile.mkdtemp(prefix="shoal-spark-")
            try:
                async with asyncio.timeout(cfg.start_timeout_s):
                    self.spark = await asyncio.to_thread(
                        start_session,
                        master=cfg.master,
                        remote=cfg.remote,
                        app_name=cfg.app_name,
                        conf=cfg.conf,
                        local_dir=self._local_dir,
                    )
            except TimeoutError:
                await asyncio.to_thread(abandon_start, cfg.remote)
                raise SparkStartError(
                    f"Spark did not start within {cfg.start_timeout_s:.0f}s "
                    f"({cfg.remote or cfg.master}; spark.start_timeout_s)"
                ) from None
        try:
            async with asyncio.timeout(cfg.start_timeout_s):
                await asyncio.to_thread(warm, self.spark)
            if self.foreach_batch is None and cfg.path == "embedded" and cfg.remote is None:
                await asyncio.to_thread(self._warm_write, None)
            if self.committer is not None:
                if not self.committer.store.is_local:  # reachable and writable: now, not later
                    await asyncio.to_thread(self.committer.store.check)
                await asyncio.to_thread(self.committer.recover)
                for legacy in self.committer.legacy_state():
                    log.warning(
                        "%r: %s/%s holds output state of an earlier shoal version, not kept "
                        "per connector; it is not read",
                        self,
                        cfg.output_dir,
                        legacy,
                    )
            elif self.foreach_batch is None and cfg.resume_dedupe:
                # no progress files to resume from: learn the tails from the output itself
                await asyncio.to_thread(self._seed_tails)
            if cfg.path == "streaming":
                self._streaming = self._stream_backend()
                self._next_seq = await asyncio.to_thread(self._streaming.next_seq)
                await asyncio.to_thread(self._streaming.start)
                async with asyncio.timeout(cfg.start_timeout_s):
                    await self._warm_stream()
        except TimeoutError:
            await self._stop_spark()
            raise SparkStartError(
                f"Spark's first job did not finish within {cfg.start_timeout_s:.0f}s "
                "(spark.start_timeout_s)"
            ) from None
        except BaseException:
            await self._stop_spark()
            raise
        # both paths: a lost session is replaced (the streaming query starts again on it)
        warm_more = None
        if cfg.path == "embedded" and self.foreach_batch is None and cfg.remote is None:
            warm_more = self._warm_write
        self._supervisor = SessionSupervisor(
            cfg,
            self.spark,
            owned=self._owns_spark,
            local_dir=self._local_dir,
            warm_more=warm_more,
        )
        if cfg.dead_letter is not None:
            rq = RetryQueue(
                cfg.dead_letter.kafka,
                cfg.dead_letter.queue_config(),
                self._send_retry,
                name=cfg.dead_letter.name,
                driver=self._rq_driver,
                takeover_grace_s=cfg.dead_letter.takeover_grace_s,
            )
            try:
                await rq.__aenter__()
            except BaseException:
                await self._stop_spark()
                raise
            self._rq = rq
            self._retry_kick = asyncio.Event()
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        self._group.create_task(self._cut_loop(), name="spark-bridge-cut")
        self._group.create_task(self._commit_loop(), name="spark-bridge-commit")
        if self._rq is not None:
            self._group.create_task(self._retry_loop(), name="spark-bridge-retry")
        if self._streaming is not None:
            self._ack_kick = asyncio.Event()
            self._group.create_task(self._ack_loop(), name="spark-bridge-ack")
        log.info("%r: started", self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._closed:
            return
        self._closed = True
        assert self._group is not None
        assert self._kick is not None
        self._closing = True
        self._kick.set()
        try:
            try:
                async with asyncio.timeout(self.config.stop_timeout_s):
                    await self._group.__aexit__(None, None, None)
            except TimeoutError:
                log.exception("%r: in-flight batches did not commit in time; failing them", self)
                self._fail_everything(BridgeError("the Spark bridge stopped before committing"))
        finally:
            try:
                if self._rq is not None:
                    await self._rq.__aexit__(None, None, None)
            finally:
                self._fail_everything(BridgeError("the Spark bridge stopped"))
                await self._stop_spark()

    async def abort(self) -> None:
        """Die abruptly (for tests of a task's death): the RQ/DLQ writes nothing more and every
        pending batch fails; what is in the RQ topic stays there for the next bridge. The
        context manager still has to exit."""
        self._broken = BridgeError(f"{self!r} was aborted")
        if self._rq is not None:
            await self._rq.abort()
        self._fail_everything(self._broken)

    async def _stop_spark(self) -> None:
        if self._streaming is not None:
            await asyncio.to_thread(self._streaming.stop)
        supervisor = self._supervisor
        if supervisor is not None and supervisor.lost is not None:
            await asyncio.to_thread(supervisor.forget)  # its JVM is gone: stop() would fail
            self.spark = None
        elif self._owns_spark and self.spark is not None:
            dead = (
                None
                if supervisor is None
                else await asyncio.to_thread(supervisor.dead_because, None)
            )
            if supervisor is not None and dead is not None:
                # No job since needed the session (a job would have found it dead), so nothing
                # was lost with it; stop() would only fail on the dead JVM.
                log.warning("%r: Spark's session was lost before the end: %s", self, dead)
                await asyncio.to_thread(supervisor.forget)
            else:
                await asyncio.to_thread(self.spark.stop)
            self.spark = None
        if self._local_dir is not None:
            shutil.rmtree(self._local_dir, ignore_errors=True)

    # --- the Sink port --------------------------------------------------------------------

    async def prepare(self, token: str) -> None:
        """Before a reader of ``token`` hands over anything: with the RQ/DLQ, fold in every
        entry written so far (what the partition's previous owner parked keeps its keys
        blocked)."""
        if self._rq is not None:
            await self._rq.barrier()

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        """Hand over a batch; waits while the buffer is full and ``max_inflight_batches``
        micro-batches are in flight. The future resolves once Spark committed its rows."""
        if self._changed is None or self._closing:
            self._puts_refused += 1
            raise BridgeError(f"{self!r} is not running")
        if self._broken is not None:
            self._puts_refused += 1
            raise self._broken
        if self._rq is not None:
            try:
                self._rq.check_alive()
            except RetryQueueError as exc:
                self._puts_refused += 1
                raise BridgeError(f"{self!r}: the retry queue failed: {exc}") from exc
        if not _is_sink_batch(batch):
            self._puts_refused += 1
            raise TypeError(f"SparkBridge.put takes a SinkBatch of DataChange, got {batch!r:.200}")
        if id(batch) in self._futures:
            self._puts_refused += 1
            raise BridgeError(f"this SinkBatch object of {batch.token} is already in flight")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._puts += 1
        rows = sum(len(r.mods) for r in batch.records)
        self._rows_in += rows
        async with self._changed:
            await self._changed.wait_for(lambda: not self._batcher.full() or self._closing)
            if self._stopping():
                self._puts_refused += 1
                raise BridgeError(f"{self!r} stopped")
            admitted = self.ledger.admit(id(batch), batch.token, batch.records, batch.watermark)
            self._check()
            if not isinstance(admitted, Admit):  # it continues past a failed batch (a gap)
                self._puts_refused += 1
                self._puts_failed += 1
                _fail(
                    future,
                    BridgeError(
                        f"an earlier batch of {batch.token} failed; re-read from the committed "
                        "watermark"
                    ),
                )
                return future
            now = time.monotonic()
            if self.first_put_at is None and batch.records:
                self.first_put_at = now
            self._batcher.add(batch, now)
            self._futures[id(batch)] = future
            self._put_at[id(batch)] = now
        assert self._kick is not None
        if self._batcher.entries == 1 or self._batcher.full():
            self._kick.set()
        return future

    def entries_of(self, batch_id: int) -> tuple[SinkBatch, ...]:
        """The ``SinkBatch``es of micro-batch ``batch_id`` while it is in flight (else ())."""
        cut = self._inflight_cuts.get(batch_id)
        return () if cut is None else cut.entries

    def _streaming_foreach(self) -> Callable[[Any, int], None] | None:
        """The ``foreach_batch`` as Spark's streaming query calls it: Spark's own batch id is
        stable across re-delivery (its checkpoint replays a batch under the same id), so it is
        the identity there (``s<batch id>``)."""
        foreach: Callable[..., None] | None = self.foreach_batch
        if foreach is None or not self._foreach_identity:
            return foreach

        def with_identity(df: Any, batch_id: int) -> None:
            assert foreach is not None
            foreach(df, batch_id, f"s{batch_id}")

        return with_identity

    async def durable_position(self, token: str) -> Position | None:
        """Partition ``token``'s committed position by the default output's own record (None
        without atomic commits: then the sync topic's position is the one). A new reader of
        the partition asks this first: a gap an earlier reader's failed batch left is closed
        (it resumes from what is committed; a partition read on elsewhere and back here was
        refused for ever)."""
        self.ledger.reader_starts(token)
        self._check()
        if self.committer is None:
            return None
        return await asyncio.to_thread(self.committer.committed, token)

    async def fence(self, batches: Sequence[SinkBatch]) -> list[bool] | None:
        """For each batch, whether it passed the commit point; those that did not never will
        (a batch no longer held is answered False: its future tells). None without atomic
        commits: nothing to fence against (at-least-once there)."""
        committer = self.committer
        if committer is None:
            return None
        keys = [self.ledger.key_of(id(b)) for b in batches]
        outcome = await asyncio.to_thread(committer.fence, [k for k in keys if k is not None])
        return [k is not None and k in outcome.committed for k in keys]

    def _check(self) -> None:
        """With ``SparkConfig.debug_validate``: the ledger's invariants, after each of its
        events on the event loop."""
        if self._validate:
            self.ledger.validate()

    def _stopping(self) -> bool:
        return self._closing

    def stats(self) -> BridgeStats:
        return BridgeStats(
            puts=self._puts,
            rows_in=self._rows_in,
            rows_deduplicated=self._rows_dedup,
            rows_committed=self._rows_committed,
            batches_committed=self._batches_committed,
            batches_failed=self._batches_failed,
            attempts_failed=self._attempts_failed,
            puts_failed=self._puts_failed,
            puts_refused=self._puts_refused,
            inflight=self._inflight,
            buffered_rows=self._batcher.rows,
            last_commit_latency_s=self._last_latency,
            last_batch_id=self._last_batch_id,
            rows_parked=self._rows_parked,
            rows_retried=self._rows_retried,
            isolation_runs=self._isolation_runs,
            rq_held=0 if self._rq is None else self._rq.core.held_count(),
            in_dlq=0 if self._rq is None else len(self._rq.core.dlq_records()),
            fenced_refused=0 if self.committer is None else self.committer.fenced_refused,
        )

    # --- the cutter -----------------------------------------------------------------------

    async def _cut_loop(self) -> None:
        assert self._changed is not None
        assert self._kick is not None
        try:
            while True:
                now = time.monotonic()
                if self._closing and self._batcher.entries == 0:
                    return
                if not self._closing and not self._batcher.due(now, self._inflight):
                    deadline = self._batcher.deadline()
                    if deadline is not None and deadline <= now:
                        deadline = None  # old enough but held back: until full or one is done
                    self._kick.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(None if deadline is None else deadline - now):
                            await self._kick.wait()
                    continue
                async with self._changed:
                    await self._changed.wait_for(
                        lambda: self._inflight < self.config.max_inflight_batches
                    )
                    cut = self._batcher.cut()
                    if cut is None:
                        continue
                    self._inflight += 1
                    self._inflight_cuts[cut.batch_id] = cut
                    self._changed.notify_all()
                # after a failure the cutter's tail starts again from what committed
                generation = self.ledger.begin_cut()
                await self._seed_from_progress(cut)
                self._check()
                log.debug("%r: cut micro-batch %d (%d rows)", self, cut.batch_id, cut.rows)
                prepared = await asyncio.to_thread(self._prepare, cut)
                await self._queue.put((cut, generation, *prepared))
        finally:
            self._queue.put_nowait(_STOP)

    def _warm_write(self, spark: Any = None) -> None:
        """Blocking: one tiny write through the default sink, into a temporary directory (the
        first costs seconds; the typed layout's also registers its data source with the session
        and starts a Python worker per core, each importing what the Delta path needs with
        ``table_format`` delta)."""
        target = tempfile.mkdtemp(prefix="shoal-spark-warm-")
        spark = self.spark if spark is None else spark
        try:
            if self.layout == "typed":
                sc = getattr(spark, "sparkContext", None)
                rows = max(1, sc.defaultParallelism if sc is not None else 1)
                batch = TypedBatch([("warm", warm_records(rows))], rows)
                if self.config.table_format == "delta":
                    batch.write_unlisted_delta_files(spark, target)
                else:
                    batch.write_in_place(spark, target, "warm")
            else:
                write_default(spark.createDataFrame(warm_table()), target, "warm")
        except Exception as exc:
            raise SparkStartError(f"Spark cannot write parquet: {exc}") from exc
        finally:
            shutil.rmtree(target, ignore_errors=True)

    async def _seed_from_progress(self, cut: Cut) -> None:
        """With atomic commits: the first time a partition is seen, learn what is committed of
        it from its progress file (one small file, not the whole output), so records an earlier
        run wrote and a re-reader hands in again are not written twice."""
        committer = self.committer
        if committer is None:
            return
        for token in self.ledger.unseeded(e.token for e in cut.entries):
            position = await asyncio.to_thread(committer.committed, token)
            self.ledger.seed(token, position)

    def _seed_tails(self) -> None:
        """Blocking: learn, per partition token, the newest commit timestamp in the default
        output and the identities at it, so records a previous run wrote but never acked
        (its readers re-read them after a restart) are not written twice."""
        out = Path(self.config.output_dir)
        if self.layout == "typed":
            for token, identity in typed_tails(self.config.output_dir):
                self.ledger.seed_identity(token, identity)
            return
        if self.config.remote is None and not any(out.rglob("*.parquet")):
            return
        from pyspark.sql import functions as f

        # Over Spark Connect the read is lazy: a missing directory fails at collect(), and the
        # directory is the server's, so we cannot look first. Both steps are in the try.
        try:
            df = self.spark.read.parquet(str(out)).select(
                "partition_token", "commit_ts", "server_transaction_id", "record_sequence"
            )
            newest = df.groupBy("partition_token").agg(f.max("commit_ts").alias("commit_ts"))
            rows = df.join(newest, ["partition_token", "commit_ts"]).distinct().collect()
        except Exception as exc:
            if not _no_output_yet(exc):
                raise SparkStartError(
                    f"cannot read the earlier output at {out} to resume de-duplication: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            log.info("%r: no earlier output at %s to resume de-duplication from", self, out)
            return
        for row in rows:
            ts, txn, seq = row["commit_ts"], row["server_transaction_id"], row["record_sequence"]
            self.ledger.seed_identity(row["partition_token"], (ts, txn, seq))
        log.info("%r: resumed de-duplication for %d partitions", self, self.ledger.partitions())

    def _prepare(self, cut: Cut) -> tuple[Any, list[tuple[str, list[DataChange]]], int]:
        """Off the loop: drop replays, build the Arrow table."""
        t0 = time.monotonic()
        fresh = [(e.token, self.ledger.take_fresh(e.token, e.records)) for e in cut.entries]
        rows = sum(len(r.mods) for _, records in fresh for r in records)
        if self.layout == "typed" and self.foreach_batch is None:
            batch = TypedBatch(fresh, rows)
            self.phase_s["prepare"] += time.monotonic() - t0
            return batch, fresh, rows
        if self.foreach_batch is not None and self.config.foreach_batch_frames == "typed":
            return _TypedTables(fresh, rows), fresh, rows
        table = to_arrow(fresh)
        if self.committer is not None and rows:
            # Handing the rows to the JVM takes a tenth of a micro-batch's time: done here, it
            # overlaps the previous micro-batch's write (DataFrames can be re-run on a retry).
            try:
                self._frames[cut.batch_id] = self._dataframe(table)
            except Exception:
                log.warning(
                    "%r: building micro-batch %d early failed", self, cut.batch_id, exc_info=True
                )
        return table, fresh, rows

    # --- the committer --------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        # the default output's micro-batches are pipelined (_pipelined): one commits while the
        # next is written; these are the tasks of the last two, oldest first
        running: deque[asyncio.Task[None]] = deque()
        try:
            while True:
                item = await self._queue.get()
                if item is _STOP:
                    return
                cut, generation, table, fresh, rows = item
                self._rows_dedup += cut.rows - rows
                self._remember_watermarks(cut)
                if not self.ledger.current(generation):
                    self._fail_cut(cut, BridgeError("an earlier micro-batch failed; re-read"))
                    await self._done(cut)
                elif self._streaming is not None:
                    await self._spool(cut, table, fresh, rows, generation)  # see _ack_loop
                elif self._pipelined():
                    assert self._group is not None
                    while len(running) > 1:  # the one before the previous must be done
                        await asyncio.wait([running.popleft()])
                    written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    order = _Order(running[-1] if running else None, written, generation)
                    running.append(
                        self._group.create_task(
                            self._commit_in_order(cut, table, fresh, rows, order),
                            name=f"spark-bridge-batch-{cut.batch_id}",
                        )
                    )
                    await written  # its Spark write ended: the next one's may start
                else:
                    try:
                        await self._commit(cut, table, fresh, rows)
                    finally:
                        await self._done(cut)
        finally:
            if running:
                await asyncio.wait(running)
            self._committer_done = True

    def _pipelined(self) -> bool:
        """Whether micro-batches are committed by the committer while the next one is written:
        the default output without the RQ (``_commit_in_order``)."""
        return self.committer is not None and self._rq is None

    async def _commit_in_order(
        self,
        cut: Cut,
        table: Any,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
        order: _Order,
    ) -> None:
        """Write micro-batch ``cut`` through Spark as soon as the one before it is written, and
        commit it once the one before it is committed (``order``): Spark writes the next
        micro-batch while the committer makes this one visible (its files are invisible until
        then: docs/design.md#exactly-once-output). If the one before it fails, this one
        commits nothing (its files are deleted) and fails as cut after a failure does."""
        try:
            await self._commit(cut, table, fresh, rows, order)
        finally:
            order.wrote()
            await self._done(cut)

    async def _done(self, cut: Cut) -> None:
        """``cut`` is no longer in flight (committed or failed)."""
        assert self._changed is not None
        self._inflight_cuts.pop(cut.batch_id, None)
        self._frames.pop(cut.batch_id, None)
        async with self._changed:
            self._inflight -= 1
            self._changed.notify_all()
        assert self._kick is not None
        self._kick.set()  # a micro-batch held back by age (Batcher.due) may be cut now

    async def _commit(
        self,
        cut: Cut,
        table: Any,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
        order: _Order | None = None,
    ) -> None:
        if self._rq is not None:
            try:
                await self._commit_keyed(self._rq, cut, table, fresh, rows)
            except RetryQueueError as exc:
                self._broken = BridgeError(f"the retry queue failed: {exc}")
                self._fail_permanently([cut], self._broken)
            except SparkLost as lost:
                self._fail_permanently([cut], lost)
            return
        error = None
        if self.committer is not None:
            error = await self._attempts(cut.batch_id, table, rows, cut, commit=True, order=order)
            if order is not None:
                await order.after_prior()  # failed early: still after the one before it
                if not self.ledger.current(order.generation):  # the one before it failed
                    self._fail_cut(cut, BridgeError("an earlier micro-batch failed; re-read"))
                    return
            if isinstance(error, CommitRefused | CommitIncomplete):
                if isinstance(error, CommitIncomplete):
                    self._broken = BridgeError(str(error))
                self._fail_permanently([cut], BridgeError(str(error)))
                return
        elif rows or self.foreach_batch is not None:
            error = await self._attempts(cut.batch_id, table, rows, cut)
        if isinstance(error, SparkLost):
            self._fail_permanently([cut], error)
            return
        if error is not None:
            self._fail_permanently(
                [cut],
                BridgeError(
                    f"Spark micro-batch {cut.batch_id} failed after {self.config.max_attempts} "
                    f"attempts: {_error_text(error)}"
                ),
            )
            return
        self._succeed(cut, fresh, rows)

    async def _attempts(
        self,
        batch_id: int,
        table: Any,
        rows: int,
        cut: Cut,
        *,
        commit: bool = False,
        identity: str | None = None,
        order: _Order | None = None,
    ) -> Exception | None:
        """Run micro-batch ``cut`` (its rows: ``table``) up to ``max_attempts`` times (with
        backoff); the last error, or None once it committed. With ``commit`` it goes through
        the committer (a refused or incomplete commit is not retried: it is returned at once):
        Spark writes it (one job at a time), then it is committed, with ``order`` only once the
        micro-batch before it is done (if that one failed, what this one wrote is deleted and
        None returned: the caller sees the generation moved). ``identity``: the batch
        identity, if not the cut's (its rows were filtered)."""
        cfg = self.config
        error: Exception | None = None
        if identity is None:
            # the default output's directories are shared by connectors: salted by this one;
            # a user's foreach_batch gets the contents' identity (docs/design.md)
            salt = self.config.connector if self.committer is not None else ""
            identity = _cut_identity(cut, salt)
        if isinstance(self._broken, SparkLost):
            return self._broken
        attempt = 0
        while True:
            attempt += 1
            try:
                async with self._spark_lock:
                    if commit:
                        staged = await self._spark_job(table, self._stage, cut, table, identity)
                    else:
                        await self._spark_job(table, self._run_batch, batch_id, table, identity)
                if commit:
                    if order is not None:
                        order.wrote()
                        await order.after_prior()
                        if not self.ledger.current(order.generation):
                            await asyncio.to_thread(self._discard, identity, staged)
                            return None
                    t0 = time.monotonic()
                    committer = self.committer
                    assert committer is not None
                    await asyncio.to_thread(self._commit_cut, committer, cut, identity, *staged)
                    self._log_commit(cut, table, staged, time.monotonic() - t0)
            except (CommitRefused, CommitIncomplete) as exc:
                self._job_succeeded()  # Spark wrote it; the commit itself was refused
                return exc
            except Exception as exc:
                try:
                    if await self._session_replaced(exc):
                        attempt -= 1  # the session died under the batch: not the batch's fault
                        continue
                except SparkLost as lost:
                    return lost
                error = exc
                self._attempts_failed += 1
                log.warning(  # the text: PySpark errors' repr is often just "PySparkValueError()"
                    "%r: micro-batch %d (%d rows) failed, attempt %d/%d: %s",
                    self,
                    batch_id,
                    rows,
                    attempt,
                    cfg.max_attempts,
                    _error_text(exc),
                )
                delay = retry_delay(attempt, cfg.max_attempts, cfg.retry_backoff_s)
                if delay is None:  # the last attempt (protocol/ledger.py, rule 5)
                    return error
                await asyncio.sleep(delay)
                continue
            self._job_succeeded()
            return None

    # --- the retry queue and dead-letter queue (dead_letter) ------------------------------

    async def _commit_keyed(
        self,
        rq: RetryQueue,
        cut: Cut,
        table: Any,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
    ) -> None:
        """Commit ``cut`` with the RQ: rows of keys the RQ holds are parked behind them; if
        Spark keeps failing the rest, the failing rows are isolated and parked."""
        by_entry: list[list[SparkRecord]] | None = None
        parked: dict[int, list[asyncio.Future[None]]] = {}
        direct_rows = rows
        if rows and rq.busy():
            keys = await asyncio.to_thread(_ordering_keys, fresh)
            blocked = {k for k in keys if rq.blocks(k)}  # on the loop: consistent with the RQ
            if blocked:
                by_entry = await asyncio.to_thread(_records_by_entry, fresh)
                for i, records in enumerate(by_entry):
                    behind = [r for r in records if r.key in blocked]
                    if behind:
                        parked.setdefault(i, []).append(await self._park(rq, behind, None))
                    by_entry[i] = [r for r in records if r.key not in blocked]
                direct = [r for records in by_entry for r in records]
                direct_rows = len(direct)
                table = await asyncio.to_thread(records_table, direct)
        committed = direct_rows
        error = None
        if direct_rows or self.foreach_batch is not None:
            identity = None
            if by_entry is not None:  # rows parked: the identity of the rows written
                identity = records_identity(r.record_id for rs in by_entry for r in rs)
            error = await self._attempts(cut.batch_id, table, direct_rows, cut, identity=identity)
        if error is not None:
            if by_entry is None:
                by_entry = await asyncio.to_thread(_records_by_entry, fresh)
            entry_of = {r.record_id: i for i, records in enumerate(by_entry) for r in records}
            direct = [r for records in by_entry for r in records]
            ok, failed = await self._write_isolating(direct, error)
            committed = len(ok)
            groups: dict[tuple[int, str], list[SparkRecord]] = {}
            for record, text in failed:
                groups.setdefault((entry_of[record.record_id], text), []).append(record)
            # entry order: a key's rows are in one group per entry, and must reach the RQ in order
            for (i, text), records in sorted(groups.items(), key=lambda g: g[0][0]):
                parked.setdefault(i, []).append(await self._park(rq, records, text))
            log.warning(
                "%r: micro-batch %d failed %d times: %d rows committed in parts, %d parked in "
                "the retry queue (%d keys)",
                self,
                cut.batch_id,
                self.config.max_attempts,
                len(ok),
                len(failed),
                len(record_keys(r for r, _ in failed)),
            )
        self._succeed(cut, fresh, committed, parked)

    async def _park(
        self, rq: RetryQueue, records: list[SparkRecord], failed: str | None
    ) -> asyncio.Future[None]:
        self._rows_parked += len(records)
        return await rq.submit(
            [(r.record_id, r.key, encode_record(r)) for r in records], failed=failed
        )

    async def _write_isolating(
        self, records: list[SparkRecord], error: Exception | None
    ) -> tuple[list[SparkRecord], list[tuple[SparkRecord, str]]]:
        """Write ``records`` to Spark (they failed already with ``error``, if given), bisecting
        by ordering key on failure: (committed, failed alone with their error)."""
        committed: list[SparkRecord] = []
        failed: list[tuple[SparkRecord, str]] = []
        todo: list[tuple[list[SparkRecord], Exception | None]] = [(records, error)]
        while todo:
            group, err = todo.pop()
            if not group:
                continue
            if err is None:
                err = await self._write_once(group)
                if err is None:
                    committed += group
                    continue
            if isinstance(err, SparkLost):  # not the rows' fault: nothing to isolate
                raise err
            if isinstance(err, RowsFailed):
                named = [r for r in group if r.key in err.keys]
                if named:
                    failed += [(r, _error_text(err)) for r in named]
                    todo.append(([r for r in group if r.key not in err.keys], None))
                    continue
            if len(record_keys(group)) == 1:
                failed += [(r, _error_text(err)) for r in group]
                continue
            left, right = halves(group)
            todo += [(right, None), (left, None)]
        return committed, failed

    async def _write_once(self, records: list[SparkRecord]) -> Exception | None:
        """One Spark batch of ``records`` under a fresh batch id: None, or why it failed."""
        batch_id = self._batcher.take_id()
        self._isolation_runs += 1
        table = await asyncio.to_thread(records_table, records)
        identity = records_identity(r.record_id for r in records)
        try:
            async with self._spark_lock:
                await self._spark_job(table, self._run_batch, batch_id, table, identity)
        except Exception as exc:
            try:
                if await self._session_replaced(exc):
                    return await self._write_once(records)
            except SparkLost as lost:
                return lost
            self._attempts_failed += 1
            log.info("%r: batch %d (%d rows) failed: %r", self, batch_id, len(records), exc)
            return exc
        self._job_succeeded()
        return None

    async def _spark_job(self, table: Any, run: Callable[..., Any], *args: Any) -> Any:
        """Run ``run(*args)`` (one attempt of a batch of ``table``) in a worker thread and
        return what it returns, under ``SparkConfig.job_timeout_s`` where Spark runs it: past
        it the session's jobs are cancelled and, once the thread ended,
        :class:`SparkJobTimeout` is raised (the supervisor then replaces the session). A job that finished as it was cancelled counts
        as done. A thread that does not end after the cancel is a session that cannot be
        trusted with the batch again (it may still commit it): :class:`SparkLost`."""
        limit = self.config.job_timeout_s
        if limit is None:
            return await asyncio.to_thread(run, *args)
        job = asyncio.ensure_future(asyncio.to_thread(run, *args))
        try:
            done, _ = await asyncio.wait({job}, timeout=limit)
            if job in done:
                return job.result()
            log.error(
                "%r: a Spark job ran past spark.job_timeout_s (%gs): cancelling it", self, limit
            )
            try:
                async with asyncio.timeout(_CANCEL_WAIT_S):
                    await asyncio.to_thread(cancel_jobs, self.spark)
            except Exception as exc:  # the thread's end below decides
                log.warning("%r: cancelling Spark's jobs failed: %s", self, _error_text(exc))
            done, _ = await asyncio.wait({job}, timeout=_CANCEL_WAIT_S)
        finally:
            if not job.done():  # cancelled with us, or still running: its end is logged
                job.add_done_callback(self._late_job_ended)
        if job not in done:
            where = self.config.remote or self.config.master
            raise SparkLost(
                f"Spark ({where}): a job ran past spark.job_timeout_s ({limit:g}s) and had not "
                f"ended {_CANCEL_WAIT_S:g}s after it was cancelled"
            )
        failed = job.exception()
        if failed is None:
            log.warning("%r: the Spark job finished as it was cancelled", self)
            return job.result()
        raise SparkJobTimeout(
            f"a Spark job ran past spark.job_timeout_s ({limit:g}s) and was cancelled"
        ) from failed

    def _late_job_ended(self, job: asyncio.Future[None]) -> None:
        if job.cancelled():
            return
        if (exc := job.exception()) is not None:
            log.warning("%r: a Spark job given up on ended: %s", self, _error_text(exc))
        else:
            log.warning("%r: a Spark job given up on ended", self)

    def _job_succeeded(self) -> None:
        if self._supervisor is not None:
            self._supervisor.job_succeeded()

    async def _session_replaced(self, exc: BaseException) -> bool:
        """After a Spark job failed with ``exc``: whether the session had died and a new one
        now stands in (run the job again); ``SparkLost`` (the bridge is broken for good, the
        process must stop) if it cannot be replaced (``runtime.spark.supervisor``)."""
        supervisor = self._supervisor
        if supervisor is None:
            return False
        if isinstance(exc, SparkLost):  # the job itself found the session beyond repair
            self._broken = exc
            raise exc
        if self._broken is not None and isinstance(self._broken, SparkLost):
            raise self._broken
        async with self._spark_lock:  # no other job on the dead session meanwhile
            try:
                replaced = await supervisor.recover(exc)
            except SparkLost as lost:
                self._broken = lost
                raise
        if replaced:
            self.spark = supervisor.spark
        return replaced

    async def _send_retry(self, send: PendingSend) -> None:
        """The RQ's delivery port: gather sends for the retry loop's next Spark batch."""
        assert self._retry_kick is not None
        self._retry_sends.append(send)
        self._retry_kick.set()

    async def _retry_loop(self) -> None:
        """Deliver what the RQ sends (at most one row per key), one Spark batch at a time, and
        answer each send; ends once the bridge closes and the RQ has nothing unsettled."""
        rq, kick = self._rq, self._retry_kick
        assert rq is not None
        assert kick is not None
        while True:
            if self._closing and self._committer_done and rq.statistics().unsettled == 0:
                return
            if not self._retry_sends:
                kick.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await kick.wait()
                continue
            sends, self._retry_sends = self._retry_sends, []
            records: list[SparkRecord] = []
            for send in sends:
                try:
                    records.append(decode_record(send.payload))
                except msgspec.DecodeError as exc:
                    log.exception("%r: RQ payload of %s undecodable", self, send.record_id)
                    rq.failed(send.record_id, f"undecodable payload: {exc}")
            try:
                ok, failed = await self._write_isolating(records, None)
            except SparkLost:
                log.exception("%r: the retry queue stops with Spark", self)
                return
            self._rows_retried += len(ok)
            self._rows_committed += len(ok)
            for record in ok:
                rq.delivered(record.record_id)
            for record, text in failed:
                rq.failed(record.record_id, text)

    # --- operator actions (dead_letter) ---------------------------------------------------

    def _dead_letter(self) -> RetryQueue:
        if self._rq is None:
            raise BridgeError(f"{self!r} has no retry queue (SparkConfig.dead_letter)")
        return self._rq

    def dlq_records(self) -> list[SparkDlqRecord]:
        """The rows in the DLQ."""
        out = []
        for e, raw in self._dead_letter().dlq_records():
            record = None
            if raw is not None:
                try:
                    record = decode_record(raw)
                except msgspec.DecodeError:
                    log.exception("%r: DLQ payload of %s undecodable", self, e.record_id)
            out.append(SparkDlqRecord(e.record_id, e.key, e.attempts, e.error, record))
        return out

    def replay_dlq(self, record_ids: Iterable[str] | None = None) -> list[str]:
        """Put DLQ rows (all, or those named) back into the RQ, due now; return their ids."""
        return self._dead_letter().replay_dlq(record_ids)

    def discard_dlq(self, record_ids: Iterable[str]) -> list[str]:
        return self._dead_letter().discard_dlq(record_ids)

    async def wait_replayed(self, record_ids: Sequence[str]) -> None:
        """Wait until each of ``record_ids`` was committed or dead-lettered again."""
        await self._dead_letter().wait_replayed(record_ids)

    async def wait_retries_idle(self) -> None:
        """Wait until nothing is unsettled, in flight or due in the RQ (only DLQ rows, and rows
        parked behind them, remain)."""
        await self._dead_letter().wait_idle()

    def _fail_permanently(self, cuts: list[Cut], failure: BridgeError | SparkLost) -> None:
        """``cuts`` will never commit: fail them, and everything after them (it was
        de-duplicated assuming they commit), and refuse their partitions' continuations."""
        self._batches_failed += len(cuts)
        log.error("%r: %s", self, failure)
        # the ledger's cascade (protocol/ledger.py, rule 3): every batch held and not committed
        # fails, and its partition's continuations are refused from now on (gaps), or one could
        # commit past them; the generation moves on, so the cuts still in flight fail when they
        # reach the committer
        keys = [
            k for cut in cuts for e in cut.entries if (k := self.ledger.key_of(id(e))) is not None
        ]
        self.ledger.fail(keys)
        self._check()
        for cut in cuts:
            self._fail_cut(cut, failure)
        for entry in self._batcher.take_all():
            self._resolve(entry, failure)

    def _succeed(
        self,
        cut: Cut,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
        parked: dict[int, list[asyncio.Future[None]]] | None = None,
    ) -> None:
        """``cut``'s rows are committed, or (``parked``: entry index → RQ futures) handed to
        the RQ; an entry with parked rows resolves once the RQ settled them all."""
        keys = [k for e in cut.entries if (k := self.ledger.key_of(id(e))) is not None]
        self.ledger.committed(keys, fresh)
        self._check()
        self._rows_committed += rows
        self._batches_committed += 1
        self._last_batch_id = cut.batch_id
        now = time.monotonic()
        self._last_latency = now - cut.first_put
        if rows:
            self.last_commit_at = now
        for i, entry in enumerate(cut.entries):
            waits = (parked or {}).get(i)
            if waits:
                self._resolve_after(entry, waits)
            else:
                self._resolve(entry, None, now)

    def _resolve_after(self, entry: SinkBatch, waits: list[asyncio.Future[None]]) -> None:
        left = len(waits)

        def done(_: asyncio.Future[None]) -> None:
            nonlocal left
            left -= 1
            if left:
                return
            error: BaseException | None = None
            for f in waits:
                if f.cancelled():
                    error = BridgeError("parking rows in the retry queue was cancelled")
                elif f.exception() is not None:
                    error = BridgeError(f"parking rows in the retry queue failed: {f.exception()}")
            self._resolve(entry, error, time.monotonic())

        for f in waits:
            f.add_done_callback(done)

    # --- the streaming path ---------------------------------------------------------------

    async def _spool(
        self,
        cut: Cut,
        table: Any,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
        generation: int,
    ) -> None:
        """Write ``cut`` as the next spool file (none if it has no rows: it is acked with the
        files before it); Spark's checkpoint acks it (``_ack_loop``). The typed layout spools
        the chunks of its wire table, which tell the streaming writer where its files go
        (``TypedBatch.spool_table``); the bridge commits them once Spark's checkpoint holds
        the micro-batch."""
        from runtime.spark.streaming import spool_write

        seq: int | None = None
        identity: str | None = None
        if isinstance(table, TypedBatch):
            identity = _cut_identity(cut, self.config.connector)
        if rows:
            seq = self._next_seq
            try:
                if isinstance(table, TypedBatch):
                    assert self.committer is not None
                    assert identity is not None
                    table_ = await asyncio.to_thread(
                        table.spool_table,
                        self.committer,
                        identity,
                        self.config.table_format,
                        self._stream_chunks(),
                    )
                else:
                    table_ = table
                await asyncio.to_thread(spool_write, self._streaming.spool, seq, table_)
            except Exception as exc:
                self._attempts_failed += 1
                self._fail_permanently(
                    [cut], BridgeError(f"writing spool file {seq}: {type(exc).__name__}: {exc}")
                )
                await self._done(cut)
                return
            self._next_seq += 1
        self._unacked.append(_Spooled(seq, cut, fresh, rows, table, identity, generation))
        assert self._ack_kick is not None
        self._ack_kick.set()

    def _stream_chunks(self) -> int:
        """The chunks (tasks) of a typed micro-batch on the streaming path: the session's
        parallelism, as the query's start found it (spooling never asks Spark: its session may
        be dead, the spool file then waits for the query on the new one)."""
        return int(self._streaming.chunks)

    async def _warm_stream(self) -> None:
        """Spool an empty file and wait until Spark committed it: the query's first micro-batch
        (source process, planning, checkpoint) costs seconds, paid here before traffic."""
        from runtime.spark.streaming import spool_write

        seq = self._next_seq
        empty = to_arrow([])
        if self._streaming.typed:
            from runtime.spark.datasource import wire_chunks
            from runtime.typed import wire_table

            empty = wire_chunks(wire_table([])[0], 1).slice(0, 0)
        await asyncio.to_thread(spool_write, self._streaming.spool, seq, empty)
        self._next_seq += 1
        while True:  # Spark's checkpoint is files: polled, as in _ack_loop
            committed = await asyncio.to_thread(self._streaming.committed)
            if committed >= seq:
                return
            await asyncio.sleep(self.config.ack_poll_s)

    async def _ack_loop(self) -> None:
        """Resolve spooled cuts, in order, once Spark's checkpoint has committed them; restart
        a query that died (``max_attempts`` times), then fail what it never committed."""
        assert self._ack_kick is not None
        backend = self._streaming
        while not (self._committer_done and not self._unacked):
            if not self._unacked:
                self._ack_kick.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._ack_kick.wait()
                continue
            try:
                committed = await asyncio.to_thread(backend.committed)
            except Exception as exc:
                broken: BridgeError | SparkLost
                try:
                    if await self._session_replaced(exc):
                        # the JVM died under the query: a new query on the new session goes
                        # on from the checkpoint (the spool files it did not commit are there)
                        backend = await self._new_stream(backend)
                        continue
                except SparkLost as lost:
                    broken = lost
                else:
                    self._attempts_failed += 1
                    log.warning("%r: %s", self, _error_text(exc))
                    if backend.restarts + 1 < self.config.max_attempts:
                        await asyncio.sleep(self.config.retry_backoff_s)
                        try:
                            await asyncio.to_thread(backend.restart)
                        except Exception as err:  # the next committed() tells what became of it
                            log.warning("%r: restarting the query: %s", self, _error_text(err))
                        continue
                    broken = BridgeError(f"Spark's streaming query failed for good: {exc}")
                cuts = [spooled.cut for spooled in self._unacked]
                self._unacked.clear()
                self._broken = broken
                self._fail_permanently(cuts, broken)
                for cut in cuts:
                    await self._done(cut)
                return
            while self._unacked and _acked(self._unacked[0].seq, committed):
                spooled = self._unacked.popleft()
                if self.committer is None:
                    self._succeed(spooled.cut, spooled.fresh, spooled.rows)
                else:
                    await self._commit_streamed(spooled)
                await self._done(spooled.cut)
            await asyncio.sleep(self.config.ack_poll_s)

    def _stream_backend(self) -> Any:
        from runtime.spark.streaming import StreamingBackend

        backend = StreamingBackend(
            self.spark,
            self.config,
            self._streaming_foreach(),
            typed=self.layout == "typed" and self.foreach_batch is None,
        )
        if self.stream_sink is not None:
            backend.sink = self.stream_sink
        return backend

    async def _new_stream(self, old: Any) -> Any:
        """The streaming query on the session that replaced a lost one (its query is dropped,
        not stopped: its JVM is gone); its restarts count on."""

        backend = self._stream_backend()
        backend.restarts = old.restarts
        await asyncio.to_thread(backend.start)
        self._streaming = backend
        log.warning("%r: the streaming query runs again on the new session", self)
        return backend

    async def _commit_streamed(self, spooled: _Spooled) -> None:
        """The streaming path's typed layout: Spark's checkpoint holds ``spooled``'s
        micro-batch (its files and receipt written): commit it as the embedded path commits
        (``runtime.files.commit``: the moves or Delta commits, the partitions' positions, fences and
        the lease), once; a cut after a failed one fails (it was de-duplicated assuming the
        failed one commits)."""
        cut = spooled.cut
        if not self.ledger.current(spooled.generation):
            self._fail_cut(cut, BridgeError("an earlier micro-batch failed; re-read"))
            return
        table = spooled.table
        assert isinstance(table, TypedBatch)
        assert spooled.identity is not None
        try:
            await asyncio.to_thread(self._commit_spooled, cut, table, spooled.identity)
        except Exception as exc:
            self._attempts_failed += 1
            if isinstance(exc, CommitIncomplete):
                self._broken = BridgeError(str(exc))
            self._fail_permanently(
                [cut],
                BridgeError(f"committing streamed micro-batch {cut.batch_id}: {_error_text(exc)}"),
            )
            return
        self._succeed(cut, spooled.fresh, spooled.rows)

    def _commit_spooled(self, cut: Cut, table: TypedBatch, identity: str) -> None:
        committer = self.committer
        assert committer is not None
        moves, tables = table.streamed(committer, identity, self.config.table_format)
        self._commit_cut(committer, cut, identity, moves, tables)

    def _commit_cut(
        self,
        committer: Committer,
        cut: Cut,
        identity: str,
        moves: list[tuple[str, str]],
        tables: list[TableWrite],
    ) -> None:
        """Commit micro-batch ``cut`` (blocking): what it wrote, its partitions' positions, the
        fences of its batches and, with Delta tables, the completeness watermark."""
        keys = [k for e in cut.entries if (k := self.ledger.key_of(id(e))) is not None]
        metadata = None
        if tables and self._mark is not None:
            metadata = {"shoal.low_watermark_us": self._mark()}
        committer.commit(
            identity,
            moves,
            [(e.token, e.records, e.watermark) for e in cut.entries],
            fence=keys,
            tables=tables,
            metadata=metadata,
        )

    def _stage(
        self, cut: Cut, table: Any, identity: str
    ) -> tuple[list[tuple[str, str]], list[TableWrite]]:
        """In a worker thread: Spark's write of one attempt of micro-batch ``cut`` into the
        default output, to be committed atomically (see the module docstring): the typed
        layout through ``TypedBatch.stage`` (parquet or Delta tables); the generic one
        partitioned by table by Spark, each ``table=<t>`` to be renamed to
        ``table=<t>/batch=<identity>``. What the committer then commits (moves, Delta tables);
        nothing is visible until it does."""
        committer = self.committer
        assert committer is not None
        moves: list[tuple[str, str]] = []
        tables: list[TableWrite] = []
        t0 = time.monotonic()
        if isinstance(table, TypedBatch):
            moves, tables = table.stage(self.spark, committer, identity, self.config.table_format)
            self._count_typed_write(table)
        elif table.num_rows:
            staging = committer.staging(identity)
            df = self._frames.get(cut.batch_id)
            write_staged(df if df is not None else self._dataframe(table), str(staging))
            staged = sorted(p.name for p in staging.glob("table=*") if p.is_dir())
            if not staged:
                raise BridgeError(
                    f"Spark wrote {table.num_rows} rows but {staging} holds none here: over "
                    "Spark Connect or on a cluster the output must be on a file system this "
                    "process shares with the executors (or set SparkConfig.atomic_commit=False)"
                )
            rel = committer.staged(identity)
            moves = [(f"{rel}/{t}", f"{t}/batch={identity}") for t in staged]
        self.phase_s["write"] += time.monotonic() - t0
        return moves, tables

    def _discard(
        self, identity: str, staged: tuple[list[tuple[str, str]], list[TableWrite]]
    ) -> None:
        """In a worker thread: delete what :meth:`_stage` wrote for a micro-batch that will
        not be committed (the one before it failed)."""
        committer = self.committer
        assert committer is not None
        committer.discard(identity, staged[1])

    def _log_commit(
        self,
        cut: Cut,
        table: Any,
        staged: tuple[list[tuple[str, str]], list[TableWrite]],
        seconds: float,
    ) -> None:
        self.phase_s["commit"] += seconds
        moves, tables = staged
        log.debug(
            "%r: micro-batch %d (%d rows, %d tables) committed in %.3f s",
            self,
            cut.batch_id,
            table.num_rows,
            len(tables) or len(moves),
            seconds,
        )

    def _count_typed_write(self, batch: TypedBatch) -> None:
        receipt = batch.receipt
        if batch.num_rows and receipt is not None and receipt.spark_jobs is not None:
            self.typed_writes += 1
            self.typed_write_jobs += receipt.spark_jobs

    def _dataframe(self, table: Any) -> Any:
        if table.num_rows == 0:
            # Spark Connect cannot infer a schema from an empty table (CANNOT_INFER_EMPTY_SCHEMA);
            # a foreach_batch still gets the micro-batch (a heartbeat moved a watermark).
            from pyspark.sql.pandas.types import from_arrow_schema

            return self.spark.createDataFrame(table, schema=from_arrow_schema(table.schema))
        return self.spark.createDataFrame(table)

    def _frames_of(self, tables: _TypedTables) -> dict[str, Any]:
        """A ``foreach_batch``'s typed frames (``SparkConfig.foreach_batch_frames``): each
        table's typed rows as a DataFrame (``createDataFrame`` from Arrow, as the generic
        one); a micro-batch without rows gets an empty mapping."""
        tables.check()
        return {name: self.spark.createDataFrame(t) for name, t in tables.tables.items()}

    def _run_batch(self, batch_id: int, table: Any, identity: str) -> None:
        """In a worker thread: one attempt of one micro-batch."""
        if isinstance(table, TypedBatch):
            name = f"{self.run_id}-{batch_id:010d}"
            table.write_in_place(self.spark, self.config.output_dir, name)
            self._count_typed_write(table)
            return
        df = self._frames_of(table) if isinstance(table, _TypedTables) else self._dataframe(table)
        if self.foreach_batch is not None:
            foreach: Callable[..., None] = self.foreach_batch
            if self._foreach_identity:
                foreach(df, batch_id, identity)
            else:
                foreach(df, batch_id)
        else:
            write_default(df, self.config.output_dir, f"{self.run_id}-{batch_id:010d}")

    def _remember_watermarks(self, cut: Cut) -> None:
        self.watermarks[cut.batch_id] = cut.watermarks
        self._watermark_ids.append(cut.batch_id)
        while len(self._watermark_ids) > 1000:
            self.watermarks.pop(self._watermark_ids.popleft(), None)

    def _fail_cut(self, cut: Cut, error: BaseException) -> None:
        """Fail ``cut``'s batches (their gaps opened when the ledger's cascade doomed them)."""
        for entry in cut.entries:
            self._resolve(entry, error)

    def _resolve(self, entry: SinkBatch, error: BaseException | None, now: float = 0.0) -> None:
        future = self._futures.pop(id(entry), None)
        put_at = self._put_at.pop(id(entry), None)
        key = self.ledger.key_of(id(entry))
        if key is not None:
            self.ledger.release(key)
            self._check()
            if self.committer is not None:
                self.committer.forget((key,))
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
            if put_at is not None:
                self.latencies.append(now - put_at)
        else:
            _fail(future, error)
            self._puts_failed += 1

    def _fail_everything(self, error: BaseException) -> None:
        for entry in self._batcher.take_all():
            self._resolve(entry, error)
        for future in self._futures.values():
            if not future.done():
                self._puts_failed += 1
                _fail(future, error)
        self._futures.clear()
        self._put_at.clear()
        self.ledger.release_all()


_STORE_SCHEMES = ("s3://", "gs://", "gcs://", "file://")


def _is_path(output_dir: str) -> bool:
    """Whether ``output_dir`` is a path (not a URL)."""
    return ":/" not in output_dir


def _store_output(output_dir: str) -> bool:
    """Whether the typed output can be written to ``output_dir`` through pyarrow's file systems
    (by the executors, and committed by this process: ``runtime.lake.store``): a path, or an
    ``s3://``, ``gs://`` or ``file://`` URI. Other URLs (``s3a://``, ``hdfs://``) are Spark's
    own, written by Spark in place (the generic layout)."""
    return _is_path(output_dir) or output_dir.lower().startswith(_STORE_SCHEMES)


def _layout(config: SparkConfig, has_foreach: bool) -> str:
    """The default output's layout (see the module docstring); refuses typed where it cannot be
    written."""
    typed_ok = not has_foreach and config.dead_letter is None and _store_output(config.output_dir)
    if config.output_layout == "typed" and not typed_ok and not has_foreach:
        raise ValueError(
            "output_layout='typed' is written without dead_letter, to a directory or an "
            "s3://, gs:// or file:// URI; use output_layout='generic' here"
        )
    return config.output_layout or ("typed" if typed_ok else "generic")


class _TypedTables:
    """A micro-batch for a ``foreach_batch`` with typed frames: each table's typed rows
    (``runtime.typed.typed_tables``, the typed layout's conversion), built when it is cut;
    ``error``: why they could not be built (raised when the batch runs, as a failed batch)."""

    def __init__(self, fresh: Sequence[tuple[str, Sequence[DataChange]]], rows: int) -> None:
        from runtime.typed import TypedError, typed_tables

        self.num_rows = rows
        self.tables: dict[str, Any] = {}
        self.error: TypedError | None = None
        try:
            self.tables = typed_tables(fresh)
        except TypedError as exc:
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class _Order:
    """A pipelined micro-batch's place in line (``SparkBridge._commit_in_order``): the task of
    the micro-batch before it (None: none in flight), a future this one sets once its Spark
    write ended (the next one's may start), and the bridge's generation when it was cut (moved
    on: one before it failed, so it must not commit)."""

    def __init__(
        self, prior: asyncio.Task[None] | None, written: asyncio.Future[None], generation: int
    ) -> None:
        self.prior = prior
        self.written = written
        self.generation = generation

    def wrote(self) -> None:
        if not self.written.done():
            self.written.set_result(None)

    async def after_prior(self) -> None:
        """Once the micro-batch before this one is done (committed or failed)."""
        if self.prior is not None:
            await asyncio.wait([self.prior])


class _Spooled(msgspec.Struct, frozen=True):
    """A cut on the streaming path, spooled (``seq``: its file; None without rows) and waiting
    for Spark's checkpoint; ``identity``: its batch identity (the typed layout);
    ``generation``: the bridge's when it was cut."""

    seq: int | None
    cut: Cut
    fresh: list[tuple[str, list[DataChange]]]
    rows: int
    table: Any
    identity: str | None
    generation: int


def _cut_identity(cut: Cut, connector: str) -> str:
    return batch_identity(((e.token, e.records) for e in cut.entries), connector)


def _takes_identity(foreach_batch: Callable[..., Any]) -> bool:
    """Whether ``foreach_batch`` takes a third positional parameter (the batch identity)."""
    try:
        params = inspect.signature(foreach_batch).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in positional)


def _records_by_entry(fresh: list[tuple[str, list[DataChange]]]) -> list[list[SparkRecord]]:
    return [spark_records(token, records) for token, records in fresh]


def _ordering_keys(fresh: list[tuple[str, list[DataChange]]]) -> set[str]:
    """The ordering keys of the rows (as ``SparkRecord.key``), without building the rows."""
    return {f"{c.table}:{m.keys}" for _, records in fresh for c in records for m in c.mods}


def _error_text(exc: BaseException) -> str:
    """An error for the RQ/DLQ entry: Spark's messages carry whole JVM stack traces."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + "..."


def _acked(seq: int | None, committed: int) -> bool:
    return seq is None or seq <= committed


def _fail(future: asyncio.Future[None], error: BaseException) -> None:
    """Fail a put's future. The bridge has logged and counted the failure; a reader that
    dropped the future after an earlier failure of its partition need not retrieve it."""
    future.set_exception(error)
    future.exception()  # marks it retrieved: no "exception was never retrieved" at GC


def _is_sink_batch(batch: object) -> bool:
    return isinstance(batch, SinkBatch) and all(isinstance(r, DataChange) for r in batch.records)


_NO_OUTPUT_CONDITIONS = frozenset({"PATH_NOT_FOUND", "UNABLE_TO_INFER_SCHEMA"})


def _no_output_yet(exc: BaseException) -> bool:
    """Whether reading the default output failed because there is none yet (a missing
    directory, or one without parquet files), as opposed to Spark or the files being broken."""
    from pyspark.errors import AnalysisException

    if not isinstance(exc, AnalysisException):
        return False
    condition = exc.getCondition() if hasattr(exc, "getCondition") else exc.getErrorClass()
    return condition in _NO_OUTPUT_CONDITIONS
