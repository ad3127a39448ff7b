"""The membership lease: until when a member of the heartbeat group surely still is one, derived
from the classic group protocol, so that a member holds its lease through a rebalance it takes
part in and still stops before anyone else can be given its partitions
(docs/design.md#membership-and-leases).

A task may read only under a valid lease. The lease must end before the coordinator can remove the
member from the group, since only a generation without it lets another task be given its
partitions. Everything below is about when the coordinator may remove a member.

What the coordinator does (the classic protocol, Kafka's ``GroupCoordinator``/``MemberMetadata``)
  K1. Every request it processes from a member of the group — a heartbeat answered ``NONE`` or
      ``REBALANCE_IN_PROGRESS`` (in ``PreparingRebalance`` the heartbeat is answered so *and*
      restarts the session), a JoinGroup it answers (``onCompleteJoin`` restarts every joined
      member's session), a SyncGroup it answers (``propagateAssignment`` restarts it) — restarts
      that member's session: the member stays until at least the session timeout after it.
  K2. A rebalance begins (``PreparingRebalance``) at some time T. A member that has not sent
      its JoinGroup by the end of the join phase is removed at that end, and the join phase ends
      at the latest at T + the rebalance timeout (JoinGroup's ``rebalance_timeout_ms``; the
      group's is the largest of its members'). It may end earlier only once every member has
      joined or was removed. T is later than any moment at which the coordinator answered a
      heartbeat ``NONE`` or answered a JoinGroup or SyncGroup of this member (at those moments no
      rebalance was being prepared, or its join phase had ended).
  K3. Otherwise a member is removed only when its session expires, when it leaves (LeaveGroup,
      sent only when the task stops reading for good), or when it is fenced (it then learns so
      at its next request).
  K4. A member with a JoinGroup the coordinator holds is kept until the join phase ends and is
      then in the next generation (K1 restarts its session). But a JoinGroup that has not been
      answered proves nothing: it may never have reached the coordinator, or reached it after
      the member was removed (it is then answered ``UNKNOWN_MEMBER_ID``).

  aiokafka (0.14) answers: it heartbeats every ``heartbeat_interval_ms`` while the group is
  stable, counts ``REBALANCE_IN_PROGRESS`` as a successful heartbeat and then *stops*
  heartbeating while its JoinGroup and SyncGroup are in flight, and starts again after the
  SyncGroup is answered. The membership adapter therefore heartbeats itself, on a second
  connection, while its rebalance is in flight (``runtime/kafka/membership.py``, ``_probe``):
  by K1 each such heartbeat answered ``REBALANCE_IN_PROGRESS`` (or ``NONE``, Kafka's answer in
  ``CompletingRebalance``) restarts the session, and it is a fact like any other heartbeat's.
  Without them a member whose JoinGroup or SyncGroup the coordinator held (waiting for a dead
  member, or for a dead leader's SyncGroup) lost its lease although it stayed in the group.

The embedded broker (Tansu 0.6.0) differs, and the rule takes the stricter of the two:
  T1. It has no join phase bounded by a rebalance timeout (it ignores ``rebalance_timeout_ms``)
      and removes a member whose last request (of any kind) it processed more than the session
      timeout ago; every heartbeat, JoinGroup and SyncGroup of the member counts, and a
      heartbeat during a rebalance is answered ``REBALANCE_IN_PROGRESS`` after it counted.
  T2. It holds a JoinGroup for about half the session timeout (re-examining it every second,
      each time counting it as contact) before it answers.
  Both are consistent with K1, K3 and K4 (Tansu only removes *later* than K2 allows), so the
  Kafka bound is the stricter one and is the rule. Checked against the broker by
  ``tests/integration/test_kafka_group.py``: a member whose JoinGroup is held is kept,
  heartbeats during a rebalance are answered ``REBALANCE_IN_PROGRESS``, and heartbeats on a
  second connection while the member's own JoinGroup or SyncGroup is held are answered as the
  member's and keep its lease (without them, with the group's leader killed, it lapsed for
  about 4.5 s).

Timing assumptions
  A1. Causality: the coordinator processes a request after the member sent it, so every time
      below is the member's clock *just before sending* (never when the answer came back: that
      would count the answer's way back as membership).
  A2. Clock rates: the member's monotonic clock and the coordinator's clock run at the same
      rate within a factor the margin absorbs; the margin also covers how long the task takes
      to see that its lease ended and stop handing batches to the sink. The margin is taken
      off the bound below, never added.
  A3. Every fact is a send time, and the facts only ever take the newest (``max``), so the
      order in which answers come back does not matter, nor whether they come on one connection
      or two (the adapter's heartbeats during a rebalance use a second one). An error on a
      connection or a timed-out request says nothing about whether the coordinator processed
      it: it is no proof of anything, and it never extends the lease (K4: an unanswered
      JoinGroup neither). An answer to a request of an earlier membership (sent before the
      membership was lost) is dropped.
  A4. Every member uses the same rebalance timeout (the group's is the largest, so a member
      with a smaller one only makes this bound shorter than it could be).

The rule (:func:`valid_until`)
  With ``alive`` the latest send time of a request answered as this member's (K1: heartbeat
  answered ``NONE`` or ``REBALANCE_IN_PROGRESS``, JoinGroup or SyncGroup answered ``NONE``) and
  ``stable`` the latest send time of one answered in a way that shows no rebalance was being
  prepared (heartbeat ``NONE``, JoinGroup or SyncGroup answered ``NONE``)::

      lease = min(alive + session_timeout, stable + rebalance_timeout) - margin

  where the margin is the configured one plus how late the member's event loop has lately run
  (A2), at most half the shorter timeout (:func:`margin_under_lag`).

  By K1 and K3 nothing but the join phase removes the member before ``alive + session``; by K2
  the join phase of a rebalance that began after ``stable`` cannot end before
  ``stable + rebalance``. A member told ``REBALANCE_IN_PROGRESS`` keeps its lease from that
  answer (the answer proves the coordinator saw it alive then) up to the rebalance timeout from
  its last stable answer; its JoinGroup's answer, and then its SyncGroup's, renew it from their
  send times. A JoinGroup in flight adds nothing (K4, A3). So a member whose rebalance completes
  within ``session - margin`` of its last answered heartbeat, and within
  ``rebalance - margin`` of its last stable answer, never loses its lease, and one that is
  paused or cut off still stops before the coordinator can remove it.

:class:`LeaseRules` exists for the fault simulator's teeth tests, which break the rule on
purpose (count a JoinGroup in flight, or drop the rebalance-timeout bound) and must see two
readers of one partition.
"""

