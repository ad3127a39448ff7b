"""Membership of the consumer group named after the connector, on the heartbeat topic
``<connector>_heartbeat``, as a :class:`runtime.ports.Membership` (:class:`KafkaMembership`).

The group is used only for Kafka's rebalance protocol: a custom assignor, which runs on the group
leader only, reads every member's task id from its subscription and tells every member the
generation's leader and member list. No partition is ever assigned.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, BinaryIO, Final, Self

import msgspec
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from aiokafka.errors import KafkaError, RebalanceInProgressError

from protocol import epochs, lease
from protocol import trace as tracing
from protocol.membership import (
    Assigned,
    HeartbeatAnswered,
    JoinAnswered,
    JoinFailed,
    JoinSent,
    LeaseUntil,
    LoopLagged,
    MemberCommand,
    MemberCore,
    MemberEvent,
    MembershipLost,
    Refuse,
    Said,
    SyncAnswered,
    Take,
)
from runtime import compat
from runtime.kafka.config import KafkaAdapterError, KafkaConfig
from runtime.kafka.topics import check_connector, ensure_topic, heartbeat_topic
from runtime.ports import GroupAssignment, GroupEvent, GroupLease, GroupLost, Membership

log = logging.getLogger(__name__)

_UNKNOWN_MEMBER_ID: Final = ""  # aiokafka's JoinGroupRequest.UNKNOWN_MEMBER_ID
_NONE: Final = 0  # a group request's error code: none
_REBALANCE_IN_PROGRESS: Final[int] = RebalanceInProgressError.errno


class MembershipError(KafkaAdapterError):
    """The heartbeat-topic group membership failed for good (not a normal loss of membership)."""


_ASSIGNOR_NAME: Final = "shoal-tasks-v1"


class _MemberInfo(msgspec.Struct, frozen=True):
    """What a member puts in its subscription's ``user_data``."""

    task_id: str
    v: int = 1
    floor: int = epochs.NO_EPOCH  # the newest epoch this member knows (assigned, or in the log)
    # this process has read nothing (never assigned a generation, or its task says so: a new
    # or restarted task; the leader may deal out what the CIM credits to its task id)
    fresh: bool = False


class _GroupInfo(msgspec.Struct, frozen=True):
    """What the leader puts in every member's assignment ``user_data``."""

    leader: str
    members: tuple[str, ...]
    v: int = 1
    epoch: int = epochs.NO_EPOCH  # the generation's epoch (none from a leader predating epochs)
    fresh: tuple[str, ...] = ()  # task ids whose every member said it is fresh


_member_info_decoder: Final = msgspec.json.Decoder(_MemberInfo)
_group_info_decoder: Final = msgspec.json.Decoder(_GroupInfo)


