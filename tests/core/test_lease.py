"""The membership lease rule (``protocol.lease``): exact deadlines for each fact, and the two
ways of getting it wrong that the fault simulator's teeth tests use."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import lease
from protocol.lease import LeaseRules, LeaseTiming, MemberFacts

S, R, M = 3_000_000, 6_000_000, 500_000
TIMING = LeaseTiming(session=S, rebalance=R, margin=M)


def joined(at: int) -> MemberFacts:
    """A member whose join (sent at ``at``) and sync (sent 10 ms later) were answered."""
    facts = lease.join_answered(lease.join_sent(MemberFacts(), at))
    return lease.sync_answered(facts, at + 10_000)


def test_no_lease_before_the_first_sync_or_after_a_loss() -> None:
    assert lease.valid_until(MemberFacts(), TIMING) is None
    facts = lease.join_answered(lease.join_sent(MemberFacts(), 0))
    assert lease.valid_until(facts, TIMING) is None  # joined, not synced: not a member yet
    assert lease.valid_until(lease.lost(joined(0)), TIMING) is None


def test_a_stable_member_holds_a_session_from_its_last_heartbeat_send() -> None:
    facts = lease.heartbeat_answered(joined(0), 1_000_000, rebalancing=False)
    assert lease.valid_until(facts, TIMING) == 1_000_000 + S - M
    assert not lease.rebalance_in_progress(facts)


def test_rebalance_in_progress_answer_proves_alive_but_not_stable() -> None:
    facts = lease.heartbeat_answered(joined(0), 1_000_000, rebalancing=False)
    facts = lease.heartbeat_answered(facts, 2_000_000, rebalancing=True)
    assert lease.rebalance_in_progress(facts)
    # alive + session = 5.0 s, stable + rebalance = 7.0 s
    assert lease.valid_until(facts, TIMING) == 2_000_000 + S - M


def test_the_rebalance_timeout_bounds_the_lease_from_the_last_stable_answer() -> None:
    short = LeaseTiming(session=S, rebalance=2_000_000, margin=M)
    facts = lease.heartbeat_answered(joined(0), 1_000_000, rebalancing=False)
    facts = lease.heartbeat_answered(facts, 2_500_000, rebalancing=True)
    # alive + session = 5.5 s, but the join phase may end (removing a member that did not join)
    # at stable + rebalance = 3.0 s
    assert lease.valid_until(facts, short) == 1_000_000 + 2_000_000 - M
    broken = LeaseRules(rebalance_bound=False)
    assert lease.valid_until(facts, short, broken) == 2_500_000 + S - M


def test_a_join_in_flight_adds_nothing_until_answered() -> None:
    facts = lease.heartbeat_answered(joined(0), 2_000_000, rebalancing=True)
    before = lease.valid_until(facts, TIMING)
    facts = lease.join_sent(facts, 2_100_000)
    assert lease.rebalance_in_progress(facts)
    assert lease.valid_until(facts, TIMING) == before == 2_000_000 + S - M
    broken = LeaseRules(join_in_flight_counts=True)
    assert lease.valid_until(facts, TIMING, broken) == 2_100_000 + S - M
    answered = lease.join_answered(facts)
    assert lease.valid_until(answered, TIMING) == 2_100_000 + S - M
    assert lease.valid_until(lease.join_failed(facts), TIMING) == before


def test_sync_renews_from_its_send_time_and_ends_the_rebalance() -> None:
    facts = lease.heartbeat_answered(joined(0), 2_000_000, rebalancing=True)
    facts = lease.join_answered(lease.join_sent(facts, 2_100_000))
    facts = lease.sync_answered(facts, 4_000_000)
    assert lease.valid_until(facts, TIMING) == 4_000_000 + S - M
    assert not lease.rebalance_in_progress(facts)


def test_timing_refuses_a_margin_as_long_as_a_timeout() -> None:
    with pytest.raises(ValueError, match="margin"):
        LeaseTiming(session=S, rebalance=S, margin=S)
    with pytest.raises(ValueError, match="margin"):
        LeaseTiming(session=S, rebalance=100, margin=200)


_step = st.one_of(
    st.tuples(st.just("hb"), st.integers(0, 2_000_000), st.booleans()),
    st.tuples(st.just("join"), st.integers(0, 2_000_000), st.booleans()),
    st.tuples(st.just("sync"), st.integers(0, 2_000_000), st.booleans()),
)


@given(st.lists(_step, max_size=30))
def test_the_lease_never_goes_back_and_never_passes_its_bounds(
    steps: list[tuple[str, int, bool]],
) -> None:
    """Facts only grow while a member, so the lease never moves back; it is never later than the
    last answered request's send plus the session, nor the last stable answer's plus the
    rebalance timeout (minus the margin)."""
    facts, now, last = joined(0), 10_000, lease.valid_until(joined(0), TIMING)
    for kind, gap, flag in steps:
        now += gap
        if kind == "hb":
            facts = lease.heartbeat_answered(facts, now, rebalancing=flag)
        elif kind == "join":
            facts = lease.join_sent(facts, now)
            facts = lease.join_answered(facts) if flag else lease.join_failed(facts)
        else:
            facts = lease.sync_answered(facts, now)
        until = lease.valid_until(facts, TIMING)
        assert until is not None
        assert last is not None
        assert until >= last
        assert facts.alive is not None
        assert facts.stable is not None
        assert until <= facts.alive + S - M
        assert until <= facts.stable + R - M
        last = until


def test_silence_counts_from_the_answer_of_a_held_sync_group_not_its_send_time() -> None:
    """A follower's SyncGroup sent at 1 s is held by the coordinator until its slow leader's
    comes, and answered at 5.5 s. The lease (from the send time, session 4 s) has run out, so
    the member reads nothing; but the coordinator answered it just now: it is reachable, and
    the membership is not declared lost (that made a member of the new generation rejoin and
    start another rebalance). Nothing answered at all: silence counts from the send time."""
    sec = 1_000_000
    timing = LeaseTiming(session=4 * sec, rebalance=10 * sec, margin=sec // 2)
    facts = lease.sync_answered(MemberFacts(), 1 * sec)
    assert lease.valid_until(facts, timing) == 4_500_000
    assert lease.silent_for(facts, heard=5_500_000, now=5_600_000) == 100_000
    assert lease.silent_for(facts, heard=None, now=5_600_000) == 4_600_000
    assert lease.silent_for(MemberFacts(), heard=None, now=7) == 7


def test_a_lagging_loop_grows_the_margin_up_to_half_the_shorter_timeout() -> None:
    facts = joined(0)  # alive and stable from 10 ms
    base = lease.valid_until(facts, TIMING)
    assert base == 10_000 + S - M
    # the loop ran 0.8 s late lately: the task may see its lease end 0.8 s late, so it ends
    # 0.8 s earlier
    assert lease.valid_until(facts, TIMING, lag=800_000) == 10_000 + S - M - 800_000
    assert lease.margin_under_lag(TIMING, 800_000) == M + 800_000
    # a stall of seconds: the margin stops at half the session (3 s), a lease is left
    assert lease.margin_under_lag(TIMING, 10_000_000) == S // 2
    assert lease.valid_until(facts, TIMING, lag=10_000_000) == 10_000 + S - S // 2
    # no lag (or a negative measurement): the configured margin
    assert lease.margin_under_lag(TIMING, 0) == M
    assert lease.margin_under_lag(TIMING, -5) == M
    # a configured margin above half the session is kept, never lowered
    wide = LeaseTiming(session=S, rebalance=R, margin=2_000_000)
    assert lease.margin_under_lag(wide, 5_000_000) == 2_000_000
