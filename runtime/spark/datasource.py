"""Spark writes the typed per-table changelog: one Spark job per micro-batch, whatever the number
of tables, through a PySpark Python data source with an Arrow writer.

:func:`write_staged_typed` takes a micro-batch as its wire table (``runtime.typed.WIRE``: one
row per mod, grouped by table, keys and values as JSON text) and each table's
:class:`~runtime.typed.TableSpec` (its columns and whether it holds old values, decided over
the whole micro-batch). The wire table enters Spark as an Arrow-backed DataFrame of **chunks**
(:func:`wire_chunks`): the wire table cut into as many slices as the session has cores, each
slice one row holding its Arrow IPC stream (column ``_wire``), one partition per chunk. Spark
moves each chunk as one binary value: turning a wide table of JSON text into Spark's rows and
back into Arrow for the Python writer cost about as much as the whole floor write of the same
rows (``bench typedwrites``, docs/benchmarks.md). The wire table is grouped by table, so each
task gets runs of whole tables and a micro-batch of ``n`` tables makes at most
``n + tasks - 1`` files. It is written with ``format("shoal_typed")``:

* **executors** (:class:`TypedWriter.write`) get their chunk, read its slice of the wire table,
  turn it into each table's typed rows with ``runtime.typed.tables_from_wire`` (the same
  conversion as the in-process ``typed_tables``) and write one parquet file per table under the
  staging location, ``<staging>/<table>/part-<partition>-<attempt>-<random>.parquet``, through
  pyarrow's file systems (:func:`filesystem`: a local path, ``file://``, ``s3://``, ``gs://``),
  and return a commit message listing their files (table, path, rows, bytes) with the writing
  process's pid and host;
* the **driver** (:meth:`TypedWriter.commit`, run once per write in a Python process Spark's
  JVM starts, not in the caller's) writes the receipt ``<staging>/_receipt.json`` (one object
  written at once: a temporary file renamed on a local file system, one PUT on an object store)
  listing exactly the files of the task attempts Spark committed; :meth:`TypedWriter.abort`
  deletes the files its messages list.

Back in the caller, :func:`write_staged_typed` reads the receipt (of this write: a random write
id ties them), checks it holds every row of the wire table, and deletes every other file under
the staging location (those of failed task attempts). What is staged is then committed by the
caller (the Spark bridge: ``runtime.files.commit``'s renames, or copies on an object store).

**Delta tables** (``tables_uri``): the executors write each table's file straight into the
Delta table's directory, ``<tables>/<table>/part-<batch>-<write>p<partition>a<attempt>.parquet``
(invisible to readers until a Delta commit names it), with the statistics of its add action
from the footer they just wrote; the staging location holds only the receipt. The caller
commits the receipt's files as one Delta transaction per table (the Spark bridge:
``runtime.files.commit``'s ``tables=``, idempotent by its application transaction); files of task
attempts Spark did not count, or of a write that failed, are found by the write's id in their
name and deleted (:func:`drop_write`); a process killed before its commit leaves files that no
Delta log names (``VACUUM`` removes them).

**The streaming path** (``format("shoal_typed_stream")``, :class:`TypedStreamWriter`, a
``DataSourceStreamArrowWriter``): the same executor-side conversion and files
(:func:`write_task`), the options coming with the chunks (:func:`with_write`: a streaming
writer's options are fixed when the query starts); the driver's ``commit(messages, batchId)``
writes the receipt; the caller commits once Spark's checkpoint holds the micro-batch
(:func:`streamed_receipt`). The classes must be importable where
Spark runs Python (the executors, the driver's planning and commit processes): shoal installed
there, or its directory on their ``PYTHONPATH``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.fs as pafs
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from runtime.files.typed import encode_parquet
from runtime.typed import TableSpec, decode_specs, encode_specs, tables_from_wire

__all__ = [
    "CHUNK_COLUMN",
    "NAME",
    "RECEIPT",
    "STREAM_NAME",
    "Receipt",
    "StagedFile",
    "StreamTaskWritten",
    "TaskFiles",
    "TaskWritten",
    "TypedChangelog",
    "TypedStreamChangelog",
    "TypedStreamWriter",
    "TypedWriteError",
    "TypedWriter",
    "data_file_name",
    "drop_unlisted",
    "drop_write",
    "filesystem",
    "read_chunks",
    "read_receipt",
    "streamed_receipt",
    "wire_chunks",
    "with_write",
    "write_staged_typed",
    "write_task",
]

log = logging.getLogger("shoal.spark")

NAME = "shoal_typed"
"""The data source's name (``df.write.format(NAME)``)."""

