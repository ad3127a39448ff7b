"""One member of the heartbeat-topic group: its epochs and its lease, as a pure core.

:class:`MemberCore` holds what a member knows about its membership and decides everything the
rules of :mod:`protocol.epochs` (numbering, acceptance) and :mod:`protocol.lease` (the lease)
say about it. It has no I/O and no clock: the shell hands it events, with ``now`` and the send
times of the requests they are about (micros of the member's clock), and carries out what it
returns. The Kafka membership adapter (``runtime/kafka/membership.py``) and the fault
simulator's group model (``runtime/sim/faultsim.py``) are both such shells.

1. **What it says when it joins** (:meth:`MemberCore.said`): its task id, the newest epoch it
   knows (the newest it was assigned, :attr:`MemberCore.epoch_seen`, or the ``floor`` the shell
   gives, its CIM's epoch) and whether it is a fresh life: never assigned a generation, or
   (``unread``, the task's ``TaskCore.says_fresh``) assigned but never permitted to read.
2. **As the group's leader** (:meth:`MemberCore.number`): the generation's epoch, numbered over
   what every member said and what the leader knows itself (``epochs.number``), and the task
   ids that are fresh (``epochs.fresh_tasks``).
3. **An assignment in** (:class:`Assigned`): :class:`Take` (the epoch is newer than every one it
   knows, or is the assignment's own that landed in its CIM first: ``epochs.receive``,
   ``epochs.landed_first``) and ``epoch_seen`` moves to it; or :class:`Refuse` (stale): the
   shell treats the membership as lost and rejoins, telling the next leader what it knows.
4. **The lease** (:class:`LeaseUntil`): after every answer that is a fact of the lease (a
   heartbeat, JoinGroup or SyncGroup answered, ``protocol/lease.py`` K1-K4) the core reports the
   lease those facts give, so the shell pushes it to its task rather than the task polling.
   A JoinGroup sent, or one that failed, is reported too (a broken rule may count it). How
   late the shell's event loop has lately run (:class:`LoopLagged`) grows the lease's margin
   (``lease.margin_under_lag``): a task on a stalled loop sees its lease end that much later.

:class:`MemberRules` holds the rules as derived (the defaults), or broken for the fault
simulator's teeth tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import assert_never

import msgspec

from protocol import epochs, lease
from protocol.epochs import NO_EPOCH, Logged
from protocol.lease import LeaseRules, LeaseTiming, MemberFacts

__all__ = [
    "Assigned",
    "HeartbeatAnswered",
    "JoinAnswered",
    "JoinFailed",
    "JoinSent",
    "LeaseUntil",
    "LoopLagged",
    "MemberCommand",
    "MemberCore",
    "MemberEvent",
    "MemberRules",
    "MembershipLost",
    "Numbered",
    "Refuse",
    "Said",
    "SyncAnswered",
    "Take",
]


class MemberRules(msgspec.Struct, frozen=True):
    """The rules as derived (the defaults), or broken for a teeth test."""

    lease: LeaseRules = LeaseRules()
    # off: the epoch is the group's generation as given, and every assignment is taken
    epoch_rules: bool = True
    # off: an assignment whose own epoch landed in the CIM first is refused as stale (rule 5)
    accept_landed_epochs: bool = True
    # off: a member never says it is fresh (the histories before the reset rule)
    report_fresh: bool = True


class Said(msgspec.Struct, frozen=True):
    """What a member says in its JoinGroup: its task id, the newest epoch it knows, and whether
    it is a fresh life (it has read nothing: never assigned a generation, or never permitted to
    read in the generations it was assigned)."""

    task_id: str
    floor: int = NO_EPOCH
    fresh: bool = False


class Numbered(msgspec.Struct, frozen=True):
    """The leader's numbering of a generation: its epoch, and the task ids that are fresh."""

    epoch: int
    fresh: tuple[str, ...] = ()


# -- events -----------------------------------------------------------------------------------


class _Event(msgspec.Struct, frozen=True, tag_field="event"):
    pass


class _Command(msgspec.Struct, frozen=True, tag_field="command"):
    pass


