"""One task of the protocol (docs/design.md) as a pure state machine: events in, commands out.

Every task is a regular task; the one the group leader's assignor named also plays the Leader for
that generation. Time (``now``, every interval of :class:`TaskConfig`) is integer microseconds of
the shell's wall clock. The rules, each under the modules that hold it: :class:`TaskCore` keeps
the state, dispatches the events and calls their functions in :meth:`TaskCore._step`'s order
(leader's duties, offers, negotiation, removal, releases, readers, publishing); a rule without a
module of its own is a method of :class:`TaskCore`:

Subscription order and membership (``TaskCore.may_read``, ``_on_joined``, ``_on_epoch``)
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

Rebalance (``protocol/leading.py``)
  On every completed rebalance a task answers at once with an incremental message in the new
  generation. Sharing (offers and pick-ups) is disabled from the rebalance until the epoch of that
  generation is in the CIM. The leader waits for every member's answer, or a bounded time, asks
  its shell for a plan (``protocol/planner.py``), and writes the epoch message: members, and in its
  own share section the ownerless partitions it offers. An epoch message whose append fails is
  sent again with the same plan while the generation lasts (without its epoch nobody shares, and
  a task that joined in it never reads). A member restarted under its id (a fresh life: the group
  says so) that has not answered when the leader plans, or that has while survivors are members,
  is *reset*: the plan deals out what the CIM credits to it, and the task drops what it adopted
  when it reads the epoch (``leading.reset_members``, ``_on_epoch``).

Incremental messages (``protocol/publishing.py``)
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

Sharing and hand-off (``protocol/offers.py``, ``protocol/negotiation.py``; the pure rules of
``protocol/share.py`` and ``protocol/handoff.py``)
  A ``new`` offer addressed to the task is picked up into its own state. A ``move`` offer is
  answered with ``incoming`` (the target is ready); the offerer then stops its reader and releases
  the partition with its final committed watermark; the target reads from exactly there. The
  offerer drops an offer once the target owns it; it never re-owns a ``new`` offer nobody picked
  up. Offers to tasks that left are re-planned by the leader when they were in the CIM it planned
  from, otherwise re-targeted by their holder.

Partitions (``protocol/lifecycle.py``; ``TaskCore._on_finished``, ``_remove_finished``,
``_reconcile_readers``)
  At most ``cap`` partitions are read at once. A partition is read only when every parent has
  finished. When a reader finishes, the children it registers go to the most underloaded member.
  Finished partitions are removed once nothing refers to them.

Poison partitions (``protocol/quarantine.py``; docs/design.md#poison-partitions)
  A partition whose reader fails ``quarantine_after`` times in a row without its committed
  position moving, while another partition of this task advanced between the last two failures
  (so the source and the sink work: a failure of everything is an outage, retried, not poison),
  is *quarantined*: its reader is stopped and the partition stays in this task's state, owned,
  with a ``quarantine`` (the error, the failing record, the watermark it is parked at). Nobody
  reads a quarantined partition: the field travels with it through hand-offs, offers and plans,
  so whoever owns it next keeps it parked. A ``release`` message naming it (CIM rule 9) is
  applied by its owner: the quarantine is cleared and the partition read from its watermark.

MUTABLE_KEY_RANGE partitions (``protocol/mutable.py``, rules 5-8; ``TaskConfig.mutable``)
  A partition start a reader reports registers the tokens nobody knows, dealt like children, as
  claims read once the CIM credits them (``protocol/claims.py``). A
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

from collections import Counter, deque
from collections.abc import Callable, Iterator
from random import Random

import msgspec

from protocol import (
    claims,
    leading,
    lifecycle,
    mutable,
    negotiation,
    offers,
    publishing,
    quarantine,
    share,
)
from protocol import snapshot as snapshots
from protocol.cim import Cim, TaskView
from protocol.events import (
    Alert,
    Drain,
    Ids,
    Joined,
    Joining,
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
    Share,
    StateMessage,
)
from protocol.planner import Plan

__all__ = [
    "Alert",
    "Drain",
    "Joined",
    "Joining",
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
    # A leader whose epoch append failed sends it again (``leading.resend_epoch``); the teeth
    # test turns it off to show that leaves a generation without its epoch.
    resend_failed_epoch: bool = True
    # A leader plans only under a valid lease and once its own answer is in its CIM
    # (``leading.may_plan``); the teeth test turns it off: a leader back from a pause past its
    # lease plans its old generation from a CIM that has read nothing since.
    lead_under_lease: bool = True
    # A plan's offers reach the CIM only in its epoch message and are withdrawn when another
    # epoch fences it (``leading.settle_plan``); the teeth test turns it off: a fenced plan's
    # offers are published in a later generation.
    plan_offers_in_epoch_only: bool = True
    # A partition handed over through the share section leaves this task's state in the same
    # message as the offer carrying it, and a finished partition's end goes out with the offers
    # of its children (``publishing.diff``); the teeth tests turn it off: a leader whose share
    # section waits for its epoch sends the removal (or the end) alone, dies, and the partition
    # (or the child) is lost.
    release_with_offer: bool = True
    # An epoch keeps a dropped task's answer to a later generation (Cim rule 5); the teeth test
    # turns it off: that generation's leader, whose answer it was, never plans.
    keep_later_answers: bool = True
    # Of several offers of one partition that hand it to whoever takes them ('new' offers and
    # released moves) only the newest is picked up (``offers.newest_offers``); the teeth test
    # turns it off: an old offer and its re-plan are both picked up.
    newest_offer_only: bool = True
    # Only a member whose every group member is a fresh life (it has read nothing) is
    # reset when it has not answered by the plan (``leading.reset_members``); the teeth test
    # resets every member that has not answered: a survivor still reading under its lease loses
    # its partitions to another reader.
    reset_only_fresh: bool = True
    # A rejoined task that is no fresh life reads what the CIM credits to it once its answer is
    # read back (``_resumed_on_answer``), before its generation's epoch lands; its safety rests
    # on CIM rule 2a (``fence_superseded_epochs``: an epoch older than an applied answer's
    # generation is ignored). The teeth test turns the fence off: an epoch planned while the
    # task was away lands after its answer and hands its partitions to a second reader.
    resume_on_answer: bool = True
    fence_superseded_epochs: bool = True
    # A fresh member is reset even when it has answered, as long as members that are no fresh
    # lives are there to take its partitions (``leading.reset_members``): a task in a crash loop
    # no longer keeps its partitions unread through every recovery. Off: it keeps what it
    # adopted once it answered (the histories the regression seeds were found in).
    reset_answered_fresh: bool = True
    # ... and so is a fresh leader beside survivors: its plan deals out its own partitions
    # (``leading.leader_yields``; on Kafka a restarted process joins a rebalance first, so it
    # leads). Off (the teeth test): a leader in a crash loop keeps its partitions unread through
    # each of its lives (bench chaos --seed 3, 28.5 s unread).
    reset_fresh_leader: bool = True
    # A life is fresh until it has read (``TaskCore._on_joining``): a restarted task assigned a
    # generation whose epoch never landed (its leader died before planning) still says so at
    # its next join, so that generation's leader resets it too. Off (the teeth test): only a
    # life never assigned a generation says it is fresh, and a life whose first generation
    # came to nothing keeps its earlier life's partitions unread through the next recovery.
    fresh_until_read: bool = True
    # While survivors are members (``reset_answered_fresh``) the leader plans once every member
    # that is no fresh life has answered: the fresh ones are reset whether they answered or not,
    # so their answers change nothing in the plan (``leading.duties``). Waiting for them (a
    # restarted process still replaying the log) cost the whole answer wait, 2 s, in most
    # recoveries of bench chaos. Off: the leader waits for every member's answer.
    plan_without_fresh_answers: bool = True
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
        # this life may have read: reading was permitted at a step (no fresh life since)
        self.has_read = False
        # it said it is fresh in a JoinGroup while knowing this epoch (``_on_joining``): it reads
        # nothing until it takes a newer generation; None: no such join outstanding
        self._said_fresh_above: int | None = None
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
        # that epoch, and are withdrawn if another epoch fences it (see leading.settle_plan)
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
        self._failing: dict[str, quarantine.Failing] = {}
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
            case Joining():
                # it binds a task that has read nothing: no reader to stop, nothing to step
                self._on_joining(event.known)
                return []
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
                quarantine.on_failed(self, event, now)
            case PartitionsAnnounced():
                claims.on_announced(self, event)
            case PlanReady():
                out += leading.on_plan(self, event.plan, now)
            case PublishFailed():
                self.counters["publish_failed"] += 1
                self._unread.discard(event.state_ts)  # it will not be read back
                if self._sync_failing_since < 0:
                    self._sync_failing_since = now
                publishing.resync(self)
                out += leading.resend_epoch(self, event.state_ts, now)
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
            and self._said_fresh_above is None
            and (self.cim.epoch >= self.continuous_since or self._resumed_on_answer())
            and self.me in self.cim.members
        )

    @property
    def says_fresh(self) -> bool:
        """Whether this life said in its latest JoinGroup (:class:`Joining`) that it is fresh
        and has taken no newer generation since (:meth:`_on_joining`)."""
        return self._said_fresh_above is not None

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
                publishing.publish_due(self),
                self._permission_ends(now),
                self._probation_ends(now),
            )
            if d is not None
        ]
        first = min(due, default=None)
        # the negotiation's dry run costs O(partitions of the group): only when it could be first
        if first is None or self._last_negotiate + self.config.negotiate_interval < first:
            negotiate = negotiation.due(self, now)
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
        """The end of the leader's wait for answers (``leading.plan_due``)."""
        return leading.plan_due(self)

    def _checkpoint_due(self) -> int | None:
        """The leader's next checkpoint (``leading.checkpoint_due``)."""
        return leading.checkpoint_due(self)

    def _negotiate_due(self, now: int) -> int | None:
        """The next negotiation round worth a tick (``negotiation.due``)."""
        return negotiation.due(self, now)

    def _movable(self) -> list[str]:
        """Own partitions a negotiation round may offer (``negotiation.movable``)."""
        return negotiation.movable(self)

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
        leading.settle_plan(self)
        if self._claims:
            claims.settle(self)
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
                publishing.resync(self)
            opened = isinstance(message, EpochMessage) and self.cim.epoch != before_epoch
            if not opened:
                return  # (an epoch message whose foreign part was dropped still opens its epoch)
        if own and not self._unread:
            view = self.cim.view(self.me)
            if view.partitions != self._sent_parts or view.share != self._sent_share:
                # every message is read back, yet the log holds something other than what
                # they said (e.g. an answer written before an epoch that dropped this task
                # landed after it): re-send the difference against the truth
                publishing.resync(self)
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
        above = self._said_fresh_above
        if above is not None and event.generation > above:
            # the generation of a join in which it said it is fresh (``_on_joining``): counted
            # fresh, it reads only from this generation's epoch (the plan may reset it)
            self._said_fresh_above = None
            if self.me in event.fresh:
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

    def _on_joining(self, known: int) -> None:
        """A JoinGroup goes out, the newest epoch the member knows being ``known``; it says
        this life is *fresh* (:attr:`says_fresh`) if it has read nothing (reading was never
        permitted at a step), so that the generation's leader may reset it
        (``leading.reset_members``). A life is fresh until it has read, not only until its
        first generation: one whose generation came to nothing (its leader died before
        planning) has read nothing either. Saying so binds it: it reads nothing until it takes
        a generation newer than ``known`` (the one this JoinGroup makes, or a later one), and
        then, if that generation counts it fresh, only from that generation's epoch
        (:meth:`_on_joined`); an assignment of an earlier join that reaches it meanwhile does
        not let it read. (``Rules.fresh_until_read``; the shell applies this event as it sends
        the JoinGroup, the Kafka adapter's assignor metadata, and reads :attr:`says_fresh`.)"""
        if self.has_read or not self.config.rules.fresh_until_read:
            return
        above = self._said_fresh_above
        self._said_fresh_above = known if above is None else max(above, known)

    def _on_committed(self, token: str, watermark: int, tail: Ids = ()) -> None:
        part = self.mine.get(token)
        if part is not None and part.status == "owned" and _newer(part, watermark, tail):
            self.mine[token] = mutable.passed(
                msgspec.structs.replace(part, watermark=watermark, tail=tail)
            )
            quarantine.advanced(self, token)

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
            quarantine.advanced(self, event.token)
        if event.hold is not None and part is not None and part.status == "owned":
            # rule 5: stopped at a move-in it may not pass: held until its sources reach it
            part = self.mine[event.token] = msgspec.structs.replace(part, hold=event.hold)
            self.counters["move_in_holds"] += 1
            self._urgent = True
        if event.token in self.releasing and part is not None:
            offers.release(self, event.token)

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

    def _unfinished(self) -> Iterator[Partition]:
        """Every unfinished partition this task knows of: its own, its offers, the CIM's
        (owned, taken over, offered, orphaned)."""
        yield from (p for p in self.mine.values() if p.status != "finished")
        yield from (o.partition for o in self.shares.values())
        yield from self.cim.unfinished()

    # -- the step after every event -----------------------------------------------------------
    def _step(self, now: int) -> list[TaskCommand]:
        out: list[TaskCommand] = []
        out += leading.duties(self, now)
        shares_before = dict(self.shares)
        offers.follow(self, now)
        offers.take_orphans(self, now)
        negotiation.negotiate(self, now)
        self._unsettled = self.shares != shares_before
        self._remove_finished()
        quarantine.apply_releases(self)
        out += self._reconcile_readers(now)
        message = publishing.maybe_publish(self, now)
        if message is not None:
            out.append(Publish(message))
        return out

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
            self.has_read = True  # no fresh life from here on (``_on_joining``)
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
        if self._said_fresh_above is not None:
            assert not self.has_read, f"{self.me} said it is fresh after reading"
            assert not self.reading, f"{self.me} said it is fresh and reads {sorted(self.reading)}"
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
