"""The Spark bridge's micro-batch path: Spark jobs, attempts, and the default output's commits.

:class:`SparkJobs` runs one Spark job at a time, in a worker thread, under
``SparkConfig.job_timeout_s``, and after a failed one asks the session supervisor whether the
session died; :class:`MicroBatches` turns a cut micro-batch into Spark jobs and commits (the
shell, :class:`runtime.spark.bridge.SparkBridge`, owns both and settles each micro-batch's
futures with the output ledger).

* Retry: a micro-batch Spark fails is re-run with the same batch id (``max_attempts``, with
  backoff: ``protocol.ledger.retry_delay``); the default sink overwrites its own partitions
  (dynamic partition overwrite keyed by run and batch id), so a re-run never duplicates. After
  the last attempt it fails (the bridge's cascade: ``SparkBridge._fail_permanently``).
* A lost session (embedded path): after a failed Spark job the bridge asks its
  ``SessionSupervisor`` (``runtime.spark.supervisor``) whether the session died (the local JVM
  exited, a Spark Connect server restarted); if so a new one is started, warmed, and the job run
  again without counting the attempt, up to ``SparkConfig.restarts`` times; if it cannot be
  replaced the bridge breaks with ``SparkLost`` (an ``Unrecoverable``: the process stops).
  A Spark job that runs past ``SparkConfig.job_timeout_s`` is cancelled and its session
  handled as a lost one (a cluster without master and executors never finishes it).
* The default output: parquet under ``output_dir``, partitioned by ``table`` and by ``batch``,
  one row per mod; ``read_output`` reads it back. On the embedded path (without
  ``dead_letter``) each micro-batch is committed atomically with the sink's own durable position
  (docs/design.md#exactly-once-output, ``runtime.files.commit``): Spark writes it, with its own
  ``_temporary`` commit, partitioned by table, under ``<output_dir>/_staging/<batch>/`` where no
  reader looks; the lease (``permit``) is checked; a manifest is written (the commit point); each
  staged ``table=<t>`` directory is renamed to ``table=<t>/batch=<id>`` and each partition's
  position recorded. ``<id>`` is the batch identity (``protocol.commit.batch_identity``), so a
  micro-batch written twice appears once. The renames are done by this process: over Spark
  Connect the output must be a path this process sees as the server does (a shared or local
  file system); ``SparkConfig.atomic_commit=False`` writes straight into place (at-least-once;
  re-reads dropped by ``read_output``'s ``dedupe``).
* The default output's layout (``SparkConfig.output_layout``): **typed** (the default without
  ``dead_letter``, to a path this process writes or an ``s3://``, ``gs://`` or ``file://`` URI)
  is the typed per-table changelog: each micro-batch with rows is one Spark job whatever the
  number of tables, its executors converting the rows and writing every table's files
  (``runtime.spark.datasource``), then committed by the same atomic committer
  (``runtime.spark.typed_output``): ``<table>/batch=<id>/`` directories moved into place
  (renamed, or copied on an object store), or with ``SparkConfig.table_format = "delta"`` one
  Delta table per table, the files written straight into it and made visible by one idempotent
  Delta commit per table and micro-batch (``runtime.lake.delta``; the completeness watermark
  ``mark()`` in its commit info): exactly once on an object store too. **generic** is the
  layout described above (the RQ/DLQ always writes it; Spark's own URLs such as ``s3a://`` get
  it, written in place; on the streaming path Spark's file sink).
* ``foreach_batch(df, batch_id)`` gets a run-local batch number; a ``foreach_batch`` taking a
  third parameter gets ``(df, batch_id, identity)`` with the deterministic batch identity,
  stable across re-delivery: key an idempotent write on it (docs/operations.md). With
  ``SparkConfig.foreach_batch_frames = "typed"`` (embedded path) ``df`` is a ``TypedFrames``:
  table name -> that table's typed DataFrame (docs/reading-output.md).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.commit import batch_identity
from protocol.ledger import retry_delay
from protocol.records import DataChange
from runtime.files.commit import CommitIncomplete, CommitRefused, Committer, TableWrite
from runtime.spark.config import BridgeError
from runtime.spark.output import write_default, write_staged
from runtime.spark.rows import Cut, to_arrow, warm_records, warm_table
from runtime.spark.session import SparkStartError
from runtime.spark.supervisor import SparkJobTimeout, SparkLost, cancel_jobs
from runtime.spark.typed_output import TypedBatch, typed_tails

if TYPE_CHECKING:
    from runtime.spark.bridge import SparkBridge

__all__ = ["MicroBatches", "Order", "SparkJobs", "cut_identity", "error_text"]

log = logging.getLogger("shoal.spark")

# how long a cancelled Spark job (and the cancel itself) may take to end
_CANCEL_WAIT_S = 30.0


class SparkJobs:
    """The bridge's Spark jobs (micro-batches, halves, retries): one at a time (``lock``),
    each under ``SparkConfig.job_timeout_s``, and a lost session replaced through the bridge's
    supervisor."""

    def __init__(self, bridge: SparkBridge) -> None:
        self.bridge = bridge
        self.lock = asyncio.Lock()  # one Spark job at a time

    async def run(self, table: Any, run: Callable[..., Any], *args: Any) -> Any:
        """Run ``run(*args)`` (one attempt of a batch of ``table``) in a worker thread and
        return what it returns, under ``SparkConfig.job_timeout_s`` where Spark runs it: past
        it the session's jobs are cancelled and, once the thread ended,
        :class:`SparkJobTimeout` is raised (the supervisor then replaces the session). A job
        that finished as it was cancelled counts as done. A thread that does not end after the
        cancel is a session that cannot be trusted with the batch again (it may still commit
        it): :class:`SparkLost`."""
        b = self.bridge
        limit = b.config.job_timeout_s
        if limit is None:
            return await asyncio.to_thread(run, *args)
        job = asyncio.ensure_future(asyncio.to_thread(run, *args))
        try:
            done, _ = await asyncio.wait({job}, timeout=limit)
            if job in done:
                return job.result()
            log.error("%r: a Spark job ran past spark.job_timeout_s (%gs): cancelling it", b, limit)
            try:
                async with asyncio.timeout(_CANCEL_WAIT_S):
                    await asyncio.to_thread(cancel_jobs, b.spark)
            except Exception as exc:  # the thread's end below decides
                log.warning("%r: cancelling Spark's jobs failed: %s", b, error_text(exc))
            done, _ = await asyncio.wait({job}, timeout=_CANCEL_WAIT_S)
        finally:
            if not job.done():  # cancelled with us, or still running: its end is logged
                job.add_done_callback(self._late_job_ended)
        if job not in done:
            where = b.config.remote or b.config.master
            raise SparkLost(
                f"Spark ({where}): a job ran past spark.job_timeout_s ({limit:g}s) and had not "
                f"ended {_CANCEL_WAIT_S:g}s after it was cancelled"
            )
        failed = job.exception()
        if failed is None:
            log.warning("%r: the Spark job finished as it was cancelled", b)
            return job.result()
        raise SparkJobTimeout(
            f"a Spark job ran past spark.job_timeout_s ({limit:g}s) and was cancelled"
        ) from failed

    def _late_job_ended(self, job: asyncio.Future[None]) -> None:
        if job.cancelled():
            return
        if (exc := job.exception()) is not None:
            log.warning("%r: a Spark job given up on ended: %s", self.bridge, error_text(exc))
        else:
            log.warning("%r: a Spark job given up on ended", self.bridge)

    def succeeded(self) -> None:
        supervisor = self.bridge._supervisor
        if supervisor is not None:
            supervisor.job_succeeded()

    async def session_replaced(self, exc: BaseException) -> bool:
        """After a Spark job failed with ``exc``: whether the session had died and a new one
        now stands in (run the job again); ``SparkLost`` (the bridge is broken for good, the
        process must stop) if it cannot be replaced (``runtime.spark.supervisor``)."""
        b = self.bridge
        supervisor = b._supervisor
        if supervisor is None:
            return False
        if isinstance(exc, SparkLost):  # the job itself found the session beyond repair
            b._broken = exc
            raise exc
        if b._broken is not None and isinstance(b._broken, SparkLost):
            raise b._broken
        async with self.lock:  # no other job on the dead session meanwhile
            try:
                replaced = await supervisor.recover(exc)
            except SparkLost as lost:
                b._broken = lost
                raise
        if replaced:
            b.spark = supervisor.spark
        return replaced


class MicroBatches:
    """The micro-batch path of a bridge: a cut's rows prepared off the loop, run through Spark
    (``attempts``), and with the default output's committer staged, committed or discarded."""

    def __init__(self, bridge: SparkBridge, jobs: SparkJobs) -> None:
        self.bridge = bridge
        self.jobs = jobs
        self._frames: dict[int, Any] = {}  # batch id → its DataFrame, built by the cutter

    def forget(self, batch_id: int) -> None:
        """Micro-batch ``batch_id`` is no longer in flight."""
        self._frames.pop(batch_id, None)

    # --- before traffic -------------------------------------------------------------------

    def warm_write(self, spark: Any = None) -> None:
        """Blocking: one tiny write through the default sink, into a temporary directory (the
        first costs seconds; the typed layout's also registers its data source with the session
        and starts a Python worker per core, each importing what the Delta path needs with
        ``table_format`` delta). With an object store for output the typed write goes there,
        into a staging directory of its own deleted after (nothing is committed): the workers
        and the driver open the store's file system now, not in the first micro-batch."""
        b = self.bridge
        spark = b.spark if spark is None else spark
        store = None if b.committer is None else b.committer.store
        remote = b.layout == "typed" and store is not None and not store.is_local
        target = "" if remote else tempfile.mkdtemp(prefix="shoal-spark-warm-")
        scratch = ""
        if remote:
            assert b.committer is not None
            scratch = b.committer.staged(f"warm-{uuid.uuid4().hex}")
        try:
            if b.layout == "typed":
                sc = getattr(spark, "sparkContext", None)
                rows = max(1, sc.defaultParallelism if sc is not None else 1)
                batch = TypedBatch([("warm", warm_records(rows))], rows)
                if remote:
                    assert store is not None
                    batch.write_unlisted_delta_files(spark, store.uri_for(scratch))
                elif b.config.table_format == "delta":
                    batch.write_unlisted_delta_files(spark, target)
                else:
                    batch.write_in_place(spark, target, "warm")
            else:
                write_default(spark.createDataFrame(warm_table()), target, "warm")
        except Exception as exc:
            raise SparkStartError(f"Spark cannot write parquet: {exc}") from exc
        finally:
            if remote:
                assert store is not None
                try:
                    store.delete_tree(scratch)
                except OSError as exc:  # staging: readers skip it, a later run may delete it
                    log.warning("deleting the warm-up's %s failed: %s", scratch, exc)
            else:
                shutil.rmtree(target, ignore_errors=True)

    def seed_tails(self) -> None:
        """Blocking: learn, per partition token, the newest commit timestamp in the default
        output and the identities at it, so records a previous run wrote but never acked
        (its readers re-read them after a restart) are not written twice."""
        b = self.bridge
        out = Path(b.config.output_dir)
        if b.layout == "typed":
            for token, identity in typed_tails(b.config.output_dir):
                b.ledger.seed_identity(token, identity)
            return
        if b.config.remote is None and not any(out.rglob("*.parquet")):
            return
        from pyspark.sql import functions as f

        # Over Spark Connect the read is lazy: a missing directory fails at collect(), and the
        # directory is the server's, so we cannot look first. Both steps are in the try.
        try:
            df = b.spark.read.parquet(str(out)).select(
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
            log.info("%r: no earlier output at %s to resume de-duplication from", b, out)
            return
        for row in rows:
            ts, txn, seq = row["commit_ts"], row["server_transaction_id"], row["record_sequence"]
            b.ledger.seed_identity(row["partition_token"], (ts, txn, seq))
        log.info("%r: resumed de-duplication for %d partitions", b, b.ledger.partitions())

    # --- a cut micro-batch ----------------------------------------------------------------

    def prepare(self, cut: Cut) -> tuple[Any, list[tuple[str, list[DataChange]]], int]:
        """Off the loop: drop replays, build the Arrow table."""
        b = self.bridge
        t0 = time.monotonic()
        fresh = [(e.token, b.ledger.take_fresh(e.token, e.records)) for e in cut.entries]
        rows = sum(len(r.mods) for _, records in fresh for r in records)
        if b.layout == "typed" and b.foreach_batch is None:
            batch = TypedBatch(fresh, rows)
            b.phase_s["prepare"] += time.monotonic() - t0
            return batch, fresh, rows
        if b.foreach_batch is not None and b.config.foreach_batch_frames == "typed":
            return _TypedTables(fresh, rows), fresh, rows
        table = to_arrow(fresh)
        if b.committer is not None and rows:
            # Handing the rows to the JVM takes a tenth of a micro-batch's time: done here, it
            # overlaps the previous micro-batch's write (DataFrames can be re-run on a retry).
            try:
                self._frames[cut.batch_id] = self.dataframe(table)
            except Exception:
                log.warning(
                    "%r: building micro-batch %d early failed", b, cut.batch_id, exc_info=True
                )
        return table, fresh, rows

    async def commit(
        self,
        cut: Cut,
        table: Any,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
        order: Order | None = None,
    ) -> None:
        """Commit ``cut`` (without the RQ): run it through Spark (and the committer), then
        settle it with the bridge: committed, or failed with what comes after it."""
        b = self.bridge
        error = None
        if b.committer is not None:
            error = await self.attempts(cut.batch_id, table, rows, cut, commit=True, order=order)
            if order is not None:
                await order.after_prior()  # failed early: still after the one before it
                if not b.ledger.current(order.generation):  # the one before it failed
                    b._fail_cut(cut, BridgeError("an earlier micro-batch failed; re-read"))
                    return
            if isinstance(error, CommitRefused | CommitIncomplete):
                if isinstance(error, CommitIncomplete):
                    b._broken = BridgeError(str(error))
                b._fail_permanently([cut], BridgeError(str(error)))
                return
        elif rows or b.foreach_batch is not None:
            error = await self.attempts(cut.batch_id, table, rows, cut)
        if isinstance(error, SparkLost):
            b._fail_permanently([cut], error)
            return
        if error is not None:
            b._fail_permanently(
                [cut],
                BridgeError(
                    f"Spark micro-batch {cut.batch_id} failed after {b.config.max_attempts} "
                    f"attempts: {error_text(error)}"
                ),
            )
            return
        b._succeed(cut, fresh, rows)

    async def attempts(
        self,
        batch_id: int,
        table: Any,
        rows: int,
        cut: Cut,
        *,
        commit: bool = False,
        identity: str | None = None,
        order: Order | None = None,
    ) -> Exception | None:
        """Run micro-batch ``cut`` (its rows: ``table``) up to ``max_attempts`` times (with
        backoff); the last error, or None once it committed. With ``commit`` it goes through
        the committer (a refused or incomplete commit is not retried: it is returned at once):
        Spark writes it (one job at a time), then it is committed, with ``order`` only once the
        micro-batch before it is done (if that one failed, what this one wrote is deleted and
        None returned: the caller sees the generation moved). ``identity``: the batch
        identity, if not the cut's (its rows were filtered)."""
        b = self.bridge
        cfg = b.config
        jobs = self.jobs
        error: Exception | None = None
        if identity is None:
            # the default output's directories are shared by connectors: salted by this one;
            # a user's foreach_batch gets the contents' identity (docs/design.md)
            salt = cfg.connector if b.committer is not None else ""
            identity = cut_identity(cut, salt)
        if isinstance(b._broken, SparkLost):
            return b._broken
        attempt = 0
        while True:
            attempt += 1
            try:
                async with jobs.lock:
                    if commit:
                        staged = await jobs.run(table, self._stage, cut, table, identity)
                    else:
                        await jobs.run(table, self.run_batch, batch_id, table, identity)
                if commit:
                    if order is not None:
                        order.wrote()
                        await order.after_prior()
                        if not b.ledger.current(order.generation):
                            await asyncio.to_thread(self._discard, identity, staged)
                            return None
                    t0 = time.monotonic()
                    committer = b.committer
                    assert committer is not None
                    await asyncio.to_thread(self.commit_cut, committer, cut, identity, *staged)
                    self._log_commit(cut, table, staged, time.monotonic() - t0)
            except (CommitRefused, CommitIncomplete) as exc:
                jobs.succeeded()  # Spark wrote it; the commit itself was refused
                return exc
            except Exception as exc:
                try:
                    if await jobs.session_replaced(exc):
                        attempt -= 1  # the session died under the batch: not the batch's fault
                        continue
                except SparkLost as lost:
                    return lost
                error = exc
                b._attempts_failed += 1
                log.warning(  # the text: PySpark errors' repr is often just "PySparkValueError()"
                    "%r: micro-batch %d (%d rows) failed, attempt %d/%d: %s",
                    b,
                    batch_id,
                    rows,
                    attempt,
                    cfg.max_attempts,
                    error_text(exc),
                )
                delay = retry_delay(attempt, cfg.max_attempts, cfg.retry_backoff_s)
                if delay is None:  # the last attempt (protocol/ledger.py, rule 5)
                    return error
                await asyncio.sleep(delay)
                continue
            jobs.succeeded()
            return None

    # --- in worker threads ----------------------------------------------------------------

    def commit_cut(
        self,
        committer: Committer,
        cut: Cut,
        identity: str,
        moves: list[tuple[str, str]],
        tables: list[TableWrite],
    ) -> None:
        """Commit micro-batch ``cut`` (blocking): what it wrote, its partitions' positions, the
        fences of its batches and, with Delta tables, the completeness watermark."""
        b = self.bridge
        keys = [k for e in cut.entries if (k := b.ledger.key_of(id(e))) is not None]
        metadata = None
        if tables and b._mark is not None:
            metadata = {"shoal.low_watermark_us": b._mark()}
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
        b = self.bridge
        committer = b.committer
        assert committer is not None
        moves: list[tuple[str, str]] = []
        tables: list[TableWrite] = []
        t0 = time.monotonic()
        if isinstance(table, TypedBatch):
            moves, tables = table.stage(b.spark, committer, identity, b.config.table_format)
            self.count_typed_write(table)
        elif table.num_rows:
            staging = committer.staging(identity)
            df = self._frames.get(cut.batch_id)
            write_staged(df if df is not None else self.dataframe(table), str(staging))
            staged = sorted(p.name for p in staging.glob("table=*") if p.is_dir())
            if not staged:
                raise BridgeError(
                    f"Spark wrote {table.num_rows} rows but {staging} holds none here: over "
                    "Spark Connect or on a cluster the output must be on a file system this "
                    "process shares with the executors (or set SparkConfig.atomic_commit=False)"
                )
            rel = committer.staged(identity)
            moves = [(f"{rel}/{t}", f"{t}/batch={identity}") for t in staged]
        seconds = time.monotonic() - t0
        b.phase_s["write"] += seconds
        log.debug("%r: micro-batch %d written in %.3f s", b, cut.batch_id, seconds)
        return moves, tables

    def _discard(
        self, identity: str, staged: tuple[list[tuple[str, str]], list[TableWrite]]
    ) -> None:
        """In a worker thread: delete what :meth:`_stage` wrote for a micro-batch that will
        not be committed (the one before it failed)."""
        committer = self.bridge.committer
        assert committer is not None
        committer.discard(identity, staged[1])

    def _log_commit(
        self,
        cut: Cut,
        table: Any,
        staged: tuple[list[tuple[str, str]], list[TableWrite]],
        seconds: float,
    ) -> None:
        self.bridge.phase_s["commit"] += seconds
        moves, tables = staged
        log.debug(
            "%r: micro-batch %d (%d rows, %d tables) committed in %.3f s",
            self.bridge,
            cut.batch_id,
            table.num_rows,
            len(tables) or len(moves),
            seconds,
        )

    def count_typed_write(self, batch: TypedBatch) -> None:
        receipt = batch.receipt
        if batch.num_rows and receipt is not None and receipt.spark_jobs is not None:
            self.bridge.typed_writes += 1
            self.bridge.typed_write_jobs += receipt.spark_jobs

    def dataframe(self, table: Any) -> Any:
        spark = self.bridge.spark
        if table.num_rows == 0:
            # Spark Connect cannot infer a schema from an empty table (CANNOT_INFER_EMPTY_SCHEMA);
            # a foreach_batch still gets the micro-batch (a heartbeat moved a watermark).
            from pyspark.sql.pandas.types import from_arrow_schema

            return spark.createDataFrame(table, schema=from_arrow_schema(table.schema))
        return spark.createDataFrame(table)

    def _frames_of(self, tables: _TypedTables) -> dict[str, Any]:
        """A ``foreach_batch``'s typed frames (``SparkConfig.foreach_batch_frames``): each
        table's typed rows as a DataFrame (``createDataFrame`` from Arrow, as the generic
        one); a micro-batch without rows gets an empty mapping."""
        tables.check()
        return {name: self.bridge.spark.createDataFrame(t) for name, t in tables.tables.items()}

    def run_batch(self, batch_id: int, table: Any, identity: str) -> None:
        """In a worker thread: one attempt of one micro-batch."""
        b = self.bridge
        if isinstance(table, TypedBatch):
            name = f"{b.run_id}-{batch_id:010d}"
            table.write_in_place(b.spark, b.config.output_dir, name)
            self.count_typed_write(table)
            return
        df = self._frames_of(table) if isinstance(table, _TypedTables) else self.dataframe(table)
        if b.foreach_batch is not None:
            foreach: Callable[..., None] = b.foreach_batch
            if b._foreach_identity:
                foreach(df, batch_id, identity)
            else:
                foreach(df, batch_id)
        else:
            write_default(df, b.config.output_dir, f"{b.run_id}-{batch_id:010d}")


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


class Order:
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


def cut_identity(cut: Cut, connector: str) -> str:
    return batch_identity(((e.token, e.records) for e in cut.entries), connector)


def error_text(exc: BaseException) -> str:
    """An error for the RQ/DLQ entry: Spark's messages carry whole JVM stack traces."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + "..."


_NO_OUTPUT_CONDITIONS = frozenset({"PATH_NOT_FOUND", "UNABLE_TO_INFER_SCHEMA"})


def _no_output_yet(exc: BaseException) -> bool:
    """Whether reading the default output failed because there is none yet (a missing
    directory, or one without parquet files), as opposed to Spark or the files being broken."""
    from pyspark.errors import AnalysisException

    if not isinstance(exc, AnalysisException):
        return False
    condition = exc.getCondition() if hasattr(exc, "getCondition") else exc.getErrorClass()
    return condition in _NO_OUTPUT_CONDITIONS
