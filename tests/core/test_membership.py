"""The member core (``protocol.membership``): the exact commands it returns for each event, what
it says when it joins, and how it numbers a generation as the group's leader."""

from __future__ import annotations

import pytest

from protocol.epochs import NO_EPOCH, Logged
from protocol.lease import LeaseRules, LeaseTiming, MemberFacts
from protocol.membership import (
    Assigned,
    HeartbeatAnswered,
    JoinAnswered,
    JoinFailed,
    JoinSent,
    LeaseUntil,
    LoopLagged,
    MemberCore,
    MemberRules,
    MembershipLost,
    Numbered,
    Refuse,
    Said,
    SyncAnswered,
    Take,
)

TIMING = LeaseTiming(session=3_000, rebalance=6_000, margin=500)


def _core(rules: MemberRules | None = None) -> MemberCore:
    return MemberCore("a", TIMING, rules)


def _member(epoch: int = 4) -> MemberCore:
    """A member of the generation with ``epoch``: joined at 100, synced at 200."""
    core = _core()
    core.handle(JoinSent(100), 100)
    core.handle(JoinAnswered(), 150)
    core.handle(SyncAnswered(200), 250)
    assert core.handle(Assigned(epoch, epoch, "a", ("a",)), 250) == [Take(epoch, "a", ("a",))]
    return core


def test_a_join_proves_nothing_until_the_sync_is_answered() -> None:
    core = _core()
    assert core.handle(JoinSent(100), 100) == []  # no lease: not a member
    assert core.facts == MemberFacts(join_sent=100)
    assert core.rebalance_in_progress()
    assert core.handle(JoinAnswered(), 150) == []
    assert core.facts == MemberFacts(alive=100, stable=100)
    # the SyncGroup's answer makes it a member: lease = min(200 + 3000, 200 + 6000) - 500
    assert core.handle(SyncAnswered(200), 250) == [LeaseUntil(2_700)]
    assert core.lease_until() == 2_700
    assert not core.rebalance_in_progress()
    core.validate()


def test_heartbeats_renew_the_lease_within_the_rebalance_bound() -> None:
    core = _member()
    assert core.handle(HeartbeatAnswered(1_000, rebalancing=False), 1_010) == [LeaseUntil(3_500)]
    # told REBALANCE_IN_PROGRESS: alive from 4000, but bounded by the last stable answer (1000)
    assert core.handle(HeartbeatAnswered(4_000, rebalancing=True), 4_010) == [LeaseUntil(6_500)]
    assert core.handle(HeartbeatAnswered(6_000, rebalancing=True), 6_010) == [LeaseUntil(6_500)]
    assert core.rebalance_in_progress()
    core.validate()


def test_a_join_in_flight_or_failed_does_not_move_the_lease() -> None:
    core = _member()
    assert core.handle(JoinSent(1_000), 1_000) == [LeaseUntil(2_700)]
    assert core.handle(JoinFailed(), 3_000) == [LeaseUntil(2_700)]
    assert core.facts.join_sent is None


def test_the_broken_lease_rule_counts_a_join_in_flight() -> None:
    core = _core(MemberRules(lease=LeaseRules(join_in_flight_counts=True)))
    core.handle(SyncAnswered(200), 200)
    assert core.handle(JoinSent(1_000), 1_000) == [LeaseUntil(3_500)]


def test_a_loss_forgets_the_facts_but_not_the_epoch() -> None:
    core = _member(epoch=4)
    assert core.handle(MembershipLost("fenced"), 300) == []
    assert core.facts == MemberFacts()
    assert core.lease_until() is None
    assert core.epoch_seen == 4
    assert not core.fresh


def test_an_assignment_newer_than_every_known_epoch_is_taken() -> None:
    core = _core()
    assert core.said() == Said("a", NO_EPOCH, fresh=True)
    taken = core.handle(Assigned(8, 1, "b", ("a", "b"), ("b",), floor=7), 0)
    assert taken == [Take(8, "b", ("a", "b"), ("b",))]
    assert core.epoch_seen == 8
    assert core.said() == Said("a", 8, fresh=False)
    assert (core.stale_epochs, core.landed_first) == (0, 0)


@pytest.mark.parametrize(
    ("epoch", "generation", "floor", "refused"),
    [
        (7, 7, 7, Refuse(7, 7)),  # the CIM's epoch is not older
        (3, 3, 5, Refuse(3, 5)),
        (NO_EPOCH, 5, 5, Refuse(5, 5)),  # a leader predating epochs: the generation
    ],
)
def test_a_stale_assignment_is_refused(
    epoch: int, generation: int, floor: int, refused: Refuse
) -> None:
    core = _core()
    assert core.handle(Assigned(epoch, generation, "b", ("a", "b"), floor=floor), 0) == [refused]
    assert core.epoch_seen == NO_EPOCH  # nothing taken
    assert core.stale_epochs == 1
    assert refused.reason == f"assigned a stale epoch {refused.epoch} (epoch {floor} is known here)"