RECEIPT = "_receipt.json"
"""The receipt's name under the staging location (table names start with a letter)."""

CHUNK_COLUMN = "_wire"
"""The chunks' one column: a slice of the wire table as an Arrow IPC stream."""


class TypedWriteError(RuntimeError):
    """A typed write whose outcome is not what Spark reported (no receipt, rows missing)."""


class StagedFile(msgspec.Struct, frozen=True):
    """One file a task wrote: its table, its path in the file system of the staging location
    (of the tables' location, with ``tables``), its rows and bytes; with ``tables`` also when it
    was written (epoch ms) and its Delta statistics (``runtime.lake.delta.parquet_stats``)."""

    table: str
    path: str
    rows: int
    bytes: int
    modified_ms: int = 0
    stats: str | None = None


class TaskFiles(msgspec.Struct, frozen=True):
    """What one task attempt wrote, and where it ran."""

    partition: int
    attempt: int
    task_attempt_id: int
    pid: int
    host: str
    files: tuple[StagedFile, ...]
    read_s: float = 0.0  # taking the chunks in and reading them
    convert_s: float = 0.0  # tables_from_wire
    write_s: float = 0.0  # encoding and writing the files


class Receipt(msgspec.Struct, frozen=True):
    """The files of one write that Spark committed (every task attempt it counted), written by
    the driver's commit; ``spark_jobs``: the Spark jobs the write ran, as counted by the caller
    (None where it cannot tell: Spark Connect)."""

    write_id: str
    tasks: tuple[TaskFiles, ...]
    spark_jobs: int | None = None

    @property
    def files(self) -> list[StagedFile]:
        return [f for task in self.tasks for f in task.files]

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def tables(self) -> list[str]:
        """The tables with files, by name."""
        return sorted({f.table for f in self.files})


_receipt_encoder = msgspec.json.Encoder()
_receipt_decoder = msgspec.json.Decoder(Receipt)


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The file system of a location and the location's path in it: a local path, ``file://``,
    ``s3://``, ``gs://`` (credentials from the standard environment and credential chains).
    The one place the typed write opens a file system, in executors and in the caller. On S3
    a file smaller than a multipart upload's part is written by one PUT when it closes
    (``allow_delayed_open``), not by a multipart upload of three requests; either way it
    appears whole or not at all."""
    if uri.startswith(("s3://", "s3a://")) and "?" not in uri:
        uri += "?allow_delayed_open=true"
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


def _is_local(fs: pafs.FileSystem) -> bool:
    return bool(fs.type_name == "local")


@dataclass(frozen=True)
class TaskWritten(WriterCommitMessage):
    """A task's commit message (pickled by Spark back to the driver)."""

    task: TaskFiles


