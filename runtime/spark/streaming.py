"""The Structured Streaming path: a PySpark 4 Python data source ``shoal`` over a spool
directory of Arrow IPC files, and the ``StreamingBackend`` the bridge drives.

The runtime writes each micro-batch the bridge cuts as one file ``<seq>.arrow`` (``seq``: a
zero-padded, increasing number), atomically (written under a dot-name, then renamed). Spark owns
everything after that: ``spark.readStream.format("shoal").option("path", spool)`` serves, per
Spark micro-batch, the files ``start < seq <= end`` (offsets ``{"seq": n}``); the query's
checkpoint keeps offsets and replays an uncommitted batch after a crash.

The typed layout (the default; option ``layout`` ``typed``): each spool file holds the chunks of
one micro-batch's wire table (``runtime.spark.datasource.wire_chunks``, column ``_wire``), each
carrying where and how its task writes (``with_write``); the source serves **one spool file per
Spark micro-batch** (a micro-batch's tables have one spec each) and one partition (task) per
chunk, and the query writes through ``TypedStreamWriter``: the executors convert and write the
files as the embedded path's do, the driver's commit writes the receipt, and the bridge commits
the micro-batch once the checkpoint holds it. A micro-batch Spark runs again (after a failure,
from the checkpoint) is the same spool file: the same identity, the same staging directory.
The generic layout: the query writes parquet partitioned by table through Spark's file sink
(exactly once with its checkpoint), or hands each micro-batch to the user's ``foreach_batch``.

The ack: when Spark's checkpoint has a commit for micro-batch ``b`` (``commits/b``), every spool
file up to the end offset of ``b`` (``offsets/b``) is durably in the sink; the backend resolves
the bridge's futures up to there and deletes those files. The source's own ``commit(end)`` is
lazy (called when the next batch is planned, skipped for the last one before a stop), so the
checkpoint's commit log is read instead; ``commit`` only deletes files as a second chance.

The source class must be importable in the Python processes Spark starts (the driver-side reader
runs in one of them): ``session.prepare_environment`` puts shoal on their ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from runtime.spark.datasource import CHUNK_COLUMN, TypedStreamChangelog
from runtime.spark.rows import COLUMNS

__all__ = ["SOURCE_NAME", "ShoalSource", "StreamingBackend", "spool_write"]

log = logging.getLogger("shoal.spark")

SOURCE_NAME = "shoal"
_SPARK_TYPES = {"string": "string", "int64": "bigint", "int32": "int"}
SCHEMA_DDL = ", ".join(f"`{name}` {_SPARK_TYPES[t]}" for name, t in COLUMNS)
TYPED_SCHEMA_DDL = f"`{CHUNK_COLUMN}` binary"  # the chunks of a typed write (typed layout)
_FILE = re.compile(r"^(\d{12})\.arrow$")


def spool_files(spool: Path) -> dict[int, Path]:
    """The complete spool files by sequence number (half-written dot-files excluded)."""
    out = {}
    with os.scandir(spool) as entries:
        for entry in entries:
            match = _FILE.match(entry.name)
            if match:
                out[int(match.group(1))] = Path(entry.path)
    return out


def spool_write(spool: Path, seq: int, table: Any) -> Path:
    """Write ``table`` as spool file ``seq`` atomically (fsync, then rename)."""
    import pyarrow as pa

    final = spool / f"{seq:012d}.arrow"
    tmp = spool / f".{seq:012d}.arrow.tmp"
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    return final


class SpoolPartition(InputPartition):
    """A spool file, or (``batch``) one record batch of it: one chunk of a typed write."""

    def __init__(self, path: str, batch: int | None = None) -> None:
        super().__init__((path, batch))
        self.path = path
        self.batch = batch


def _batches(path: Path) -> int:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return int(pa.ipc.open_file(source).num_record_batches)


class ShoalStreamReader(DataSourceStreamReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        path = options.get("path")
        if not path:
            raise ValueError("the shoal source needs option path: the spool directory")
        self.spool = Path(path)
        self.typed = options.get("layout") == "typed"

    def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        return {"seq": -1}

    def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:  # noqa: N802
        files = spool_files(self.spool)
        if self.typed:  # one spool file (one write, with its own specs) per micro-batch
            return {"seq": start["seq"] + 1 if start["seq"] + 1 in files else start["seq"]}
        return {"seq": max(files, default=start["seq"])}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[SpoolPartition]:
        files = spool_files(self.spool)
        wanted = range(start["seq"] + 1, end["seq"] + 1)
        missing = [s for s in wanted if s not in files]
        if missing:
            raise FileNotFoundError(
                f"shoal spool {self.spool}: files {missing[:5]} of offsets "
                f"{start['seq']}..{end['seq']} are gone (deleted before Spark committed them?)"
            )
        if self.typed:  # one partition (one task) per chunk
            return [
                SpoolPartition(str(files[s]), i) for s in wanted for i in range(_batches(files[s]))
            ]
        return [SpoolPartition(str(files[s])) for s in wanted]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import pyarrow as pa

        assert isinstance(partition, SpoolPartition)
        with pa.memory_map(partition.path) as source:
            reader = pa.ipc.open_file(source)
            if partition.batch is not None:
                yield reader.get_batch(partition.batch)
                return
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)

    def commit(self, end: dict[str, int]) -> None:
        for seq, path in spool_files(self.spool).items():
            if seq <= end["seq"]:
                path.unlink(missing_ok=True)


class ShoalSource(DataSource):
    """``spark.readStream.format("shoal").option("path", <spool dir>).load()``."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        if self.options.get("layout") == "typed":
            return TYPED_SCHEMA_DDL
        return SCHEMA_DDL

    def streamReader(self, schema: Any) -> ShoalStreamReader:  # noqa: N802 - Spark's name
        return ShoalStreamReader(self.options)


