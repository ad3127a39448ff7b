"""One shoal task, assembled: the embedding API.

``async with TaskNode(config, ...) as node:`` runs one task inside the caller's event loop:

1. the task actor starts and the sync topic is replayed into its CIM (from the latest
   checkpoint, if one was recorded), until a marker it wrote itself is read back;
2. only then does it join the heartbeat-topic group (the subscription order of docs/design.md#sync-topic-and-cim: a new task
   is ready to read partitions before the others learn about it);
3. the leader actor, the task's timer and the partition readers do the rest.

Leaving the block leaves the group and stops every actor; partitions are handed over by the
group's next epoch. :meth:`TaskNode.drain` first stops reading for good, lets in-flight batches
commit and waits until the final watermarks are in the sync topic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from random import Random
from types import TracebackType
from typing import BinaryIO, Self

import msgspec

from actors.kernel import MailboxStats, Supervisor
from actors.task import LeaderActor, TaskActor, wall_micros
from protocol import epochs, messages
from protocol.bounds import empty_first_window, nothing_left
from protocol.messages import CheckpointMessage
from protocol.task import Drain, SyncRead, TaskConfig
from runtime.ports import ChangeStreamSource, Membership, Sink, SnapshotSource, SyncLog

log = logging.getLogger("shoal.node")

_CHECKPOINT_SCAN = 1000  # messages read past the checkpoint pointer looking for the checkpoint

MembershipFactory = Callable[[str], Awaitable[Membership]]


class NodeConfig(msgspec.Struct, frozen=True):
    task: TaskConfig
    stream_start: int = -1  # where a never-started stream is read from; -1: now
    # an explicit start (--start-at): refuse to run, before joining the group, when the sync
    # topic already records a different start of this connector (StartConflict); -1: none
    require_start: int = -1
    # an end (--end-at): refuse to run, before joining the group, a first start (no start in
    # the sync topic) whose stream start lies after it: it would read nothing (EmptyWindow)
    end_at: int = -1
    # where the connector first started by its output's own record (-1: none, or no output
    # that keeps one): with a snapshot asked and none in the sync topic, such a connector is
    # refused one (SnapshotConflict), as one whose sync topic records its start
    output_start: int = -1
    replay_timeout: float = 60.0
    publish_timeout: float = 10.0
    # an owned partition whose committed watermark stands still this long, though nothing
    # should keep it from being read, is logged as stuck (checked every stuck_after / 4)
    stuck_after: float = 60.0
    # opt-in: write every core input and its commands to <trace_dir>/<task id>.trace.jsonl
    # (replay with protocol.trace); debug: check the core's invariants after every event
    trace_dir: str | None = None
    debug_validate: bool = False


class StartConflict(ValueError):
    """An explicit start differs from the one the connector's sync topic records: the
    connector already started there, and a restart resumes from its watermarks."""

    def __init__(self, recorded: int, requested: int) -> None:
        super().__init__(
            f"the connector already started at {recorded} (Unix micros, in its sync topic), "
            f"not at {requested}"
        )
        self.recorded = recorded
        self.requested = requested


class SnapshotConflict(ValueError):
    """A snapshot is asked of a connector that already started without one: a snapshot is
    taken only when a connector first starts (``protocol/snapshot.py``, rule 1)."""

    def __init__(self, recorded: int) -> None:
        super().__init__(
            f"the connector already started at {recorded} (Unix micros) without a snapshot in "
            "its sync topic"
        )
        self.recorded = recorded


class EmptyWindow(ValueError):
    """The connector has not started yet and would start (at its start, or now) after its end:
    it would read nothing. Refused before the start is recorded, so a corrected start works."""

    def __init__(self, stream_start: int, end_at: int) -> None:
        super().__init__(
            f"the connector would first start at {stream_start} (Unix micros), after its end "
            f"{end_at}: nothing to read"
        )
        self.stream_start = stream_start
        self.end_at = end_at


class NodeStatus(msgspec.Struct, frozen=True):
    task_id: str
    member: bool
    out_of_group_s: float  # since the task was last a member (0.0 while it is one)
    leader: str
    generation: int
    epoch: int
    owned: int
    reading: int
    offers: int
    stuck: int  # owned partitions not read for stuck_after though they should be (last watch)
    watermarks: dict[str, int]
    counters: dict[str, int]
    mailboxes: list[MailboxStats]
    # owned partitions parked by the quarantine rule: token -> "at <watermark>: <error>"
    quarantined: dict[str, str] = {}


class TaskNode:
    def __init__(
        self,
        config: NodeConfig,
        *,
        sync_log: SyncLog,
        join: MembershipFactory,
        source: ChangeStreamSource,
        sink: Sink,
        rng: Random | None = None,
        snapshots: SnapshotSource | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """``snapshots``: where the leader plans the connector's snapshot when it first starts
        with ``config.task.snapshot`` (``source`` reads its partitions). ``on_change``: called
        once the node is ready and after its task's core handled each event."""
        self.config = config
        self._snapshots = snapshots
        self._sync_log = sync_log
        self._join = join
        self._source = source
        self._sink = sink
        self._rng = rng or Random()
        self._supervisor = Supervisor(f"node:{config.task.task_id}")
        self.task: TaskActor | None = None
        self.membership: Membership | None = None
        self.ready = asyncio.Event()
        self._closed = False
        self._trace: BinaryIO | None = None
        self._on_change = on_change

    @property
    def task_id(self) -> str:
        return self.config.task.task_id

    async def __aenter__(self) -> Self:
        await self._supervisor.__aenter__()
        try:
            await self._start()
        except BaseException:
            await self._supervisor.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        cfg = self.config
        stream_start = cfg.stream_start if cfg.stream_start >= 0 else wall_micros()
        sup = self._supervisor
        task = self.task = TaskActor(
            cfg.task,
            sync_log=self._sync_log,
            source=self._source,
            sink=self._sink,
            supervisor=sup,
            stream_start=stream_start,
            publish_timeout=cfg.publish_timeout,
            rng=Random(self._rng.getrandbits(64)),
            trace=self._open_trace(),
            validate=cfg.debug_validate,
            on_step=self._on_change,
        )
        await sup.spawn(task)
        sup.start_soon(task.publish_loop(), name=f"publish:{self.task_id}")
        start = await self._replay_start(task)
        sup.start_soon(task.tail_loop(start), name=f"tail:{self.task_id}")
        sup.start_soon(
            task.watch_loop(cfg.stuck_after / 4, cfg.stuck_after), name=f"watch:{self.task_id}"
        )
        await task.marker(cfg.replay_timeout)
        log.info("task %s replayed the sync topic to offset %d", self.task_id, task.last_offset)
        recorded = task.core.cim.stream_start
        if cfg.require_start >= 0 and recorded >= 0 and recorded != cfg.require_start:
            raise StartConflict(recorded, cfg.require_start)
        if empty_first_window(recorded, stream_start, cfg.end_at):
            raise EmptyWindow(stream_start, cfg.end_at)
        started = recorded if recorded >= 0 else cfg.output_start
        if cfg.task.snapshot and started >= 0 and task.core.cim.snapshot.plan is None:
            # a snapshot is taken only at a connector's first start (protocol/snapshot.py):
            # planned again over an output with state, its partitions could differ
            raise SnapshotConflict(started)
        self.membership = await self._join(self.task_id)
        # A membership that needs it (KafkaMembership) learns the newest epoch in the sync
        # topic, so that its group's epochs stay newer than it when Kafka's generations start
        # over, and asks the task at each JoinGroup whether it has read nothing (a fresh life:
        # TaskActor.joining). Set before anything awaits: the first JoinGroup has not been sent.
        core = task.core
        self.membership.set_epoch_floor(
            lambda: core.cim.epoch,
            lambda: epochs.Logged(core.cim.epoch, core.cim.leader, core.cim.members),
            task.joining,
        )
        leader = LeaderActor(
            task,
            self._source,
            cfg.task.cap,
            Random(self._rng.getrandbits(64)),
            snapshots=self._snapshots,
        )
        await sup.spawn(leader)
        task.leader = leader
        sup.start_soon(task.membership_loop(self.membership), name=f"group:{self.task_id}")
        sup.start_soon(task.timer_loop(), name=f"timer:{self.task_id}")
        if not task.core.member:  # time out of the group counts from here, not from replay
            task.out_of_group_since = time.monotonic()
        self.ready.set()
        if self._on_change is not None:
            self._on_change()

    async def _replay_start(self, task: TaskActor) -> int:
        """Seed the CIM from the latest checkpoint; return the offset to replay from."""
        offset = await self._sync_log.checkpoint_offset()
        if offset is None:
            return 0
        # A checkpoint too big for one record is read whole at its last fragment's offset, and
        # other tasks' messages may come first: they are read again from ``as_of + 1``.
        skipped = 0
        reader = self._sync_log.read(offset)
        try:
            async for at, payload in reader:
                try:
                    message = messages.decode(payload)
                except messages.SyncDecodeError as exc:
                    log.warning("sync message at %d unreadable (%s) before the checkpoint", at, exc)
                    message = None
                if isinstance(message, CheckpointMessage) and message.as_of >= 0:
                    await task.tell(SyncRead(at, message))
                    return message.as_of + 1
                skipped += 1
                if skipped >= _CHECKPOINT_SCAN:
                    break
        finally:
            await reader.aclose()
        log.warning("no checkpoint within %d messages of offset %d: full replay", skipped, offset)
        return 0

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._closed:
            return None
        self._closed = True
        try:
            if self.membership is not None:
                try:
                    await self.membership.close()
                except Exception:
                    log.exception("task %s: leaving the group failed", self.task_id)
            await self._supervisor.__aexit__(exc_type, exc, tb)
        finally:
            if self._trace is not None:
                self._trace.close()
        return None

    def _open_trace(self) -> BinaryIO | None:
        if self.config.trace_dir is None:
            return None
        path = Path(self.config.trace_dir) / f"{self.task_id}.trace.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._trace = path.open("ab")
        log.info("task %s: tracing its core to %s", self.task_id, path)
        return self._trace

    async def drain(self, timeout: float | None = 10.0) -> bool:
        """Stop reading for good (in-flight batches commit first), then wait until the task's
        final state is read back from the sync topic. Returns whether it got that far within
        ``timeout`` (``False``: time ran out, or the task is not a member any more, so its
        partitions are the group's to settle from their last published watermarks). A task
        that never joined a generation (the group had not formed yet) holds nothing and read
        nothing: ``True``."""
        task = self.task
        if task is None:
            return False
        await task.tell(Drain())
        core = task.core
        try:
            async with asyncio.timeout(timeout):
                await task.readers_idle.wait()
                while core.member and core.cim.view(core.me).partitions != core.mine:  # noqa: ASYNC110 (no event for the CIM catching up)
                    await asyncio.sleep(0.05)
        except TimeoutError:
            log.warning("task %s: drain did not finish in %ss", self.task_id, timeout)
            return False
        never_joined = core.generation < 0 and not core.mine and not core.reading
        return core.member or never_joined

    def nothing_left(self) -> bool:
        """With an end (``--end-at``): whether this task's CIM shows every partition of the
        connector read to its end (``protocol/bounds.py``); then the run may drain and stop."""
        return self.task is not None and nothing_left(self.task.core.cim)

    def status(self) -> NodeStatus:
        assert self.task is not None
        core = self.task.core
        return NodeStatus(
            task_id=core.me,
            member=core.member,
            out_of_group_s=(
                0.0
                if self.task.out_of_group_since is None
                else time.monotonic() - self.task.out_of_group_since
            ),
            leader=core.leader,
            generation=core.generation,
            epoch=core.cim.epoch,
            owned=sum(1 for _ in core.owned_unfinished()),
            reading=len(core.reading),
            offers=len(core.shares),
            stuck=self.task.stuck,
            watermarks={t: p.watermark for t, p in core.mine.items() if p.status == "owned"},
            counters=dict(core.counters),
            mailboxes=self._supervisor.statistics(),
            quarantined={
                p.token: f"at {p.watermark}: {p.quarantine.error}"
                for p in core.quarantined()
                if p.quarantine is not None
            },
        )