class TypedWriter(DataSourceArrowWriter):
    """Writes each task's typed tables (see the module docstring). Options: ``staging`` (the
    staging location), ``specs`` (the tables' specs, ``runtime.typed.encode_specs``) and
    ``write_id``; ``tables`` and ``batch`` for Delta tables (:func:`write_staged_typed`)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        try:
            self.staging = options["staging"]
            self.specs_text = options["specs"]
            self.write_id = options["write_id"]
        except KeyError as exc:
            raise TypedWriteError(f"the {NAME} data source needs the option {exc}") from None
        self.tables = options.get("tables")
        self.batch = options.get("batch", "")
        if self.tables is not None and not self.batch:
            raise TypedWriteError(f"the {NAME} data source's option tables needs batch")

    def write(self, iterator: Iterator[pa.RecordBatch]) -> TaskWritten:
        t0 = time.monotonic()
        slices = [s for batch in iterator for s in read_chunks(batch)]
        task = write_task(
            slices,
            self.specs_text,
            staging=self.staging,
            tables=self.tables,
            batch=self.batch,
            write_id=self.write_id,
            t0=t0,
        )
        return TaskWritten(task)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        tasks = []
        for message in messages:
            if not isinstance(message, TaskWritten):
                raise TypedWriteError(f"a task of write {self.write_id} sent {message!r}")
            tasks.append(message.task)
        receipt = Receipt(self.write_id, tuple(sorted(tasks, key=lambda t: t.partition)))
        fs, base = filesystem(self.staging)
        _put_atomically(fs, f"{base}/{RECEIPT}", _receipt_encoder.encode(receipt))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        fs, _ = filesystem(self.staging)
        for message in messages:
            if isinstance(message, TaskWritten):
                for f in message.task.files:
                    _delete(fs, f.path)


def _task_context() -> tuple[int, int, int]:
    """(partition, attempt number, task attempt id) of the running Spark task."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return 0, 0, -1
    return ctx.partitionId(), ctx.attemptNumber(), ctx.taskAttemptId()


def write_task(
    slices: Sequence[pa.Table],
    specs_text: str,
    *,
    staging: str,
    tables: str | None,
    batch: str,
    write_id: str,
    t0: float | None = None,
) -> TaskFiles:
    """In an executor: turn a task's slices of a wire table into each table's typed rows
    (``runtime.typed.tables_from_wire``) and write one parquet file per table, under
    ``<staging>/<table>/`` or, for Delta tables, straight into ``<tables>/<table>/``
    (:func:`data_file_name`, with the add action's statistics); what the task wrote. The one
    executor-side conversion of both writers (:class:`TypedWriter`, :class:`TypedStreamWriter`)."""
    partition, attempt, task_attempt = _task_context()
    t0 = time.monotonic() if t0 is None else t0
    files: list[StagedFile] = []
    t1 = t2 = time.monotonic()
    if slices:
        typed = tables_from_wire(pa.concat_tables(slices), decode_specs(specs_text))
        t2 = time.monotonic()
        if tables is not None:  # Delta: straight into each table's directory
            fs, base = filesystem(tables)
            name = data_file_name(batch, write_id, partition, attempt)
        else:
            fs, base = filesystem(staging)
            name = f"part-{partition:05d}-{attempt}-{uuid.uuid4().hex[:12]}.parquet"
        for table, rows in typed.items():
            files.append(_write_file(fs, f"{base}/{table}", name, table, rows, tables is not None))
    t3 = time.monotonic()
    return TaskFiles(
        partition,
        attempt,
        task_attempt,
        os.getpid(),
        socket.gethostname(),
        tuple(files),
        read_s=t1 - t0,
        convert_s=t2 - t1,
        write_s=t3 - t2,
    )


def _write_file(
    fs: pafs.FileSystem, directory: str, name: str, table: str, typed: pa.Table, delta: bool
) -> StagedFile:
    stats: str | None = None
    if delta:
        data, stats = _encode_with_stats(typed)
    else:
        data = encode_parquet(typed)
    if _is_local(fs):
        fs.create_dir(directory, recursive=True)
    path = f"{directory}/{name}"
    with fs.open_output_stream(path) as out:
        out.write(data)
    modified_ms = int(time.time() * 1000)
    return StagedFile(table, path, typed.num_rows, data.size, modified_ms, stats)


class TypedChangelog(DataSource):
    """The ``shoal_typed`` data source: write only (:class:`TypedWriter`)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def writer(self, schema: Any, overwrite: bool) -> TypedWriter:
        return TypedWriter(self.options)


# --- the streaming writer --------------------------------------------------------------------

STREAM_NAME = "shoal_typed_stream"
"""The streaming data source's name (``df.writeStream.format(STREAM_NAME)``)."""

_META_SPECS = b"shoal.specs"
_META_STAGING = b"shoal.staging"
_META_TABLES = b"shoal.tables"
_META_BATCH = b"shoal.batch"
_META_WRITE = b"shoal.write_id"


