"""The partition reader actor: the async shell around :class:`protocol.reader.ReaderCore`, which
holds every rule of reading a partition (docs/design.md#reading-a-partition: chunks into
batches, heartbeats, child partitions, re-reads dropped by identity, commits in order, restarts
with backoff, stalls, the lease check, stops and drains, the end).

The shell only does what the core's commands say and feeds it what happens:

* before the first query it prepares the sink (``Sink.prepare``) and asks the sink for its own
  durable position of the partition (``Sink.durable_position``): the core resumes from the newer of
  that and the task's (``Start``);
* ``StartQuery`` runs the source's query in a task that feeds each answer back as a ``Chunk``
  (with ``permit()``, the membership lease, read when the chunk is handled, and again right
  before each of its batches is put into the sink) and waits until the core has handed its
  batches to the sink (backpressure); the query's end or error comes back as an event;
  ``CancelQuery`` cancels that task (its stream is closed);
* ``PutBatch`` puts a batch into the sink; the sink's future comes back as ``BatchCommitted`` or
  ``BatchFailed``;
* ``FenceBatches`` (a stop with batches in flight) asks the sink to fence them (``fence_sink``)
  and answers ``BatchesFenced`` with those that committed (their futures succeeded, or the sink
  says they passed its commit point); a sink that cannot fence, or whose fence fails, answers
  ``held=False`` (logged);
* ``FlushBatches`` (the query ended or a drain began, batches in flight) tells the sink
  (``Sink.flush``) it need not hold them for more; a failing flush is logged, nothing else;
* it calls the core again at ``next_deadline()`` (stalls, backoff, the drain's end);
* ``Report`` goes to the task at once; ``Done``'s event is reported **once, as the last thing,
  when this reader is no longer alive** (the task may start a new reader for the partition as
  soon as it hears of it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import BinaryIO

import msgspec

from actors.kernel import Actor
from protocol import trace as tracing
from protocol.dedup import Position
from protocol.events import Ids, ReaderFailed, ReaderStopped, StopReason, TaskEvent
from protocol.messages import MoveInHold
from protocol.reader import (
    BatchCommitted,
    BatchesFenced,
    BatchFailed,
    CancelQuery,
    Chunk,
    Done,
    FenceBatches,
    FlushBatches,
    PutBatch,
    QueryEnded,
    QueryError,
    ReaderCommand,
    ReaderConfig,
    ReaderCore,
    ReaderEvent,
    ReaderTick,
    Report,
    Start,
    StartQuery,
    StopRequested,
)
from protocol.records import ChangeRecord
from runtime.ports import (
    ChangeStreamSource,
    Sink,
    SinkBatch,
    fence_sink,
)

log = logging.getLogger("shoal.reader")


class Stop(msgspec.Struct, frozen=True):
    reason: StopReason
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


def _micros() -> int:
    return int(time.monotonic() * 1_000_000)


_Item = tuple[ReaderEvent, asyncio.Future[None] | None]


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
        tail: Ids = (),
        trace: BinaryIO | None = None,
        trace_name: str = "",
        validate: bool = False,
        mutable: bool = False,
        hold: MoveInHold | None = None,
    ) -> None:
        """``trace``: record the core's inputs and commands there (its task's trace, the core
        named ``trace_name``: protocol/trace.py); ``validate``: check the core's invariants after
        every event (debugging)."""
        super().__init__(f"reader:{token}", capacity=4)
        self.token = token
        self._source = source
        self._sink = sink
        self._report = report
        self._permit = permit
        self._max_backoff = max_backoff
        # A partition query sends a heartbeat at least every few seconds: one that sends
        # nothing for ``stall_timeout`` is stalled and is restarted (rule 9 of the core).
        config = ReaderConfig(
            token,
            batch_records=batch_records,
            max_backoff=int(max_backoff * 1e6),
            drain_timeout=int(drain_timeout * 1e6),
            stall_timeout=int(stall_timeout * 1e6),
            mutable=mutable,  # a MUTABLE_KEY_RANGE stream's partition (the core's rule 13)
        )
        start = Position(start_ts, tail)
        self.core = ReaderCore(config, start, hold)
        self._trace = trace
        self._trace_name = trace_name or f"reader:{token}"
        if trace is not None:
            trace.write(tracing.encode(tracing.ReaderStart(self._trace_name, config, start, hold)))
        self._validate = validate
        self._inbox: asyncio.Queue[_Item] = asyncio.Queue()
        self._query: asyncio.Task[None] | None = None
        self._group: asyncio.TaskGroup | None = None
        # batches in the sink, by the core's batch id, until their future resolves
        self._handed: dict[int, tuple[SinkBatch, asyncio.Future[None]]] = {}
        self._fence_timeout = max(drain_timeout, 5.0)

    @property
    def committed(self) -> int:
        return self.core.committed.ts

    def request_stop(self, reason: StopReason | str, drain: bool) -> None:
        if self.alive:
            try:
                self.tell_nowait(Stop(StopReason(reason), drain))
            except Exception as exc:  # a full mailbox: a stop is already queued
                log.debug("reader %s: stop not queued (%r)", self.token, exc)

    def progress(self) -> ReaderProgress:
        core = self.core
        return ReaderProgress(
            core.committed.ts,
            core.committed_at / 1e6,
            core.position,
            core.source_at / 1e6,
            core.source_kind,
            len(core.pending),
            core.restarts,
        )

    async def run(self) -> None:
        """Read until the core is done; then report its end once this reader is dead."""
        end: TaskEvent | None = None
        cancelled = False  # shutdown: the task is going away too, nothing to tell it
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                stops = group.create_task(self._stops(), name=f"stops:{self.token}")
                self.started.set()
                end = await self._drive()
                stops.cancel()
                if self._query is not None:
                    self._query.cancel()
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._group = None
            self.close()
            if end is None and not cancelled:
                # An exception (it propagates to whoever awaits us): the partition is not read
                # any more, so say so, or the task would believe it still is.
                position = self.core.committed_position()
                end = ReaderStopped(self.token, position.ts, position.ids)
            if end is not None:
                log.info(
                    "reader %s: %s at %d (%d records, %d re-reads dropped, %d out of order)",
                    self.token,
                    type(end).__name__,
                    self.core.committed.ts,
                    self.core.records,
                    self.core.dropped,
                    self.core.out_of_order,
                )
                self._report(end)

    async def _stops(self) -> None:
        """The mailbox: stop requests become core events (``stop()`` itself: stop at once)."""
        while True:
            message = await self.next_message()
            if message is None:
                self._inbox.put_nowait((StopRequested(StopReason.NOT_WANTED, False), None))
                return
            self._inbox.put_nowait((StopRequested(message.reason, message.drain), None))

    async def _prepare(self) -> Position | None:
        """Prepare the sink and ask it for its own position, retrying with backoff: the sink
        catches up with what the partition's previous owner left before anything is handed."""
        attempt = 0
        while True:
            try:
                await self._sink.prepare(self.token)
                return await self._sink.durable_position(self.token)
            except Exception as exc:
                attempt += 1
                self._report(ReaderFailed(self.token, f"{type(exc).__name__}: {exc}"))
                delay = min(self._max_backoff, 0.05 * 2**attempt)
                log.warning(
                    "reader %s: preparing the sink: %r; again in %.2fs", self.token, exc, delay
                )
                await asyncio.sleep(delay)

    def _step(self, event: ReaderEvent) -> list[ReaderCommand]:
        """One event through the core (traced and checked when asked)."""
        now = _micros()
        commands = self.core.handle(event, now)
        if self._trace is not None:
            step = tracing.ReaderStep(self._trace_name, now, event, tuple(commands))
            self._trace.write(tracing.encode(step))
        if self._validate:
            self.core.validate()
        return commands

    async def _drive(self) -> TaskEvent:
        sink_position = await self._prepare()
        commands = self._step(Start(sink_position))
        while True:
            for command in commands:
                end = await self._execute(command)
                if end is not None:
                    return end
            event, handled = await self._next_event()
            if isinstance(event, Chunk):
                event = msgspec.structs.replace(event, permitted=self._permit())
            late = self.core.out_of_order
            try:
                commands = self._step(event)
            finally:
                if handled is not None and not handled.done():
                    handled.set_result(None)
            if self.core.out_of_order > late:
                ts, position = self.core.out_of_order_last
                log.error(
                    "reader %s: the source sent %d records older than the position its query "
                    "had reached (the last at %d, behind %d): it broke commit-timestamp order "
                    "within the partition; a record the position has passed is dropped",
                    self.token,
                    self.core.out_of_order - late,
                    ts,
                    position,
                )

    async def _next_event(self) -> _Item:
        deadline = self.core.next_deadline()
        if deadline is None:
            return await self._inbox.get()
        try:
            async with asyncio.timeout(max(0.0, (deadline - _micros()) / 1e6)):
                return await self._inbox.get()
        except TimeoutError:
            return ReaderTick(), None

    async def _execute(self, command: ReaderCommand) -> TaskEvent | None:
        match command:
            case StartQuery():
                assert self._group is not None
                self._query = self._group.create_task(
                    self._run_query(command.query, command.start_ts), name=f"read:{self.token}"
                )
            case CancelQuery():
                if self._query is not None:
                    self._query.cancel()
                    self._query = None
            case PutBatch():
                await self._put(command)
            case FenceBatches():
                self._inbox.put_nowait((await self._fence(command.batches), None))
            case FlushBatches():
                try:
                    await self._sink.flush(self.token)
                except Exception:  # a hint: the batches still commit by the sink's own cut
                    log.exception("reader %s: flushing the sink failed", self.token)
            case Report():
                if isinstance(command.event, ReaderFailed):
                    log.warning(
                        "reader %s: %s; restarting from %d",
                        self.token,
                        command.event.error,
                        self.core.committed.ts,
                    )
                self._report(command.event)
            case Done():
                return command.end
        return None

    async def _fence(self, ids: Sequence[int]) -> BatchesFenced:
        """Fence the batches ``ids`` still in the sink (rule 12 of the core)."""
        handed = [(i, *self._handed[i]) for i in ids if i in self._handed]
        open_ = [(i, batch, f) for i, batch, f in handed if not f.done()]
        said: list[bool] | None = [] if not open_ else None
        try:
            if open_:
                async with asyncio.timeout(self._fence_timeout):
                    said = await fence_sink(self._sink, [batch for _, batch, _ in open_])
        except Exception:
            log.exception(
                "reader %s: fencing %d batches in flight failed: they may still commit "
                "after the partition is released",
                self.token,
                len(open_),
            )
            said = None
        passed = {i for (i, _, _), ok in zip(open_, said or (), strict=False) if ok}
        # a future that succeeded meanwhile committed (the sink resolves only after the point)
        committed = tuple(i for i, _, f in handed if i in passed or (f.done() and _succeeded(f)))
        if said is None and open_:
            log.warning(
                "reader %s: %d batches in flight abandoned to a sink that cannot fence them",
                self.token,
                len(open_),
            )
        elif open_:
            log.info(
                "reader %s: fenced %d batches in flight (%d had committed)",
                self.token,
                len(open_),
                len(passed),
            )
        return BatchesFenced(committed, held=said is not None or not open_)

    async def _put(self, command: PutBatch) -> None:
        batch_id = command.batch
        if not self._permit():
            # the permit was read when the chunk was handled; the lease may have run out since
            # (a process paused in between, or a put before this one that waited for room):
            # a zombie hands the sink nothing, so the batch fails and the restarted query's
            # first chunk finds the reader not permitted (the core's rule 5)
            self._inbox.put_nowait(
                (BatchFailed(batch_id, "the task may no longer read: batch not handed"), None)
            )
            return
        batch = SinkBatch(self.token, command.records, command.watermark)
        try:
            future = await self._sink.put(batch)
        except Exception as exc:
            self._inbox.put_nowait((BatchFailed(batch_id, repr(exc)), None))
            return
        self._handed[batch_id] = (batch, future)

        def settled(done: asyncio.Future[None]) -> None:
            self._handed.pop(batch_id, None)
            if done.cancelled():
                self._inbox.put_nowait((BatchFailed(batch_id, "cancelled"), None))
            elif (exc := done.exception()) is not None:
                self._inbox.put_nowait((BatchFailed(batch_id, repr(exc)), None))
            else:
                self._inbox.put_nowait((BatchCommitted(batch_id), None))

        future.add_done_callback(settled)

    async def _run_query(self, query: int, start_ts: int) -> None:
        """One query of the source: each answer is a ``Chunk``, handled (its batches in the
        sink) before the next is read; the end or an error is an event too."""
        loop = asyncio.get_running_loop()
        stream = self._source.query(self.token, start_ts, None)
        try:
            async for records in stream:
                handled: asyncio.Future[None] = loop.create_future()
                self._inbox.put_nowait((Chunk(query, _records(records)), handled))
                await handled
            self._inbox.put_nowait((QueryEnded(query), None))
        except Exception as exc:
            self._inbox.put_nowait((QueryError(query, f"{type(exc).__name__}: {exc}"), None))
        finally:
            await _close(stream)


def _succeeded(future: asyncio.Future[None]) -> bool:
    return not future.cancelled() and future.exception() is None


def _records(records: Sequence[ChangeRecord]) -> tuple[ChangeRecord, ...]:
    return records if isinstance(records, tuple) else tuple(records)


async def _close(stream: AsyncGenerator[Sequence[ChangeRecord], None]) -> None:
    await stream.aclose()
