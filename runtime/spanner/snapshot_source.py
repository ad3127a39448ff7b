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
  partition's) is not sent: the partition ends with nothing in it. While a chunk takes longer
  than ``heartbeat_s`` it sends a heartbeat at T (:func:`in_thread`).

The blocking client's calls run in the pool (``threads`` at once): reading many partitions at
once never takes the default executor's threads, which the file sink's commits use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar, cast

import msgspec

from protocol.messages import SnapshotItem, SnapshotPlan
from protocol.records import ChangeRecord, DataChange, Heartbeat
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

__all__ = [
    "SpannerSnapshots",
    "as_record",
    "describe",
    "in_thread",
    "partition_of",
    "snapshot_plan",
]

log = logging.getLogger("shoal.snapshot")

C = TypeVar("C")

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
        heartbeat_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if threads < 1 or chunk_rows < 1 or heartbeat_s <= 0:
            raise ValueError("threads and chunk_rows must be at least 1, heartbeat_s positive")
        self.chunk_rows = chunk_rows
        self.heartbeat_s = heartbeat_s
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

        def chunks() -> Iterator[SnapshotChunk]:
            return read_partition(self._db(), partition, chunk_rows)

        async for chunk in in_thread(
            self._pool, chunks, self.heartbeat_s, Heartbeat(partition.read_ts)
        ):
            if isinstance(chunk, Heartbeat):
                yield (chunk,)
                continue
            self.chunks += 1
            if chunk.rows:
                self.rows += chunk.rows
                yield (as_record(chunk.change),)

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


async def in_thread(
    pool: Executor, make: Callable[[], Iterator[C]], heartbeat_s: float, heartbeat: Heartbeat
) -> AsyncGenerator[C | Heartbeat, None]:
    """The items of the blocking iterator ``make()`` returns, each taken in a thread of ``pool``
    (the next one only when the consumer asks for it), and ``heartbeat`` whenever one takes
    longer than ``heartbeat_s``: a partition whose next chunk waits for a thread (more
    partitions read at once than the pool has threads) or for Spanner is not taken for a
    stalled query (the reader's rule 9); a heartbeat at T does not move its position. Closed
    early (a stop, a cancelled query), it lets the item being taken finish, then closes the
    iterator in the pool (a running generator cannot be closed)."""
    loop = asyncio.get_running_loop()
    items: Iterator[C] | None = None
    end = object()

    def step() -> object:
        assert items is not None
        return next(items, end)

    pending: asyncio.Future[object] | None = None
    try:
        items = await loop.run_in_executor(pool, make)
        while True:
            pending = loop.run_in_executor(pool, step)
            while True:
                done, _ = await asyncio.wait({pending}, timeout=heartbeat_s)
                if done:
                    break
                yield heartbeat
            item = pending.result()
            pending = None
            if item is end:
                return
            yield cast(C, item)
    finally:
        if pending is not None:
            await asyncio.wait({pending})
        close: Any = getattr(items, "close", None)
        if close is not None:
            await loop.run_in_executor(pool, close)
