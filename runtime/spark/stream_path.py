"""The Spark bridge's streaming path (``SparkConfig.path = "streaming"``): cut micro-batches
spooled for Spark's streaming query, settled once Spark's checkpoint holds them.

:class:`StreamPath` writes each cut with rows as the next spool file (``runtime.spark.streaming``:
the ``shoal`` data source, the query's ``StreamingBackend``); a cut without rows is acked with the
files before it. Its ack loop polls the checkpoint and settles the spooled cuts in order: without
a committer they are committed once Spark's checkpoint is; with the typed layout the streaming
query's writer (``runtime.spark.datasource.TypedStreamWriter``) has written the same files the
embedded path writes, from the spooled chunks, and the bridge commits each micro-batch the same
way (``runtime.files.commit``) once the checkpoint holds it. A query that died is restarted
(``max_attempts`` times), then what it never committed fails; a lost session is replaced and a
new query goes on from the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from protocol.records import DataChange
from runtime.files.commit import CommitIncomplete
from runtime.spark.batch import cut_identity, error_text
from runtime.spark.config import BridgeError
from runtime.spark.rows import Cut, to_arrow
from runtime.spark.supervisor import SparkLost
from runtime.spark.typed_output import TypedBatch

if TYPE_CHECKING:
    from runtime.spark.bridge import SparkBridge
    from runtime.spark.streaming import StreamingBackend

__all__ = ["StreamPath"]

log = logging.getLogger("shoal.spark")


class StreamPath:
    """A bridge's streaming query (``backend``) and the spooled cuts it has not committed."""

    def __init__(self, bridge: SparkBridge) -> None:
        self.bridge = bridge
        self.backend = self._new_backend()
        # spooled cuts Spark's checkpoint has not committed yet
        self._unacked: deque[_Spooled] = deque()
        self._next_seq = 0
        self._kick = asyncio.Event()

    async def start(self, timeout_s: float) -> None:
        """Start the query (from its checkpoint) and warm it, the warming within ``timeout_s``
        (``TimeoutError`` past it)."""
        self._next_seq = await asyncio.to_thread(self.backend.next_seq)
        await asyncio.to_thread(self.backend.start)
        async with asyncio.timeout(timeout_s):
            await self._warm()

    async def stop(self) -> None:
        await asyncio.to_thread(self.backend.stop)

    async def spool(
        self,
        cut: Cut,
        table: Any,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
        generation: int,
    ) -> None:
        """Write ``cut`` as the next spool file (none if it has no rows: it is acked with the
        files before it); Spark's checkpoint acks it (:meth:`ack_loop`). The typed layout
        spools the chunks of its wire table, which tell the streaming writer where its files go
        (``TypedBatch.spool_table``); the bridge commits them once Spark's checkpoint holds
        the micro-batch."""
        from runtime.spark.streaming import spool_write

        b = self.bridge
        seq: int | None = None
        identity: str | None = None
        if isinstance(table, TypedBatch):
            identity = cut_identity(cut, b.config.connector)
        if rows:
            seq = self._next_seq
            try:
                if isinstance(table, TypedBatch):
                    assert b.committer is not None
                    assert identity is not None
                    table_ = await asyncio.to_thread(
                        table.spool_table,
                        b.committer,
                        identity,
                        b.config.table_format,
                        self._chunks(),
                    )
                else:
                    table_ = table
                await asyncio.to_thread(spool_write, self.backend.spool, seq, table_)
            except Exception as exc:
                b._attempts_failed += 1
                b._fail_permanently(
                    [cut], BridgeError(f"writing spool file {seq}: {type(exc).__name__}: {exc}")
                )
                await b._done(cut)
                return
            self._next_seq += 1
        self._unacked.append(_Spooled(seq, cut, fresh, rows, table, identity, generation))
        self._kick.set()

    def _chunks(self) -> int:
        """The chunks (tasks) of a typed micro-batch on the streaming path: the session's
        parallelism, as the query's start found it (spooling never asks Spark: its session may
        be dead, the spool file then waits for the query on the new one)."""
        return int(self.backend.chunks)

    async def _warm(self) -> None:
        """Spool an empty file and wait until Spark committed it: the query's first micro-batch
        (source process, planning, checkpoint) costs seconds, paid here before traffic."""
        from runtime.spark.streaming import spool_write

        seq = self._next_seq
        empty = to_arrow([])
        if self.backend.typed:
            from runtime.spark.datasource import wire_chunks
            from runtime.typed import wire_table

            empty = wire_chunks(wire_table([])[0], 1).slice(0, 0)
        await asyncio.to_thread(spool_write, self.backend.spool, seq, empty)
        self._next_seq += 1
        while True:  # Spark's checkpoint is files: polled, as in ack_loop
            committed = await asyncio.to_thread(self.backend.committed)
            if committed >= seq:
                return
            await asyncio.sleep(self.bridge.config.ack_poll_s)

    async def ack_loop(self) -> None:
        """Resolve spooled cuts, in order, once Spark's checkpoint has committed them; restart
        a query that died (``max_attempts`` times), then fail what it never committed."""
        b = self.bridge
        backend = self.backend
        while not (b._committer_done and not self._unacked):
            if not self._unacked:
                self._kick.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._kick.wait()
                continue
            try:
                committed = await asyncio.to_thread(backend.committed)
            except Exception as exc:
                broken: BridgeError | SparkLost
                try:
                    if await b._jobs.session_replaced(exc):
                        # the JVM died under the query: a new query on the new session goes
                        # on from the checkpoint (the spool files it did not commit are there)
                        backend = await self._new_stream(backend)
                        continue
                except SparkLost as lost:
                    broken = lost
                else:
                    b._attempts_failed += 1
                    log.warning("%r: %s", b, error_text(exc))
                    if backend.restarts + 1 < b.config.max_attempts:
                        await asyncio.sleep(b.config.retry_backoff_s)
                        try:
                            await asyncio.to_thread(backend.restart)
                        except Exception as err:  # the next committed() tells what became of it
                            log.warning("%r: restarting the query: %s", b, error_text(err))
                        continue
                    broken = BridgeError(f"Spark's streaming query failed for good: {exc}")
                cuts = [spooled.cut for spooled in self._unacked]
                self._unacked.clear()
                b._broken = broken
                b._fail_permanently(cuts, broken)
                for cut in cuts:
                    await b._done(cut)
                return
            while self._unacked and _acked(self._unacked[0].seq, committed):
                spooled = self._unacked.popleft()
                if b.committer is None:
                    b._succeed(spooled.cut, spooled.fresh, spooled.rows)
                else:
                    await self._commit_streamed(spooled)
                await b._done(spooled.cut)
            await asyncio.sleep(b.config.ack_poll_s)

    def _new_backend(self) -> StreamingBackend:
        from runtime.spark.streaming import StreamingBackend

        b = self.bridge
        backend = StreamingBackend(
            b.spark,
            b.config,
            self._foreach(),
            typed=b.layout == "typed" and b.foreach_batch is None,
        )
        if b.stream_sink is not None:
            backend.sink = b.stream_sink
        return backend

    async def _new_stream(self, old: StreamingBackend) -> StreamingBackend:
        """The streaming query on the session that replaced a lost one (its query is dropped,
        not stopped: its JVM is gone); its restarts count on."""
        backend = self._new_backend()
        backend.restarts = old.restarts
        await asyncio.to_thread(backend.start)
        self.backend = backend
        log.warning("%r: the streaming query runs again on the new session", self.bridge)
        return backend

    def _foreach(self) -> Callable[[Any, int], None] | None:
        """The ``foreach_batch`` as Spark's streaming query calls it: Spark's own batch id is
        stable across re-delivery (its checkpoint replays a batch under the same id), so it is
        the identity there (``s<batch id>``)."""
        foreach: Callable[..., None] | None = self.bridge.foreach_batch
        if foreach is None or not self.bridge._foreach_identity:
            return foreach

        def with_identity(df: Any, batch_id: int) -> None:
            assert foreach is not None
            foreach(df, batch_id, f"s{batch_id}")

        return with_identity

    async def _commit_streamed(self, spooled: _Spooled) -> None:
        """The streaming path's typed layout: Spark's checkpoint holds ``spooled``'s
        micro-batch (its files and receipt written): commit it as the embedded path commits
        (``runtime.files.commit``: the moves or Delta commits, the partitions' positions, fences
        and the lease), once; a cut after a failed one fails (it was de-duplicated assuming the
        failed one commits)."""
        b = self.bridge
        cut = spooled.cut
        if not b.ledger.current(spooled.generation):
            b._fail_cut(cut, BridgeError("an earlier micro-batch failed; re-read"))
            return
        table = spooled.table
        assert isinstance(table, TypedBatch)
        assert spooled.identity is not None
        try:
            await asyncio.to_thread(self._commit_spooled, cut, table, spooled.identity)
        except Exception as exc:
            b._attempts_failed += 1
            if isinstance(exc, CommitIncomplete):
                b._broken = BridgeError(str(exc))
            b._fail_permanently(
                [cut],
                BridgeError(f"committing streamed micro-batch {cut.batch_id}: {error_text(exc)}"),
            )
            return
        b._succeed(cut, spooled.fresh, spooled.rows)

    def _commit_spooled(self, cut: Cut, table: TypedBatch, identity: str) -> None:
        b = self.bridge
        committer = b.committer
        assert committer is not None
        moves, tables = table.streamed(committer, identity, b.config.table_format)
        b._batch.commit_cut(committer, cut, identity, moves, tables)


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


def _acked(seq: int | None, committed: int) -> bool:
    return seq is None or seq <= committed
