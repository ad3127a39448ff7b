"""The partition reader's rules as a pure core (docs/design.md#reading-a-partition): events in,
commands out, the time passed in as integer microseconds. The async shell
(``actors/reader.py``) queries the source, puts batches into the sink and awaits their acks,
sleeps until :meth:`ReaderCore.next_deadline`; the fault simulator drives the same core.

The rules:

1. **Start.** The reader starts from the position its task gave it (the committed watermark and
   the identities committed at it, ``StartReader.tail``) and the sink's own durable record of
   the partition, if it keeps one (``Sink.durable_position``): it resumes from the newer of the two
   (:func:`resume_position`, ``Position.newer``). The first query starts there.
2. **Re-reads are dropped by identity.** A query reads from a timestamp *inclusive*, so records
   already handed to the sink can come again. Every record is checked against the *handed tail*
   (``protocol/dedup.py``, ``PartitionTail``): the tail of what was put into the sink, committed
   or still in flight. A record that is not new is dropped and counted.
3. **Chunks become batches.** The records of one chunk the source sent, less the re-reads, are
   cut into sink batches of at most ``batch_records``. Each batch carries a watermark: the last
   record's commit timestamp for a batch cut short, the chunk's read position for the last one.
   A chunk with no new record still makes one (empty) batch when its position moved past what
   was handed: heartbeats advance the position.
4. **Child partitions end the partition at ``start_ts - 1``.** A ``ChildPartitions`` record
   moves the position to one microsecond before the children's start (a restarted query must see
   the record again, and a start past the partition's end is refused); the children and their
   start are collected.
5. **The permit.** Before a chunk's batches go to the sink the shell says whether the task may
   read (its lease, ``Chunk.permitted``). Not permitted: the query is cancelled and the reader
   stops at once (``ReaderStopped`` at the committed position); a zombie hands the sink nothing.
6. **Commits advance in order.** The committed position moves only when the sink acknowledges
   the oldest batch in flight; an ack of a later batch waits for the ones before it. Each move is
   reported (``ReaderCommitted`` with the committed tail's identities).
7. **A failed batch** (once every batch before it is committed) drops every batch in flight,
   resets the handed tail to the committed one, cancels the query and restarts it, after a
   backoff, from the committed position: nothing handed after the last commit is trusted. The
   report (``ReaderFailed``) names the batch's first record: the task's quarantine rule
   (``protocol/task.py``) says which record a poison partition is parked before.
8. **A query error** restarts the query from the committed timestamp after a backoff
   ``min(max_backoff, 50 ms * 2^attempt)``; batches in flight stay in flight (rule 2 drops what
   they hold when it is read again). The attempt count resets whenever the source answers. The
   backoff is a deadline (:meth:`next_deadline`), not a sleep.
9. **Stalls.** A query that sends nothing, not even a heartbeat, for ``stall_timeout`` is
   cancelled and restarted like a failed one; each stall in a row waits twice as long, up to 8x;
   any answer resets the count.
10. **The end.** When a query ends (after its ``ChildPartitions`` record) the partition is read
    to its end; it is *finished* only once every batch is committed: then ``Done`` carries
    ``ReaderFinished`` with the children. A batch failing meanwhile restarts the query (rule 7),
    which reads the child-partition record again. While batches are still in flight the reader
    asks the sink to flush them (``FlushBatches``): it hands nothing more until they commit, and
    the children wait for it, so a sink that gathers batches by age need not wait.
11. **Stops.** ``StopRequested`` cancels the query. Without ``drain`` the reader stops at once;
    with it, in-flight batches may commit until ``drain_timeout`` (a batch failing ends the
    drain), flushed as at the end (rule 10): then ``Done`` carries ``ReaderStopped`` with the
    committed position.
12. **No batch outlives its reader's end.** A reader that ends with batches still in flight
    (the drain timed out or failed, a stop without drain, the permit refused) first *fences*
    them (``FenceBatches``; docs/design.md#exactly-once-output, rule 4): the sink answers which
    of them passed its commit point already and guarantees the others never will
    (``BatchesFenced``). The committed position moves over the committed ones (in order, up to
    the first that did not commit) and only then ``Done`` carries ``ReaderStopped``, so the
    position the task releases is exact and the next owner re-reads only what was never
    written. A sink that cannot fence answers ``held=False``: its abandoned batches may still
    commit (counted in ``unfenced``).

13. **MUTABLE_KEY_RANGE** (``ReaderConfig.mutable``; ``protocol/mutable.py``). A partition
    start record is reported at once (``PartitionsAnnounced``) and moves the position to its
    start; a move-out event, or a move-in the task's released hold passes, moves it to its
    timestamp. A move-in it does not pass ends the chunk there: the query is cancelled, and
    once everything before the event is committed ``Done`` carries ``ReaderStopped`` with the
    hold (``mutable.held_at``): the task decides when the partition may go on. A partition end
    record moves the position to its end, and the query's end then finishes the partition (no
    children). (The source chains the mode's bounded query ends, at most 30 minutes each, into
    one stream, so a query ends only at the partition's end or at the connector's ``end_at``,
    which finishes the partition as in the other mode.)
    When the sink's durable position is newer than the task's (a reader whose commits reached
    the sink but whose task's state never reached the sync topic), the queries start at the
    task's position until they pass the sink's (``rescan``): the records in between are
    dropped as re-reads (rule 2), but a partition start among them is reported again, since the
    registration it caused may never have reached the sync topic; a move-in among them before
    the sink's position was passed by the reader that wrote past it, and is passed again.

``Done`` is the last command; the shell reports its event once the reader is no longer alive.
"""

