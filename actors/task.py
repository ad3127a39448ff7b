"""The regular-task actor (with its timer) and the leader actor: thin async shells
around ``protocol.task.TaskCore``.

``TaskActor`` owns the core. Its mailbox takes the core's events from everywhere: the sync-topic
tail, the group membership, the partition readers, the leader actor and its own timer.
It carries out the core's commands: a ``Publish`` goes to the publisher loop (which appends to
the sync topic in order and reports a failed append back as ``PublishFailed``), ``StartReader`` /
``StopReader`` start and stop :class:`~actors.reader.PartitionReader` actors, ``RequestPlan``
goes to the ``LeaderActor`` with an immutable snapshot of the CIM.

``LeaderActor`` computes the epoch plan off the task's loop (in a thread: a plan over ten
thousand partitions must not stall the mailbox), discovering the root partitions first when the
stream was never started (and, asked to, planning the connector's snapshot at the stream's
start, the roots then starting after it: ``protocol/snapshot.py``), and tells the task
``PlanReady``.

``TaskActor.timer_loop`` is the task's only timer, as aioquic's ``get_timer()``: it sleeps until
the core's ``next_deadline()`` or until the core handled another event (which may move the
deadline), whichever comes first, then hands the core a ``TaskTick``; an idle task with nothing
due does not wake. The core's lease comes from the membership, which pushes each renewal (a
``GroupLease`` event, turned into the core's ``Lease`` by ``membership_loop``): nobody polls it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from random import Random
from typing import BinaryIO

import msgspec

from actors.kernel import Actor, MailboxFull, Supervisor
from actors.reader import PartitionReader
from protocol import messages, planner
from protocol import snapshot as snapshots
from protocol import trace as tracing
from protocol.cim import Cim
from protocol.dedup import Position
from protocol.events import Ids
from protocol.messages import CheckpointMessage, MarkerMessage, Partition, SyncMessage
from protocol.mutable import PartitionStart
from protocol.records import ChildPartitions
from protocol.task import (
    Alert,
    Joining,
    Lease,
    Publish,
    PublishFailed,
    ReaderCommitted,
    ReadersCommitted,
    RequestPlan,
    StartReader,
    StopReader,
    SyncBad,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
    TaskEvent,
    TaskTick,
    own_state_ts,
)
from runtime.ports import (
    ChangeStreamSource,
    Membership,
    Sink,
    SnapshotSource,
    SyncLog,
    Unrecoverable,
)

log = logging.getLogger("shoal.task")

_MIN_GAP = 0.005  # seconds: the least time between two ticks of a deadline that did not move


def wall_micros() -> int:
    return time.time_ns() // 1000


class PlanRequest(msgspec.Struct, frozen=True):
    request: RequestPlan
    snapshot: CheckpointMessage


class FlushReports(msgspec.Struct, frozen=True):
    """Mailbox wake-up: readers reported something (see :meth:`TaskActor.report`)."""


class TaskActor(Actor[TaskEvent | FlushReports]):
    def __init__(
        self,
        config: TaskConfig,
        *,
        sync_log: SyncLog,
        source: ChangeStreamSource,
        sink: Sink,
        supervisor: Supervisor,
        stream_start: int,
        clock: Callable[[], int] = wall_micros,
        mailbox: int = 4096,
        publish_timeout: float = 10.0,
        rng: Random | None = None,
        trace: BinaryIO | None = None,
        validate: bool = False,
        on_step: Callable[[], None] | None = None,
    ) -> None:
        """``on_step``: called after the core handled each event (its state, membership or
        time out of the group may have changed), e.g. for the run to look at its end again."""
        super().__init__(f"task:{config.task_id}", capacity=mailbox)
        seed = (rng or Random()).getrandbits(64)
        self.core = TaskCore(config, Random(seed))
        # opt-in: every core input and its commands, replayable offline (protocol/trace.py)
        self._trace = trace
        if trace is not None:
            trace.write(tracing.encode(tracing.start(config, seed)))
        # debug: the core (and each reader's) checks its invariants after every event
        self._validate = validate
        self._readers_started = 0  # names each reader core in the trace
        self.sync_log = sync_log
        self.source = source
        self.sink = sink
        self.supervisor = supervisor
        self.clock = clock
        self.stream_start = stream_start
        self.readers: dict[str, PartitionReader] = {}
        self._reader_runs: dict[str, asyncio.Task[None]] = {}
        self.leader: LeaderActor | None = None
        self._outbox: asyncio.Queue[SyncMessage] = asyncio.Queue(10_000)
        self._publish_timeout = publish_timeout
        self.markers: dict[str, asyncio.Event] = {}
        self.last_offset = -1
        self.readers_idle = asyncio.Event()
        self.readers_idle.set()
        # readers' newest committed positions (watermark, tail), not handed over yet
        self._commits: dict[str, tuple[int, Ids]] = {}
        self._overflow: deque[TaskEvent] = deque()  # readers' other reports, not handed over
        self._flush_queued = False
        self._still: dict[str, tuple[int, float]] = {}  # token -> (watermark, unchanged since)
        self.stuck = 0  # owned partitions whose watermark stood still too long (last watch)
        self._stepped = asyncio.Event()  # set whenever the core handled an event
        self.ticks = 0  # TaskTicks the timer handed the core
        # Monotonic time since which the task has not been a group member (None: it is one).
        self.out_of_group_since: float | None = time.monotonic()
        self._on_step = on_step

    # -- mailbox ------------------------------------------------------------------------------
    async def receive(self, message: TaskEvent | FlushReports) -> None:
        if not isinstance(message, FlushReports):
            self._apply(message)
        self._flush_reports()

    def _flush_reports(self) -> None:
        """Hand the core what readers reported outside the mailbox: their terminal events in
        order, then every partition's newest committed watermark in one event."""
        while self._overflow:
            self._apply(self._overflow.popleft())
        self._flush_queued = False
        if self._commits:
            commits, self._commits = self._commits, {}
            watermarks = tuple((token, wm) for token, (wm, _) in commits.items())
            tails = tuple((token, tail) for token, (_, tail) in commits.items() if tail)
            self._apply(ReadersCommitted(watermarks, tails))

    def _apply(self, message: TaskEvent) -> None:
        if isinstance(message, SyncRead):
            self.last_offset = message.offset
            if isinstance(message.message, MarkerMessage):
                seen = self.markers.get(message.message.marker)
                if seen is not None:
                    seen.set()
        now = self.clock()
        commands = self.core.handle(message, now)
        if self._trace is not None:
            self._trace.write(tracing.encode(tracing.TraceStep(now, message, tuple(commands))))
        if self._validate:
            self.core.validate()
        self._stepped.set()  # the core's deadline may have moved: the timer looks again
        for command in commands:
            self.execute(command)
        if self.core.member:
            self.out_of_group_since = None
        elif self.out_of_group_since is None:
            self.out_of_group_since = time.monotonic()
        if self._on_step is not None:
            self._on_step()

    def joining(self, known: int) -> bool:
        """The membership sends a JoinGroup now, knowing epoch ``known``: whether this task is
        a fresh life (it has read nothing), which binds it (``TaskCore._on_joining``). Applied
        at once rather than through the mailbox: aiokafka asks for the JoinGroup's metadata
        synchronously, and the answer must hold from the moment it is given."""
        self._apply(Joining(known))
        return self.core.says_fresh

    def report(self, event: TaskEvent) -> None:
        """For readers, without waiting. A committed watermark supersedes the partition's older
        one, so commits are merged per partition and handed over in one event; other reports
        queue in order. Neither takes a mailbox slot per report: with thousands of readers a
        busy task's mailbox would fill (it did, at 10,000 partitions) and a report must not be
        lost. Both are bounded by the readers (one watermark and a few reports each)."""
        if not self.alive:
            return
        if isinstance(event, ReaderCommitted):
            seen = self._commits.get(event.token)
            new = Position(event.watermark, event.tail)
            if seen is None or Position(*seen).newer(new) is new:  # a tie keeps the one seen
                self._commits[event.token] = (event.watermark, event.tail)
        else:
            self._overflow.append(event)
        if not self._flush_queued:
            try:
                self.tell_nowait(FlushReports())
                self._flush_queued = True
            except MailboxFull:
                pass  # the task is busy: it flushes after the message it handles now

    def permit(self) -> bool:
        return self.core.lease_valid(self.clock())

    def execute(self, command: TaskCommand) -> None:
        match command:
            case Publish():
                self._outbox.put_nowait(command.message)
            case StartReader():
                self._start_reader(command)
            case StopReader():
                reader = self.readers.get(command.token)
                if reader is not None:
                    reader.request_stop(command.reason, drain=command.drain)
            case Alert():
                log.error("task %s: %s: %s", self.core.me, command.kind, command.detail)
            case RequestPlan():
                if self.leader is not None and not self.leader.alive:
                    # Only while the node shuts down: the leader actor stops before this one.
                    log.warning("task %s: leader actor stopped, plan request dropped", self.core.me)
                elif self.leader is not None:
                    snapshot = self.core.cim.checkpoint(self.core.me, self.clock())
                    self.leader.tell_nowait(PlanRequest(command, snapshot))

    def _start_reader(self, command: StartReader) -> None:
        token = command.token
        old = self.readers.get(token)
        if old is not None and old.alive:
            # Readers report their end only once dead, so this should not happen; if it does,
            # start the new reader when the old one is gone rather than never.
            log.error(
                "task %s: reader for %s still running; starting after it", self.core.me, token
            )
            self.supervisor.start_soon(
                self._start_after(self._reader_runs[token], command),
                name=f"restart:{token}",
                daemon=True,
            )
            return
        reader = PartitionReader(
            token,
            command.start_ts,
            source=self.source,
            sink=self.sink,
            report=self.report,
            permit=self.permit,
            stall_timeout=self.core.config.stall_timeout / 1e6,
            tail=command.tail,
            trace=self._trace,
            trace_name=f"reader:{token}:{self._readers_started}",
            validate=self._validate,
            # a MUTABLE_KEY_RANGE stream's partition (a snapshot partition is none)
            mutable=self.core.config.mutable and not snapshots.is_snapshot(token),
            hold=command.hold,
        )
        self._readers_started += 1
        log.info("task %s: reading %s from %d", self.core.me, token, command.start_ts)
        self.readers[token] = reader
        self.readers_idle.clear()
        self._reader_runs[token] = self.supervisor.start_soon(
            self._run_reader(reader), name=reader.name, daemon=True
        )

    async def _start_after(self, old: asyncio.Task[None], command: StartReader) -> None:
        await asyncio.wait({old})
        if self.alive and self.core.reading.get(command.token) == command.start_ts:
            self._start_reader(command)

    async def _run_reader(self, reader: PartitionReader) -> None:
        try:
            await reader.run()
        finally:
            if self.readers.get(reader.token) is reader:
                del self.readers[reader.token]
                self._reader_runs.pop(reader.token, None)
            if not self.readers:
                self.readers_idle.set()

    # -- the stuck-partition watch -------------------------------------------------------------
    def watch(self, now: float, stuck_after: float) -> tuple[list[str], list[str]]:
        """Owned partitions whose committed watermark has not moved for ``stuck_after`` seconds
        (a partition's query sends a heartbeat every few seconds, so one that is read moves),
        each with where its reader is or why it has none: ``(stuck, waiting)``, where waiting
        ones stand still for an expected reason (room under the cap, the task not allowed to
        read: its group membership is watched apart). Sets :attr:`stuck`."""
        stuck: list[str] = []
        waiting: list[str] = []
        owned = {t: p for t, p in self.core.mine.items() if p.status == "owned"}
        for token in [t for t in self._still if t not in owned]:
            del self._still[token]
        for token, part in owned.items():
            still = self._still.get(token)
            if still is None or still[0] != part.watermark:
                self._still[token] = (part.watermark, now)
                continue
            if now - still[1] < stuck_after:
                continue
            head = f"{token[:16]} at {part.resume_ts()} for {now - still[1]:.0f}s"
            reader = self.readers.get(token)
            if reader is None:
                expected, why = self.core.why_unread(token, self.clock())
                (waiting if expected else stuck).append(f"{head}: {why}")
                continue
            p = reader.progress()
            stuck.append(
                f"{head}: reader at {p.position} (committed {p.committed}, "
                f"{now - p.committed_at:.0f}s ago), last from source {p.source_kind} "
                f"{now - p.source_at:.0f}s ago, {p.pending} batches in the sink, "
                f"{p.restarts} restarts"
            )
        self.stuck = len(stuck)
        return stuck, waiting

    async def watch_loop(self, interval: float = 15.0, stuck_after: float = 60.0) -> None:
        """Every ``interval`` seconds, log the partitions :meth:`watch` finds: the first few
        stuck ones as a warning, the first few waiting ones at info level."""
        while True:
            await asyncio.sleep(interval)
            stuck, waiting = self.watch(time.monotonic(), stuck_after)
            if stuck:
                log.warning(
                    "task %s: %d owned partitions not read for %.0fs+ (%d more waiting as "
                    "expected): %s",
                    self.core.me,
                    len(stuck),
                    stuck_after,
                    len(waiting),
                    "; ".join(stuck[:5]),
                )
            if waiting:
                log.info(
                    "task %s: %d owned partitions waiting for %.0fs+, as expected: %s",
                    self.core.me,
                    len(waiting),
                    stuck_after,
                    "; ".join(waiting[:3]),
                )

    # -- publishing ---------------------------------------------------------------------------
    async def publish_loop(self) -> None:
        """Append the core's messages to the sync topic, in order, each within a bounded time."""
        while True:
            message = await self._outbox.get()
            payload = messages.encode(message)
            try:
                async with asyncio.timeout(self._publish_timeout):
                    offset = await self.sync_log.append(payload)
            except Exception as exc:
                log.exception("task %s: sync append failed", self.core.me)
                failed = PublishFailed(f"{type(exc).__name__}: {exc}", own_state_ts(message))
                await self.tell(failed)
                continue
            if isinstance(message, CheckpointMessage):
                try:
                    await self.sync_log.record_checkpoint(offset)
                except Exception:
                    # the checkpoint message is in the log; only the pointer to it was not
                    # stored: a starting task replays from the previous checkpoint instead
                    log.exception("task %s: recording checkpoint %d failed", self.core.me, offset)
                    self.core.counters["checkpoint_record_failed"] += 1

    async def tail_loop(self, start: int) -> None:
        """Every sync message from ``start`` on, into the mailbox; bad ones are counted."""
        async for offset, payload in self.sync_log.read(start):
            try:
                message = messages.decode(payload)
            except messages.SyncDecodeError as exc:
                log.warning("sync offset %d skipped: %s", offset, exc)
                await self.tell(SyncBad(offset, exc.reason))
                continue
            await self.tell(SyncRead(offset, message))

    async def membership_loop(self, membership: Membership) -> None:
        """The membership's events into the mailbox: an assignment (with the lease it holds
        then), a loss, and each lease renewal the membership pushes."""
        from protocol.task import Joined, Lost
        from runtime.ports import GroupAssignment, GroupLease

        async for event in membership.events():
            if isinstance(event, GroupAssignment):
                await self.tell(self.lease_at(membership.lease_valid_until()))
                await self.tell(
                    Joined(event.generation, event.leader, event.members, fresh=event.fresh)
                )
            elif isinstance(event, GroupLease):
                await self.tell(self.lease_at(event.until))
            else:
                await self.tell(Lost(event.reason))

    def lease_at(self, until: float) -> Lease:
        """A membership's lease (monotonic seconds) as an event for the core (on its clock)."""
        # A membership that is not (yet) a member has no lease: KafkaMembership says -inf. A
        # lease in the past changes nothing (the core keeps the latest), so clamp it to now.
        remaining = max(0.0, until - time.monotonic())
        return Lease(self.clock() + int(remaining * 1_000_000))

    # -- the timer ----------------------------------------------------------------------------
    async def timer_loop(self) -> None:
        """Sleep until the core's next deadline, or until the core handled another event,
        whichever comes first; when the deadline is reached, tick the core and wait until it
        handled the tick. One tick in flight at a time; a deadline the tick did not move (a core
        bug) is retried at most every ``_MIN_GAP`` seconds, never in a busy loop."""
        loop = asyncio.get_running_loop()
        last_tick = -math.inf
        while True:
            self._stepped.clear()
            now = self.clock()
            deadline = self.core.next_deadline()
            at = None if deadline is None else loop.time() + max(0, deadline - now) / 1_000_000
            if deadline is not None and deadline <= now:
                at = max(loop.time(), last_tick + _MIN_GAP)
            if at is None or at > loop.time():
                try:
                    async with asyncio.timeout_at(at):
                        await self._stepped.wait()
                    continue  # the core handled an event: its deadline may have moved
                except TimeoutError:
                    pass
            now = self.clock()
            deadline = self.core.next_deadline()
            if deadline is not None and deadline <= now:
                last_tick = loop.time()
                self.ticks += 1
                await self.ask(TaskTick())

    async def marker(self, timeout: float) -> None:
        """Write a marker and wait until it is read back: everything before it is in the CIM."""
        marker = f"{self.core.me}:{Random().getrandbits(64):016x}"
        seen = self.markers[marker] = asyncio.Event()
        payload = messages.encode(MarkerMessage(task_id=self.core.me, marker=marker))
        await self.sync_log.append(payload)
        try:
            async with asyncio.timeout(timeout):
                await seen.wait()
        finally:
            del self.markers[marker]