class JoinSent(_Event, frozen=True, tag="join-sent"):
    """A JoinGroup was sent at ``sent`` (it proves nothing until answered: lease K4)."""

    sent: int


class JoinAnswered(_Event, frozen=True, tag="join-answered"):
    """The JoinGroup in flight was answered ``NONE``."""


class JoinFailed(_Event, frozen=True, tag="join-failed"):
    """The JoinGroup in flight failed or timed out: no proof of anything (lease A3)."""


class HeartbeatAnswered(_Event, frozen=True, tag="heartbeat-answered"):
    """A heartbeat sent at ``sent`` was answered ``NONE`` or (``rebalancing``)
    ``REBALANCE_IN_PROGRESS``."""

    sent: int
    rebalancing: bool


class SyncAnswered(_Event, frozen=True, tag="sync-answered"):
    """A SyncGroup sent at ``sent`` was answered ``NONE``: a member of the new generation."""

    sent: int


class MembershipLost(_Event, frozen=True, tag="lost"):
    """The membership is lost (fenced, expelled, refused a stale epoch, given up)."""

    reason: str = ""


class Assigned(_Event, frozen=True, tag="assigned"):
    """A generation's assignment reached this member: the epoch its leader numbered
    (:data:`~protocol.epochs.NO_EPOCH` from a leader predating epochs), the group's generation,
    the leader, the members and the fresh task ids; ``floor`` and ``logged``: the newest epoch
    in the member's CIM, and who opened it for which members."""

    epoch: int
    generation: int
    leader: str
    members: tuple[str, ...]
    fresh: tuple[str, ...] = ()
    floor: int = NO_EPOCH
    logged: Logged = Logged()


class LoopLagged(_Event, frozen=True, tag="loop-lagged"):
    """The member's event loop has lately run up to ``lag`` micros late (the shell measures it):
    the lease margin grows by it (``protocol.lease.margin_under_lag``)."""

    lag: int


MemberEvent = (
    LoopLagged
    | JoinSent
    | JoinAnswered
    | JoinFailed
    | HeartbeatAnswered
    | SyncAnswered
    | MembershipLost
    | Assigned
)


# -- commands ---------------------------------------------------------------------------------


class LeaseUntil(_Command, frozen=True, tag="lease"):
    """The lease the facts give now (micros of the member's clock, exclusive)."""

    until: int


class Take(_Command, frozen=True, tag="take"):
    """Take the assignment: this generation's epoch, leader, members and fresh task ids;
    ``landed_first``: its epoch was in the CIM before it came (epochs rule 5)."""

    epoch: int
    leader: str
    members: tuple[str, ...]
    fresh: tuple[str, ...] = ()
    landed_first: bool = False


class Refuse(_Command, frozen=True, tag="refuse"):
    """Refuse the assignment: its ``epoch`` is not newer than the ``known`` one. The membership
    is lost; rejoin, so that the next leader learns the epoch known here."""

    epoch: int
    known: int
    landed_first: bool = False

    @property
    def reason(self) -> str:
        return epochs.Stale(self.epoch, self.known).reason


MemberCommand = LeaseUntil | Take | Refuse