def with_write(
    wire: pa.Table,
    specs: Mapping[str, TableSpec],
    *,
    staging: str,
    write_id: str,
    tables: str | None = None,
    batch: str = "",
) -> pa.Table:
    """``wire`` carrying, in its schema's metadata, everything a task needs to write it (the
    options :class:`TypedWriter` takes): the chunks of it (:func:`wire_chunks`) are what the
    streaming path spools, and every Spark micro-batch of the streaming query then writes its
    own micro-batch's files (:class:`TypedStreamWriter`: a streaming writer's options are fixed
    when the query starts)."""
    meta = {
        _META_SPECS: encode_specs(dict(specs)).encode(),
        _META_STAGING: staging.encode(),
        _META_BATCH: batch.encode(),
        _META_WRITE: write_id.encode(),
    }
    if tables is not None:
        meta[_META_TABLES] = tables.encode()
    return wire.replace_schema_metadata(meta)


@dataclass(frozen=True)
class StreamTaskWritten(WriterCommitMessage):
    """A streaming task's commit message: what it wrote, and for which write (None: it got no
    chunk)."""

    task: TaskFiles
    staging: str | None
    write_id: str | None


class TypedStreamWriter(DataSourceStreamArrowWriter):
    """The streaming path's writer: per Spark micro-batch, the executors write the typed tables
    of the chunks they get, as :class:`TypedWriter` does (:func:`write_task`, with the options
    the chunks carry: :func:`with_write`), and the driver's ``commit(messages, batchId)``, run
    once per micro-batch, writes the receipt of the files of the tasks Spark committed under
    the micro-batch's staging location. It commits nothing to the output: the bridge does, once
    Spark's checkpoint holds the micro-batch (``runtime.spark.stream_path``)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.options = dict(options)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StreamTaskWritten:
        t0 = time.monotonic()
        slices = [s for batch in iterator for s in read_chunks(batch)]
        meta = (slices[0].schema.metadata or {}) if slices else {}
        if slices and _META_SPECS not in meta:
            raise TypedWriteError(f"the {STREAM_NAME} data source got chunks without a write")
        if not slices:
            task = TaskFiles(*_task_context(), os.getpid(), socket.gethostname(), ())
            return StreamTaskWritten(task, None, None)
        staging = meta[_META_STAGING].decode()
        write_id = meta[_META_WRITE].decode()
        tables = meta[_META_TABLES].decode() if _META_TABLES in meta else None
        task = write_task(
            slices,
            meta[_META_SPECS].decode(),
            staging=staging,
            tables=tables,
            batch=meta[_META_BATCH].decode(),
            write_id=write_id,
            t0=t0,
        )
        return StreamTaskWritten(task, staging, write_id)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        written = []
        for message in messages:
            if not isinstance(message, StreamTaskWritten):
                raise TypedWriteError(f"a task of streaming batch {batchId} sent {message!r}")
            written.append(message)
        writes = {(m.staging, m.write_id) for m in written if m.staging is not None}
        if not writes:
            return  # no chunk: an empty micro-batch
        if len(writes) > 1:
            raise TypedWriteError(
                f"streaming batch {batchId} holds chunks of {len(writes)} writes; each must be "
                "its own micro-batch"
            )
        ((staging, write_id),) = writes
        assert staging is not None
        assert write_id is not None
        tasks = tuple(sorted((m.task for m in written), key=lambda t: t.partition))
        fs, base = filesystem(staging)
        _put_atomically(fs, f"{base}/{RECEIPT}", _receipt_encoder.encode(Receipt(write_id, tasks)))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        for message in messages:
            if isinstance(message, StreamTaskWritten) and message.staging is not None:
                fs, _ = filesystem(message.staging)
                for f in message.task.files:
                    _delete(fs, f.path)


class TypedStreamChangelog(DataSource):
    """The ``shoal_typed_stream`` data source: the streaming path's writer only."""

    @classmethod
    def name(cls) -> str:
        return STREAM_NAME

    def streamWriter(self, schema: Any, overwrite: bool) -> TypedStreamWriter:  # noqa: N802
        return TypedStreamWriter(self.options)


