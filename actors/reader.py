"""The partition reader actor: reads one change-stream partition and hands its records to the
sink in batches.

* It reads from the resume point its task gave it (the committed watermark, else the partition's
  start) and puts batches into the sink; the sink's future for a batch resolves when the batch is
  durably committed, and only then does the committed watermark advance (``ReaderCommitted``).
* Heartbeats advance the read position without data. ``ChildPartitions`` records are collected;
  when the query ends the partition has finished: once every batch is committed the reader
  reports ``ReaderFinished`` with the children.
* A query error, or a batch the sink failed, restarts the partition from its committed
  watermark with exponential backoff; records at exactly the watermark that were already
  committed are dropped by their identity (commit ts, transaction id, record sequence).
* ``request_stop`` stops reading; for a hand-off it first lets in-flight batches commit (bounded
  by ``drain_timeout``) so the new owner starts as late as possible; then it reports
  ``ReaderStopped`` with the committed watermark.
* Before every batch it checks ``permit()`` (the membership lease): a zombie that wakes up after
  its lease ran out stops before it hands the sink anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec

from actors.kernel import Actor
from actors.mailbox import Flag
from protocol.dedup import PartitionTail
from protocol.records import ChangeRecord, ChildPartition, ChildPartitions, DataChange, Heartbeat
from protocol.task import ReaderCommitted, ReaderFailed, ReaderFinished, ReaderStopped, TaskEvent
from runtime.ports import ChangeStreamSource, Sink, SinkBatch, prepare_sink

log = logging.getLogger("shoal.reader")


class Stop(msgspec.Struct, frozen=True):
    reason: str
    drain: bool


class ReaderProgress(msgspec.Struct, frozen=True):
    """Where a running reader is, for the task's stuck-partition watch (monotonic seconds)."""

    committed: int
    committed_at: float  # when the committed watermark last advanced (or the reader started)
    position: int  # the newest timestamp read from the source
    source_at: float  # when the source last sent anything (a batch of records or heartbeats)
    source_kind: str  # what that was: the last record's kind
    pending: int  # batches handed to the sink, not yet committed
    restarts: int


class _Seen:
    """What a reader saw last (for :class:`ReaderProgress`), and whether the sink is prepared."""

    __slots__ = ("committed_at", "position", "prepared", "source_at", "source_kind", "stalls")

    def __init__(self, position: int, now: float) -> None:
        self.committed_at = now
        self.position = position
        self.source_at = now
        self.source_kind = "none"
        self.prepared = False
        self.stalls = 0  # queries in a row abandoned as stalled (each waits twice as long)


class NotPermitted(Exception):
    """The task's lease ran out: stop reading at once."""


