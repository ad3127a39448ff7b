"""``SparkBridge``: the ``Sink`` that hands change records to Spark in micro-batches.

Partition readers ``put`` their ``SinkBatch``es; the bridge buffers them (``Batcher``) and cuts
a micro-batch at ``max_rows`` rows or ``max_age_s`` seconds. A cutter task drops replayed
records (``Tails``) and builds the Arrow table off the event loop; a committer task hands each
micro-batch, in order, to Spark (``createDataFrame`` from Arrow, then the default parquet sink or
the user's ``foreach_batch(df, batch_id)``), and resolves the futures of its ``SinkBatch``es
only once Spark has committed it. Readers advance their committed watermark only over resolved
futures, so a crash anywhere loses nothing.

* Backpressure: at most ``max_inflight_batches`` micro-batches are cut and not yet committed;
  while that many are in flight and the buffer is full, ``put`` waits.
* Retry: a micro-batch Spark fails is re-run with the same batch id (``max_attempts``, with
  backoff); the default sink overwrites its own partitions (dynamic partition overwrite keyed by
  run and batch id), so a re-run never duplicates. After the last attempt its futures fail, and
  so does everything cut or buffered after it (those were de-duplicated on the assumption that
  the failed one commits); a later batch of an affected partition is refused until its reader
  re-reads from its committed watermark.
* The default output: parquet under ``output_dir``, partitioned by ``table`` and by ``batch``
  (``<run>-<batch id>``), one row per mod; ``read_output`` reads it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import msgspec

from protocol.records import DataChange
from runtime.ports import SinkBatch
from runtime.spark.rows import Batcher, Cut, Tails, to_arrow, warm_table
from runtime.spark.session import SparkStartError, start_session, warm

__all__ = ["BridgeError", "BridgeStats", "SparkBridge", "SparkConfig"]

log = logging.getLogger("shoal.spark")

ForeachBatch = Callable[[Any, int], None]


class SparkConfig(msgspec.Struct, frozen=True):
    master: str = "local[2]"
    remote: str | None = None  # Spark Connect URL sc://host:port (instead of master)
    app_name: str = "shoal"
    conf: dict[str, str] = {}
    output_dir: str = "shoal-output"
    checkpoint_dir: str | None = None  # streaming: default <output_dir>/_checkpoint
    path: Literal["embedded", "streaming"] = "embedded"
    max_rows: int = 100_000
    max_age_s: float = 1.0
    max_inflight_batches: int = 4
    max_attempts: int = 3  # per micro-batch, the first run included
    retry_backoff_s: float = 0.5  # doubled per attempt
    start_timeout_s: float = 180.0
    stop_timeout_s: float = 120.0
    spool_dir: str | None = None  # streaming: default <output_dir>/_spool
    trigger_interval_s: float = 1.0  # streaming: the query's processing-time trigger
    ack_poll_s: float = 0.1  # streaming: how often Spark's checkpoint is read for commits
    resume_dedupe: bool = True  # on start, learn each partition's tail from the output


class BridgeStats(msgspec.Struct, frozen=True):
    puts: int  # SinkBatches handed in
    rows_in: int  # rows (mods) handed in
    rows_deduplicated: int  # rows dropped as replays
    rows_committed: int  # rows Spark committed
    batches_committed: int  # micro-batches committed
    batches_failed: int  # micro-batches that failed every attempt
    attempts_failed: int  # failed attempts, retried or not
    puts_failed: int  # SinkBatches whose future failed
    puts_refused: int  # SinkBatches refused (bad input, closed bridge, past a failed batch)
    inflight: int  # micro-batches cut and not yet committed
    buffered_rows: int
    last_commit_latency_s: float  # oldest put of the last micro-batch → its commit
    last_batch_id: int


class BridgeError(RuntimeError):
    """A batch the bridge could not commit (its reader re-reads it) or a bridge misuse."""


_STOP = object()


class SparkBridge:
    """The Spark micro-batch bridge; satisfies ``runtime.ports.Sink``. One bridge serves every
    task node of a process. ``spark``: an existing session to use (not stopped on exit)."""

    def __init__(
        self,
        config: SparkConfig,
        *,
        foreach_batch: ForeachBatch | None = None,
        spark: Any = None,
    ) -> None:
        if config.max_rows < 1 or config.max_age_s <= 0 or config.max_inflight_batches < 1:
            raise ValueError("max_rows, max_age_s and max_inflight_batches must be positive")
        if config.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.config = config
        self.foreach_batch = foreach_batch
        self.spark: Any = spark
        self._owns_spark = spark is None
        self.run_id = f"{time.time_ns():020d}"
        self._batcher = Batcher(config.max_rows, config.max_age_s)
        self._futures: dict[int, asyncio.Future[None]] = {}  # id(SinkBatch) → future
        self._tails = Tails()  # what the cutter accepted (touched only by the cutter)
        self._committed = Tails()  # what Spark committed
        self._gate = Tails()  # gaps left by failed batches (checked in put)
        self._generation = 0  # bumped by every failed micro-batch
        self._tails_generation = 0
        self.watermarks: dict[int, dict[str, int]] = {}  # batch id → token → watermark (recent)
        self._watermark_ids: deque[int] = deque()
        self.latencies: deque[float] = deque(maxlen=100_000)  # put → commit, per SinkBatch
        self._put_at: dict[int, float] = {}
        self._inflight_cuts: dict[int, Cut] = {}
        self._committer_done = False
        self._unacked: deque[tuple[int | None, Cut, list[tuple[str, list[DataChange]]], int]] = (
            deque()
        )
        self._next_seq = 0
        self._ack_kick: asyncio.Event | None = None
        self._broken: BridgeError | None = None  # the streaming query died for good
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._changed: asyncio.Condition | None = None
        self._kick: asyncio.Event | None = None
        self._group: asyncio.TaskGroup | None = None
        self._closing = False
        self._closed = False
        self._inflight = 0
        self._local_dir: str | None = None
        self._streaming: Any = None
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
                raise SparkStartError(
                    f"Spark did not start within {cfg.start_timeout_s:.0f}s "
                    f"({cfg.remote or cfg.master})"
                ) from None
        try:
            async with asyncio.timeout(cfg.start_timeout_s):
                await asyncio.to_thread(warm, self.spark)
            if self.foreach_batch is None and cfg.path == "embedded" and cfg.remote is None:
                await asyncio.to_thread(self._warm_write)
            if self.foreach_batch is None and cfg.resume_dedupe:
                await asyncio.to_thread(self._seed_tails)
            if cfg.path == "streaming":
                from runtime.spark.streaming import StreamingBackend

                self._streaming = StreamingBackend(self.spark, cfg, self.foreach_batch)
                self._next_seq = await asyncio.to_thread(self._streaming.next_seq)
                await asyncio.to_thread(self._streaming.start)
                async with asyncio.timeout(cfg.start_timeout_s):
                    await self._warm_stream()
        except TimeoutError:
            await self._stop_spark()
            raise SparkStartError(
                f"Spark's first job did not finish within {cfg.start_timeout_s:.0f}s"
            ) from None
        except BaseException:
            await self._stop_spark()
            raise
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        self._group.create_task(self._cut_loop(), name="spark-bridge-cut")
        self._group.create_task(self._commit_loop(), name="spark-bridge-commit")
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
            self._fail_everything(BridgeError("the Spark bridge stopped"))
            await self._stop_spark()

    async def _stop_spark(self) -> None:
        if self._streaming is not None:
            await asyncio.to_thread(self._streaming.stop)
        if self._owns_spark and self.spark is not None:
            await asyncio.to_thread(self.spark.stop)
            self.spark = None
        if self._local_dir is not None:
            shutil.rmtree(self._local_dir, ignore_errors=True)

    # --- the Sink port --------------------------------------------------------------------

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        """Hand over a batch; waits while the buffer is full and ``max_inflight_batches``
        micro-batches are in flight. The future resolves once Spark committed its rows."""
        if self._changed is None or self._closing:
            self._puts_refused += 1
            raise BridgeError(f"{self!r} is not running")
        if self._broken is not None:
            self._puts_refused += 1
            raise self._broken
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
        if self._gate.refuses(batch.token, batch.records):
            self._puts_refused += 1
            self._puts_failed += 1
            _fail(
                future,
                BridgeError(
                    f"an earlier batch of {batch.token} failed; re-read from the committed watermark"
                ),
            )
            return future
        async with self._changed:
            await self._changed.wait_for(lambda: not self._batcher.full() or self._closing)
            if self._stopping():
                self._puts_refused += 1
                raise BridgeError(f"{self!r} stopped")
            now = time.monotonic()
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
                if not self._closing and not self._batcher.due(now):
                    deadline = self._batcher.deadline()
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
                generation = self._generation
                if self._tails_generation != generation:
                    self._tails.rewind(self._committed)
                    self._tails_generation = generation
                prepared = await asyncio.to_thread(self._prepare, cut)
                await self._queue.put((cut, generation, *prepared))
        finally:
            self._queue.put_nowait(_STOP)

    def _warm_write(self) -> None:
        """Blocking: one tiny write through the default sink (the first costs seconds)."""
        target = tempfile.mkdtemp(prefix="shoal-spark-warm-")
        try:
            write_default(self.spark.createDataFrame(warm_table()), target, "warm")
        except Exception as exc:
            raise SparkStartError(f"Spark cannot write parquet: {exc}") from exc
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def _seed_tails(self) -> None:
        """Blocking: learn, per partition token, the newest commit timestamp in the default
        output and the identities at it, so records a previous run wrote but never acked
        (its readers re-read them after a restart) are not written twice."""
        out = Path(self.config.output_dir)
        if self.config.remote is None and not any(out.rglob("*.parquet")):
            return
        from pyspark.sql import functions as f

        try:
            df = self.spark.read.parquet(str(out)).select(
                "partition_token", "commit_ts", "server_transaction_id", "record_sequence"
            )
        except Exception as exc:  # nothing there yet (remote Spark: we cannot look first)
            log.info("%r: no earlier output to resume de-duplication from: %s", self, exc)
            return
        newest = df.groupBy("partition_token").agg(f.max("commit_ts").alias("commit_ts"))
        rows = df.join(newest, ["partition_token", "commit_ts"]).distinct().collect()
        for row in rows:
            ts, txn, seq = row["commit_ts"], row["server_transaction_id"], row["record_sequence"]
            for tails in (self._tails, self._committed):
                tails.accept_identity(row["partition_token"], (ts, txn, seq))
        log.info("%r: resumed de-duplication for %d partitions", self, len(self._committed))

    def _prepare(self, cut: Cut) -> tuple[Any, list[tuple[str, list[DataChange]]], int]:
        """Off the loop: drop replays, build the Arrow table."""
        fresh = [(e.token, self._tails.fresh(e.token, e.records)) for e in cut.entries]
        rows = sum(len(r.mods) for _, records in fresh for r in records)
        return to_arrow(fresh), fresh, rows

    # --- the committer --------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        try:
            while True:
                item = await self._queue.get()
                if item is _STOP:
                    return
                cut, generation, table, fresh, rows = item
                self._rows_dedup += cut.rows - rows
                self._remember_watermarks(cut)
                if generation != self._generation:
                    self._fail_cut(cut, BridgeError("an earlier micro-batch failed; re-read"))
                    await self._done(cut)
                elif self._streaming is not None:
                    await self._spool(cut, table, fresh, rows)  # acked by _ack_loop
                else:
                    try:
                        await self._commit(cut, table, fresh, rows)
                    finally:
                        await self._done(cut)
        finally:
            self._committer_done = True

    async def _done(self, cut: Cut) -> None:
        """``cut`` is no longer in flight (committed or failed)."""
        assert self._changed is not None
        self._inflight_cuts.pop(cut.batch_id, None)
        async with self._changed:
            self._inflight -= 1
            self._changed.notify_all()

    async def _commit(
        self, cut: Cut, table: Any, fresh: list[tuple[str, list[DataChange]]], rows: int
    ) -> None:
        cfg = self.config
        error: BaseException | None = None
        for attempt in range(1, cfg.max_attempts + 1):
            try:
                if rows or self.foreach_batch is not None:
                    await asyncio.to_thread(self._run_batch, cut.batch_id, table)
            except Exception as exc:
                error = exc
                self._attempts_failed += 1
                log.warning(
                    "%r: micro-batch %d (%d rows) failed, attempt %d/%d: %r",
                    self,
                    cut.batch_id,
                    rows,
                    attempt,
                    cfg.max_attempts,
                    exc,
                )
                if attempt < cfg.max_attempts:
                    await asyncio.sleep(cfg.retry_backoff_s * 2 ** (attempt - 1))
                continue
            error = None
            break
        if error is not None:
            self._fail_permanently(
                [cut],
                BridgeError(
                    f"Spark micro-batch {cut.batch_id} failed after {cfg.max_attempts} "
                    f"attempts: {error!r}"
                ),
            )
            return
        self._succeed(cut, fresh, rows)

    def _fail_permanently(self, cuts: list[Cut], failure: BridgeError) -> None:
        """``cuts`` will never commit: fail them, and everything after them (it was
        de-duplicated assuming they commit), and refuse their partitions' continuations."""
        self._batches_failed += len(cuts)
        log.error("%r: %s", self, failure)
        for cut in cuts:
            self._fail_cut(cut, failure)
        self._generation += 1
        # Cuts still in flight fail when they reach the committer; refuse their partitions'
        # continuations from now on, or one could commit past them before they fail.
        for cut in self._inflight_cuts.values():
            for entry in cut.entries:
                self._gate.open_gap(entry.token, entry.records)
        for entry in self._batcher.take_all():
            self._gate.open_gap(entry.token, entry.records)
            self._resolve(entry, failure)

    def _succeed(self, cut: Cut, fresh: list[tuple[str, list[DataChange]]], rows: int) -> None:
        for token, records in fresh:
            for change in records:
                self._committed.accept(token, change)
        self._rows_committed += rows
        self._batches_committed += 1
        self._last_batch_id = cut.batch_id
        now = time.monotonic()
        self._last_latency = now - cut.first_put
        for entry in cut.entries:
            self._resolve(entry, None, now)

    # --- the streaming path ---------------------------------------------------------------

    async def _spool(
        self, cut: Cut, table: Any, fresh: list[tuple[str, list[DataChange]]], rows: int
    ) -> None:
        """Write ``cut`` as the next spool file (none if it has no rows: it is acked with the
        files before it); Spark's checkpoint acks it (``_ack_loop``)."""
        from runtime.spark.streaming import spool_write

        seq: int | None = None
        if rows:
            seq = self._next_seq
            try:
                await asyncio.to_thread(spool_write, self._streaming.spool, seq, table)
            except Exception as exc:
                self._attempts_failed += 1
                self._fail_permanently([cut], BridgeError(f"writing spool file {seq}: {exc!r}"))
                await self._done(cut)
                return
            self._next_seq += 1
        self._unacked.append((seq, cut, fresh, rows))
        assert self._ack_kick is not None
        self._ack_kick.set()

    async def _warm_stream(self) -> None:
        """Spool an empty file and wait until Spark committed it: the query's first micro-batch
        (source process, planning, checkpoint) costs seconds, paid here before traffic."""
        from runtime.spark.streaming import spool_write

        seq = self._next_seq
        await asyncio.to_thread(spool_write, self._streaming.spool, seq, to_arrow([]))
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
                self._attempts_failed += 1
                log.warning("%r: %r", self, exc)
                if backend.restarts + 1 < self.config.max_attempts:
                    await asyncio.sleep(self.config.retry_backoff_s)
                    await asyncio.to_thread(backend.restart)
                    continue
                cuts = [cut for _, cut, _, _ in self._unacked]
                self._unacked.clear()
                self._broken = BridgeError(f"Spark's streaming query failed for good: {exc}")
                self._fail_permanently(cuts, self._broken)
                for cut in cuts:
                    await self._done(cut)
                return
            while self._unacked and _acked(self._unacked[0][0], committed):
                _, cut, fresh, rows = self._unacked.popleft()
                self._succeed(cut, fresh, rows)
                await self._done(cut)
            await asyncio.sleep(self.config.ack_poll_s)

    def _run_batch(self, batch_id: int, table: Any) -> None:
        """In a worker thread: one attempt of one micro-batch."""
        df = self.spark.createDataFrame(table)
        if self.foreach_batch is not None:
            self.foreach_batch(df, batch_id)
        else:
            write_default(df, self.config.output_dir, f"{self.run_id}-{batch_id:010d}")

    def _remember_watermarks(self, cut: Cut) -> None:
        self.watermarks[cut.batch_id] = cut.watermarks
        self._watermark_ids.append(cut.batch_id)
        while len(self._watermark_ids) > 1000:
            self.watermarks.pop(self._watermark_ids.popleft(), None)

    def _fail_cut(self, cut: Cut, error: BaseException) -> None:
        for entry in cut.entries:
            self._gate.open_gap(entry.token, entry.records)
            self._resolve(entry, error)

    def _resolve(self, entry: SinkBatch, error: BaseException | None, now: float = 0.0) -> None:
        future = self._futures.pop(id(entry), None)
        put_at = self._put_at.pop(id(entry), None)
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


def _acked(seq: int | None, committed: int) -> bool:
    return seq is None or seq <= committed


def _fail(future: asyncio.Future[None], error: BaseException) -> None:
    """Fail a put's future. The bridge has logged and counted the failure; a reader that
    dropped the future after an earlier failure of its partition need not retrieve it."""
    future.set_exception(error)
    future.exception()  # marks it retrieved: no "exception was never retrieved" at GC


def _is_sink_batch(batch: object) -> bool:
    return isinstance(batch, SinkBatch) and all(isinstance(r, DataChange) for r in batch.records)


def write_default(df: Any, output_dir: str, batch: str) -> None:
    """The default sink: parquet partitioned by table (and by batch, so a re-run of the same
    batch overwrites exactly its own files)."""
    from pyspark.sql import functions as f

    (
        df.withColumn("batch", f.lit(batch))
        .write.mode("overwrite")
        .option("partitionOverwriteMode", "dynamic")
        .partitionBy("table", "batch")
        .parquet(str(Path(output_dir)))
    )