from __future__ import annotations

from typing import Final

import msgspec


class LeaseTiming(msgspec.Struct, frozen=True):
    """The group's timeouts and the lease margin, in microseconds of the member's clock."""

    session: int
    rebalance: int
    margin: int

    def __post_init__(self) -> None:
        if not 0 <= self.margin < min(self.session, self.rebalance):
            raise ValueError(
                f"the margin ({self.margin}) must be >= 0 and below the session ({self.session}) "
                f"and rebalance ({self.rebalance}) timeouts"
            )


class LeaseRules(msgspec.Struct, frozen=True):
    """The rule as derived (the defaults), or broken for a teeth test."""

    # broken: a JoinGroup in flight counts as proof of membership from its send time
    join_in_flight_counts: bool = False
    # broken: the rebalance timeout does not bound the lease (only the session does)
    rebalance_bound: bool = True


class MemberFacts(msgspec.Struct, frozen=True):
    """What a member knows about its membership, with the send times (micros) of the requests
    that prove it. ``None``: no such answer in this membership."""

    member: bool = False  # a SyncGroup was answered and the membership not lost since
    alive: int | None = None  # latest send time of an answer as this member's (K1)
    stable: int | None = None  # latest send time of an answer that shows no rebalance (K2)
    join_sent: int | None = None  # send time of the JoinGroup in flight, if any


