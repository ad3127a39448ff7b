"""One task of the protocol (docs/design.md) as a pure state machine: events in, commands out.

Every task is a regular task; the one the group leader's assignor named also plays the Leader for
that generation. Time (``now``, every interval of :class:`TaskConfig`) is integer microseconds of
the shell's wall clock. The rules, in the order a reader meets them in :class:`TaskCore`:

Subscription order and membership
  A task replays the sync topic into its CIM before it joins the heartbeat-topic group (the shell
  does that). It reads partitions only while (a) it is a member with a valid lease, (b) the CIM's
  epoch is at least the generation its unbroken membership began in, and (c) that epoch lists it.
  So a task that lost its membership, or a zombie whose lease ran out, stops its readers before
  the leader can hand its partitions out, and a rejoined task waits for an epoch that includes it.
  An epoch that does not list the task means its partitions were handed out: it drops its state.
  A rejoined task that is no fresh life need not wait for that epoch: once its own answer in the
  new generation is read back while the CIM's epoch still lists it, it reads what the CIM credits
  to it (``_resumed_on_answer``). Every epoch that could have handed those partitions out landed
  before its answer (and it has applied it), and none older than its generation lands after
  (CIM rule 2a); the epochs of its generation and later list it and keep a member's partitions.

Rebalance
  On every completed rebalance a task answers at once with an incremental message in the new
  generation. Sharing (offers and pick-ups) is disabled from the rebalance until the epoch of that
  generation is in the CIM. The leader waits for every member's answer, or a bounded time, asks
  its shell for a plan (``protocol/planner.py``), and writes the epoch message: members, and in its
  own share section the ownerless partitions it offers. An epoch message whose append fails is
  sent again with the same plan while the generation lasts (without its epoch nobody shares, and
  a task that joined in it never reads). A member restarted under its id (a fresh life: the group
  says so) that has not answered when the leader plans, or that has while survivors are members,
  is *reset*: the plan deals out what the CIM credits to it, and the task drops what it adopted
  when it reads the epoch (``_reset_members``, ``_on_epoch``).

Incremental messages
  A task writes only its own state, as the difference between what it has and what its earlier
  messages told the CIM. Ownership changes go out at once; watermark advances are coalesced for
  ``publish_interval``. Group commit: while one of its messages is on its way (appended, not yet
  read back) a task holds further changes, up to ``coalesce_wait``, and sends them as one message
  once it is read back, so a hand-off of n partitions costs a few messages, not n. What is on
  its way is tracked by state timestamp, so a copy read twice (a re-delivery, a producer's
  retry) is not mistaken for a later message read back. When the CIM ignores one of its
  messages (fenced by a newer epoch), or when all its messages are read back and the CIM's view
  of it still differs from what it has, the task re-sends the difference against what the CIM
  really holds. A failed append is sent again the same way; while appends fail and nothing of
  its own is on its way, a task sends a message even with nothing new in it, since appends
  failing for ``sync_timeout`` stop its readers until one of its messages is read back.

Sharing and hand-off (``protocol/share.py``, ``protocol/handoff.py``)
  A ``new`` offer addressed to the task is picked up into its own state. A ``move`` offer is
  answered with ``incoming`` (the target is ready); the offerer then stops its reader and releases
  the partition with its final committed watermark; the target reads from exactly there. The
  offerer drops an offer once the target owns it; it never re-owns a ``new`` offer nobody picked
  up. Offers to tasks that left are re-planned by the leader when they were in the CIM it planned
  from, otherwise re-targeted by their holder.

Partitions (``protocol/lifecycle.py``)
  At most ``cap`` partitions are read at once. A partition is read only when every parent has
  finished. When a reader finishes, the children it registers go to the most underloaded member.
  Finished partitions are removed once nothing refers to them.

Poison partitions (docs/design.md#poison-partitions)
  A partition whose reader fails ``quarantine_after`` times in a row without its committed
  position moving, while another partition of this task advanced between the last two failures
  (so the source and the sink work: a failure of everything is an outage, retried, not poison),
  is *quarantined*: its reader is stopped and the partition stays in this task's state, owned,
  with a ``quarantine`` (the error, the failing record, the watermark it is parked at). Nobody
  reads a quarantined partition: the field travels with it through hand-offs, offers and plans,
  so whoever owns it next keeps it parked. A ``release`` message naming it (CIM rule 9) is
  applied by its owner: the quarantine is cleared and the partition read from its watermark.

MUTABLE_KEY_RANGE partitions (``protocol/mutable.py``, rules 5-7; ``TaskConfig.mutable``)
  A partition start a reader reports registers the tokens nobody knows, dealt like children. A
  reader that stopped at a move-in it may not pass leaves its partition held
  (``Partition.hold``): not read (and not counted against the cap) until every source the hold
  names has finished or committed past the event, as this task's state and the CIM show. A
  finished partition is removed only once every unfinished one resumes past its end.

Snapshot partitions (``protocol/snapshot.py``)
  With ``snapshot`` the leader that starts the stream asks for the snapshot's partitions too
  (``RequestPlan.snapshot``); its epoch records them. They are partitions like any other here;
  a finished one is removed only once the CIM records it done, and one the CIM records done is
  finished for every rule.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator
from random import Random

import msgspec

from protocol import lifecycle, mutable, share
from protocol import snapshot as snapshots
from protocol.cim import Cim, TaskView
from protocol.events import (
    Alert,
    Drain,
    Ids,
    Joined,
    Lease,
    Lost,
    PartitionsAnnounced,
    PlanReady,
    Publish,
    PublishFailed,
    ReaderCommitted,
    ReaderFailed,
    ReaderFinished,
    ReadersCommitted,
    ReaderStopped,
    RequestPlan,
    StartReader,
    StopReader,
    StopReason,
    SyncBad,
    SyncRead,
    TaskCommand,
    TaskEvent,
    TaskTick,
    own_state_ts,
)
from protocol.handoff import Move
from protocol.messages import (
    EpochMessage,
    Partition,
    Quarantine,
    Share,
    StateMessage,
    TaskState,
)
from protocol.planner import Plan

__all__ = [
    "Alert",
    "Drain",
    "Joined",
    "Lease",
    "Lost",
    "PartitionsAnnounced",
    "PlanReady",
    "Publish",
    "PublishFailed",
    "Readable",
    "ReaderCommitted",
    "ReaderFailed",
    "ReaderFinished",
    "ReaderStopped",
    "ReadersCommitted",
    "RequestPlan",
    "Rules",
    "StartReader",
    "StopReader",
    "StopReason",
    "SyncBad",
    "SyncRead",
    "TaskCommand",
    "TaskConfig",
    "TaskCore",
    "TaskEvent",
    "TaskTick",
    "own_state_ts",
]

Readable = Callable[[Partition, lifecycle.Lookup], bool]


class Rules(msgspec.Struct, frozen=True):
    """The protocol rules that the simulator's teeth tests swap for broken ones."""

    fence_epochs: bool = True
    readable: Readable = lifecycle.readable
    # A 'new' offer for a partition a member of the epoch already owns is not picked up. Defence
    # in depth: it makes a planner that deals out survivors' partitions harmless, so the teeth
    # test of such a planner turns it off to show the simulator still catches the planner.
    refuse_owned_offers: bool = True
    # A task restarted under its old id takes over what the CIM credits to it (``_adopt``);
    # the teeth test turns it off to show that orphans the partitions.
    adopt_own_state: bool = True
    # A leader whose epoch append failed sends it again (``_resend_epoch``); the teeth test turns
    # it off to show that leaves a generation without its epoch.
    resend_failed_epoch: bool = True
    # A leader plans only under a valid lease and once its own answer is in its CIM
    # (``_may_plan``); the teeth test turns it off: a leader back from a pause past its lease
    # plans its old generation from a CIM that has read nothing since.
    lead_under_lease: bool = True
    # A plan's offers reach the CIM only in its epoch message and are withdrawn when another
    # epoch fences it (``_settle_plan``); the teeth test turns it off: a fenced plan's offers
    # are published in a later generation.
    plan_offers_in_epoch_only: bool = True
    # A partition handed over through the share section leaves this task's state in the same
    # message as the offer carrying it, and a finished partition's end goes out with the offers
    # of its children (``_diff``); the teeth tests turn it off: a leader whose share section
    # waits for its epoch sends the removal (or the end) alone, dies, and the partition (or the
    # child) is lost.
    release_with_offer: bool = True
    # An epoch keeps a dropped task's answer to a later generation (Cim rule 5); the teeth test
    # turns it off: that generation's leader, whose answer it was, never plans.
    keep_later_answers: bool = True
    # Of several offers of one partition that hand it to whoever takes them ('new' offers and
    # released moves) only the newest is picked up (``_follow_offers``); the teeth test turns it
    # off: an old offer and its re-plan are both picked up.
    newest_offer_only: bool = True
    # Only a member whose every group member is a fresh life (never assigned a generation) is
    # reset when it has not answered by the plan (``_reset_members``); the teeth test resets
    # every member that has not answered: a survivor still reading under its lease loses its
    # partitions to another reader.
    reset_only_fresh: bool = True
    # A rejoined task that is no fresh life reads what the CIM credits to it once its answer is
    # read back (``_resumed_on_answer``), before its generation's epoch lands; its safety rests
    # on CIM rule 2a (``fence_superseded_epochs``: an epoch older than an applied answer's
    # generation is ignored). The teeth test turns the fence off: an epoch planned while the
    # task was away lands after its answer and hands its partitions to a second reader.
    resume_on_answer: bool = True
    fence_superseded_epochs: bool = True
    # A fresh member is reset even when it has answered, as long as members that are no fresh
    # lives are there to take its partitions (``_reset_members``): a task in a crash loop no
    # longer keeps its partitions unread through every recovery. Off: it keeps what it adopted
    # once it answered (the histories the regression seeds were found in).
    reset_answered_fresh: bool = True
    # ... and so is a fresh leader beside survivors: its plan deals out its own partitions
    # (``_leader_yields``; on Kafka a restarted process joins a rebalance first, so it leads).
    # Off (the teeth test): a leader in a crash loop keeps its partitions unread through each
    # of its lives (bench chaos --seed 3, 28.5 s unread).
    reset_fresh_leader: bool = True
    # A finished snapshot partition leaves its owner's state only once the CIM records it done
    # (protocol/snapshot.py, rule 4); the teeth test removes it at once: the log never learns it
    # was read, and the snapshot never completes.
    snapshot_done_before_removal: bool = True
    # A quarantined partition is read by nobody (``_reconcile_readers``); the teeth test reads
    # it anyway: the simulator sees a quarantined partition read.
    park_quarantined: bool = True
    # MUTABLE_KEY_RANGE: a held partition is read only once its move-in hold is released
    # (protocol/mutable.py, rule 5); the teeth test reads it at once, passing the event
    move_in_holds: bool = True
    # MUTABLE_KEY_RANGE: a partition registered from a partition start is a claim, read only
    # once the CIM credits it; of several claims of one token the first to land wins
    # (protocol/mutable.py, rule 8). The teeth test registers it as owned at once: two tasks
    # whose partitions both announce it read it twice.
    claim_announced: bool = True