from __future__ import annotations

import enum
from collections import deque

import msgspec

from protocol import mutable
from protocol.dedup import Position
from protocol.events import (
    PartitionsAnnounced,
    ReaderCommitted,
    ReaderFailed,
    ReaderFinished,
    ReaderStopped,
    StopReason,
)
from protocol.messages import MoveInHold
from protocol.mutable import PartitionEnd, PartitionEvent, PartitionStart
from protocol.records import ChangeRecord, ChildPartition, ChildPartitions, DataChange, Heartbeat

SourceRecord = ChangeRecord | PartitionStart | PartitionEnd | PartitionEvent

__all__ = [
    "BatchCommitted",
    "BatchFailed",
    "BatchesFenced",
    "CancelQuery",
    "Chunk",
    "Done",
    "FenceBatches",
    "FlushBatches",
    "PutBatch",
    "QueryEnded",
    "QueryError",
    "ReaderCommand",
    "ReaderConfig",
    "ReaderCore",
    "ReaderEvent",
    "ReaderRules",
    "ReaderTick",
    "Report",
    "Start",
    "StartQuery",
    "StopRequested",
    "resume_position",
]

BASE_BACKOFF_US = 50_000
MAX_STALL_FACTOR = 8


class _Event(msgspec.Struct, frozen=True, tag_field="event"):
    pass


class _Command(msgspec.Struct, frozen=True, tag_field="command"):
    pass


# -- events ---------------------------------------------------------------------------------


class Start(_Event, frozen=True, tag="reader-start"):
    """The shell is ready (the sink prepared); ``sink`` is the sink's own durable position of
    the partition, if it keeps one."""

    sink: Position | None = None


class Chunk(_Event, frozen=True, tag="reader-chunk"):
    """Records the source sent for query ``query``; ``permitted``: the task's lease holds."""

    query: int
    records: tuple[SourceRecord, ...]
    permitted: bool = True


class QueryEnded(_Event, frozen=True, tag="reader-query-ended"):
    query: int


class QueryError(_Event, frozen=True, tag="reader-query-error"):
    query: int
    error: str