class PartitionReader(Actor[Stop]):
    def __init__(
        self,
        token: str,
        start_ts: int,
        *,
        source: ChangeStreamSource,
        sink: Sink,
        report: Callable[[TaskEvent], None],
        permit: Callable[[], bool],
        max_backoff: float = 10.0,
        drain_timeout: float = 5.0,
        batch_records: int = 2000,
        stall_timeout: float = 30.0,
    ) -> None:
        super().__init__(f"reader:{token}", capacity=4)
        self.token = token
        self.committed = start_ts
        self._source = source
        self._sink = sink
        self._report = report
        self._permit = permit
        self._max_backoff = max_backoff
        self._drain_timeout = drain_timeout
        self._batch_records = batch_records
        self._pending: deque[tuple[asyncio.Future[None], int, tuple[DataChange, ...]]] = deque()
        # the committed watermark and the records committed at exactly it (protocol/dedup.py):
        # a restarted query reads from the watermark inclusive, and those are dropped
        self._tail = PartitionTail(start_ts)
        self._records = 0
        self._batches = 0
        self._restarts = 0
        self._dups = 0
        self._wake = Flag()
        self._sink_error: BaseException | None = None
        self._end: ReaderStopped | ReaderFinished | None = None  # how the read loop ended
        # A partition query sends a heartbeat at least every few seconds: one that sends
        # nothing for this long is stalled and is restarted from the committed watermark. Each
        # stall in a row doubles the wait (up to 8x): a slow source answers late rather than
        # never (the emulator's first answer took 30 s and more when it was overloaded, and
        # every restart loaded it further).
        self.stall_timeout = stall_timeout
        # one attribute, not five: past 30 attributes an instance's dict is no longer shared
        # with its class's (1.6 KB instead of 0.3 KB per reader, with thousands of readers)
        self._seen = _Seen(start_ts, time.monotonic())

    def request_stop(self, reason: str, drain: bool) -> None:
        if self.alive:
            try:
                self.tell_nowait(Stop(reason, drain))
            except Exception as exc:  # a full mailbox: a stop is already queued
                log.debug("reader %s: stop not queued (%r)", self.token, exc)

    def progress(self) -> ReaderProgress:
        seen = self._seen
        return ReaderProgress(
            self.committed,
            seen.committed_at,
            seen.position,
            seen.source_at,
            seen.source_kind,
            len(self._pending),
            self._restarts,
        )

    async def run(self) -> None:
        """Read until the partition finishes, the lease lapses or a stop arrives; then report
        that end **once, as the last thing, when this reader is no longer alive** (the core may
        start a new reader for the partition as soon as it hears of it)."""
        end: TaskEvent | None = None
        cancelled = False  # shutdown: the task is going away too, nothing to tell it
        try:
            async with asyncio.TaskGroup() as group:
                reading = group.create_task(self._read_loop(), name=f"read:{self.token}")
                committing = group.create_task(self._commit_loop(), name=f"commit:{self.token}")
                self.started.set()
                stop = await self._next_stop(reading)
                reading.cancel()
                committing.cancel()
                await asyncio.wait({reading, committing})
                if stop is not None and stop.drain:
                    await self._drain()
            if isinstance(self._end, ReaderFinished):
                end = self._end
            elif stop is not None or self._end is not None:  # stopped, or the lease lapsed
                end = ReaderStopped(self.token, self.committed)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._dead = True
            self._fail_pending()
            if end is None and not cancelled:
                # An exception (it propagates to whoever awaits us): the partition is not read
                # any more, so say so, or the task would believe it still is.
                end = ReaderStopped(self.token, self.committed)
            if end is not None:
                log.info(
                    "reader %s: %s at %d (%d records)",
                    self.token,
                    type(end).__name__,
                    self.committed,
                    self._records,
                )
                self._report(end)

    async def _next_stop(self, reading: asyncio.Task[None]) -> Stop | None:
        getter = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait({getter, reading}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            item = getter.result()
            return item if isinstance(item, Stop) else Stop("stop", drain=False)
        return None  # the partition finished (reported by the read loop)

    async def _drain(self) -> None:
        """Let in-flight batches commit before stopping (bounded). A batch the sink fails here
        ends the drain: the committed watermark stays before it, so the next owner re-reads it."""
        try:
            async with asyncio.timeout(self._drain_timeout):
                while self._pending:
                    await self._advance()
        except TimeoutError:
            log.warning("reader %s: drain timed out at %d", self.token, self.committed)
        except Exception as exc:
            log.warning(
                "reader %s: the sink failed a batch while draining: %r; stopping at %d",
                self.token,
                exc,
                self.committed,
            )

    async def _advance(self) -> None:
        future, watermark, records = self._pending[0]
        await asyncio.shield(future)
        self._pending.popleft()
        self._tail.commit(watermark, records)
        if watermark > self.committed:
            self.committed = watermark
            self._seen.committed_at = time.monotonic()

    async def _commit_loop(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._advance()
            except Exception as exc:
                log.warning("reader %s: the sink failed a batch: %r; re-reading", self.token, exc)
                self._sink_error = exc
                self._pending.clear()
                continue
            if not self._pending or self._pending[0][0].done() is False:
                self._report(ReaderCommitted(self.token, self.committed))

    async def _read_loop(self) -> None:
        attempt = 0
        while True:
            try:
                children, child_start = await self._read_once()
            except NotPermitted:
                log.warning("reader %s: lease expired, stopping", self.token)
                self._end = ReaderStopped(self.token, self.committed)
                return
            except Exception as exc:
                self._restarts += 1
                attempt += 1
                self._report(ReaderFailed(self.token, f"{type(exc).__name__}: {exc}"))
                delay = min(self._max_backoff, 0.05 * 2**attempt)
                log.warning(
                    "reader %s: %r; restarting from %d in %.2fs",
                    self.token,
                    exc,
                    self.committed,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            while self._pending:
                await asyncio.sleep(0.005)
                if self._sink_error is not None:
                    break
            if self._sink_error is not None:
                self._sink_error = None
                continue
            self._end = ReaderFinished(self.token, self.committed, children, child_start)
            return

    async def _read_once(self) -> tuple[tuple[ChildPartition, ...], int]:
        if not self._seen.prepared:
            # the sink catches up with what the partition's previous owner left (its retry
            # queue), before this reader hands it anything
            await prepare_sink(self._sink, self.token)
            self._seen.prepared = True
        self._sink_error = None
        start = self.committed
        position = start
        children: list[ChildPartition] = []
        child_start = start
        buffer: list[DataChange] = []
        async for batch in _watched(self._source.query(self.token, start, None), self):
            if self._sink_error is not None:
                raise _SinkFailed(self._sink_error)
            self._seen.source_at = time.monotonic()
            if batch:
                self._seen.source_kind = type(batch[-1]).__name__
            for record in batch:
                match record:
                    case DataChange():
                        if self._tail.seen(record.commit_ts, record.identity):
                            self._dups += 1
                            continue
                        buffer.append(record)
                        position = max(position, record.commit_ts)
                    case Heartbeat():
                        position = max(position, record.timestamp)
                    case ChildPartitions():
                        children.extend(record.children)
                        child_start = max(child_start, record.start_ts)
                        # The partition ends here. Commit just short of it: a restarted
                        # query must see this record again, and a start past the end is
                        # refused (the emulator accepts [start, end] and says OUT_OF_RANGE).
                        position = max(position, record.start_ts - 1)
            self._seen.position = position
            await self._put(buffer, position)
            buffer = []
        if self._sink_error is not None:
            raise _SinkFailed(self._sink_error)
        return tuple(children), child_start

    async def _put(self, records: list[DataChange], position: int) -> None:
        if not records and position <= self.committed:
            return
        if not self._permit():
            raise NotPermitted(self.token)
        for i in range(0, max(1, len(records)), self._batch_records):
            chunk = tuple(records[i : i + self._batch_records])
            last = i + self._batch_records >= len(records)
            watermark = position if last else chunk[-1].commit_ts
            future = await self._sink.put(SinkBatch(self.token, chunk, watermark))
            self._pending.append((future, watermark, chunk))
            self._records += len(chunk)
            self._batches += 1
            self._wake.set()


class _SinkFailed(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"sink failed a batch: {cause!r}")


class QueryStalled(Exception):
    """A partition query sent nothing (not even a heartbeat) for ``stall_timeout`` seconds."""


async def _watched(
    batches: AsyncIterator[Sequence[ChangeRecord]], reader: PartitionReader
) -> AsyncIterator[Sequence[ChangeRecord]]:
    """``batches``, failing with :class:`QueryStalled` when the next one takes longer than the
    reader's ``stall_timeout``, doubled for each stall in a row (the read loop then restarts
    the query, like any failure)."""
    seen = reader._seen
    try:
        while True:
            timeout = reader.stall_timeout * 2 ** min(seen.stalls, 3)
            try:
                async with asyncio.timeout(timeout):
                    batch = await anext(batches)
            except StopAsyncIteration:
                return
            except TimeoutError:
                seen.stalls += 1
                raise QueryStalled(
                    f"partition {reader.token}: nothing from the source for "
                    f"{timeout:g}s (not even a heartbeat)"
                ) from None
            seen.stalls = 0
            yield batch
    finally:
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()