def heartbeat_answered(facts: MemberFacts, sent: int, *, rebalancing: bool) -> MemberFacts:
    """A heartbeat sent at ``sent`` was answered ``NONE`` (``rebalancing=False``) or
    ``REBALANCE_IN_PROGRESS`` (``rebalancing=True``)."""
    alive = _newest(facts.alive, sent)
    stable = facts.stable if rebalancing else _newest(facts.stable, sent)
    return msgspec.structs.replace(facts, alive=alive, stable=stable)


def join_sent(facts: MemberFacts, sent: int) -> MemberFacts:
    """A JoinGroup was sent at ``sent`` (it proves nothing until answered: K4)."""
    return msgspec.structs.replace(facts, join_sent=sent)


def join_answered(facts: MemberFacts) -> MemberFacts:
    """The JoinGroup in flight was answered ``NONE``: the member is in the next generation."""
    sent = facts.join_sent
    if sent is None:
        return facts
    return msgspec.structs.replace(
        facts, alive=_newest(facts.alive, sent), stable=_newest(facts.stable, sent), join_sent=None
    )


def join_failed(facts: MemberFacts) -> MemberFacts:
    """The JoinGroup in flight failed (an error answer, a timeout, a broken connection): no
    proof of anything (A3)."""
    return msgspec.structs.replace(facts, join_sent=None)


def sync_answered(facts: MemberFacts, sent: int) -> MemberFacts:
    """A SyncGroup sent at ``sent`` was answered ``NONE``: a member of the new generation."""
    return msgspec.structs.replace(
        facts,
        member=True,
        alive=_newest(facts.alive, sent),
        stable=_newest(facts.stable, sent),
    )


def lost(facts: MemberFacts) -> MemberFacts:
    """The membership is lost (fenced, unknown member id, given up): nothing proven carries over
    to the next membership."""
    return MemberFacts()


def rebalance_in_progress(facts: MemberFacts) -> bool:
    """The member was told a rebalance is under way (an answer after its last stable one) or has
    a JoinGroup in flight."""
    if facts.join_sent is not None:
        return True
    return facts.alive is not None and (facts.stable is None or facts.alive > facts.stable)


DERIVED: Final = LeaseRules()


def margin_under_lag(timing: LeaseTiming, lag: int) -> int:
    """The margin for a member whose event loop has lately run up to ``lag`` micros late
    (A2: the margin covers how long the task takes to see that its lease ended; a stalled loop
    sees it that much later): the configured margin plus the lag, at most half the shorter
    timeout, so that a loop stalled for seconds shortens the lease but leaves one."""
    ceiling = max(timing.margin, min(timing.session, timing.rebalance) // 2)
    return min(timing.margin + max(0, lag), ceiling)


def valid_until(
    facts: MemberFacts, timing: LeaseTiming, rules: LeaseRules = DERIVED, lag: int = 0
) -> int | None:
    """The end of the lease (micros, exclusive): ``min(alive + session, stable + rebalance) -
    margin``, the margin grown by the loop's recent ``lag`` (:func:`margin_under_lag`);
    ``None`` while not a member (no lease)."""
    if not facts.member or facts.alive is None:
        return None
    alive = facts.alive
    if rules.join_in_flight_counts and facts.join_sent is not None:
        alive = max(alive, facts.join_sent)
    until = alive + timing.session
    if rules.rebalance_bound:
        stable = facts.stable if facts.stable is not None else alive
        until = min(until, stable + timing.rebalance)
    return until - margin_under_lag(timing, lag)


def silent_for(facts: MemberFacts, heard: int | None, now: int) -> int:
    """How long (micros) the coordinator has said nothing as this member's: since the later of
    the latest answered request's send time (``facts.alive``) and when its answer came
    (``heard``, the member's clock at the answer). This measures whether the coordinator is
    reachable, not the membership: a SyncGroup the coordinator held for a whole session (its
    leader was slow) proves membership only from its send time (the lease may have run out,
    and the member reads nothing until its next heartbeat's answer renews it), but the answer
    shows the coordinator alive and this member in the new generation."""
    latest = max((t for t in (facts.alive, heard) if t is not None), default=None)
    return now - latest if latest is not None else now


def _newest(old: int | None, new: int) -> int:
    return new if old is None else max(old, new)