class BatchCommitted(_Event, frozen=True, tag="reader-batch-committed"):
    batch: int


class BatchFailed(_Event, frozen=True, tag="reader-batch-failed"):
    batch: int
    error: str


class BatchesFenced(_Event, frozen=True, tag="reader-batches-fenced"):
    """The sink's answer to ``FenceBatches``: ``committed`` passed the commit point, the rest
    of the fenced batches never will; ``held=False``: the sink cannot fence (nothing is
    known of the rest)."""

    committed: tuple[int, ...] = ()
    held: bool = True


class StopRequested(_Event, frozen=True, tag="reader-stop"):
    reason: StopReason
    drain: bool


class ReaderTick(_Event, frozen=True, tag="reader-tick"):
    """A timer: nothing happened, but time passed."""


ReaderEvent = (
    Start
    | Chunk
    | QueryEnded
    | QueryError
    | BatchCommitted
    | BatchFailed
    | BatchesFenced
    | StopRequested
    | ReaderTick
)

# -- commands -------------------------------------------------------------------------------


class StartQuery(_Command, frozen=True, tag="start-query"):
    query: int
    start_ts: int


class CancelQuery(_Command, frozen=True, tag="cancel-query"):
    query: int


class PutBatch(_Command, frozen=True, tag="put-batch"):
    """Hand the sink a batch (``SinkBatch(token, records, watermark)``); ack it by ``batch``."""

    batch: int
    records: tuple[DataChange, ...]
    watermark: int


class FenceBatches(_Command, frozen=True, tag="fence-batches"):
    """Ask the sink to fence these batches (by ``PutBatch.batch``); answer ``BatchesFenced``."""

    batches: tuple[int, ...]


class FlushBatches(_Command, frozen=True, tag="flush-batches"):
    """Ask the sink not to hold this reader's batches in flight for more (rules 10, 11): the
    reader hands nothing more until they commit. A hint: a sink may ignore it."""


class Report(_Command, frozen=True, tag="report"):
    event: ReaderCommitted | ReaderFailed | PartitionsAnnounced


class Done(_Command, frozen=True, tag="done"):
    """The reader is over; report ``end`` once it is no longer alive."""

    end: ReaderStopped | ReaderFinished


ReaderCommand = StartQuery | CancelQuery | PutBatch | FenceBatches | FlushBatches | Report | Done


class ReaderRules(msgspec.Struct, frozen=True):
    """The production rules; the simulator's teeth tests turn one off to see it caught."""

    drop_rereads: bool = True  # rule 2
    resume_at_committed: bool = True  # rule 7: restart from the committed position
    rescan_behind_sink: bool = True  # rule 13: read again from the task's position


class ReaderConfig(msgspec.Struct, frozen=True):
    token: str
    batch_records: int = 2000
    max_backoff: int = 10_000_000  # micros
    drain_timeout: int = 5_000_000
    stall_timeout: int = 30_000_000
    rules: ReaderRules = ReaderRules()
    mutable: bool = False  # a MUTABLE_KEY_RANGE stream's partition (rule 13)


def _name(record: DataChange) -> str:
    """A record as the quarantine rule names it: commit timestamp, transaction, sequence."""
    return f"{record.commit_ts} {record.server_transaction_id} {record.record_sequence}"


def resume_position(given: Position, sink: Position | None) -> Position:
    """Where a reader starts: the newer of its task's position and the sink's own record."""
    return given.newer(sink)


class _Phase(enum.Enum):
    INIT = "init"
    QUERYING = "querying"
    BACKOFF = "backoff"
    ENDED = "ended"  # the query ended: waiting for every batch to commit
    DRAINING = "draining"
    FENCING = "fencing"  # ending: waiting for the sink's answer to FenceBatches
    DONE = "done"


class _Batch(msgspec.Struct):
    id: int
    watermark: int
    records: tuple[DataChange, ...]
    acked: bool = False
    failed: str = ""