class MemberCore:
    """One member's epochs and lease facts (see the module docstring)."""

    def __init__(self, task_id: str, timing: LeaseTiming, rules: MemberRules | None = None) -> None:
        self.task_id = task_id
        self.timing = timing
        self.rules = rules if rules is not None else MemberRules()
        self.epoch_seen = NO_EPOCH  # the newest epoch this member was assigned
        self.facts = MemberFacts()  # the facts of the lease (protocol/lease.py)
        self.stale_epochs = 0  # assignments refused
        self.landed_first = 0  # assignments whose own epoch was in the CIM first
        self.lag = 0  # how late the event loop has lately run (micros): the margin grows by it

    # -- queries ----------------------------------------------------------------------------
    @property
    def fresh(self) -> bool:
        """Never assigned a generation (a new or restarted life): it has read nothing."""
        return self.epoch_seen == NO_EPOCH

    def known(self, floor: int = NO_EPOCH) -> int:
        """The newest epoch this member knows, given its CIM's (``floor``): epochs rule 1."""
        return epochs.newest(self.epoch_seen, floor)

    def said(self, floor: int = NO_EPOCH, unread: bool = False) -> Said:
        """What this member says when it joins (rule 1 of the module docstring); ``unread``:
        its task has read nothing in this life (``TaskCore.says_fresh``)."""
        fresh = self.rules.report_fresh and (self.fresh or unread)
        return Said(self.task_id, self.known(floor), fresh)

    def number(self, generation: int, said: Iterable[Said], floor: int = NO_EPOCH) -> Numbered:
        """As the group's leader: ``generation``'s epoch over what the members ``said`` and
        what this member knows (``floor``: its CIM's epoch), and the fresh task ids."""
        members = list(said)
        known = [self.known(floor), *(s.floor for s in members)]
        epoch = epochs.number(generation, known) if self.rules.epoch_rules else generation
        fresh = epochs.fresh_tasks((s.task_id, s.fresh) for s in members)
        return Numbered(epoch, fresh)

    def lease_until(self) -> int | None:
        """The end of the lease (micros, exclusive); ``None`` while not a member."""
        return lease.valid_until(self.facts, self.timing, self.rules.lease, self.lag)

    def rebalance_in_progress(self) -> bool:
        """Told a rebalance is under way (after its last stable answer), or joining."""
        return lease.rebalance_in_progress(self.facts)

    def silent_for(self, heard: int | None, now: int) -> int:
        """How long (micros) the coordinator has said nothing as this member's
        (``protocol.lease.silent_for``)."""
        return lease.silent_for(self.facts, heard, now)

    # -- events -----------------------------------------------------------------------------
    def handle(self, event: MemberEvent, now: int) -> list[MemberCommand]:
        """Apply one event at ``now``; what the shell must do."""
        facts = self.facts
        match event:
            case LoopLagged(lag=lag):
                self.lag = max(0, lag)
            case JoinSent(sent=sent):
                self.facts = lease.join_sent(facts, sent)
            case JoinAnswered():
                self.facts = lease.join_answered(facts)
            case JoinFailed():
                self.facts = lease.join_failed(facts)
            case HeartbeatAnswered(sent=sent, rebalancing=rebalancing):
                self.facts = lease.heartbeat_answered(facts, sent, rebalancing=rebalancing)
            case SyncAnswered(sent=sent):
                self.facts = lease.sync_answered(facts, sent)
            case MembershipLost():
                self.facts = lease.lost(facts)
                return []
            case Assigned():
                return [self._assigned(event)]
            case _:
                assert_never(event)
        until = self.lease_until()
        return [] if until is None else [LeaseUntil(until)]

    def _assigned(self, event: Assigned) -> Take | Refuse:
        own = self.rules.accept_landed_epochs and epochs.landed_first(
            event.epoch, event.leader, event.members, self.epoch_seen, event.logged
        )
        if own:
            self.landed_first += 1
        verdict: epochs.Accepted | epochs.Stale = epochs.receive(
            event.epoch, event.generation, self.known(event.floor), own=own
        )
        if not self.rules.epoch_rules:
            verdict = epochs.Accepted(event.epoch)
        if isinstance(verdict, epochs.Stale):
            self.stale_epochs += 1
            return Refuse(verdict.epoch, verdict.known, landed_first=own)
        self.epoch_seen = verdict.epoch
        return Take(verdict.epoch, event.leader, event.members, event.fresh, landed_first=own)

    def validate(self) -> None:
        """The core's invariants (the simulator and ``--debug-validate`` call it after every
        step)."""
        f = self.facts
        assert self.epoch_seen >= NO_EPOCH, self.epoch_seen
        assert self.stale_epochs >= 0, self.stale_epochs
        assert self.landed_first >= 0, self.landed_first
        assert self.lag >= 0, self.lag
        if f.member:  # a SyncGroup was answered: it is alive from its send time
            assert f.alive is not None, f
        if f.stable is not None:  # a stable answer is an answer as this member's too
            assert f.alive is not None, f
            assert f.stable <= f.alive, f