class _TaskAssignor(AbstractPartitionAssignor):  # type: ignore[misc]
    """Assigns no partition; carries task ids (and the newest epoch each member knows) up in the
    subscriptions, and the leader, the member list and the generation's epoch down.

    What a member says and how the leader numbers the generation's epoch are the member core's
    (:meth:`protocol.membership.MemberCore.said`, :meth:`~protocol.membership.MemberCore.number`):
    the generation, unless some member knows an epoch at least as new.

    aiokafka calls ``metadata``/``on_assignment`` on every member and ``assign`` on the group
    leader only, on this very instance (the ABC declares them classmethods; instances work).
    """

    name = _ASSIGNOR_NAME
    version = 0

    def __init__(
        self,
        core: MemberCore,
        floor: Callable[[], int],
        generation: Callable[[], int],
        unread: Callable[[int], bool],
    ) -> None:
        self._core = core
        self._task_id = core.task_id
        self._floor = floor  # the newest epoch in this member's CIM
        self._generation = generation
        self._unread = unread  # the task has read nothing (TaskCore.says_fresh), given the known
        self.received: _GroupInfo | None = None  # the last assignment's info, if it decoded
        self.bad_subscriptions = 0

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        floor = self._floor()
        said = self._core.said(floor, unread=self._unread(self._core.known(floor)))
        user_data = msgspec.json.encode(
            _MemberInfo(task_id=said.task_id, floor=said.floor, fresh=said.fresh)
        )
        return ConsumerProtocolMemberMetadata(self.version, sorted(topics), user_data)

    def assign(
        self, cluster: Any, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        task_ids: dict[str, str] = {}
        floor = self._floor()
        said: list[Said] = []  # what each member said in its JoinGroup
        for member_id, metadata in members.items():
            try:
                member_info = _member_info_decoder.decode(metadata.user_data)
                task_ids[member_id] = member_info.task_id
                said.append(Said(member_info.task_id, member_info.floor, member_info.fresh))
            except msgspec.DecodeError as exc:
                self.bad_subscriptions += 1
                log.warning(
                    "group member %s sent no shoal task id (%s); using its member id instead",
                    member_id,
                    exc,
                )
                task_ids[member_id] = member_id
                said.append(Said(member_id))
        unique = sorted(set(task_ids.values()))
        if len(unique) != len(task_ids):
            log.error(
                "two group members claim the same task id (%s): task ids must be unique",
                sorted(task_ids.values()),
            )
        # aiokafka sets the coordinator's generation from the JoinGroup response before it asks
        # the leader to assign.
        generation = self._generation()
        numbered = self._core.number(generation, said, floor)
        epoch, fresh = numbered.epoch, numbered.fresh
        if epoch != generation:
            log.warning(
                "group generation %d is not newer than epoch %d a member knows (the group "
                "started over): this generation is epoch %d",
                generation,
                epochs.newest(self._core.known(floor), *(s.floor for s in said)),
                epoch,
            )
        info = msgspec.json.encode(
            _GroupInfo(leader=self._task_id, members=tuple(unique), epoch=epoch, fresh=fresh)
        )
        log.info(
            "group leader %s assigns epoch %d members %s (fresh %s)",
            self._task_id,
            epoch,
            unique,
            list(fresh),
        )
        return {
            member_id: ConsumerProtocolMemberAssignment(self.version, [], info)
            for member_id in members
        }

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        try:
            self.received = _group_info_decoder.decode(assignment.user_data)
        except msgspec.DecodeError as exc:
            self.received = None
            log.warning("undecodable group assignment from the leader: %s", exc)


class MembershipStats(msgspec.Struct, frozen=True):
    generation: int  # -1 while not a member
    leader: str
    members: tuple[str, ...]
    assignments: int  # GroupAssignment events emitted
    losses: int  # GroupLost events emitted
    heartbeats_ok: int
    heartbeats_failed: int
    poll_errors: int
    events_dropped: int  # oldest events dropped because nobody read them
    stale_epochs: int  # assignments refused because their epoch was not newer than one known
    # assignments whose own epoch was in the sync topic first (protocol/epochs.py, rule 5)
    landed_first: int = 0
    # heartbeats sent on a second connection while this member's rebalance was in flight, and
    # how many of them the coordinator answered as this member's (they renew the lease)
    probes: int = 0
    probes_counted: int = 0
    lease_lapses: int = 0  # times the lease ran out while a member (readers stop until renewed)


_END: Final = object()
_LEASE: Final = object()  # the lease was renewed: events() yields the lease it then holds


class KafkaMembership(Membership):
    """Membership of the consumer group ``connector`` on the topic ``<connector>_heartbeat``.

    ``await start()`` (or ``async with``) creates the topic if missing, joins in the background
    and returns at once; :meth:`events` then yields a :class:`GroupAssignment` after each
    completed rebalance and a :class:`GroupLost` when the membership is lost:

    * the coordinator rejected a heartbeat or join (unknown member id, illegal generation —
      the session expired or this member was fenced);
    * no heartbeat succeeded for a whole session timeout (broker unreachable), or, while a
      rebalance is in progress, for the session plus the rebalance timeout.

    After a loss the member keeps trying to rejoin; success is a new :class:`GroupAssignment`.

    :meth:`lease_valid_until` is the rule of :mod:`protocol.lease` on the monotonic clock: the
    send time of the last request the coordinator answered as this member's (a heartbeat
    answered ``NONE`` or ``REBALANCE_IN_PROGRESS``, a JoinGroup or SyncGroup answered ``NONE``)
    plus the session timeout, but no later than the last answer that showed no rebalance plus
    the rebalance timeout, minus ``lease_margin_ms`` (default: a sixth of the session, at most
    1 s: it must cover how long the task takes to notice the lease is past and stop its
    readers); ``-inf`` while not a member. A task stops its readers once it is past. So a
    member keeps its lease through a rebalance it takes part in, and a JoinGroup in flight never
    extends it (it may never have reached the coordinator): while its rebalance is in flight
    (aiokafka sends no heartbeat then) the member heartbeats on a second connection every
    heartbeat interval (``heartbeat_while_rebalancing``, on by default), and each answer as this
    member's renews the lease, up to the rebalance timeout from the last stable answer.
    :attr:`rebalance_in_progress` says whether a rebalance is under way for this member. The
    requests' send times and answers are observed through :func:`runtime.compat.observe_group_requests`.

    :meth:`close` leaves the group at once (others rebalance in ~2 s on the embedded broker
    instead of waiting a session timeout); if this member's rebalance is in flight it first lets
    it finish (at most twice the rebalance timeout + 1 s). When the coordinator answered nothing
    for a whole session (down, frozen, cut off) it does neither: it forgets its generation and
    drops its connections, so closing takes no time whatever Kafka does (the coordinator
    expires the member). ``rebalance_timeout_ms`` defaults to
    twice the session timeout: the lease of a member told ``REBALANCE_IN_PROGRESS`` is bounded
    by the rebalance timeout from its last stable heartbeat (:mod:`protocol.lease`), and with
    the rebalance timeout equal to the session that bound would end the lease a heartbeat
    interval earlier than the session does. aiokafka rejoins at its first heartbeat after the
    rebalance began, so a longer rebalance timeout delays no rebalance unless a member stops
    rejoining while it still heartbeats.

    A :class:`GroupAssignment`'s ``generation`` is the *epoch* of the generation, which never goes
    back, unlike Kafka's generations (they start at 0 on the embedded broker, restart when it
    restarts, and on a real Kafka when an empty group's metadata is deleted). Each member tells
    the leader the newest epoch it knows — the newest it was assigned, and ``epoch_floor()`` (a
    task gives its CIM's epoch, read from the sync topic) — and the leader assigns
    ``max(generation, newest known + 1)``. A member that is assigned an epoch not newer than
    what it knows (the leader had not read as far: a race at the first join) refuses it and
    rejoins, telling the next leader, unless it is the assignment's own epoch that landed in the
    sync topic first (``logged_epoch()``, the CIM's newest epoch: a follower answered after the
    leader planned). While the group keeps its generations the epoch *is* the generation. These
    rules are the pure functions of :mod:`protocol.epochs`.
    """

    def __init__(
        self,
        config: KafkaConfig,
        connector: str,
        task_id: str,
        *,
        lease_margin_ms: int | None = None,
        rebalance_timeout_ms: int | None = None,
        event_buffer: int = 64,
        clock: Callable[[], float] = time.monotonic,
        epoch_floor: Callable[[], int] | None = None,
        logged_epoch: Callable[[], epochs.Logged] | None = None,
        heartbeat_while_rebalancing: bool = True,
        trace: BinaryIO | None = None,
        validate: bool = False,
        loop_lag: Callable[[], float] | None = None,
    ) -> None:
        """``trace``: record the member core's inputs and commands there (protocol/trace.py);
        ``validate``: check its invariants after every event (debugging); ``loop_lag``: how
        late (seconds) the event loop has lately run (``runtime.looplag.LoopLag.recent``),
        added to the lease margin (``protocol.lease.margin_under_lag``)."""
        check_connector(connector)
        if not task_id:
            raise ValueError("task_id must not be empty")
        session = config.session_timeout_ms
        margin = lease_margin_ms if lease_margin_ms is not None else min(session // 6, 1_000)
        rebalance = rebalance_timeout_ms or 2 * session
        if not 0 <= margin < min(session, rebalance):
            raise ValueError(
                f"lease_margin_ms must be in [0, {min(session, rebalance)}) (below the session "
                f"and rebalance timeouts), got {margin}"
            )
        if event_buffer < 1:
            raise ValueError(f"event_buffer must be >= 1, got {event_buffer}")
        self._config = config
        self.connector = connector
        self.task_id = task_id
        self.group_id = connector
        self.topic = heartbeat_topic(connector)
        self._session_s = session / 1000
        self._rebalance_timeout_ms = rebalance
        self._timing = lease.LeaseTiming(
            session=session * 1000, rebalance=rebalance * 1000, margin=margin * 1000
        )
        # this member's epochs and the facts its lease is derived from (protocol/membership.py)
        self._core = MemberCore(task_id, self._timing)
        self._trace = trace
        if trace is not None:
            trace.write(tracing.encode(tracing.MemberStart(task_id, task_id, self._timing)))
        self._validate = validate
        self._loop_lag = loop_lag
        # when (our clock, micros) the coordinator last answered a group request as this
        # member's: it is reachable then, whatever the lease (send times) says
        self._heard: int | None = None
        self._clock = clock
        self._epoch_floor = epoch_floor
        self._logged_epoch = logged_epoch
        self._unread: Callable[[int], bool] | None = None
        self._assignor = _TaskAssignor(
            self._core, self._cim_epoch, self._coordinator_generation, self._task_unread
        )
        self._events: asyncio.Queue[GroupEvent | object] = asyncio.Queue(event_buffer)
        self._consumer: AIOKafkaConsumer | None = None
        self._runner: asyncio.Task[None] | None = None
        self._closed = False
        self._events_taken = False
        # Membership state.
        self._current: GroupAssignment | None = None  # None: not a member
        self._joining = False
        self._settled = asyncio.Event()  # set while no rebalance of this member is in flight
        # Counters.
        self._assignments = 0
        self._losses = 0
        self._heartbeats_ok = 0
        self._heartbeats_failed = 0
        self._poll_errors = 0
        self._events_dropped = 0
        self._lease_queued = False  # a lease renewal waits in the events queue
        self._probes = 0
        self._probes_counted = 0
        self._lease_lapses = 0
        self._lapsed_at: float | None = None  # when the lease ran out, while it stays out
        self._life = 0  # memberships lost so far: an answer to a request of an earlier one is old
        self._heartbeat_while_rebalancing = heartbeat_while_rebalancing  # False: tests only

    def __repr__(self) -> str:
        return (
            f"KafkaMembership(group={self.group_id!r}, task_id={self.task_id!r}, "
            f"generation={self.generation})"
        )

    # -- public view ---------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._current.generation if self._current is not None else -1

    @property
    def rebalance_in_progress(self) -> bool:
        """A rebalance started (this member was told so, or is rejoining) and has not completed
        yet."""
        return self._joining or self._core.rebalance_in_progress()

    @property
    def lease_facts(self) -> lease.MemberFacts:
        """The membership facts the lease is derived from (send times in micros of the clock)."""
        return self._core.facts

    @property
    def current(self) -> GroupAssignment | None:
        """The latest assignment while a member, else ``None``."""
        return self._current

    def set_epoch_floor(
        self,
        epoch_floor: Callable[[], int],
        logged: Callable[[], epochs.Logged] | None = None,
        unread: Callable[[int], bool] | None = None,
    ) -> None:
        """Where the newest epoch this task has read in the sync topic comes from, (``logged``)
        who opened it for which members (see the class docstring), and (``unread``, given the
        newest epoch known: ``TaskActor.joining``) whether the task has read nothing, asked as
        each JoinGroup is sent; may be set after :meth:`start`."""
        self._epoch_floor = epoch_floor
        if logged is not None:
            self._logged_epoch = logged
        if unread is not None:
            self._unread = unread

    def _task_unread(self, known: int) -> bool:
        """Whether the task has read nothing in this life (asked as a JoinGroup is sent);
        without a task, a member that was never assigned a generation still says so."""
        return self._unread(known) if self._unread is not None else False

    def _cim_epoch(self) -> int:
        """The newest epoch this task has read in the sync topic (none without ``epoch_floor``)."""
        return self._epoch_floor() if self._epoch_floor is not None else epochs.NO_EPOCH

    def _coordinator_generation(self) -> int:
        consumer = self._consumer
        coordinator = None if consumer is None else compat.group_coordinator(consumer)
        if coordinator is None:
            return -1
        generation: int = coordinator.generation
        return generation

    def lease_valid_until(self) -> float:
        if self._current is None:
            return -math.inf
        until = self._core.lease_until()
        return -math.inf if until is None else until / 1_000_000

    def statistics(self) -> MembershipStats:
        current = self._current
        return MembershipStats(
            generation=self.generation,
            leader=current.leader if current is not None else "",
            members=current.members if current is not None else (),
            assignments=self._assignments,
            losses=self._losses,
            heartbeats_ok=self._heartbeats_ok,
            heartbeats_failed=self._heartbeats_failed,
            poll_errors=self._poll_errors,
            events_dropped=self._events_dropped,
            stale_epochs=self._core.stale_epochs,
            landed_first=self._core.landed_first,
            probes=self._probes,
            probes_counted=self._probes_counted,
            lease_lapses=self._lease_lapses,
        )

    def events(self) -> AsyncIterator[GroupEvent]:
        """Rebalances and losses in order; ends after :meth:`close`. One reader only."""
        if self._events_taken:
            raise MembershipError("events() may be iterated by one reader only")
        self._events_taken = True
        return self._iterate_events()

    async def _iterate_events(self) -> AsyncIterator[GroupEvent]:
        while True:
            item = await self._events.get()
            if item is _LEASE:
                self._lease_queued = False
                until = self.lease_valid_until()
                if until > -math.inf:
                    yield GroupLease(until=until)
                continue
            if item is _END:
                runner = self._runner
                if runner is not None and runner.done() and not runner.cancelled():
                    error = runner.exception()
                    if error is not None:
                        raise MembershipError(f"{self!r} failed: {error!r}") from error
                return
            assert isinstance(item, GroupAssignment | GroupLost | GroupLease)
            yield item

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the heartbeat topic if missing and start joining the group (in the
        background: watch :meth:`events`)."""
        if self._consumer is not None or self._closed:
            raise MembershipError(f"{self!r} was already started")
        try:
            await ensure_topic(self._config, self.topic, partitions=1)
        except KafkaAdapterError as exc:
            raise MembershipError(f"{self!r} cannot start: {exc}") from exc
        consumer = AIOKafkaConsumer(
            **self._config.with_client_id(f"shoal-{self.task_id}").client_kwargs(),
            group_id=self.group_id,
            session_timeout_ms=self._config.session_timeout_ms,
            heartbeat_interval_ms=self._config.heartbeat_interval_ms,
            rebalance_timeout_ms=self._rebalance_timeout_ms,
            partition_assignment_strategy=(self._assignor,),
            enable_auto_commit=False,
            auto_offset_reset="latest",
        )
        self._consumer = consumer
        try:
            await consumer.start()  # no subscription yet: does not join
            self._observe_heartbeats(consumer)
            consumer.subscribe([self.topic], listener=_Listener(self))
        except BaseException as exc:
            self._consumer = None
            await consumer.stop()
            if isinstance(exc, KafkaError):
                raise MembershipError(f"{self!r} cannot connect: {exc!r}") from exc
            raise
        self._runner = asyncio.create_task(self._run(consumer), name=f"membership-{self.task_id}")

    async def close(self) -> None:
        """Leave the group (a prompt rebalance for the others) and end :meth:`events`."""
        if self._closed:
            return
        self._closed = True
        runner, consumer = self._runner, self._consumer
        self._runner = None
        try:
            if runner is not None:
                runner.cancel()
                await asyncio.wait([runner])  # a cancellation of close() itself propagates
                if not runner.cancelled() and runner.exception() is not None:
                    log.error("%r had failed before close: %r", self, runner.exception())
        finally:
            if consumer is not None:
                await self._leave(consumer)
            self._current = None
            self._put(_END)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _leave(self, consumer: AIOKafkaConsumer) -> None:
        coordinator = compat.group_coordinator(consumer)
        silent = self._core.silent_for(self._heard, int(self._clock() * 1e6)) / 1e6
        unreachable = silent > self._session_s
        if self._joining and unreachable:
            # Nothing answered for a whole session: the coordinator is unreachable (down,
            # frozen, cut off), and a rebalance it cannot run will not finish for waiting.
            log.warning(
                "%r: leaving without waiting for its rebalance: the coordinator answered "
                "nothing for %.1f s",
                self,
                silent,
            )
        elif self._joining:
            # Leaving while our JoinGroup/SyncGroup is in flight can make the embedded broker
            # elect the departed member leader of the next generation, which then never
            # completes (seen with Tansu 0.6.0-510f3e2). Let the rebalance finish first. It can
            # take a whole rebalance timeout to begin (the broker waits that long for a member
            # that left) and as long again to finish: on a loaded machine one finished just
            # after a single timeout, the member had left, and the next group stalled.
            wait_s = 2 * self._rebalance_timeout_ms / 1000 + 1.0
            try:
                async with asyncio.timeout(wait_s):
                    await self._settled.wait()
            except TimeoutError:
                log.warning(
                    "%r: leaving although its rebalance did not finish in %.1f s", self, wait_s
                )
        # aiokafka sends LeaveGroup only in a generation > 0. The embedded broker starts at 0,
        # and a member closed while its JoinGroup is in flight has a member id but generation
        # -1: leave explicitly then, or the others wait a whole session timeout for us.
        if (
            not unreachable
            and coordinator is not None
            and coordinator.generation <= 0
            and coordinator.member_id != _UNKNOWN_MEMBER_ID
        ):
            try:
                async with asyncio.timeout(self._config.request_timeout_ms / 1000):
                    await compat.send_leave_group(coordinator, self.group_id)
            except (TimeoutError, KafkaError) as exc:
                log.warning(
                    "%r: LeaveGroup (generation %d) failed: %r", self, coordinator.generation, exc
                )
        if not unreachable:
            await consumer.stop()
            return
        # aiokafka's stop waits for the request in flight (a JoinGroup to a frozen broker: the
        # whole request timeout) and then sends LeaveGroup in a generation > 0, which cannot be
        # answered either. The coordinator expires this member instead: forget the generation,
        # and once the stop began, drop the connections so what is in flight fails at once.
        if coordinator is not None:
            coordinator.reset_generation()
        async with asyncio.TaskGroup() as group:
            group.create_task(consumer.stop())
            await asyncio.sleep(0)  # the stop marks the coordinator closing
            await compat.abort_connections(consumer)

    # -- the background work -------------------------------------------------------------------

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._poll(consumer))
                group.create_task(self._watch(consumer))
                if self._heartbeat_while_rebalancing:
                    group.create_task(self._probe(consumer))
        finally:
            if not self._closed:
                # The runner died on its own: say so to the events reader.
                self._put(_END)

    async def _poll(self, consumer: AIOKafkaConsumer) -> None:
        """Keep polling: aiokafka leaves the group if ``getmany`` is not called for
        ``max_poll_interval_ms``, and its coordination errors surface here."""
        backoff = self._config.heartbeat_interval_ms / 1000
        while True:
            try:
                await consumer.getmany(timeout_ms=1000)
            except KafkaError as exc:
                self._poll_errors += 1
                log.warning("%r: group coordination error (will retry): %r", self, exc)
                await asyncio.sleep(backoff)

    async def _watch(self, consumer: AIOKafkaConsumer) -> None:
        """Declare the membership lost once the coordinator has answered nothing for too long.

        Silence is counted from the later of the last answered request's send time and when
        its answer came: a SyncGroup the coordinator held for a whole session (it waits for a
        slow leader's) proves membership only from its send time, so the lease may run out,
        but the answer shows the coordinator reachable, and the next heartbeat's answer renews
        the lease. Declaring the membership lost there made a member that was in the new
        generation rejoin, and start yet another rebalance for everyone."""
        period = min(self._config.heartbeat_interval_ms / 1000 / 4, 0.25)
        while True:
            await asyncio.sleep(period)
            if self._current is None:
                self._lapsed_at = None
                continue
            self._note_lapse()
            coordinator = compat.group_coordinator(consumer)
            if coordinator is not None and coordinator.member_id == _UNKNOWN_MEMBER_ID:
                self._lose(
                    "the coordinator no longer knows this member (session expired or fenced)"
                )
                continue
            allowed = self._session_s
            if self._joining:
                allowed += self._rebalance_timeout_ms / 1000
            silent = self._core.silent_for(self._heard, int(self._clock() * 1e6)) / 1e6
            if silent > allowed:
                self._lose(
                    f"no successful heartbeat for {silent:.1f} s (session timeout "
                    f"{self._session_s:.1f} s): the group coordinator is unreachable"
                )
                if coordinator is not None:
                    coordinator.request_rejoin()

    def _note_lapse(self) -> None:
        """Log when the lease runs out while a member, and when it is renewed: the task reads
        nothing in between, and the facts say why."""
        now = self._clock()
        if self.lease_valid_until() > now:
            if self._lapsed_at is not None:
                log.info("%r: lease renewed after %.1f s out", self, now - self._lapsed_at)
                self._lapsed_at = None
            return
        if self._lapsed_at is not None:
            return
        self._lapsed_at = now
        self._lease_lapses += 1
        f = self._core.facts

        def ago(t: int | None) -> str:
            return "never" if t is None else f"{now - t / 1e6:.1f} s ago"

        log.info(
            "%r: lease ran out (last answer as a member sent %s, last stable one %s, JoinGroup "
            "in flight since %s, rebalancing %s)",
            self,
            ago(f.alive),
            ago(f.stable),
            ago(f.join_sent),
            self._joining,
        )

    async def _probe(self, consumer: AIOKafkaConsumer) -> None:
        """Heartbeat on a second connection while this member's rebalance is in flight.

        aiokafka sends no heartbeat from its JoinGroup until its SyncGroup is answered, and the
        coordinator may hold a JoinGroup for seconds (until every member rejoined or was removed;
        the embedded broker holds each for about half a session). An unanswered JoinGroup
        proves nothing (protocol/lease.py, K4), so without these heartbeats the lease ran out in
        a held JoinGroup and the member stopped reading although it stayed in the group. The
        coordinator answers them ``REBALANCE_IN_PROGRESS`` and restarts the member's session
        (K1): that renews the lease from the heartbeat's send time, still bounded by the
        rebalance timeout from the last stable answer, so a member cut off or paused stops as
        before."""
        coordinator = compat.group_coordinator(consumer)
        interval = self._config.heartbeat_interval_ms / 1000
        timeout = self._config.request_timeout_ms / 1000
        while True:
            await asyncio.sleep(interval)
            joining = self._joining or self._core.facts.join_sent is not None
            if self._current is None or not joining:
                continue
            life = self._life
            sent = self._clock()
            try:
                async with asyncio.timeout(timeout):
                    error = await compat.send_heartbeat_aside(coordinator)
            except (TimeoutError, KafkaError) as exc:
                log.info("%r: heartbeat during the rebalance got no answer: %r", self, exc)
                continue  # no proof of anything (A3)
            if error is None:
                continue
            self._probes += 1
            if life != self._life:
                continue  # the membership it was sent for was lost meanwhile
            if self._heartbeat_answered(int(sent * 1_000_000), error):
                self._probes_counted += 1
            else:
                log.info("%r: heartbeat during the rebalance answered error %d", self, error)

    def _heartbeat_answered(self, sent: int, error: int | None) -> bool:
        """A heartbeat's answer, on aiokafka's connection or :meth:`_probe`'s: ``NONE`` or
        ``REBALANCE_IN_PROGRESS`` answers it as this member's, a lease fact from its send time
        (micros; protocol/lease.py K1). True when it counted."""
        if error not in (_NONE, _REBALANCE_IN_PROGRESS):
            return False
        self._apply(HeartbeatAnswered(sent, rebalancing=error == _REBALANCE_IN_PROGRESS))
        self._heard = int(self._clock() * 1e6)  # an answer as this member's came now
        return True

    def _observe_heartbeats(self, consumer: AIOKafkaConsumer) -> None:
        """Learn the send time and answer of every group request (aiokafka has no public
        callback for them: see :func:`runtime.compat.observe_group_requests`); they are the
        facts of the lease (:mod:`protocol.lease`)."""
        coordinator = compat.group_coordinator(consumer)

        def heartbeat_done(sent: float, ok: bool) -> None:
            if ok:
                self._heartbeats_ok += 1
            else:
                self._heartbeats_failed += 1
                if coordinator.member_id == _UNKNOWN_MEMBER_ID:
                    self._lose("heartbeat rejected: unknown member id or illegal generation")

        def answered(kind: str, sent_s: float, error: int | None) -> None:
            sent = int(sent_s * 1_000_000)
            if kind == "heartbeat":
                self._heartbeat_answered(sent, error)
                return
            event: MemberEvent | None = None
            if kind == "join":
                if error is None:
                    event = JoinSent(sent)
                elif error == _NONE:
                    event = JoinAnswered()
                else:
                    event = JoinFailed()
            elif error == _NONE:  # sync
                event = SyncAnswered(sent)
            if error == _NONE:
                self._heard = int(self._clock() * 1e6)  # an answer as this member's came now
            if event is not None:
                self._apply(event)

        compat.observe_heartbeats(coordinator, self._clock, heartbeat_done)
        compat.observe_group_requests(coordinator, self._clock, answered)

    # -- state changes (called from the listener, the heartbeat hook and the watchdog) ---------

    def _rebalance_started(self) -> None:
        self._joining = True
        self._settled.clear()

    def _rebalance_done(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        coordinator = compat.group_coordinator(consumer)
        self._joining = False
        self._settled.set()
        info = self._assignor.received
        if info is None:
            self._poll_errors += 1
            log.error("%r: rebalance done without a usable assignment; rejoining", self)
            coordinator.request_rejoin()
            return
        if self.task_id not in info.members:
            log.error(
                "%r: the leader's member list %s does not include this task", self, info.members
            )
        logged = self._logged_epoch() if self._logged_epoch is not None else epochs.Logged()
        assigned = Assigned(
            info.epoch,
            coordinator.generation,
            info.leader,
            info.members,
            info.fresh,
            floor=self._cim_epoch(),
            logged=logged,
        )
        [verdict] = self._step(assigned)
        assert isinstance(verdict, Take | Refuse), verdict
        if verdict.landed_first:
            log.info(
                "%r: epoch %d was in the sync topic before this member's assignment (its "
                "leader planned before this member answered): it is this generation's own",
                self,
                info.epoch,
            )
        if isinstance(verdict, Refuse):
            # The leader did not know how far the epochs went (this member had not told it yet,
            # or the group started over): rejoin, and the next leader learns it from us.
            log.warning(
                "%r: assigned epoch %d (generation %d), not newer than epoch %d known here; "
                "rejoining",
                self,
                verdict.epoch,
                coordinator.generation,
                verdict.known,
            )
            self._lose(verdict.reason)
            coordinator.request_rejoin()
            return
        event = GroupAssignment(
            generation=verdict.epoch,
            leader=verdict.leader,
            members=verdict.members,
            fresh=verdict.fresh,
        )
        self._current = event
        self._assignments += 1
        log.info(
            "%r: generation %d, leader %s, members %s",
            self,
            event.generation,
            event.leader,
            event.members,
        )
        self._put(event)

    def _lose(self, reason: str) -> None:
        if self._current is None:
            return
        log.warning("%r: group membership lost: %s", self, reason)
        self._current = None
        self._apply(MembershipLost(reason))
        self._life += 1
        self._losses += 1
        self._put(GroupLost(reason=reason))

    def _step(self, event: MemberEvent) -> list[MemberCommand]:
        now = int(self._clock() * 1e6)
        commands = self._core.handle(event, now)
        if self._trace is not None:
            step = tracing.MemberStep(self.task_id, now, event, tuple(commands))
            self._trace.write(tracing.encode(step))
        if self._validate:
            self._core.validate()
        return commands

    def _apply(self, event: MemberEvent) -> None:
        """Hand the member core an event; a lease it reports while this task is a member is
        pushed to the events' reader (one renewal queued at a time: the reader gets the lease
        the facts give when it takes it). The loop's recent lag, when it changed (to the
        millisecond), goes first, so the lease of this event has the margin it calls for."""
        if self._loop_lag is not None and not isinstance(event, LoopLagged):
            lag = round(max(0.0, self._loop_lag()) * 1000) * 1000
            if lag != self._core.lag:
                self._step(LoopLagged(lag))
        for command in self._step(event):
            member = self._current is not None
            if isinstance(command, LeaseUntil) and member and not self._lease_queued:
                self._lease_queued = True
                self._put(_LEASE)

    def _put(self, item: GroupEvent | object) -> None:
        """Queue an event; when nobody reads them, the oldest is dropped (and counted): the
        newest says more about the group than a stale one."""
        if self._events.full():
            dropped = self._events.get_nowait()
            if dropped is _LEASE:
                self._lease_queued = False
            self._events_dropped += 1
            log.error("%r: nobody reads group events; dropped the oldest: %r", self, dropped)
        self._events.put_nowait(item)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, membership: KafkaMembership) -> None:
        self._membership = membership

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._membership._rebalance_started()

    def on_partitions_assigned(self, assigned: Any) -> None:
        self._membership._rebalance_done()