ANSWER_TIMEOUT = 2_000_000  # TaskConfig.answer_timeout's default (micros); see there


class TaskConfig(msgspec.Struct, frozen=True):
    task_id: str
    cap: int = 100  # partitions read at once; 0: no cap
    # leader's bounded wait for rebalance answers (micros). A dead task's partitions stay
    # unread while it lasts; a leader that plans before its followers' answers (the embedded
    # broker answers followers' joins up to seconds after the leader's) plans from less of
    # the group's word. The fault simulator sweeps the default with followers lagging up to
    # 2 s. See docs/design.md#epochs.
    answer_timeout: int = ANSWER_TIMEOUT
    publish_interval: int = 250_000  # coalescing of watermark-only changes
    # group commit: hold changes while an own message is unread, at most this long (0: off)
    coalesce_wait: int = 100_000
    negotiate_interval: int = 200_000  # how often balancing offers are considered
    checkpoint_interval: int = 10_000_000  # leader's full-state checkpoints
    # zombie safety: appends to the sync topic failing for this long stop the task's readers
    # (its partitions may be handed out meanwhile) until one of its messages is read back
    sync_timeout: int = 3_000_000
    rules: Rules = Rules()
    # a partition query that sends nothing (not even a heartbeat) for this long is restarted
    # from its committed position (the reader core's stall rule); micros
    stall_timeout: int = 30_000_000
    # a connector that first starts reads a snapshot of its tables at its stream start first
    # (protocol/snapshot.py); decided by the leader that starts the stream
    snapshot: bool = False
    # the quarantine rule: a partition whose reader fails this many times in a row without its
    # committed position moving (while another partition of the task advanced) is parked; 0: off
    quarantine_after: int = 5
    # a restarted member (reset, or a yielding leader: its earlier life died holding
    # partitions) is given no partition by balancing, children or orphans for this long after
    # the epoch that dealt out what it held (micros; 0: off). A crash-looping task would
    # otherwise get them back at once and die again before reading them, through every life.
    # It exceeds the time a new owner takes to start reading (a change-stream query's setup),
    # so each hop of a partition includes a read.
    probation: int = 10_000_000
    # the stream is a MUTABLE_KEY_RANGE one: partition starts, move-in holds and the removal of
    # finished partitions follow protocol/mutable.py (rules 5-7)
    mutable: bool = False


class _Failing(msgspec.Struct):
    """A partition's failures in a row (the quarantine rule): how many, the task's count of
    committed-position moves at the last one, and the last error and record."""

    count: int = 0
    advances: int = 0
    error: str = ""
    record: str = ""