def _activate(spark: Any) -> None:
    """Make ``spark`` the JVM's active session of the calling thread. Spark finds a Python data
    source given to ``writeStream.format`` through the thread's active session: in a thread
    that has none (the bridge starts and restarts its query in worker threads) the lookup fails
    with ``DATA_SOURCE_NOT_FOUND`` although the source is registered (PySpark 4.3, measured).
    Spark Connect sessions have no JVM here: nothing to do."""
    jvm = getattr(spark, "_jvm", None)
    jsession = getattr(spark, "_jsparkSession", None)
    if jvm is not None and jsession is not None:
        jvm.SparkSession.setActiveSession(jsession)


def committed_seq(checkpoint: Path) -> int:
    """The highest spool sequence number Spark's checkpoint says is committed (-1: none)."""
    commits = checkpoint / "commits"
    offsets = checkpoint / "offsets"
    if not commits.is_dir():
        return -1
    done = [int(p.name) for p in commits.iterdir() if p.name.isdigit()]
    if not done:
        return -1
    text = (offsets / str(max(done))).read_text()
    # offsets/<b>: "v1", the batch metadata, then one line per source (ours is the only one)
    source_line = text.strip().splitlines()[-1]
    offset = json.loads(source_line)
    return int(offset["seq"])


class StreamingBackend:
    """Starts and watches the streaming query; the bridge writes spool files and asks
    ``committed()`` how far Spark's checkpoint has committed."""

    def __init__(
        self,
        spark: Any,
        config: Any,
        foreach_batch: Callable[[Any, int], None] | None,
        *,
        typed: bool = False,
    ) -> None:
        out = Path(config.output_dir)
        self.spark = spark
        self.output_dir = out
        self.spool = Path(config.spool_dir) if config.spool_dir else out / "_spool"
        self.checkpoint = (
            Path(config.checkpoint_dir) if config.checkpoint_dir else out / "_checkpoint"
        )
        self.trigger_s = config.trigger_interval_s
        self.foreach_batch = foreach_batch
        self.typed = typed and foreach_batch is None
        self.sink: type[TypedStreamChangelog] = TypedStreamChangelog  # a subclass in tests
        self.query: Any = None
        self.restarts = 0
        self.chunks = 2  # the typed layout's chunks (tasks) per micro-batch: set by start()

    def start(self) -> None:
        """Blocking: register the source and start the query (from its checkpoint)."""
        self.spool.mkdir(parents=True, exist_ok=True)
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        for leftover in self.spool.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)  # half-written before a crash; never served
        _activate(self.spark)
        sc = getattr(self.spark, "sparkContext", None)  # none over Spark Connect
        if sc is not None:
            self.chunks = max(1, int(sc.defaultParallelism))
        self.spark.dataSource.register(ShoalSource)
        stream = (
            self.spark.readStream.format(SOURCE_NAME)
            .option("path", str(self.spool))
            .option("layout", "typed" if self.typed else "generic")
            .load()
        )
        writer = stream.writeStream.option("checkpointLocation", str(self.checkpoint))
        writer = writer.trigger(processingTime=f"{int(self.trigger_s * 1000)} milliseconds")
        if self.foreach_batch is not None:
            writer = writer.foreachBatch(self.foreach_batch)
        elif self.typed:  # the typed layout: TypedStreamWriter, committed by the bridge
            self.spark.dataSource.register(self.sink)
            writer = writer.format(self.sink.name())
        else:
            writer = writer.format("parquet").option("path", str(self.output_dir))
            writer = writer.partitionBy("table")
        self.query = writer.queryName(f"shoal-{time.time_ns()}").start()

    def next_seq(self) -> int:
        """The first sequence number this run may use (after everything spooled or committed)."""
        self.spool.mkdir(parents=True, exist_ok=True)
        return max([committed_seq(self.checkpoint), *spool_files(self.spool)], default=-1) + 1

    def committed(self) -> int:
        """Blocking: the committed sequence number; raises if the query died."""
        query = self.query
        if query is None:  # a restart whose start failed: counted as a failure, tried again
            raise RuntimeError("the Spark streaming query is not running (its start failed)")
        if not query.isActive:
            error = query.exception()
            raise RuntimeError(f"the Spark streaming query stopped: {error}")
        seq = committed_seq(self.checkpoint)
        for s, path in spool_files(self.spool).items():
            if s <= seq:
                path.unlink(missing_ok=True)
        return seq

    def restart(self) -> None:
        self.restarts += 1
        self.stop()
        self.start()

    def stop(self) -> None:
        query, self.query = self.query, None
        if query is not None:
            try:
                query.stop()
            except Exception:
                log.exception("stopping the Spark streaming query failed")
