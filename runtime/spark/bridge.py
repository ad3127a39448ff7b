"""``SparkBridge``: the ``Sink`` that hands change records to Spark in micro-batches.

Partition readers ``put`` their ``SinkBatch``es; the bridge buffers them (``Batcher``) and cuts
a micro-batch at ``max_rows`` rows or ``max_age_s`` seconds (by age only while fewer than two
are in flight, so a slow sink gets fewer, bigger micro-batches: ``Batcher.due``), or without
waiting for its age once every reader of it waits for nothing else (``flush``). A cutter task
drops replayed records (the output ledger's pending tail, ``protocol.ledger``) and builds the
Arrow table off the event loop; a committer task hands each micro-batch, in order, to Spark
(``createDataFrame`` from Arrow, then the default parquet sink or the user's
``foreach_batch(df, batch_id)``), and resolves the futures of its ``SinkBatch``es only once Spark
has committed it. Readers advance their committed watermark only over resolved futures, so a
crash anywhere loses nothing. With the default output's committer the micro-batches are
pipelined (``_commit_in_order``): Spark writes the next one (its files invisible until committed)
while the committer makes the previous one visible; commits stay in order, and one behind a
micro-batch that fails commits nothing (its files are deleted) and fails with it.

This module is the shell: the ``Sink`` port, the lifecycle, the cutter and the committer's
order, and settling micro-batches with the output ledger. How a micro-batch reaches Spark is
one of three paths the bridge owns and calls:

* ``runtime.spark.batch``: the micro-batch path (``SparkJobs``: one Spark job at a time, under
  ``job_timeout_s``, a lost session replaced; ``MicroBatches``: attempts with backoff, the
  default output's layouts and atomic commits, ``foreach_batch``);
* ``runtime.spark.keyed_path``: with ``SparkConfig.dead_letter``, the retry queue and
  dead-letter queue (failing rows isolated by ordering key and parked, per-key order kept);
* ``runtime.spark.stream_path``: ``SparkConfig.path = "streaming"``, micro-batches spooled for
  Spark's streaming query and settled once its checkpoint holds them.

The paths keep a reference to the bridge and settle each micro-batch through it
(``_succeed``, ``_fail_permanently``, ``_fail_cut``, ``_done``): the futures, the counters and
the output ledger stay here, in one place.

* Backpressure: at most ``max_inflight_batches`` micro-batches are cut and not yet committed;
  while that many are in flight and the buffer is full, ``put`` waits.
* Failure: a micro-batch that fails after its last attempt fails its futures, and so does
  everything cut or buffered after it (those were de-duplicated on the assumption that the
  failed one commits); a later batch of an affected partition, a heartbeat past the failed
  records included, is refused until its reader re-reads from its committed watermark. These
  rules (dedup tails, gaps, the cascade, fence keys) are the output ledger's
  (``protocol.ledger``), the same as the file sink's.
* Exactly once (docs/design.md#exactly-once-output): with the default output's committer
  ``durable_position(token)`` answers a partition's committed position; ``fence(batches)``
  fences the batches a stopping reader abandons (rule 4): a micro-batch holding one is refused
  at its commit point.
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
from types import TracebackType
from typing import Any, Self

from protocol.dedup import Position
from protocol.ledger import Admit, OutputLedger
from protocol.records import DataChange
from runtime.files.commit import Committer
from runtime.ports import Sink, SinkBatch
from runtime.spark.batch import MicroBatches, Order, SparkJobs
from runtime.spark.config import BridgeError, BridgeStats, ForeachBatch, SparkConfig
from runtime.spark.dead_letter import SparkDlqRecord
from runtime.spark.keyed import RowsFailed
from runtime.spark.keyed_path import KeyedPath
from runtime.spark.rows import Batcher, Cut
from runtime.spark.session import SparkStartError, abandon_start, start_session, warm
from runtime.spark.stream_path import StreamPath
from runtime.spark.supervisor import SessionSupervisor, SparkLost

__all__ = [
    "BridgeError",
    "BridgeStats",
    "RowsFailed",
    "SparkBridge",
    "SparkConfig",
]

log = logging.getLogger("shoal.spark")

_STOP = object()


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
        # the default output's atomic commits (embedded path, no RQ): runtime/spark/batch.py
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
        self._committer_done = False
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
        self._supervisor: SessionSupervisor | None = None  # replaces a lost session
        # the paths a micro-batch takes to Spark: runtime/spark/batch.py, keyed_path.py (with
        # dead_letter, once started), stream_path.py (the streaming path, once started)
        self._jobs = SparkJobs(self)
        self._batch = MicroBatches(self, self._jobs)
        self._keyed: KeyedPath | None = None
        self._stream: StreamPath | None = None
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
            if self.committer is not None and not self.committer.store.is_local:
                # reachable and writable: now, not later (the warm-up below writes there)
                await asyncio.to_thread(self.committer.store.check)
            if self.foreach_batch is None and cfg.path == "embedded" and cfg.remote is None:
                await asyncio.to_thread(self._batch.warm_write, None)
            if self.committer is not None:
                await asyncio.to_thread(self.committer.recover)
                for legacy in await asyncio.to_thread(self.committer.legacy_state):
                    log.warning(
                        "%r: %s/%s holds output state of an earlier shoal version, not kept "
                        "per connector; it is not read",
                        self,
                        cfg.output_dir,
                        legacy,
                    )
            elif self.foreach_batch is None and cfg.resume_dedupe:
                # no progress files to resume from: learn the tails from the output itself
                await asyncio.to_thread(self._batch.seed_tails)
            if cfg.path == "streaming":
                self._stream = StreamPath(self)
                await self._stream.start(cfg.start_timeout_s)
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
            warm_more = self._batch.warm_write
        self._supervisor = SessionSupervisor(
            cfg,
            self.spark,
            owned=self._owns_spark,
            local_dir=self._local_dir,
            warm_more=warm_more,
        )
        if cfg.dead_letter is not None:
            keyed = KeyedPath(self)
            try:
                await keyed.rq.__aenter__()
            except BaseException:
                await self._stop_spark()
                raise
            self._keyed = keyed
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        self._group.create_task(self._cut_loop(), name="spark-bridge-cut")
        self._group.create_task(self._commit_loop(), name="spark-bridge-commit")
        if self._keyed is not None:
            self._group.create_task(self._keyed.retry_loop(), name="spark-bridge-retry")
        if self._stream is not None:
            self._group.create_task(self._stream.ack_loop(), name="spark-bridge-ack")
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
                if self._keyed is not None:
                    await self._keyed.rq.__aexit__(None, None, None)
            finally:
                self._fail_everything(BridgeError("the Spark bridge stopped"))
                await self._stop_spark()

    async def abort(self) -> None:
        """Die abruptly (for tests of a task's death): the RQ/DLQ writes nothing more and every
        pending batch fails; what is in the RQ topic stays there for the next bridge. The
        context manager still has to exit."""
        self._broken = BridgeError(f"{self!r} was aborted")
        if self._keyed is not None:
            await self._keyed.rq.abort()
        self._fail_everything(self._broken)

    async def _stop_spark(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
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
        if self._keyed is not None:
            await self._keyed.rq.barrier()

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        """Hand over a batch; waits while the buffer is full and ``max_inflight_batches``
        micro-batches are in flight. The future resolves once Spark committed its rows."""
        if self._changed is None or self._closing:
            self._puts_refused += 1
            raise BridgeError(f"{self!r} is not running")
        if self._broken is not None:
            self._puts_refused += 1
            raise self._broken
        if self._keyed is not None:
            try:
                self._keyed.check_alive()
            except BridgeError:
                self._puts_refused += 1
                raise
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

    async def flush(self, token: str) -> None:
        """The reader of ``token`` waits only for its batches to commit: the micro-batch holding
        them is cut without waiting for its age (``Batcher.flush``)."""
        if self._kick is not None and self._batcher.flush(token, time.monotonic()):
            self._kick.set()

    def entries_of(self, batch_id: int) -> tuple[SinkBatch, ...]:
        """The ``SinkBatch``es of micro-batch ``batch_id`` while it is in flight (else ())."""
        cut = self._inflight_cuts.get(batch_id)
        return () if cut is None else cut.entries

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
        position = await asyncio.to_thread(self.committer.committed, token)
        if self.ledger.unseeded((token,)):  # the cutter need not look it up again
            self.ledger.seed(token, position)
        return position

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
        keyed = self._keyed
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
            rows_parked=0 if keyed is None else keyed.rows_parked,
            rows_retried=0 if keyed is None else keyed.rows_retried,
            isolation_runs=0 if keyed is None else keyed.isolation_runs,
            rq_held=0 if keyed is None else keyed.rq.core.held_count(),
            in_dlq=0 if keyed is None else len(keyed.rq.core.dlq_records()),
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
                prepared = await asyncio.to_thread(self._batch.prepare, cut)
                await self._queue.put((cut, generation, *prepared))
        finally:
            self._queue.put_nowait(_STOP)

    async def _seed_from_progress(self, cut: Cut) -> None:
        """With atomic commits: the first time a partition is seen, learn what is committed of
        it from its progress file (one small file, not the whole output), so records an earlier
        run wrote and a re-reader hands in again are not written twice. A partition whose reader
        asked ``durable_position`` is known already (it was learned there)."""
        committer = self.committer
        if committer is None:
            return
        for token in self.ledger.unseeded(e.token for e in cut.entries):
            position = await asyncio.to_thread(committer.committed, token)
            self.ledger.seed(token, position)

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
                elif self._stream is not None:
                    await self._stream.spool(cut, table, fresh, rows, generation)  # see ack_loop
                elif self._pipelined():
                    assert self._group is not None
                    while len(running) > 1:  # the one before the previous must be done
                        await asyncio.wait([running.popleft()])
                    written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    order = Order(running[-1] if running else None, written, generation)
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
        return self.committer is not None and self._keyed is None

    async def _commit_in_order(
        self,
        cut: Cut,
        table: Any,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
        order: Order,
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
        self._batch.forget(cut.batch_id)
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
        order: Order | None = None,
    ) -> None:
        """Commit ``cut`` on its path: the keyed one with the RQ/DLQ, else the micro-batch
        path (``order``: its place in line when pipelined)."""
        if self._keyed is not None:
            await self._keyed.commit(cut, table, fresh, rows)
        else:
            await self._batch.commit(cut, table, fresh, rows, order)

    # --- operator actions (dead_letter: runtime/spark/keyed_path.py) ----------------------

    def _dead_letter(self) -> KeyedPath:
        if self._keyed is None:
            raise BridgeError(f"{self!r} has no retry queue (SparkConfig.dead_letter)")
        return self._keyed

    def dlq_records(self) -> list[SparkDlqRecord]:
        """The rows in the DLQ."""
        return self._dead_letter().dlq_records()

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
    """The default output's layout (``runtime.spark.batch``'s docstring); refuses typed where it
    cannot be written."""
    typed_ok = not has_foreach and config.dead_letter is None and _store_output(config.output_dir)
    if config.output_layout == "typed" and not typed_ok and not has_foreach:
        raise ValueError(
            "output_layout='typed' is written without dead_letter, to a directory or an "
            "s3://, gs:// or file:// URI; use output_layout='generic' here"
        )
    return config.output_layout or ("typed" if typed_ok else "generic")


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


def _fail(future: asyncio.Future[None], error: BaseException) -> None:
    """Fail a put's future. The bridge has logged and counted the failure; a reader that
    dropped the future after an earlier failure of its partition need not retrieve it."""
    future.set_exception(error)
    future.exception()  # marks it retrieved: no "exception was never retrieved" at GC


def _is_sink_batch(batch: object) -> bool:
    return isinstance(batch, SinkBatch) and all(isinstance(r, DataChange) for r in batch.records)