class TaskCore:
    """The whole protocol for one task. Call :meth:`handle` with an event and ``now`` (micros);
    carry out the commands it returns, in order."""

    def __init__(self, config: TaskConfig, rng: Random | None = None) -> None:
        self.config = config
        self.me = config.task_id
        self.rng = rng or Random(0)
        self.cim = Cim(
            fence_epochs=config.rules.fence_epochs,
            keep_later_answers=config.rules.keep_later_answers,
            fence_superseded_epochs=config.rules.fence_superseded_epochs,
            mutable=config.mutable,
        )
        self.mine: dict[str, Partition] = {}
        self.shares: dict[str, Share] = {}
        self.moves: dict[str, Move] = {}
        self._sent_parts: dict[str, Partition] = {}
        self._sent_share: dict[str, Share] = {}
        self.generation = -1
        self.leader = ""
        self.members: tuple[str, ...] = ()
        self.fresh: tuple[str, ...] = ()  # members of this generation that are fresh lives
        self.member = False
        self.continuous_since = -1
        self._answered = -1  # the newest generation whose answer of ours the CIM applied
        self.lease_until = 0
        self.reading: dict[str, int] = {}  # token -> start ts of the running reader
        self.stopping: set[str] = set()
        self.releasing: set[str] = set()
        self.retired: set[str] = set()  # finished partitions this task removed
        self.consumed: set[tuple[str, str, int]] = set()  # offers picked up: (holder, token, since)
        self._now = 0
        self._plan_deadline = -1
        self._plan_requested = -1
        # the plan of this task's epoch message on its way, and that message's state timestamp:
        # an append that fails is sent again (the epoch must land, or nobody shares and a task
        # that joined in this generation never reads)
        self._epoch_out: tuple[Plan, int] | None = None
        # the newest plan whose epoch has not landed yet, with this task's share entries of its
        # tokens and the claims it replaced from before it: its offers reach the CIM only in
        # that epoch, and are withdrawn if another epoch fences it (see _settle_plan)
        self._plan_out: tuple[Plan, dict[str, Share | None], dict[str, Partition]] | None = None
        self._urgent = False
        self._answer = False
        self._last_publish = -(10**18)
        self._last_negotiate = -(10**18)
        self._last_checkpoint = -(10**18)
        self._last_state_ts = -1
        # state timestamps of own messages published and not read back yet (exact: a duplicate
        # delivery or a producer's retry copy is not a second read-back)
        self._unread: set[int] = set()
        self._adopted = False  # the previous life's state taken over (at the first join)
        self.draining = False
        self._sync_failing_since = -1  # first failed append not followed by a read-back
        self.counters: Counter[str] = Counter()
        self.log: deque[tuple[int, str]] = deque(maxlen=256)
        self._alerts: list[Alert] = []
        self._double_owners: set[tuple[str, str, int]] = set()  # (token, other task, epoch)
        # partitions registered here from partition starts, not yet credited (mutable, rule 8)
        self._claims: set[str] = set()
        self._unsettled = False  # the last step changed the offers: see next_deadline
        # the quarantine rule: partitions failing in a row, and how often any partition's
        # committed position moved (another partition advancing tells poison from an outage)
        self._failing: dict[str, _Failing] = {}
        self._advances = 0
        # restarted members on probation: member -> until (see TaskConfig.probation)
        self._probation: dict[str, int] = {}

    # -- the entry point ------------------------------------------------------------------
    def handle(self, event: TaskEvent, now: int) -> list[TaskCommand]:
        self.log.append((now, type(event).__name__))
        self._now = now
        out: list[TaskCommand] = []
        match event:
            case SyncRead():
                self._on_sync(event, now)
            case SyncBad():
                self.counters[f"sync_bad.{event.reason}"] += 1
            case Joined():
                self._on_joined(event, now)
            case Lost():
                self.counters["membership_lost"] += 1
                self.member = False
            case Lease():
                self.lease_until = max(self.lease_until, event.until)
            case TaskTick():
                pass
            case ReaderCommitted():
                self._on_committed(event.token, event.watermark, event.tail)
            case ReadersCommitted():
                tails = dict(event.tails)
                for token, watermark in event.watermarks:
                    self._on_committed(token, watermark, tails.get(token, ()))
            case ReaderFinished():
                self._on_finished(event)
            case ReaderStopped():
                self._on_stopped(event)
            case ReaderFailed():
                self._on_failed(event, now)
            case PartitionsAnnounced():
                self._on_announced(event)
            case PlanReady():
                out += self._on_plan(event.plan, now)
            case PublishFailed():
                self.counters["publish_failed"] += 1
                self._unread.discard(event.state_ts)  # it will not be read back
                if self._sync_failing_since < 0:
                    self._sync_failing_since = now
                self._resync()
                out += self._resend_epoch(event.state_ts, now)
            case Drain():
                self.draining = True
                self._urgent = True
        out += self._step(now)
        if self._alerts:
            out[:0] = self._alerts
            self._alerts.clear()
        return out

    # -- permissions ------------------------------------------------------------------------
    def lease_valid(self, now: int) -> bool:
        """The lease rule (docs/design.md#membership-and-leases): a member whose lease has not
        run out. The readers ask it before every batch they hand the sink (a zombie that wakes
        up after its lease ran out stops before anything reaches the sink)."""
        return self.member and now < self.lease_until

    def may_read(self, now: int) -> bool:
        return (
            not self.draining
            and (
                self._sync_failing_since < 0
                or now - self._sync_failing_since < self.config.sync_timeout
            )
            and self.lease_valid(now)
            and (self.cim.epoch >= self.continuous_since or self._resumed_on_answer())
            and self.me in self.cim.members
        )

    def _resumed_on_answer(self) -> bool:
        """A rejoined member reads before its generation's epoch lands
        (docs/design.md#membership-and-leases): its answer in this unbroken membership was
        applied while the CIM's epoch listed it, and it is no fresh life in this generation (a
        fresh one may be reset by the plan). Only what the CIM credits to it is read then
        (:meth:`_reconcile_readers`)."""
        return (
            self.config.rules.resume_on_answer
            and self.continuous_since >= 0
            and self._answered >= self.continuous_since
            and self.me not in self.fresh
        )

    def sharing_enabled(self, now: int) -> bool:
        """Sharing (offers, pick-ups, hand-offs) waits for this generation's epoch; and while the
        CIM holds a newer epoch than this task's generation (its assignment is late: the leader
        planned before it answered) whatever it writes is fenced, so a pick-up would be lost."""
        return self.may_read(now) and self.cim.epoch == self.generation

    # -- timers -------------------------------------------------------------------------------
    def next_deadline(self) -> int | None:
        """The earliest ``now`` at which ``handle(TaskTick(), now)`` has something to do, or
        ``None`` while only an event can give this task work (aioquic's ``get_timer()``).

        A tick before it returns no commands and changes nothing but the log of inputs and the
        pacing mark of a negotiation round that would find nothing to do (such a round only
        gates the next one: skipping it keeps rounds at most ``negotiate_interval`` apart). The
        shell sleeps until then or until the next event, whichever comes first; every event
        can move it, so it is asked again after each. The time-driven rules of :meth:`_step`:

        * the leader's bounded wait for rebalance answers (``answer_timeout``);
        * the leader's periodic checkpoint (``checkpoint_interval``);
        * publishing: a message held by group commit (``coalesce_wait``), or watermark-only
          changes coalesced for ``publish_interval``;
        * a negotiation round (``negotiate_interval``), only when one would offer something;
        * the end of the permission to read, when readers run: the lease runs out, or appends
          have failed for ``sync_timeout``.

        (A failed epoch append is re-sent on its ``PublishFailed``, not on a timer.) When the
        last step changed this task's offers, following them may take another pass (a move
        aborted and re-offered to its planned target, which may have left too): due at once.
        """
        now = self._now
        if self._unsettled:
            return now
        due = [
            d
            for d in (
                self._plan_due(),
                self._checkpoint_due(),
                self._publish_due(),
                self._permission_ends(now),
                self._probation_ends(now),
            )
            if d is not None
        ]
        first = min(due, default=None)
        # the negotiation's dry run costs O(partitions of the group): only when it could be first
        if first is None or self._last_negotiate + self.config.negotiate_interval < first:
            negotiate = self._negotiate_due(now)
            if negotiate is not None and (first is None or negotiate < first):
                first = negotiate
        return None if first is None else max(first, now)

    def _leads(self) -> bool:
        return self.member and self.leader == self.me

    def _probation_ends(self, now: int) -> int | None:
        """The next end of a member's probation: balancing may give it partitions from then."""
        return min((u for u in self._probation.values() if u > now), default=None)

    def on_probation(self, member: str) -> bool:
        """A restarted member within ``TaskConfig.probation`` of the epoch that dealt out what
        its earlier life held: no partition is placed on it (balancing, children, orphans)."""
        return member != self.me and self._probation.get(member, -1) > self._now

    def _plan_due(self) -> int | None:
        gen = self.generation
        if (
            self._leads()
            and self._plan_deadline >= 0
            and self._plan_requested < gen
            and self._epoch_open(gen)
            and self._may_plan(max(self._plan_deadline, self._now))
        ):
            return self._plan_deadline  # (all answers in: requested at the event that brought it)
        return None

    def _epoch_open(self, generation: int) -> bool:
        """An epoch of ``generation`` can still land: the CIM holds none that new, and no
        message of a later generation fences it (CIM rule 2a)."""
        return self.cim.epoch < generation and not self.cim.superseded(generation)

    def _may_plan(self, now: int) -> bool:
        """The leader plans and opens its generation's epoch only (a) while its lease holds: once
        it has run out, the coordinator may have removed it and completed a newer generation, and
        a process paused that long has read nothing meanwhile; and (b) once its own answer in this
        generation is in its CIM, so that the CIM it plans from has read the log at least up to
        when it joined (a process back from a pause may have a timer due before it has read
        anything). Both become true again only through events (a lease, a message read)."""
        if not self.config.rules.lead_under_lease:
            return True
        return self.lease_valid(now) and self.cim.view(self.me).epoch_seen >= self.generation

    def _checkpoint_due(self) -> int | None:
        if self._leads() and self.cim.epoch == self.generation and self.cim.leader == self.me:
            return self._last_checkpoint + self.config.checkpoint_interval
        return None

    def _publish_due(self) -> int | None:
        """When :meth:`_maybe_publish` gets past its holds, if it then publishes or clears a
        flag (an urgent change with nothing new to say still clears ``_urgent``)."""
        if not self.member or self.generation < 0:
            return None
        probe = self._sync_failing_since >= 0 and not self._unread
        flagged = self._urgent or self._answer or probe
        if not (flagged or self.mine != self._sent_parts or self._shares_to_send()):
            return None
        at = -(10**18)
        if not (flagged or self.draining):
            at = self._last_publish + self.config.publish_interval
        if self._unread:
            at = max(at, self._last_publish + self.config.coalesce_wait)
        return at

    def _negotiate_due(self, now: int) -> int | None:
        at = max(self._last_negotiate + self.config.negotiate_interval, now)
        if self.sharing_enabled(at) and any(self._negotiation()):
            return at
        return None

    def _permission_ends(self, now: int) -> int | None:
        """When :meth:`may_read` turns false (it never turns true with time alone), if readers
        run then (they are stopped; with none running, losing the permission changes nothing
        a tick would see: sharing only does less)."""
        if all(t in self.stopping for t in self.reading) or not self.may_read(now):
            return None
        ends = self.lease_until
        if self._sync_failing_since >= 0:
            ends = min(ends, self._sync_failing_since + self.config.sync_timeout)
        return ends

    # -- event handlers ---------------------------------------------------------------------
    def _on_sync(self, event: SyncRead, now: int) -> None:
        message = event.message
        before_epoch = self.cim.epoch
        ignored = self.cim.apply(event.offset, message)
        self._settle_plan()
        if self._claims:
            self._settle_claims()
        if message.task_id == self.me:
            self._sync_failing_since = -1  # an append of ours went through and was read back
            if (
                ignored is None
                and isinstance(message, StateMessage)
                and self.member
                and message.epoch == self.generation
            ):
                self._answered = message.epoch  # (applied: the CIM's epoch lists this task)
        own = message.task_id == self.me and isinstance(message, StateMessage | EpochMessage)
        awaited = False
        if own:
            state_ts = own_state_ts(message)
            awaited = state_ts in self._unread
            self._unread.discard(state_ts)
            if self._epoch_out is not None and self._epoch_out[1] == state_ts:
                self._epoch_out = None  # the epoch message landed
            # a previous life (maybe on a clock that ran ahead) wrote later timestamps: ours
            # must be newer or the CIM ignores them as older state
            self._last_state_ts = max(self._last_state_ts, state_ts)
        if ignored is not None:
            self.counters[f"sync_ignored.{ignored}"] += 1
            if awaited:
                # one of our messages was fenced (not a re-delivered or retried copy of one
                # already read back: resending on those fed a storm of copies)
                self._resync()
            opened = isinstance(message, EpochMessage) and self.cim.epoch != before_epoch
            if not opened:
                return  # (an epoch message whose foreign part was dropped still opens its epoch)
        if own and not self._unread:
            view = self.cim.view(self.me)
            if view.partitions != self._sent_parts or view.share != self._sent_share:
                # every message is read back, yet the log holds something other than what
                # they said (e.g. an answer written before an epoch that dropped this task
                # landed after it): re-send the difference against the truth
                self._resync()
        if isinstance(message, EpochMessage) and self.cim.epoch != before_epoch:
            self._on_epoch(now)
        self._settle_double_owners()

    def _settle_double_owners(self) -> None:
        """Two members owning one unfinished partition in the same epoch is never the result of
        the rules (a move goes through ``incoming``; a dead task's partitions are dealt out only
        after the epoch dropped it). Should the log show it anyway (a bug, or a foreign writer
        on the sync topic), both would read it for ever. Each owner decides, at the offset where
        the double ownership first shows, from the same CIM and so consistently: the owner with
        the older published watermark gives the partition up (ties: the greater task id), and
        reading goes on from the newer watermark. Both report it as an error."""
        members = set(self.cim.members)
        if self.me not in members:
            return
        view = self.cim.view(self.me)
        for token, part in view.partitions.items():
            if part.status != "owned" or token not in self.mine:
                continue
            for other, theirs in self.cim.holders(token):
                if other == self.me or other not in members or theirs.status != "owned":
                    continue
                key = (token, other, self.cim.epoch)
                if key in self._double_owners:
                    continue
                self._double_owners.add(key)
                self.counters["double_owner"] += 1
                yields = (part.watermark, other) < (theirs.watermark, self.me)
                self._alerts.append(
                    Alert(
                        "double-owner",
                        f"{token} is owned by {self.me} (watermark {part.watermark}) and "
                        f"{other} (watermark {theirs.watermark}) in epoch {self.cim.epoch}: "
                        + (f"{self.me} gives it up" if yields else f"{other} gives it up"),
                    )
                )
                if yields and token in self.mine:
                    del self.mine[token]
                    self.shares.pop(token, None)
                    self.moves.pop(token, None)
                    self.counters["double_owner_yielded"] += 1
                    self._urgent = True

    def _resync(self) -> None:
        """One of our messages was fenced: diff against what the CIM really holds."""
        self.counters["resync"] += 1
        view = self.cim.view(self.me)
        self._sent_parts = dict(view.partitions)
        self._sent_share = dict(view.share)
        self._urgent = True

    def _on_epoch(self, now: int) -> None:
        if self.me not in self.cim.members:
            if self.mine or self.shares:
                self.counters["evicted"] += 1
            self._drop_claims()
            return
        if self.me in self.cim.reset:
            # restarted under its id (and planned before it answered, or beside survivors): the
            # epoch dealt out what its earlier life held (CIM rule 5d); it has read none of it
            # (it never was a member of an epoch before this one), and it goes on with nothing
            if self.mine or self.shares:
                self.counters["reset"] += 1
            if self.reading:
                self.counters["reset_while_reading"] += 1
                self._alerts.append(
                    Alert("reset-while-reading", f"epoch {self.cim.epoch}: {sorted(self.reading)}")
                )
            self._drop_claims()
        self._probation = {
            m: until for m, until in self._probation.items() if m in self.cim.members
        }
        if self.config.probation > 0:
            for member in self.cim.restarted:
                self._probation[member] = now + self.config.probation
        view = self.cim.view(self.me)
        self._yield_replanned(view)
        for token, offer in self.shares.items():
            seen = view.share.get(token)
            if seen is not None and seen.partition.watermark > offer.partition.watermark:
                self.shares[token] = seen  # the epoch raised it (Cim rule 5b)
        self._sent_parts = dict(view.partitions)
        self._sent_share = dict(view.share)
        self._urgent = True

    def _drop_claims(self) -> None:
        """Forget this task's state: an epoch dropped it (evicted, or reset)."""
        self.mine.clear()
        self.shares.clear()
        self.moves.clear()
        self.releasing.clear()
        self._sent_parts.clear()
        self._sent_share.clear()
        # what it picked up is gone with its state: an offer it answered that still stands
        # (a released move whose offerer waits for it) is to be answered again once an
        # epoch takes it back, or the partition is held by nobody
        self.consumed.clear()

    def _yield_replanned(self, view: TaskView) -> None:
        """Claims this task made that never reached the CIM before the new epoch (a pickup whose
        message was held or fenced) may have been planned elsewhere: the epoch is the truth, so
        a claim another member holds, or the epoch's leader offers, is dropped here."""
        live = set(self.cim.members)
        leader = self.cim.leader
        offered = {
            token
            for token, offer in self.cim.view(leader).share.items()
            if leader != self.me and offer.target != self.me
        }
        for token, part in list(self.mine.items()):
            seen = view.partitions.get(token)
            if part.status == "finished" or (
                seen is not None and (seen.status != "incoming" or part.status == "incoming")
            ):
                continue  # the CIM knows this claim as it stands
            elsewhere = any(
                t != self.me and t in live and p.status != "incoming"
                for t, p in self.cim.holders(token)
            )
            if elsewhere or token in offered:
                del self.mine[token]
                self.shares.pop(token, None)
                self.moves.pop(token, None)
                # the offer it answered may still stand (a move whose offerer still owns the
                # partition): the answer never reached the CIM, so it may be answered again
                self.consumed = {key for key in self.consumed if key[1] != token}
                self.counters["claims_replanned"] += 1

    def _adopt(self) -> None:
        """A task restarted under the same id finds its previous life's state in the CIM: what
        it owned (and finished) and the offers it made are its own again, so nothing the CIM
        credits to it is orphaned. A take-over it had under way is dropped (its offerer sees
        that), and so is a move it was offering that was not released yet."""
        self._adopted = True
        view = self.cim.view(self.me)
        self._last_state_ts = max(self._last_state_ts, view.state_ts)
        for token, part in view.partitions.items():
            if part.status != "incoming":
                self.mine[token] = part
        for token, offer in view.share.items():
            if offer.kind == "move" and not offer.released:
                continue
            self.shares[token] = offer
        self._sent_parts = dict(view.partitions)
        self._sent_share = dict(view.share)
        if self.mine or self.shares:
            self.counters["adopted"] += len(self.mine) + len(self.shares)
            self._urgent = True

    def _on_joined(self, event: Joined, now: int) -> None:
        self.counters["rebalances"] += 1
        if not self._adopted:
            if self.config.rules.adopt_own_state:
                self._adopt()
            self._adopted = True
        if not self.member:
            self.continuous_since = event.generation
        self.member = True
        self.generation = event.generation
        self.leader = event.leader
        self.members = event.members
        self.fresh = event.fresh
        self._answer = True
        if event.leader == self.me:
            self._plan_deadline = now + self.config.answer_timeout
        else:
            self._plan_deadline = -1

    def _on_committed(self, token: str, watermark: int, tail: Ids = ()) -> None:
        part = self.mine.get(token)
        if part is not None and part.status == "owned" and _newer(part, watermark, tail):
            self.mine[token] = mutable.passed(
                msgspec.structs.replace(part, watermark=watermark, tail=tail)
            )
            self._advanced(token)

    def _advanced(self, token: str) -> None:
        """``token``'s committed position moved: its failures are no longer in a row."""
        self._advances += 1
        self._failing.pop(token, None)

    def _on_failed(self, event: ReaderFailed, now: int) -> None:
        """The quarantine rule (see the module docstring): count the failure; park the
        partition at its watermark once it failed ``quarantine_after`` times in a row while
        another partition of this task advanced since the failure before."""
        self.counters["reader_failed"] += 1
        token = event.token
        part = self.mine.get(token)
        after = self.config.quarantine_after
        if event.stalled:
            return  # a silent query, not a failing record (the stall rule restarts it)
        if after <= 0 or part is None or part.status != "owned" or part.quarantine is not None:
            return
        row = self._failing.get(token)
        if row is None:
            row = self._failing[token] = _Failing(advances=self._advances)
        others = self._advances > row.advances
        row.count += 1
        row.advances = self._advances
        row.error = event.error
        row.record = event.record or row.record
        if row.count < after:
            return
        if not others:
            self.counters["quarantine_withheld"] += 1  # nothing else advanced: an outage
            return
        del self._failing[token]
        quarantine = Quarantine(
            since=now,
            failures=row.count,
            error=row.error,
            position=part.watermark,
            record=row.record,
            task=self.me,
        )
        self.mine[token] = msgspec.structs.replace(part, quarantine=quarantine)
        self.counters["quarantined"] += 1
        self._alerts.append(
            Alert(
                "quarantined",
                f"partition {token} parked at its watermark {part.watermark} after "
                f"{row.count} failures in a row: {row.error}; record: {row.record or 'unknown'}",
            )
        )
        self._urgent = True

    def _apply_releases(self) -> None:
        """CIM rule 9: an operator released a quarantine of a partition this task owns: clear
        it (the partition is read again from its watermark; the next message says so)."""
        releases = self.cim.releases
        if not releases:
            return
        for token, part in list(self.mine.items()):
            quarantine = part.quarantine
            if quarantine is not None and releases.get(token, -1) >= quarantine.since:
                self.mine[token] = msgspec.structs.replace(part, quarantine=None)
                self._failing.pop(token, None)
                self.counters["quarantine_released"] += 1
                self._urgent = True

    def quarantined(self) -> list[Partition]:
        """The quarantined partitions this task owns."""
        return [p for p in self.mine.values() if p.quarantine is not None]

    def _on_stopped(self, event: ReaderStopped) -> None:
        self.reading.pop(event.token, None)
        self.stopping.discard(event.token)
        part = self.mine.get(event.token)
        if (
            part is not None
            and part.status == "owned"
            and _newer(part, event.watermark, event.tail)
        ):
            part = self.mine[event.token] = mutable.passed(
                msgspec.structs.replace(part, watermark=event.watermark, tail=event.tail)
            )
            self._advanced(event.token)
        if event.hold is not None and part is not None and part.status == "owned":
            # rule 5: stopped at a move-in it may not pass: held until its sources reach it
            part = self.mine[event.token] = msgspec.structs.replace(part, hold=event.hold)
            self.counters["move_in_holds"] += 1
            self._urgent = True
        if event.token in self.releasing and part is not None:
            self._release(event.token)

    def _on_finished(self, event: ReaderFinished) -> None:
        self.reading.pop(event.token, None)
        self.stopping.discard(event.token)
        self.releasing.discard(event.token)
        part = self.mine.get(event.token)
        if part is None or part.status != "owned":
            self.counters["finished_not_owned"] += 1
            return
        self.counters["partitions_finished"] += 1
        self.mine[event.token] = msgspec.structs.replace(
            part,
            status="finished",
            watermark=max(part.watermark, event.watermark),
            tail=event.tail if _newer(part, event.watermark, event.tail) else part.tail,
            children=tuple(c.token for c in event.children),
        )
        self.shares.pop(event.token, None)  # a finished partition does not move
        self.moves.pop(event.token, None)
        loads = self._placing_loads()
        for child in event.children:
            if not lifecycle.registers(event.token, child) or self._known(child.token):
                continue
            new = lifecycle.child_partition(child, event.child_start)
            target = share.place_child(self.me, loads, self.config.cap)
            if target == self.me:
                self.mine[child.token] = new
            else:
                self.shares[child.token] = Share(new, target=target, kind="new", since=self._now)
            if target is not None:
                loads[target] = loads.get(target, 0) + 1
            self.counters["children_registered"] += 1
        self._urgent = True

    def _on_announced(self, event: PartitionsAnnounced) -> None:
        """Rule 6 of ``protocol/mutable.py``: register the announced partitions nobody knows,
        dealt like children (kept here while this task's share section waits for its plan's
        epoch: the announcer's watermark must not reach the CIM without them)."""
        part = self.mine.get(event.token)
        if not self.config.mutable or part is None or part.status != "owned":
            self.counters["announced_ignored"] += 1
            return
        loads = self._loads()
        claim = self.config.rules.claim_announced
        for token in event.tokens:
            if self._known(token):
                continue
            new = Partition(token=token, start_ts=event.start_ts, claim=claim)
            target = share.place_child(self.me, loads, self.config.cap)
            if target != self.me and self._plan_out is not None:
                target = self.me
            if target == self.me:
                self.mine[token] = new
            else:
                self.shares[token] = Share(new, target=target, kind="new", since=self._now)
            if claim:
                self._claims.add(token)
            if target is not None:
                loads[target] = loads.get(target, 0) + 1
            self.counters["partitions_announced"] += 1
            self._urgent = True

    def _settle_claims(self) -> None:
        """Rule 8 of ``protocol/mutable.py``: a claim the CIM credits to this task (in its
        state or its share section) is confirmed and read; one the CIM holds elsewhere was won
        by another registration, which landed first: it is given up. Neither was read, so
        nothing is read twice; a claim whose message has not landed (or was fenced) waits."""
        view = self.cim.view(self.me)
        for token in list(self._claims):
            part = self.mine.get(token)
            offer = self.shares.get(token)
            if (part is None or not part.claim) and (offer is None or not offer.partition.claim):
                self._claims.discard(token)  # it left this task's hands meanwhile
                continue
            credited = view.partitions.get(token)
            shared = view.share.get(token)
            if credited is not None or shared is not None:
                self._claims.discard(token)
                if part is not None and part.claim and credited is not None:
                    self.mine[token] = msgspec.structs.replace(part, claim=False)
                    self._sent_parts[token] = credited
                if offer is not None and offer.partition.claim and shared is not None:
                    confirmed = msgspec.structs.replace(offer.partition, claim=False)
                    self.shares[token] = msgspec.structs.replace(offer, partition=confirmed)
                    self._sent_share[token] = shared
                self.counters["announced_claims_won"] += 1
                self._urgent = True
            elif self.cim.known_elsewhere(token, self.me):
                self._claims.discard(token)
                if part is not None and part.claim:
                    del self.mine[token]
                    self._sent_parts.pop(token, None)
                if offer is not None and offer.partition.claim:
                    del self.shares[token]
                    self._sent_share.pop(token, None)
                self.counters["announced_claims_lost"] += 1

    def _unfinished(self) -> Iterator[Partition]:
        """Every unfinished partition this task knows of: its own, its offers, the CIM's
        (owned, taken over, offered, orphaned)."""
        yield from (p for p in self.mine.values() if p.status != "finished")
        yield from (o.partition for o in self.shares.values())
        yield from self.cim.unfinished()

    def _on_plan(self, plan: Plan, now: int) -> list[TaskCommand]:
        stale = not self._epoch_open(plan.generation) and self.config.rules.lead_under_lease
        if plan.generation != self.generation or self.leader != self.me or not self.member or stale:
            # (stale: an epoch that new landed while the plan was being made: it fences this one)
            self.counters["plan_discarded"] += 1
            return []
        if not self._may_plan(now):
            # the lease ran out while the plan was being made: ask again once it holds
            self.counters["plan_discarded"] += 1
            self._plan_requested = -1
            return []
        # a plan of an earlier generation whose epoch has not landed yet is superseded by this
        # one (made from a newer CIM): what it offered and this one does not is withdrawn
        before, replaced = self._withdraw_plan({o.token for o in plan.offers})
        live = set(plan.members)
        for offer in plan.offers:
            held = self.mine.get(offer.token)
            if held is not None and held.status == "finished":
                continue  # finished here after the snapshot the plan came from
            if held is not None:
                # claimed here after that snapshot (not yet in the CIM), or given up by a
                # yielding leader (``_leader_yields``): the plan wins
                replaced.setdefault(offer.token, held)
                del self.mine[offer.token]
                yielded = offer.token in plan.yielded
                self.counters["yielded" if yielded else "claims_replanned"] += 1
            before.setdefault(offer.token, self.shares.get(offer.token))
            self.shares[offer.token] = offer
        if self.config.rules.plan_offers_in_epoch_only:
            self._plan_out = (plan, before, replaced)
        planned = {o.token for o in plan.offers}
        for token, offer in list(self.shares.items()):
            dead_target = offer.target is not None and offer.target not in live
            if offer.kind == "new" and dead_target and token not in planned:
                self._retarget(token, plan.members)  # made after the CIM the plan came from
        for part in plan.adopt:
            self.mine.setdefault(part.token, part)
        self.counters["epochs_opened"] += 1
        return [self._publish_epoch(plan, now)]

    def _settle_plan(self) -> None:
        """A plan's offers reach the CIM only in its epoch message (where rule 5b of the CIM
        raises their watermarks and the epoch fences what came before). Once the CIM holds an
        epoch at least as new as the plan's generation (or a message of a later one: rule 2a),
        that epoch message either landed (the offers are in the CIM: nothing to do) or never
        will (an epoch that new, or that message, fences it): the plan's offers are then
        withdrawn, never published in a later message of another generation, where they would
        deal out partitions from a CIM long gone (a root read to its end and removed, dealt out
        again from its start)."""
        if self._plan_out is None:
            return
        plan = self._plan_out[0]
        if self._epoch_open(plan.generation):
            return
        landed = (
            self.cim.epoch == plan.generation
            and self.cim.leader == self.me
            and self.cim.sync_epoch == plan.sync_epoch
        )
        if landed:
            self._plan_out = None
        else:
            self.counters["plan_fenced"] += 1
            self._withdraw_plan(set())

    def _withdraw_plan(
        self, keep: set[str]
    ) -> tuple[dict[str, Share | None], dict[str, Partition]]:
        """Withdraw the offers of the plan whose epoch has not landed (but those in ``keep``,
        which a newer plan deals out again): each of its tokens gets back the share entry and
        the claim this task had before the plan. An entry the CIM holds as it stands is kept.
        Returns what the kept tokens had before the plan."""
        if self._plan_out is None:
            return {}, {}
        plan, before, replaced = self._plan_out
        self._plan_out = None
        held = self.cim.view(self.me).share
        for offer in plan.offers:
            token = offer.token
            if token in keep or token not in before:
                continue
            current = self.shares.get(token)
            if current is not None and held.get(token) == current:
                continue  # the CIM holds this entry: not the plan's
            previous = before[token]
            if previous is None:
                self.shares.pop(token, None)
                self.moves.pop(token, None)
            else:
                self.shares[token] = previous
            claim = replaced.get(token)
            if claim is not None and token not in self.mine:
                self.mine[token] = claim
            self.counters["plan_offers_withdrawn"] += 1
            self._urgent = True
        kept = {t: before[t] for t in keep if t in before}
        return kept, {t: replaced[t] for t in keep if t in replaced}

    def _publish_epoch(self, plan: Plan, now: int) -> Publish:
        state = self._diff(now, force=True, epoch=True)
        assert state is not None
        self._mark_sent(state)
        self._unread.add(state.state_timestamp)
        self._epoch_out = (plan, state.state_timestamp)
        return Publish(
            EpochMessage(
                task_id=self.me,
                message_timestamp=now,
                epoch=plan.generation,
                sync_epoch=plan.sync_epoch,
                members=plan.members,
                connector_state=(state,),
                stream_start=plan.stream_start,
                reset=plan.reset,
                snapshot=plan.snapshot,
                yielded=bool(plan.yielded),
            )
        )

    def _resend_epoch(self, failed_ts: int, now: int) -> list[TaskCommand]:
        """The append of this task's epoch message failed: send it again, with the same plan
        (its offers are in this task's share section already) and this task's state as the CIM
        does not hold it yet. Not once a newer generation began or the epoch is in the CIM (a
        late copy of the first append is then ignored as a stale epoch)."""
        if (
            self._epoch_out is None
            or self._epoch_out[1] != failed_ts
            or not self.config.rules.resend_failed_epoch
        ):
            return []
        plan = self._epoch_out[0]
        self._epoch_out = None
        if (
            plan.generation != self.generation
            or self.leader != self.me
            or not self.member
            or not self._epoch_open(plan.generation)
        ):
            return []
        self.counters["epoch_resent"] += 1
        return [self._publish_epoch(plan, now)]

    # -- the step after every event -----------------------------------------------------------
    def _step(self, now: int) -> list[TaskCommand]:
        out: list[TaskCommand] = []
        out += self._leader_duties(now)
        offers = dict(self.shares)
        self._follow_offers(now)
        self._take_orphans(now)
        self._negotiate(now)
        self._unsettled = self.shares != offers
        self._remove_finished()
        self._apply_releases()
        out += self._reconcile_readers(now)
        message = self._maybe_publish(now)
        if message is not None:
            out.append(Publish(message))
        return out

    def _leader_duties(self, now: int) -> list[TaskCommand]:
        if not self.member or self.leader != self.me:
            return []
        out: list[TaskCommand] = []
        gen = self.generation
        if (
            self._plan_deadline >= 0
            and self._plan_requested < gen
            and self._epoch_open(gen)
            and self._may_plan(now)
        ):
            answered = all(self.cim.view(m).epoch_seen >= gen for m in self.members)
            if answered or now >= self._plan_deadline:
                if not answered:
                    self.counters["plan_without_all_answers"] += 1
                self._plan_requested = gen
                need_roots = self.cim.stream_start < 0
                out.append(
                    RequestPlan(
                        gen,
                        self.members,
                        need_roots=need_roots,
                        reset=self._reset_members(gen),
                        snapshot=need_roots and self.config.snapshot,
                        leader_yields=self._leader_yields(),
                    )
                )
        if (
            self.cim.epoch == gen
            and self.cim.leader == self.me
            and now - self._last_checkpoint >= self.config.checkpoint_interval
        ):
            self._last_checkpoint = now
            out.append(Publish(self.cim.checkpoint(self.me, now)))
        return out

    def _reset_members(self, gen: int) -> tuple[str, ...]:
        """The members whose state the epoch of ``gen`` drops (CIM rule 5d): a task restarted
        under its id that has not answered ``gen`` when the leader plans keeps its partitions
        unread until it has (its new life may still be replaying the log, or its join is held
        by the coordinator). Only a *fresh* member qualifies: every group member with its task
        id is a life that was never assigned a generation (it says so when it joins), so it has
        read nothing, and the life that held the partitions is no member of this generation,
        its lease bounded as a dead task's.

        A fresh member that answered is reset too when members that are no fresh lives (the
        survivors) are there to take its partitions (``Rules.reset_answered_fresh``): its
        earlier life died without handing them over, and a task that dies again soon after
        (a crash loop) would otherwise hold them unread through every recovery. The
        survivors read them from the next epoch; balancing hands some back to it later. When
        every member is fresh (the whole group restarted), each keeps what it adopted."""
        rules = self.config.rules
        candidates = self.fresh if rules.reset_only_fresh else self.members
        survivors = rules.reset_answered_fresh and any(m not in self.fresh for m in self.members)
        out = []
        for member in candidates:
            view = self.cim.view(member)
            if member == self.me or member not in self.members:
                continue
            if view.epoch_seen >= gen and not (survivors and member in self.fresh):
                continue  # answered: keeps what it adopted
            if view.partitions or view.share:
                out.append(member)
        return tuple(sorted(out))

    def _leader_yields(self) -> bool:
        """Whether this leader's plan deals out its own partitions: the rule of
        ``_reset_members`` applied to the leader itself. A fresh life that leads beside
        survivors has read nothing (a fresh life reads only from its first epoch), and the life
        that held what the CIM credits to it is no member; if it dies again soon after its epoch
        (a crash loop), what it adopted would stay unread through one more recovery each time.
        It cannot be in the epoch's ``reset`` (CIM rule 5d would drop the share section that
        carries the plan's offers), so its own epoch message gives the partitions up instead
        (``planner.plan``'s ``leader_yields``)."""
        rules = self.config.rules
        if (
            not (rules.reset_fresh_leader and rules.reset_answered_fresh)
            or self.me not in self.fresh
        ):
            return False
        if not any(m not in self.fresh for m in self.members):
            return False  # the whole group restarted: each keeps what it adopted
        return any(p.status == "owned" for p in self.cim.view(self.me).partitions.values())

    def _take_orphans(self, now: int) -> None:
        """Cim rule 5c: the leader takes what an epoch dropped that no state holds (claims that
        landed after the CIM it planned from): a finished orphan into its own state (children
        refer to it), an unfinished one offered like a child, to the most underloaded member
        within the cap, from its newest watermark. Once the epoch is in the CIM, and not while
        a plan's epoch is on its way (its offers may deal them out)."""
        if (
            not self.cim.orphans
            or self.leader != self.me
            or self.cim.leader != self.me
            or self._plan_out is not None
            or not self.sharing_enabled(now)
        ):
            return
        loads: dict[str, int] | None = None
        for token, part in sorted(self.cim.orphans.items()):
            if token in self.mine or token in self.shares or token in self.retired:
                continue
            self.counters["orphans_taken"] += 1
            self._urgent = True
            if part.status == "finished":
                self.mine[token] = part
                continue
            if loads is None:
                loads = self._placing_loads()
            target = share.place_child(self.me, loads, self.config.cap)
            if target == self.me:
                self.mine[token] = part
            else:
                self.shares[token] = Share(part, target=target, kind="new", since=now)
            if target is not None:
                loads[target] = loads.get(target, 0) + 1

    def _follow_offers(self, now: int) -> None:
        enabled = self.sharing_enabled(now)
        live = set(self.cim.members)
        # Of several offers of one partition by members that hand it to whoever picks them up
        # ('new' offers and released moves), only the newest (by ``since``, then holder) may be
        # picked up: an older one is a plan a later one re-made (an offer or a released move to
        # a task an epoch dropped, re-planned by the leader, and the target back under the same
        # id before its holder withdrew it). Every task orders them alike, so at most one target
        # picks the partition up, whatever the offerers' clocks say.
        # An offer to a task that is moving the partition away itself is not ranked: that
        # task never takes it (it hands the partition over instead), so the released move
        # stands.
        offers = list(self.cim.offers())
        newest: dict[str, tuple[int, str]] = {}
        if self.config.rules.newest_offer_only and any(o.target == self.me for _, o in offers):
            for holder, offer in offers:
                if not (offer.kind == "new" or offer.released) or holder not in live:
                    continue
                if offer.target is not None:
                    theirs = self.cim.view(offer.target).share.get(offer.token)
                    if theirs is not None and theirs.kind == "move":
                        continue
                rank = (offer.since, holder)
                newest[offer.token] = max(newest.get(offer.token, rank), rank)
        # Offers addressed to this task.
        for holder, offer in offers:
            if offer.target != self.me:
                continue
            token = offer.token
            have = self.mine.get(token)
            if have is not None:
                # the release of the move it answered: from the offerer it named, not a stale
                # released offer another holder still shows for the partition
                released = offer.kind == "move" and offer.released and have.source == holder
                # completing a hand-off is a pick-up too: not during a rebalance, before its
                # epoch is in the CIM (the offerer may be dropped by it, and the leader may have
                # dealt its partition out; a survivor's lease holds through the rebalance, so it
                # would read beside the partition's new owner)
                if have.status == "incoming" and released and enabled:
                    self.mine[token] = msgspec.structs.replace(
                        offer.partition, status="owned", source=""
                    )
                    self.counters["handoffs_in"] += 1
                    self._urgent = True
                continue
            key = (holder, token, offer.since)
            if not enabled or holder not in live or key in self.consumed:
                continue
            outgoing = self.shares.get(token)
            if token in self.retired or (outgoing is not None and outgoing.kind == "move"):
                continue  # finished here, or this task is handing it away right now
            found = self.cim.find(token)
            if (found is not None and found.status == "finished") or self.cim.snapshot.done(token):
                continue  # (a snapshot partition the CIM records done is finished)
            if (offer.kind == "new" or offer.released) and newest.get(
                token, (offer.since, holder)
            ) != (offer.since, holder):
                self.counters["offer_superseded"] += 1
                continue
            leader = self.cim.leader
            if offer.kind == "new" and holder != leader and token in self.cim.view(leader).share:
                # the leader re-planned it (the offerer's target had died; the offerer, frozen,
                # never withdrew its offer, and the target came back under the same id)
                self.counters["offer_superseded"] += 1
                continue
            if (
                (offer.kind == "new" or offer.released)
                and self.config.rules.refuse_owned_offers
                and any(
                    t != self.me and t in live and self._claimed(t, p, live)
                    for t, p in self.cim.holders(token)
                )
            ):
                # a member of this epoch owns it, or is taking it over from another member: the
                # offer came from a plan made before that claim was known (or one that never
                # became the epoch). A released move this task has no take-over of is a pick-up
                # like a 'new' offer: its target may have died and come back under the same id
                # after the leader dealt the partition out.
                self.counters["offer_already_owned"] += 1
                continue
            self.consumed.add(key)
            if offer.kind == "new" or offer.released:
                self.mine[token] = msgspec.structs.replace(
                    offer.partition, status="owned", source=""
                )
                self.counters["picked_up"] += 1
                if token in self.shares:
                    # an offer of ours for it, superseded by the one picked up: withdrawn
                    del self.shares[token]
            else:
                self.mine[token] = msgspec.structs.replace(
                    offer.partition, status="incoming", source=holder
                )
                self.counters["incoming"] += 1
            self._urgent = True
        if self.consumed:
            self.consumed &= {(h, o.token, o.since) for h, o in self.cim.offers()}
        # Moves this task is taking over whose offerer gave up or left.
        for token, part in list(self.mine.items()):
            if part.status != "incoming":
                continue
            source_offer = self.cim.view(part.source).share.get(token)
            if part.source not in live or source_offer is None or source_offer.target != self.me:
                del self.mine[token]
                self.counters["incoming_dropped"] += 1
                self._urgent = True
        # This task's own offers.
        for token, offer in list(self.shares.items()):
            target = offer.target
            if target is None:
                continue
            # what this task holds is what it has now, not its claim in the CIM: that may be
            # one it gave up in a message still on its way (a released move re-targeted when the
            # epoch dropping its target landed first), and counting it dropped the offer and
            # lost the partition
            got = (
                self.mine.get(token)
                if target == self.me
                else self.cim.view(target).partitions.get(token)
            )
            taken = got is not None and got.status != "incoming"
            if (offer.kind == "new" or offer.released) and not taken and enabled:
                # Judged only once the CIM holds this generation's epoch: before, it may still
                # show claims (or a zombie's word that it finished the partition) that epoch
                # removes, and a plan of their partitions must not be lost.
                if self._finished(token):
                    # Read to its end (here, or by a member): no task picks a finished partition
                    # up, so the offer would stand for ever and count in its target's load (a
                    # leader's plan may deal out a dead task's released move of a partition
                    # another dead task had finished).
                    self.counters["offers_of_finished_dropped"] += 1
                    taken = True
                else:
                    # Someone else has it already (a task the group dropped does not count: its
                    # partitions are what the leader offers). A released move too: the leader
                    # may have dealt it out while its target was not a member, and the target,
                    # back under the same id, never picks it up; kept, the offer would count in
                    # the target's load and hold this task's balancing for ever.
                    taken = any(
                        t != self.me and t in self.members and p.status != "incoming"
                        for t, p in self.cim.holders(token)
                    )
            if taken:
                if token in self.moves:
                    self.counters["handoffs_out"] += 1
                self._drop_offer(token)
                continue
            if offer.kind == "move" and not offer.released:
                if target not in live:
                    self._abort_move(token)
                elif got is not None and got.source == self.me:
                    self._start_release(token)
                continue
            if target not in live and self.cim.epoch >= 0 and enabled:
                leader_offer = self.cim.view(self.cim.leader).share.get(token)
                if self.cim.leader != self.me and leader_offer is not None:
                    self._drop_offer(token)  # the leader re-planned it
                else:
                    self._retarget(token)
                self._urgent = True

    def _finished(self, token: str) -> bool:
        """``token`` is read to its end: this task finished it, some state in the CIM says so, or
        the CIM records the snapshot partition done."""
        if token in self.retired or self.cim.snapshot.done(token):
            return True
        mine = self.mine.get(token)
        if mine is not None and mine.status == "finished":
            return True
        return any(p.status == "finished" for _, p in self.cim.holders(token))

    def _claimed(self, task: str, part: Partition, live: set[str]) -> bool:
        """``task`` owns ``part``, or takes it over in a hand-off from a member that offers it
        to ``task`` (a correct plan never deals out a partition between two members)."""
        if part.status == "owned":
            return True
        if part.status != "incoming" or part.source not in live:
            return False
        offer = self.cim.view(part.source).share.get(part.token)
        return offer is not None and offer.kind == "move" and offer.target == task

    def _drop_offer(self, token: str) -> None:
        self.shares.pop(token, None)
        self.moves.pop(token, None)
        self._urgent = True

    def _abort_move(self, token: str) -> None:
        move = self.moves.get(token)
        self.counters["moves_aborted"] += 1
        del self.shares[token]
        if move is None:
            return
        move = move.abort()
        if move.pending is None or token not in self.mine:
            del self.moves[token]
        else:
            self.moves[token] = move
            self.shares[token] = Share(
                self.mine[token], target=move.pending, kind="move", since=self._now
            )
        self._urgent = True

    def _start_release(self, token: str) -> None:
        if token in self.releasing or token not in self.mine:
            return
        move = self.moves.get(token)
        if move is not None and move.pending is not None and not move.ready_seen:
            self.moves[token] = move.ready()
        self.releasing.add(token)
        if token not in self.reading:
            self._release(token)  # not being read: nothing to stop (002: stateless moves at once)

    def _release(self, token: str) -> None:
        """The old owner stopped reading: hand over with the final committed watermark."""
        self.releasing.discard(token)
        part = self.mine.pop(token)
        offer = self.shares.get(token)
        if offer is None:  # the move was aborted meanwhile: keep it
            self.mine[token] = part
            return
        self.shares[token] = msgspec.structs.replace(offer, partition=part, released=True)
        self._urgent = True

    def _retarget(self, token: str, members: tuple[str, ...] | None = None) -> None:
        loads = self._loads()
        if members is not None:
            loads = {m: loads.get(m, 0) for m in members}
        target = share.room_for_parked(loads, self.config.cap)
        offer = self.shares[token]
        self.shares[token] = Share(offer.partition, target=target, kind="new", since=self._now)
        self.counters["offers_retargeted"] += 1

    def _negotiate(self, now: int) -> None:
        if not self.sharing_enabled(now):
            return
        if now - self._last_negotiate < self.config.negotiate_interval:
            return
        self._last_negotiate = now
        targeted, moves = self._negotiation()
        for token, offer in targeted:
            self.shares[token] = offer
            self._urgent = True
        for token, move in moves:
            assert move.pending is not None
            self.moves[token] = move
            self.shares[token] = Share(
                self.mine[token], target=move.pending, kind="move", since=self._now
            )
            self.counters["moves_offered"] += 1
            self._urgent = True

    def _negotiation(self) -> tuple[list[tuple[str, Share]], list[tuple[str, Move]]]:
        """What a negotiation round would change, without changing anything (so
        :meth:`next_deadline` can ask whether a round is worth a tick): parked offers given a
        target, and moves offered (one round of moves at a time)."""
        loads = self._placing_loads()
        targeted: list[tuple[str, Share]] = []
        for token, offer in self.shares.items():
            if offer.target is None:
                target = share.room_for_parked(loads, self.config.cap)
                if target is not None:
                    targeted.append((token, msgspec.structs.replace(offer, target=target)))
                    loads[target] += 1
        moves: list[tuple[str, Move]] = []
        if any(o.target is not None and o.kind == "move" for o in self.shares.values()) or any(
            o.kind == "move" for _, o in targeted
        ):
            return targeted, moves  # one round of moves at a time
        revision = self.cim.offset
        movable = iter(self._movable())
        for target, count in share.balance(self.me, loads, self.config.cap):
            for token in itertools.islice(movable, count):
                move = self.moves.get(token) or Move(token, stable=self.me)
                move = move.request(target, revision)
                if move.pending is not None:
                    moves.append((token, move))
        return targeted, moves

    def _movable(self) -> list[str]:
        """Own partitions to offer, cheapest to move first: not being read, then being read."""
        owned = [
            p
            for t, p in self.mine.items()
            if p.status == "owned"
            and p.quarantine is None  # parked: moving it gains nothing
            and not p.claim  # not the CIM's yet (protocol/mutable.py, rule 8)
            and t not in self.shares
            and t not in self.releasing
        ]
        owned.sort(key=lambda p: (p.token in self.reading, -p.start_ts, p.token))
        return [p.token for p in owned]

    def _remove_finished(self) -> None:
        finished = [t for t, p in self.mine.items() if p.status == "finished"]
        if not finished:
            return
        offered = {o.token for _, o in self.cim.offers()} | set(self.shares)
        # MUTABLE_KEY_RANGE (rule 7): the unfinished partition that resumes first decides
        first = (
            min(self._unfinished(), key=Partition.resume_ts, default=None)
            if self.config.mutable
            else None
        )
        for token in finished:
            part = self.mine[token]
            if (
                token not in offered
                and lifecycle.removable(part, self._member_lookup)
                and (
                    not self.config.mutable
                    or snapshots.is_snapshot(token)
                    or mutable.removable(part, () if first is None else (first,))
                )
                and (
                    snapshots.removable(part, self.cim.snapshot)
                    or not self.config.rules.snapshot_done_before_removal
                )
            ):
                del self.mine[token]
                self.retired.add(token)
                self.counters["partitions_removed"] += 1

    def _reconcile_readers(self, now: int) -> list[TaskCommand]:
        out: list[TaskCommand] = []
        allowed = self.may_read(now)
        wanted: list[Partition] = []
        if allowed:
            # resumed on its answer, before its generation's epoch: only what the log credits
            credited = (
                self.cim.view(self.me).partitions
                if self.cim.epoch < self.continuous_since
                else None
            )
            for token, part in self.mine.items():
                if (
                    part.status == "owned"
                    and (part.quarantine is None or not self.config.rules.park_quarantined)
                    and token not in self.releasing
                    and (credited is None or _owned(credited.get(token)))
                    and self.config.rules.readable(part, self._lookup)
                    and (
                        not self.config.rules.move_in_holds or mutable.released(part, self._lookup)
                    )
                    and not part.claim  # rule 8: not credited by the CIM yet
                ):
                    wanted.append(part)
        keep = {p.token for p in wanted if p.token in self.reading}
        cap = self.config.cap
        room = (len(wanted) if cap <= 0 else cap) - len(keep)
        start: list[Partition] = []
        if room > 0:
            # the oldest first (a cap leaves the youngest waiting); usually there are none
            candidates = [p for p in wanted if p.token not in self.reading]
            if candidates:
                start = sorted(candidates, key=lambda p: (p.start_ts, p.token))[:room]
        for token in list(self.reading):
            if token not in keep and token not in self.stopping:
                self.stopping.add(token)
                held = self.mine.get(token)
                if token in self.releasing:
                    reason = StopReason.HANDOFF
                elif held is not None and held.quarantine is not None:
                    reason = StopReason.QUARANTINED
                elif self.draining:
                    reason = StopReason.SHUTDOWN
                elif not allowed:
                    reason = StopReason.NOT_PERMITTED
                else:
                    reason = StopReason.NOT_WANTED
                drain = reason in (StopReason.HANDOFF, StopReason.SHUTDOWN)
                out.append(StopReader(token, reason, drain))
        if start and self.cim.epoch < self.continuous_since:
            self.counters["read_on_answer"] += len(start)
        for part in start:
            self.reading[part.token] = part.resume_ts()
            out.append(
                StartReader(
                    part.token, part.resume_ts(), part.parents, part.resume_tail(), part.hold
                )
            )
        return out

    # -- publishing -----------------------------------------------------------------------------
    def _maybe_publish(self, now: int) -> StateMessage | None:
        if not self.member or self.generation < 0:
            return None
        # An append failed and nothing of ours is on its way: send a message even with nothing
        # new in it, or a task with nothing to say (one whose answer was lost) would never read
        # one back, and never be allowed to read again.
        probe = self._sync_failing_since >= 0 and not self._unread
        due = self._urgent or self._answer or self.draining or probe  # a drain's: at once
        since = now - self._last_publish
        if not due and since < self.config.publish_interval:
            return None
        if self._unread and since < self.config.coalesce_wait:
            return None  # group commit: goes out with whatever else changed, once read back
        state = self._diff(now, force=self._answer or probe)
        self._urgent = False
        self._answer = False
        if state is None:
            return None
        self._mark_sent(state)
        self._last_publish = now
        self._unread.add(state.state_timestamp)
        self.counters["messages_published"] += 1
        return StateMessage(
            task_id=self.me,
            message_timestamp=now,
            epoch=self.generation,
            sync_epoch=self.cim.sync_epoch,
            connector_state=(state,),
        )

    def _shares_to_send(self) -> bool:
        """Whether a state message carries the share section. Not while this task's plan's
        epoch is on its way (:meth:`_settle_plan`): the section would carry the plan's offers
        outside their epoch, and without them it would withdraw them from the epoch that may
        land first; share changes wait until the epoch landed or was fenced."""
        return self._plan_out is None and self.shares != self._sent_share

    def _diff(self, now: int, *, force: bool, epoch: bool = False) -> TaskState | None:
        data = tuple(p for t, p in self.mine.items() if self._sent_parts.get(t) != p)
        removed = tuple(t for t in self._sent_parts if t not in self.mine)
        send = self.shares != self._sent_share if epoch else self._shares_to_send()
        if not send and self.config.rules.release_with_offer:
            # A partition that left this task's state for its share section (a released
            # move, an offer) leaves it in the message that carries the offer: sent alone, the
            # removal leaves it held by nobody in the CIM, and lost if this task dies before
            # the held share section goes out (its next life drops an unreleased move).
            removed = tuple(t for t in removed if self.shares.get(t) == self._sent_share.get(t))
            # Likewise a finished partition names its children, and a child offered from here
            # is held by nobody but the share section: sent alone, the parent's end leaves
            # that child unknown to the CIM, and unread for ever if this task dies before the
            # held section goes out. The end waits for the section; meanwhile
            # the CIM shows the parent owned here, and dealt out after a death, re-read to its
            # end by its next owner, which registers the children again.
            unsent = {t for t, o in self.shares.items() if self._sent_share.get(t) != o}
            data = tuple(
                p for p in data if p.status != "finished" or not unsent.intersection(p.children)
            )
        shares = tuple(self.shares.values()) if send else None
        if not (data or removed or shares is not None or force):
            return None
        self._last_state_ts = max(now, self._last_state_ts + 1)
        return TaskState(
            task_id=self.me,
            state_timestamp=self._last_state_ts,
            data=data,
            removed=removed,
            share=shares,
        )

    def _mark_sent(self, state: TaskState) -> None:
        for token in state.removed:
            self._sent_parts.pop(token, None)
        for part in state.data:
            self._sent_parts[part.token] = part
        if state.share is not None:
            self._sent_share = {s.token: s for s in state.share}

    # -- views ----------------------------------------------------------------------------------
    def _lookup(self, token: str) -> Partition | None:
        part = self.mine.get(token)
        if part is not None and part.status != "incoming":
            return part
        return self.cim.find(token)

    def _member_lookup(self, token: str) -> Partition | None:
        """As :meth:`_lookup`, but believing only members of the current generation: a task the
        group has dropped may have reported a child finished that the epoch being opened deals
        out again (unfinished), so its word cannot make a parent removable."""
        part = self.mine.get(token)
        if part is not None and part.status != "incoming":
            return part
        live = set(self.members) if self.members else set(self.cim.members)
        best = None
        for task, held in self.cim.holders(token):
            if task not in live:
                continue
            if held.status != "incoming":
                return held
            best = held
        return best

    def _known(self, token: str) -> bool:
        if token in self.mine or token in self.shares or token in self.retired:
            return True
        if token in self.cim.orphans:
            return True  # the leader offers it (a child registered again would start over)
        if self.cim.find(token) is not None:
            return True
        return any(o.token == token for _, o in self.cim.offers())

    def _loads(self) -> dict[str, int]:
        members = self.cim.members if self.me in self.cim.members else (self.me,)
        loads = self.cim.loads(members)
        moving = {t for t, s in self.shares.items() if s.kind == "move"}
        loads[self.me] = sum(
            1
            for t, p in self.mine.items()
            if p.status == "incoming"
            or (p.status == "owned" and t not in moving and not self._waits(p))
        )
        return loads

    def _placing_loads(self) -> dict[str, int]:
        """:meth:`_loads` without the members on probation: what balancing, children and
        orphans are placed on (a member not there neither gets one nor counts in the goals)."""
        return {m: n for m, n in self._loads().items() if not self.on_probation(m)}

    def _waits(self, part: Partition) -> bool:
        """Owned but not readable yet (see :meth:`Cim.waits`): it does not count against the cap."""
        return not self.config.rules.readable(part, self._lookup) or not mutable.released(
            part, self._lookup
        )

    def why_unread(self, token: str, now: int) -> tuple[bool, str]:
        """Why an owned partition has no reader: (expected, in words). Expected: it waits for
        room under the cap, or for the task to be allowed to read (its membership is watched
        apart). A partition waiting long for its parents or for a hand-off is reported: its
        parents or the new owner are stuck, or the parents are unknown here."""
        part = self.mine.get(token)
        if part is None or part.status != "owned":
            return True, f"not owned here ({'unknown' if part is None else part.status})"
        if token in self.reading:
            return False, "stopping" if token in self.stopping else "a reader is starting"
        if token in self.releasing:
            return False, "handed off, waiting for the new owner"
        if not self.may_read(now):
            return True, (
                f"reading not permitted (member={self.member}, lease in "
                f"{(self.lease_until - now) / 1e6:.1f}s, epoch {self.cim.epoch}, "
                f"draining={self.draining})"
            )
        waiting: list[str] = []
        for parent in part.parents:
            found = self._lookup(parent)
            if found is None or found.status != "finished":
                # who holds it in this task's CIM, to tell a stuck parent from a stale view
                held = ", ".join(f"{t} {p.status}" for t, p in self.cim.holders(parent))
                waiting.append(
                    f"{parent[:12]}={'unknown' if found is None else found.status} "
                    f"(CIM: {held or 'none'})"
                )
        if waiting:
            return False, (
                f"waiting for parents {', '.join(waiting)} (sync log read to offset "
                f"{self.cim.offset})"
            )
        hold = part.hold
        if hold is not None and not mutable.released(part, self._lookup):
            behind = [
                f"{s[:12]}={'unknown' if (p := self._lookup(s)) is None else p.watermark}"
                for s in hold.sources
                if not mutable.reached(self._lookup(s), hold.ts)
            ]
            return False, (
                f"held at a move-in at {hold.ts} until its sources commit past it: "
                f"{', '.join(behind)} (sync log read to offset {self.cim.offset})"
            )
        running = len([t for t in self.reading if t not in self.stopping])
        if 0 < self.config.cap <= running:
            return True, f"waiting for room under the cap ({running}/{self.config.cap} reading)"
        return False, "no reader, and nothing keeps one from starting"

    def owned_unfinished(self) -> Iterator[str]:
        """The partitions this task owns and has not finished (a claim not credited by the CIM
        yet is not owned: protocol/mutable.py, rule 8)."""
        for token, part in self.mine.items():
            if part.status == "owned" and not part.claim:
                yield token

    def validate(self) -> None:
        """Invariants of one task's state; the tests call it after every step."""
        self.cim.validate()
        for token in self.reading:
            part = self.mine.get(token)
            assert token in self.stopping or (part is not None and part.status == "owned"), (
                f"{self.me} reads {token} it does not own"
            )
        running = len([t for t in self.reading if t not in self.stopping])
        assert self.config.cap <= 0 or running <= self.config.cap, (
            f"{self.me} reads {running} > cap"
        )
        for token, offer in self.shares.items():
            if offer.kind == "new":
                assert (
                    token not in self.mine
                    or self.mine[token].status != "owned"
                    or (offer.target == self.me)
                ), f"{self.me} both owns and offers {token} as new"
        for token in self.moves:
            assert token in self.shares or token in self.mine, f"{self.me}: move of unknown {token}"
        for token, part in self.mine.items():
            if part.claim:
                assert token in self._claims, f"{self.me}: claim of {token} not tracked"
                assert token not in self.reading, f"{self.me} reads {token} before the CIM has it"


def _owned(part: Partition | None) -> bool:
    return part is not None and part.status == "owned"


def _newer(part: Partition, watermark: int, tail: Ids) -> bool:
    """Whether a reader's committed position is past the partition's (the same rule as
    ``Position.newer``: at one watermark, more committed identities)."""
    return watermark > part.watermark or (
        watermark == part.watermark and len(tail) > len(part.tail)
    )