class LeaderActor(Actor[PlanRequest]):
    def __init__(
        self,
        task: TaskActor,
        source: ChangeStreamSource,
        cap: int,
        rng: Random | None = None,
        snapshots: SnapshotSource | None = None,
    ) -> None:
        super().__init__(f"leader:{task.core.me}", capacity=16)
        self.task = task
        self.source = source
        self.cap = cap
        self.rng = rng or Random()
        self.snapshots = snapshots

    async def receive(self, message: PlanRequest) -> None:
        from protocol.task import PlanReady

        request = message.request
        roots: tuple[Partition, ...] = ()
        stream_start = -1
        snapshot = None
        if request.need_roots:
            stream_start = roots_at = self.task.stream_start
            if request.snapshot:
                if self.snapshots is None:
                    raise Unrecoverable(
                        "snapshot: this source cannot take a snapshot (a Spanner database or "
                        "the emulator can)"
                    )
                # T is the stream's start; the stream's roots start after it
                snapshot = await self.snapshots.plan_snapshot(stream_start)
                roots_at = snapshots.stream_after(stream_start)
            roots = await self.discover_roots(roots_at)
        cim = Cim()
        cim.apply(message.snapshot.as_of + 1, message.snapshot)
        result = await asyncio.to_thread(
            functools.partial(
                planner.plan,
                cim,
                request.members,
                self.task.core.me,
                request.generation,
                self.task.clock(),
                self.cap,
                Random(self.rng.getrandbits(64)),
                roots,
                stream_start,
                request.reset,
                snapshot=snapshot,
                leader_yields=request.leader_yields,
            )
        )
        log.info(
            "leader %s: epoch %d plan: %d offers, %d adopted, reset %s, yielded %s%s",
            self.task.core.me,
            request.generation,
            len(result.offers),
            len(result.adopt),
            list(result.reset),
            list(result.yielded),
            "" if snapshot is None else f", snapshot at {snapshot.read_ts} ({snapshot.total})",
        )
        await self.task.tell(PlanReady(result))

    async def discover_roots(self, start: int) -> tuple[Partition, ...]:
        roots: list[Partition] = []
        async for batch in self.source.query(None, start, None):
            for record in batch:
                if isinstance(record, ChildPartitions):
                    roots += [
                        Partition(token=c.token, start_ts=record.start_ts, parents=())
                        for c in record.children
                    ]
                elif isinstance(record, PartitionStart):  # a MUTABLE_KEY_RANGE stream's roots
                    roots += [Partition(token=t, start_ts=record.start_ts) for t in record.tokens]
        return tuple(roots)