class ReaderCore:
    def __init__(
        self, config: ReaderConfig, start: Position, hold: MoveInHold | None = None
    ) -> None:
        self.config = config
        self.hold = hold  # rule 13: the released hold whose move-in events this reader passes
        self.holding: MoveInHold | None = None  # rule 13: the move-in this reader stopped at
        # rule 13: (from, to) while the records between the task's position and the sink's
        # newer one are read again for their partition starts
        self.rescan: tuple[int, int] | None = None
        self.token = config.token
        self.given = start
        self.committed = start.tail()  # the committed position (the tail at the watermark)
        self.handed = start.tail()  # the tail of what was put into the sink
        self.position = start.ts  # the newest position read from the source
        self.phase = _Phase.INIT
        self.query = -1  # the running (or last) query
        self._queries = 0
        self._batches = 0
        self.pending: deque[_Batch] = deque()
        self.children: list[ChildPartition] = []
        self.child_start = start.ts
        self.attempt = 0  # restarts in a row without an answer (the backoff's exponent)
        self.stalls = 0  # stalls in a row
        self.restart_at = -1
        self.answer_deadline = -1  # a stall after this
        self.drain_until = -1
        self.committed_at = 0  # when the committed position last moved (or the reader started)
        self.source_at = 0
        self.source_kind = "none"
        self.records = 0
        self.dropped = 0  # re-reads dropped by identity
        # records older than the position their own query had already reached (a heartbeat or
        # a later record of it came first): the source broke its promise of commit-timestamp
        # order within a partition. Positions assume that order, so such a record is dropped
        # when the position has passed it; it is counted, and the shell logs it at once.
        self.out_of_order = 0
        self.out_of_order_last: tuple[int, int] = (0, 0)  # (commit ts, position it was behind)
        self.restarts = 0
        self.fenced = 0  # batches fenced at the end (they never commit)
        self.unfenced = 0  # batches abandoned at the end to a sink that cannot fence
        self.end: ReaderStopped | ReaderFinished | None = None

    # -- the entry point ------------------------------------------------------------------
    def handle(self, event: ReaderEvent, now: int) -> list[ReaderCommand]:
        out: list[ReaderCommand] = []
        if self.phase is _Phase.DONE:
            return out
        match event:
            case Start():
                self._on_start(event, now, out)
            case Chunk():
                self._on_chunk(event, now, out)
            case QueryEnded():
                if event.query == self.query and self.phase is _Phase.QUERYING:
                    self.phase = _Phase.ENDED
                    self.answer_deadline = -1
                    self._maybe_finish(out)
                    self._flush(out)
            case QueryError():
                if event.query == self.query and self.phase is _Phase.QUERYING:
                    self._restart(event.error, now, out, cancel=False)
            case BatchCommitted():
                self._on_ack(event.batch, "", now, out)
            case BatchFailed():
                self._on_ack(event.batch, event.error, now, out)
            case BatchesFenced():
                self._on_fenced(event, now, out)
            case StopRequested():
                self._on_stop(event, now, out)
            case ReaderTick():
                pass
        self._timers(now, out)
        return out

    def next_deadline(self) -> int | None:
        """When the core must be called again (a :class:`ReaderTick`) even if nothing happens."""
        match self.phase:
            case _Phase.QUERYING:
                return self.answer_deadline
            case _Phase.BACKOFF:
                return self.restart_at
            case _Phase.DRAINING:
                return self.drain_until
            case _:
                return None

    def stall_wait(self) -> int:
        """How long the running query may stay silent (doubling per stall in a row, up to 8x)."""
        factor: int = min(MAX_STALL_FACTOR, 2**self.stalls)
        return self.config.stall_timeout * factor

    def committed_position(self) -> Position:
        return self.committed.position()

    def validate(self) -> None:
        """The core's invariants (the tests call it after every event)."""
        assert self.committed.ts <= self.handed.ts or not self.config.rules.resume_at_committed, (
            self.committed,
            self.handed,
        )
        ids = [b.id for b in self.pending]
        assert ids == sorted(ids), ids
        assert len(set(ids)) == len(ids), ids
        last = self.committed.ts
        for batch in self.pending:
            assert batch.watermark >= last, (batch.watermark, last)
            last = batch.watermark
        assert (self.phase is _Phase.DONE) == (self.end is not None), self.phase
        if self.phase is _Phase.QUERYING:
            assert self.answer_deadline >= 0
        if self.phase is _Phase.BACKOFF:
            assert self.restart_at >= 0
        if isinstance(self.end, ReaderFinished):
            assert not self.pending

    # -- events ---------------------------------------------------------------------------
    def _on_start(self, event: Start, now: int, out: list[ReaderCommand]) -> None:
        if self.phase is not _Phase.INIT:
            return
        start = resume_position(self.given, event.sink)
        if (
            self.config.mutable
            and start.ts > self.given.ts
            and self.config.rules.rescan_behind_sink
        ):
            self.rescan = (self.given.ts, start.ts)
        self.committed = start.tail()
        self.handed = start.tail()
        self.position = start.ts
        self.child_start = start.ts
        self.committed_at = self.source_at = now
        self._start_query(now, out)

    def _on_chunk(self, event: Chunk, now: int, out: list[ReaderCommand]) -> None:
        if event.query != self.query or self.phase is not _Phase.QUERYING:
            return
        self.source_at = now
        self.stalls = 0
        self.attempt = 0
        self.answer_deadline = now + self.stall_wait()
        if event.records:
            self.source_kind = type(event.records[-1]).__name__
        fresh: list[DataChange] = []
        position = self.position
        drop = self.config.rules.drop_rereads
        for record in event.records:
            match record:
                case DataChange():
                    if record.commit_ts < position:
                        self.out_of_order += 1
                        self.out_of_order_last = (record.commit_ts, position)
                    if drop and self.handed.seen(record.commit_ts, record.identity):
                        self.dropped += 1
                        continue
                    fresh.append(record)
                    position = max(position, record.commit_ts)
                case Heartbeat():
                    position = max(position, record.timestamp)
                case ChildPartitions():
                    self.children.extend(record.children)
                    self.child_start = max(self.child_start, record.start_ts)
                    position = max(position, record.start_ts - 1)
                case PartitionStart():
                    out.append(
                        Report(PartitionsAnnounced(self.token, record.start_ts, record.tokens))
                    )
                    position = max(position, record.start_ts)
                case PartitionEnd():
                    position = max(position, record.end_ts)
                case PartitionEvent():
                    position = max(position, record.commit_ts)
                    rescanned = self.rescan is not None and record.commit_ts < self.rescan[1]
                    if (
                        record.move_in_from
                        and not mutable.passes(self.hold, record)
                        and not rescanned  # passed by the reader whose records the sink has
                    ):
                        self.holding = mutable.held_at(self.hold, record)
                        break  # rule 13: nothing after the event until the task releases it
        self.position = position
        if self.rescan is not None and position >= self.rescan[1]:
            self.rescan = None
        if not fresh and position <= self.handed.ts:
            self._stop_at_hold(out)
            return
        if not event.permitted:
            out.append(CancelQuery(self.query))
            self._done(ReaderStopped(self.token, self.committed.ts, self._ids()), out)
            return
        size = max(1, self.config.batch_records)
        for i in range(0, max(1, len(fresh)), size):
            records = tuple(fresh[i : i + size])
            last = i + size >= len(fresh)
            watermark = position if last else records[-1].commit_ts
            self._batches += 1
            self.pending.append(_Batch(self._batches, watermark, records))
            self.handed.commit(watermark, records)
            self.records += len(records)
            out.append(PutBatch(self._batches, records, watermark))
        self._stop_at_hold(out)

    def _stop_at_hold(self, out: list[ReaderCommand]) -> None:
        """Rule 13: at a move-in not passed, the query ends; the reader stops once every batch
        before the event is committed."""
        if self.holding is None or self.phase is not _Phase.QUERYING:
            return
        out.append(CancelQuery(self.query))
        self.phase = _Phase.ENDED
        self.answer_deadline = -1
        self._maybe_finish(out)
        self._flush(out)

    def _on_ack(self, batch_id: int, error: str, now: int, out: list[ReaderCommand]) -> None:
        for batch in self.pending:
            if batch.id == batch_id:
                if error:
                    batch.failed = error
                else:
                    batch.acked = True
                break
        else:
            return  # a batch dropped earlier (failed, or abandoned): nothing to do
        moved = False
        while self.pending and (self.pending[0].acked or self.pending[0].failed):
            head = self.pending[0]
            if head.failed and self.phase is _Phase.FENCING:
                break  # ending anyway: the position stays before it
            if head.failed:
                if moved:
                    self._report_committed(out)
                    moved = False
                self._on_batch_failed(head.failed, now, out)
                break
            self.pending.popleft()
            before = (self.committed.ts, len(self.committed.ids))
            self.committed.commit(head.watermark, head.records)
            if (self.committed.ts, len(self.committed.ids)) != before:
                moved = True
                self.committed_at = now
        if moved:
            self._report_committed(out)
        if self.phase is _Phase.ENDED:
            self._maybe_finish(out)
        elif self.phase is _Phase.DRAINING and not self.pending:
            self._done(ReaderStopped(self.token, self.committed.ts, self._ids()), out)

    def _on_batch_failed(self, error: str, now: int, out: list[ReaderCommand]) -> None:
        head = self.pending[0] if self.pending else None
        record = _name(head.records[0]) if head is not None and head.records else ""
        if self.phase is _Phase.DRAINING:
            # the drain ends: the committed position stays before the batch; the next owner
            # re-reads it; the batches after it are fenced (rule 12)
            self._done(ReaderStopped(self.token, self.committed.ts, self._ids()), out)
            return
        self.pending.clear()
        if self.config.rules.resume_at_committed:
            self.handed = self.committed.copy()
        self._restart(f"sink failed a batch: {error}", now, out, cancel=True, record=record)

    def _on_fenced(self, event: BatchesFenced, now: int, out: list[ReaderCommand]) -> None:
        if self.phase is not _Phase.FENCING:
            return
        committed = set(event.committed)
        for batch in self.pending:
            if batch.id in committed and not batch.failed:
                batch.acked = True
        moved = False
        while self.pending and self.pending[0].acked:
            head = self.pending.popleft()
            self.committed.commit(head.watermark, head.records)
            moved = True
            self.committed_at = now
        left = sum(1 for b in self.pending if not b.acked and not b.failed)
        if event.held:
            self.fenced += left
        else:
            self.unfenced += left
        self.pending.clear()
        if moved:
            self._report_committed(out)
        self._finish(ReaderStopped(self.token, self.committed.ts, self._ids()), out)

    def _on_stop(self, event: StopRequested, now: int, out: list[ReaderCommand]) -> None:
        if self.phase is _Phase.FENCING:
            return
        if self.phase is _Phase.DRAINING:
            if not event.drain:
                self._done(ReaderStopped(self.token, self.committed.ts, self._ids()), out)
            return
        if self.phase is _Phase.QUERYING:
            out.append(CancelQuery(self.query))
        if event.drain and self.pending:
            self.phase = _Phase.DRAINING
            self.drain_until = now + self.config.drain_timeout
            self._flush(out)
            return
        self._done(ReaderStopped(self.token, self.committed.ts, self._ids()), out)

    # -- timers ---------------------------------------------------------------------------
    def _timers(self, now: int, out: list[ReaderCommand]) -> None:
        if self.phase is _Phase.QUERYING and now >= self.answer_deadline:
            wait = self.stall_wait()
            self.stalls += 1
            self._restart(
                f"QueryStalled: partition {self.token}: nothing from the source for "
                f"{wait / 1e6:g}s (not even a heartbeat)",
                now,
                out,
                cancel=True,
                stalled=True,
            )
        if self.phase is _Phase.BACKOFF and now >= self.restart_at:
            self._start_query(now, out)
        if self.phase is _Phase.DRAINING and now >= self.drain_until:
            self._done(ReaderStopped(self.token, self.committed.ts, self._ids()), out)

    # -- helpers --------------------------------------------------------------------------
    def _start_query(self, now: int, out: list[ReaderCommand]) -> None:
        self._queries += 1
        self.query = self._queries
        self.phase = _Phase.QUERYING
        self.restart_at = -1
        self.answer_deadline = now + self.stall_wait()
        self.children = []
        self.holding = None
        # the handed position only with the rule broken on purpose (a teeth test)
        rules = self.config.rules
        start = self.committed.ts if rules.resume_at_committed else self.handed.ts
        if self.rescan is not None:
            start = min(start, self.rescan[0])
        self.position = start
        self.child_start = start
        out.append(StartQuery(self.query, start))

    def _restart(
        self,
        error: str,
        now: int,
        out: list[ReaderCommand],
        *,
        cancel: bool,
        record: str = "",
        stalled: bool = False,
    ) -> None:
        if cancel and self.phase is _Phase.QUERYING:
            out.append(CancelQuery(self.query))
        self.restarts += 1
        self.attempt += 1
        delay = min(self.config.max_backoff, BASE_BACKOFF_US * 2**self.attempt)
        self.phase = _Phase.BACKOFF
        self.answer_deadline = -1
        self.restart_at = now + delay
        out.append(Report(ReaderFailed(self.token, error, record, stalled)))

    def _maybe_finish(self, out: list[ReaderCommand]) -> None:
        if self.phase is _Phase.ENDED and not self.pending and self.holding is not None:
            held = ReaderStopped(self.token, self.committed.ts, self._ids(), self.holding)
            self._done(held, out)
        elif self.phase is _Phase.ENDED and not self.pending:
            end = ReaderFinished(
                self.token, self.committed.ts, tuple(self.children), self.child_start, self._ids()
            )
            self._done(end, out)

    def _flush(self, out: list[ReaderCommand]) -> None:
        """Rules 10, 11: waiting only for the batches in flight, ask the sink to flush them."""
        if self.phase in (_Phase.ENDED, _Phase.DRAINING) and any(
            not b.acked and not b.failed for b in self.pending
        ):
            out.append(FlushBatches())

    def _report_committed(self, out: list[ReaderCommand]) -> None:
        out.append(Report(ReaderCommitted(self.token, self.committed.ts, self._ids())))

    def _ids(self) -> tuple[tuple[str, str], ...]:
        return self.committed.position().ids

    def _done(self, end: ReaderStopped | ReaderFinished, out: list[ReaderCommand]) -> None:
        """End the reader with ``end``; a stop with batches in flight fences them first."""
        open_ = tuple(b.id for b in self.pending if not b.acked and not b.failed)
        if isinstance(end, ReaderStopped) and open_:
            self.phase = _Phase.FENCING
            self.answer_deadline = self.restart_at = self.drain_until = -1
            out.append(FenceBatches(open_))
            return
        self._finish(end, out)

    def _finish(self, end: ReaderStopped | ReaderFinished, out: list[ReaderCommand]) -> None:
        self.phase = _Phase.DONE
        self.end = end
        self.pending.clear()  # nothing left in flight: committed, failed or fenced
        self.answer_deadline = self.restart_at = self.drain_until = -1
        out.append(Done(end))