def data_file_name(batch: str, write_id: str, partition: int, attempt: int) -> str:
    """The name of a Delta data file a task writes: ``part-<batch>-<write>p<task>a<attempt>``
    (the micro-batch can be told from it, as from ``runtime.files.typed.delta_file_name``;
    :func:`drop_write` finds a write's files by the prefix before ``p``)."""
    return f"{_write_prefix(batch, write_id)}p{partition:05d}a{attempt}.parquet"


def _write_prefix(batch: str, write_id: str) -> str:
    return f"part-{batch}-{write_id[:16]}"


def _encode_with_stats(table: pa.Table) -> tuple[pa.Buffer, str]:
    """A Delta data file's bytes (as :func:`runtime.files.typed.encode_parquet`) and the
    statistics of its add action, from the footer just written."""
    import pyarrow.parquet as pq

    from runtime.lake.delta import parquet_stats

    sink = pa.BufferOutputStream()
    collector: list[Any] = []
    pq.write_table(table, sink, metadata_collector=collector)
    return sink.getvalue(), parquet_stats(collector[0], table.schema)


def wire_chunks(wire: pa.Table, chunks: int) -> pa.Table:
    """``wire`` cut into ``chunks`` slices of about equal rows (fewer if it has fewer rows),
    each an Arrow IPC stream in one row of column :data:`CHUNK_COLUMN`, each row its own
    record batch (``createDataFrame`` makes one partition of each)."""
    n = wire.num_rows
    chunks = max(1, min(chunks, n))
    batches = []
    for i in range(chunks):
        start, end = i * n // chunks, (i + 1) * n // chunks
        sink = pa.BufferOutputStream()
        part = wire.slice(start, end - start)
        with pa.ipc.new_stream(sink, part.schema) as stream:
            stream.write_table(part)
        data = sink.getvalue()
        offsets = pa.array([0, data.size], pa.int32()).buffers()[1]
        value = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, data])  # no copy
        batches.append(pa.record_batch([value], names=[CHUNK_COLUMN]))
    return pa.Table.from_batches(batches)


def read_chunks(batch: pa.RecordBatch) -> Iterator[pa.Table]:
    """The wire table slices of a batch of chunks (:func:`wire_chunks`), as Spark hands them to
    a task (``binary`` or ``large_binary``)."""
    column = batch.column(CHUNK_COLUMN)
    for i in range(batch.num_rows):
        data = column[i].as_buffer()
        if data is not None:
            yield pa.ipc.open_stream(data).read_all()