def test_an_assignment_refused_against_the_epoch_last_taken() -> None:
    core = _member(epoch=4)
    assert core.handle(Assigned(4, 4, "a", ("a",)), 0) == [Refuse(4, 4)]


def test_its_own_epoch_landed_first_is_taken() -> None:
    """Rule 5: the CIM holds the assignment's own epoch (same leader and members)."""
    logged = Logged(6, "b", ("a", "b"))
    core = _core()
    got = core.handle(Assigned(6, 6, "b", ("a", "b"), floor=6, logged=logged), 0)
    assert got == [Take(6, "b", ("a", "b"), landed_first=True)]
    assert core.landed_first == 1
    # another leader's epoch 6 in the CIM is not this assignment's own
    other = _core()
    got = other.handle(
        Assigned(6, 6, "b", ("a", "b"), floor=6, logged=Logged(6, "c", ("a", "b"))), 0
    )
    assert got == [Refuse(6, 6)]


def test_the_teeth_rules_refuse_landed_epochs_or_take_anything() -> None:
    logged = Logged(6, "b", ("a", "b"))
    refusing = _core(MemberRules(accept_landed_epochs=False))
    assert refusing.handle(Assigned(6, 6, "b", ("a", "b"), floor=6, logged=logged), 0) == [
        Refuse(6, 6)
    ]
    careless = _core(MemberRules(epoch_rules=False))
    assert careless.handle(Assigned(2, 2, "b", ("a", "b"), floor=6), 0) == [
        Take(2, "b", ("a", "b"))
    ]
    assert careless.epoch_seen == 2


def test_what_a_member_says_when_it_joins() -> None:
    core = _core()
    assert core.said() == Said("a", NO_EPOCH, fresh=True)
    assert core.said(floor=9) == Said("a", 9, fresh=True)
    assert _core(MemberRules(report_fresh=False)).said() == Said("a", NO_EPOCH, fresh=False)
    member = _member(epoch=4)
    assert member.said(floor=2) == Said("a", 4, fresh=False)
    assert member.said(floor=7) == Said("a", 7, fresh=False)
    # assigned a generation, but its task has read nothing (TaskCore.joining): still fresh
    assert member.said(floor=7, unread=True) == Said("a", 7, fresh=True)
    assert _core(MemberRules(report_fresh=False)).said(unread=True).fresh is False


def test_the_leader_numbers_a_generation_over_what_its_members_said() -> None:
    leader = _member(epoch=4)
    said = [Said("a", 4), Said("b", 9, fresh=False), Said("c", NO_EPOCH, fresh=True)]
    assert leader.number(5, said) == Numbered(10, ("c",))
    # while Kafka keeps its generations, the epoch is the generation
    assert leader.number(12, said) == Numbered(12, ("c",))
    # the leader's own CIM counts too, and a task id with an older life is not fresh
    again = [Said("c", NO_EPOCH, fresh=True), Said("c", 3, fresh=False)]
    assert leader.number(5, again, floor=11) == Numbered(12, ())
    # the teeth rule: the generation as given
    careless = _core(MemberRules(epoch_rules=False))
    assert careless.number(5, said) == Numbered(5, ("c",))


def test_silence_counts_from_the_later_of_the_last_send_and_the_last_answer() -> None:
    core = _member()
    assert core.silent_for(heard=None, now=1_200) == 1_000  # since the SyncGroup's send (200)
    assert core.silent_for(heard=900, now=1_200) == 300


def test_the_loops_lag_grows_the_margin_of_the_leases_reported_next() -> None:
    core = _member()
    assert core.handle(HeartbeatAnswered(1_000, rebalancing=False), 1_010) == [LeaseUntil(3_500)]
    # the loop ran 400 us late lately: the lease the same facts give ends 400 us earlier
    assert core.handle(LoopLagged(400), 1_020) == [LeaseUntil(3_100)]
    assert core.lease_until() == 3_100
    assert core.handle(HeartbeatAnswered(2_000, rebalancing=False), 2_010) == [LeaseUntil(4_100)]
    # a long stall: the margin stops at half the session (1500), a lease is left
    assert core.handle(LoopLagged(9_000), 2_020) == [LeaseUntil(3_500)]
    assert core.handle(LoopLagged(0), 2_030) == [LeaseUntil(4_500)]
    core.validate()


def test_a_lag_before_membership_reports_no_lease() -> None:
    core = _core()
    assert core.handle(LoopLagged(400), 10) == []
    assert core.lag == 400
    core.validate()
