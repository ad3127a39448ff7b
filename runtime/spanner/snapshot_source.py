"""The :class:`~runtime.ports.SnapshotSource` port over a Spanner database: the snapshot
adapter of :mod:`runtime.spanner.snapshot` as the tasks use it (``protocol/snapshot.py``).

* :meth:`SpannerSnapshots.plan_snapshot` (the leader that starts the connector): checks that T
  is within the database's ``version_retention_period`` (``check_retention``), splits the
  watched tables into partitions at T (``plan_snapshot``) and describes each as a
  :class:`~protocol.messages.SnapshotItem`: its work-item token ``snapshot:<table>/<index>``
  and the :class:`~runtime.spanner.snapshot.SnapshotPartition` in msgpack (the batch
  transaction's session and id, the partition token, the columns), which any process reads
  from. T too old, or a table missing at T, raises an ``Unrecoverable`` error: the run stops
  with exit 1 and the message says what to set.
* :meth:`SpannerSnapshots.read_snapshot` (a partition's reader, any task): reads the partition
  with ``read_partition`` in a worker thread of its own pool, a chunk at a time (the reader
  asks for the next chunk once it has handled the last), and turns each chunk into one
  ``DataChange`` with mod type ``SNAPSHOT`` and commit timestamp T. An empty chunk (an empty
  partition's) is not sent: the partition ends with nothing in it.

The blocking client's calls run in the pool (``threads`` at once): reading many partitions at
once never takes the default executor's threads, which the file sink's commits use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from protocol.messages import SnapshotItem, SnapshotPlan
from protocol.records import ChangeRecord, DataChange
from protocol.snapshot import work_token
from runtime.spanner.config import SpannerConfig
from runtime.spanner.snapshot import (
    SnapshotChange,
    SnapshotChunk,
    SnapshotPartition,
    check_retention,
    plan_snapshot,
    read_partition,
)

__all__ = ["SpannerSnapshots", "as_record", "describe", "partition_of", "snapshot_plan"]

log = logging.getLogger("shoal.snapshot")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SnapshotPartition)


def describe(partition: SnapshotPartition) -> SnapshotItem:
    """The sync topic's description of ``partition``."""
    return SnapshotItem(
        work_token(partition.table, partition.index), partition.table, _encoder.encode(partition)
    )


def partition_of(item: SnapshotItem) -> SnapshotPartition:
    """The partition ``item`` describes (raises ``msgspec.DecodeError`` for another source's)."""
    return _decoder.decode(item.source)


def as_record(change: SnapshotChange) -> DataChange:
    """A chunk's rows as the change record the sinks take (field for field)."""
    return DataChange(
        commit_ts=change.commit_ts,
        record_sequence=change.record_sequence,
        server_transaction_id=change.server_transaction_id,
        is_last_record_in_transaction_in_partition=change.is_last_record_in_transaction_in_partition,
        table=change.table,
        column_types=change.column_types,
        mods=change.mods,
        mod_type="SNAPSHOT",
        value_capture_type=change.value_capture_type,
    )


class SpannerSnapshots:
    """See the module docstring. ``tables``: the tables to snapshot, asked when the snapshot is
    planned (the change stream's tables after the connector's filters); ``chunk_rows``: the
    rows of one chunk of a snapshot this process plans (recorded with T: every reader of it
    uses the plan's); ``clock``: wall time in seconds (the retention check's now)."""

    def __init__(
        self,
        config: SpannerConfig,
        tables: Callable[[], Awaitable[Sequence[str]]],
        *,
        chunk_rows: int = 10_000,
        threads: int = 8,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if threads < 1 or chunk_rows < 1:
            raise ValueError("threads and chunk_rows must be at least 1")
        self.chunk_rows = chunk_rows
        self.config = config
        self._tables = tables
        self._clock = clock
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="snapshot")
        self._client: Any = None
        self._database: Any = None
        self.planned = 0  # partitions planned by this process
        self.chunks = 0  # chunks read (sent on; a re-read counts again)
        self.rows = 0

    def _db(self) -> Any:
        """The blocking client's database (made on first use, in a pool thread)."""
        if self._database is None:
            from google.cloud import spanner

            from runtime import compat

            compat.disable_grpc_fork_support()
            self._client = spanner.Client(**self.config.client_kwargs())
            instance = self._client.instance(self.config.instance)
            self._database = instance.database(
                self.config.database, database_role=self.config.database_role
            )
        return self._database

    async def _run(self, call: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def plan_snapshot(self, read_ts: int) -> SnapshotPlan:
        tables = sorted(set(await self._tables()))
        if not tables:
            from runtime.ports import Unrecoverable

            raise Unrecoverable(
                "snapshot: no table to snapshot (the change stream watches none that the "
                "connector's tables / exclude_tables filters keep)"
            )

        def plan() -> list[SnapshotPartition]:
            db = self._db()
            check_retention(db, read_ts, int(self._clock() * 1_000_000))
            return plan_snapshot(db, tables, read_ts)

        partitions: list[SnapshotPartition] = await self._run(plan)
        self.planned += len(partitions)
        log.info(
            "snapshot at %d: %d partitions of %d tables (%s)",
            read_ts,
            len(partitions),
            len(tables),
            ", ".join(tables),
        )
        return snapshot_plan(read_ts, self.chunk_rows, partitions)

    async def read_snapshot(
        self, item: SnapshotItem, chunk_rows: int
    ) -> AsyncIterator[Sequence[ChangeRecord]]:
        partition = partition_of(item)
        chunks: Iterator[SnapshotChunk] | None = None

        def start() -> Iterator[SnapshotChunk]:
            return read_partition(self._db(), partition, chunk_rows)

        def step() -> SnapshotChunk | None:
            assert chunks is not None
            return next(chunks, None)

        loop = asyncio.get_running_loop()
        pending: asyncio.Future[SnapshotChunk | None] | None = None
        try:
            chunks = await self._run(start)
            while True:
                pending = loop.run_in_executor(self._pool, step)
                chunk = await pending
                pending = None
                if chunk is None:
                    return
                self.chunks += 1
                if chunk.rows:
                    self.rows += chunk.rows
                    yield (as_record(chunk.change),)
        finally:
            if pending is not None:
                # cancelled while a chunk was being read: the generator runs in a pool thread
                # until that chunk is in; close it only then (a running one cannot be closed)
                await asyncio.wait({pending})
            if chunks is not None:
                close: Any = getattr(chunks, "close", None)
                if close is not None:
                    await self._run(close)

    async def close(self) -> None:
        def close() -> None:
            if self._client is not None:
                from runtime import compat
                from runtime.spanner.emulator import close_sync_client

                # not Database.close(): it joins the client's session-maintenance thread, which
                # sleeps up to ten minutes between looks (google-cloud-spanner 3.71); that
                # thread is a daemon. Its gRPC channel is closed here.
                transport = compat.database_transport(self._database)
                if transport is not None:
                    transport.close()
                close_sync_client(self._client)
                self._client = self._database = None

        await self._run(close)
        self._pool.shutdown(wait=False, cancel_futures=True)


def snapshot_plan(
    read_ts: int, chunk_rows: int, partitions: Sequence[SnapshotPartition]
) -> SnapshotPlan:
    """The plan the sync topic records for ``partitions`` read at ``read_ts`` in chunks of
    ``chunk_rows`` rows."""
    items = tuple(describe(p) for p in partitions)
    return SnapshotPlan(read_ts=read_ts, total=len(items), chunk_rows=chunk_rows, items=items)