def _put_atomically(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Readers see all of ``data`` at ``path`` or nothing: a local file is written aside and
    renamed; an object store's PUT is atomic by itself."""
    if not _is_local(fs):
        with fs.open_output_stream(path) as out:
            out.write(data)
        return
    directory, _, name = path.rpartition("/")
    fs.create_dir(directory, recursive=True)
    tmp = f"{directory}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(data)
    fs.move(tmp, path)


def _delete(fs: pafs.FileSystem, path: str) -> bool:
    """Delete a file; False if it was not there."""
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        return False
    return True


# --- the caller's side -----------------------------------------------------------------------

_registered: weakref.WeakSet[Any] = weakref.WeakSet()


def _register(spark: Any) -> None:
    """Register the data source with ``spark`` once (a replaced session needs it again)."""
    if spark not in _registered:
        spark.dataSource.register(TypedChangelog)
        _registered.add(spark)


def _spark_context(spark: Any) -> Any:
    """The session's SparkContext (None over Spark Connect, which has none: its session raises
    an ``AttributeError``, ``JVM_ATTRIBUTE_NOT_SUPPORTED``)."""
    return getattr(spark, "sparkContext", None)


_DEFAULT_CHUNKS = 2  # where the session does not tell its parallelism (Spark Connect)
_MAX_CHUNK_BYTES = 256 << 20
_JOB_PROPERTIES = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")


def write_staged_typed(
    spark: Any,
    wire: pa.Table,
    staging_uri: str,
    specs: Mapping[str, TableSpec],
    *,
    partitions: int | None = None,
    source: type[TypedChangelog] = TypedChangelog,
    options: Mapping[str, str] | None = None,
    tables_uri: str | None = None,
    batch: str = "",
) -> Receipt:
    """Blocking: write the typed tables of the wire table ``wire`` (``runtime.typed.WIRE``,
    with each table's ``specs``) under ``staging_uri`` in one Spark job, and return the receipt
    of the files Spark committed (every other file under ``staging_uri`` is deleted). No rows:
    no job. ``partitions``: the chunks, i.e. tasks (default: the session's default
    parallelism);
    ``source``: the data source class (a subclass under a name of its own, e.g. in a test) and
    ``options`` more options for it.

    ``tables_uri`` (Delta tables): the tasks write each table's files straight into
    ``<tables_uri>/<table>/`` (named by ``batch``, :func:`data_file_name`, with their Delta
    statistics), not under ``staging_uri``, which then holds only the receipt (not listed
    here: the caller deletes the staging location); nothing there is visible until a Delta
    commit names the files. Files of task attempts Spark did not commit, and of a write that
    failed, are deleted (:func:`drop_write`)."""
    write_id = uuid.uuid4().hex
    if wire.num_rows == 0:
        return Receipt(write_id, (), spark_jobs=0)
    _register(spark)
    if source is not TypedChangelog:
        spark.dataSource.register(source)
    sc = _spark_context(spark)
    if partitions is None:
        partitions = sc.defaultParallelism if sc is not None else _DEFAULT_CHUNKS
    # a chunk is one binary value (Spark and Arrow hold at most 2 GiB in one)
    partitions = max(partitions, -(-wire.nbytes // _MAX_CHUNK_BYTES))
    df = spark.createDataFrame(wire_chunks(wire, partitions))
    writer = (
        df.write.format(source.name())
        .mode("append")
        .options(**(options or {}))
        .option("staging", staging_uri)
        .option("specs", encode_specs(dict(specs)))
        .option("write_id", write_id)
    )
    if tables_uri is not None:
        writer = writer.option("tables", tables_uri).option("batch", batch)
    group = f"shoal-typed-{write_id}"
    saved: list[str | None] = []
    if sc is not None:
        saved = [sc.getLocalProperty(p) for p in _JOB_PROPERTIES]
        sc.setJobGroup(group, f"shoal: typed micro-batch ({wire.num_rows} rows)")
    try:
        try:
            writer.save()
        finally:
            if sc is not None:
                for prop, value in zip(_JOB_PROPERTIES, saved, strict=True):
                    sc.setLocalProperty(prop, value)
        jobs = None if sc is None else len(sc.statusTracker().getJobIdsForGroup(group))
        receipt = _whole_receipt(staging_uri, write_id, wire.num_rows)
    except BaseException:
        if tables_uri is not None:
            try:
                drop_write(tables_uri, sorted(specs), batch, write_id)
            except Exception as exc:  # the write's own error is the one to raise
                log.warning("typed write %s: deleting its files failed: %s", write_id, exc)
        raise
    # Delta tables: the staging location holds only the receipt (the caller deletes it)
    dropped = drop_unlisted(staging_uri, receipt) if tables_uri is None else []
    if tables_uri is not None:
        retried = sorted({f.table for t in receipt.tasks if t.attempt for f in t.files})
        if retried:  # a task that ran again may have left files of its failed attempt
            dropped += drop_write(tables_uri, retried, batch, write_id, keep=receipt)
    if dropped:
        log.warning(
            "typed write %s: deleted %d files of failed task attempts", write_id, len(dropped)
        )
    return msgspec.structs.replace(receipt, spark_jobs=jobs)


def streamed_receipt(
    staging_uri: str,
    write_id: str,
    rows: int,
    *,
    tables_uri: str | None = None,
    tables: Sequence[str] = (),
    batch: str = "",
) -> Receipt:
    """The caller's side of a micro-batch the streaming query wrote (:class:`TypedStreamWriter`)
    once Spark's checkpoint holds it: its receipt, which must hold all ``rows`` rows; every
    other file of the write is deleted (under ``staging_uri``, and with ``tables_uri`` those of
    ``tables`` named by the write: attempts Spark did not count, a run of the micro-batch that
    failed before Spark ran it again)."""
    receipt = _whole_receipt(staging_uri, write_id, rows)
    dropped = drop_unlisted(staging_uri, receipt)
    if tables_uri is not None:
        dropped += drop_write(tables_uri, tables, batch, write_id, keep=receipt)
    if dropped:
        log.warning(
            "streamed write %s: deleted %d files of failed task attempts", write_id, len(dropped)
        )
    return receipt


def _whole_receipt(staging_uri: str, write_id: str, rows: int) -> Receipt:
    """The receipt of write ``write_id``, which must hold all ``rows`` rows."""
    receipt = read_receipt(staging_uri, write_id)
    if receipt.rows != rows:
        raise TypedWriteError(
            f"Spark committed {receipt.rows} rows of a micro-batch of {rows} under {staging_uri}"
        )
    return receipt


def read_receipt(staging_uri: str, write_id: str) -> Receipt:
    """The receipt of write ``write_id`` under ``staging_uri``."""
    fs, base = filesystem(staging_uri)
    try:
        with fs.open_input_stream(f"{base}/{RECEIPT}") as f:
            data = f.read()
    except FileNotFoundError:
        raise TypedWriteError(
            f"Spark reported write {write_id} done but {staging_uri}/{RECEIPT} is missing: the "
            "staging location must be one this process reads as the Spark driver writes it"
        ) from None
    try:
        receipt = _receipt_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise TypedWriteError(f"{staging_uri}/{RECEIPT} is not a receipt: {exc}") from exc
    if receipt.write_id != write_id:
        raise TypedWriteError(
            f"{staging_uri}/{RECEIPT} is the receipt of write {receipt.write_id}, not {write_id}"
        )
    return receipt


def drop_write(
    tables_uri: str,
    tables: Sequence[str],
    batch: str,
    write_id: str,
    *,
    keep: Receipt | None = None,
) -> list[str]:
    """Delete the files write ``write_id`` of ``batch`` left in the directories of ``tables``
    under ``tables_uri`` (Delta data files, :func:`data_file_name`), except those ``keep``
    lists; the paths deleted. Other writes' files (another micro-batch's, another process's)
    are never touched: the name holds the write's random id."""
    fs, base = filesystem(tables_uri)
    listed = set() if keep is None else {f.path for f in keep.files}
    prefix = _write_prefix(batch, write_id)
    dropped: list[str] = []
    for table in tables:
        try:
            infos = fs.get_file_info(pafs.FileSelector(f"{base}/{table}", allow_not_found=True))
        except OSError as exc:
            log.warning("typed write %s: listing table %s failed: %s", write_id, table, exc)
            continue
        dropped.extend(
            info.path
            for info in infos
            if info.type == pafs.FileType.File
            and info.base_name.startswith(prefix)
            and info.path not in listed
            and _delete(fs, info.path)
        )
    return dropped


def drop_unlisted(staging_uri: str, receipt: Receipt) -> list[str]:
    """Delete every file under ``staging_uri`` that ``receipt`` does not list (the receipt
    itself excepted) and, on a local file system, directories left empty; the paths deleted."""
    fs, base = filesystem(staging_uri)
    keep = {f.path for f in receipt.files} | {f"{base}/{RECEIPT}"}
    infos: Sequence[pafs.FileInfo] = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    dropped = [
        info.path
        for info in infos
        if info.type == pafs.FileType.File and info.path not in keep and _delete(fs, info.path)
    ]
    if _is_local(fs):
        listed = {f.path.rpartition("/")[0] for f in receipt.files}
        for info in sorted(infos, key=lambda i: i.path, reverse=True):
            if (
                info.type == pafs.FileType.Directory
                and info.path not in listed
                and not fs.get_file_info(pafs.FileSelector(info.path))
            ):
                fs.delete_dir(info.path)
    return dropped
