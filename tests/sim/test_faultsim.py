"""The seeded many-task fault simulator: a sweep of seeds must pass every invariant, seeds that
failed during development stay as regression tests, and deliberately broken rules must be caught
(the simulator has teeth)."""

from __future__ import annotations

import pytest

from protocol.broken import first_parent_readable
from protocol.lease import LeaseRules
from protocol.reader import ReaderRules
from runtime.sim.faultsim import SimParams, run
from tests.sim.params import sim_params

CHUNK = 15
CHUNKS = 8  # 120 seeds in CI; `python -m bench sim --seeds 10000` runs the long sweep
# and a share of the sweep with a sink that fails batches (the readers re-read from their
# committed positions): 30 more seeds; `python -m bench sim --sink-fail-p 0.05` the long one
SINK_FAIL_CHUNKS = 2
SINK_FAIL_P = 0.05

# Seeds that exposed real bugs while the protocol was built: a lease renewed too late, a task
# picking up a partition it was handing away, a leader dropping its own offers, an offer
# dropped because a dead task still held the partition, watermarks going back after a zombie,
# a resync loop on coalesced watermarks (369), an offer withdrawn over a dropped owner's stale
# claim (336), no task left for the quiet phase (202), a held pickup read twice after the epoch
# re-planned it (648), a dropped task's claim landing after the epoch that dropped it (653), a
# frozen offerer's stale offer to a task that came back under its id, beside the leader's re-plan
# of it (468, 1839), a parent removed on a dropped task's word that its child had finished
# while the epoch dealt the child out again, unread (1959); from the 10,000-seed sweep: a paused
# task's held messages landing after its newer ones when the quiet phase cut the pause short
# (317, 8077; a simulator bug), and a storm of re-sends fed by counting a re-delivered copy of an
# own message as a second read-back (731). Since leases hold through rebalances: a leader back
# from a pause past its lease planning its old generation from a CIM that had read nothing, its
# fenced epoch's offers published in a later generation (597, 824, 1502, 1869: a root read to
# its end dealt out again from its start), and followers expelled right after the coordinator
# answered their SyncGroups (1744, two readers of one partition; a simulator bug), and a
# hand-off released by a task the rebalance dropped, completed before the epoch landed while the
# leader dealt the partition to another member (2126, two readers). From the 10,000-seed sweep
# of f6a4792: a leader's release sent as a removal alone while its share section waited for its
# epoch, the leader dying before the offer went out (8291, a partition lost), and an answer to a
# later generation erased by the epoch that dropped its writer, whose generation then waited
# for its leader's answer for ever (8675, a partition lost). Once followers' assignments lagged
# behind the leader's (2026-11): a move whose answer a new epoch fenced, never answered again
# (1012, balancing held for good), and a leader's old 'new' offer to a task an epoch dropped,
# picked up beside the next leader's re-plan of it when the task came back (942, two readers),
# and the same with a released move (387); and the newest-offer rule holding a released move
# whose offerer was also the re-plan's target, which it never takes (229, a partition lost).
REGRESSIONS = [
    0,
    6,
    8,
    35,
    57,
    101,
    105,
    111,
    117,
    130,
    202,
    296,
    317,
    336,
    348,
    369,
    468,
    597,
    642,
    648,
    653,
    731,
    824,
    1502,
    1744,
    1839,
    1869,
    1959,
    2126,
    8077,
    8291,
    8675,
]


def _check(seed: int, **overrides: object) -> None:
    result = run(sim_params(seed=seed, **overrides))
    assert result.passed, (
        f"seed {seed}: {result.violation} (replay: python -m bench sim --seed {seed} "
        "--snapshot-partitions 0)"
    )


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_seed_sweep(chunk: int) -> None:
    for seed in range(1000 + chunk * CHUNK, 1000 + (chunk + 1) * CHUNK):
        _check(seed)


@pytest.mark.parametrize("chunk", range(SINK_FAIL_CHUNKS))
def test_seed_sweep_with_a_failing_sink(chunk: int) -> None:
    failures = 0
    for seed in range(5000 + chunk * CHUNK, 5000 + (chunk + 1) * CHUNK):
        result = run(sim_params(seed=seed, sink_fail_p=SINK_FAIL_P))
        assert result.passed, (
            f"seed {seed}: {result.violation} (replay: python -m bench sim --seed {seed} "
            f"--sink-fail-p {SINK_FAIL_P} --snapshot-partitions 0)"
        )
        failures += result.sink_failures
    assert failures > CHUNK, "the sink failed too few batches to matter"


# What the seeds above were found with: every member's assignment arriving at once (followers
# lag since 2026-11). Each regression seed runs both ways: the history it was found in, and
# today's.
# Nor did a rejoined task read before its generation's epoch then (resume_on_answer), nor was a
# restarted task that answered reset (reset_answered_fresh).
FOUND_WITH: dict[str, object] = {
    "follower_lag_us": (0, 0),
    "resume_on_answer": False,
    "heartbeat_while_rebalancing": False,
    "reset_answered_fresh": False,
    "fresh_until_read": False,
}
# Found with followers lagging and a 0.5 s answer wait (a leader planning before their answers).
SHORT_WAIT: dict[str, object] = {"answer_timeout_us": 500_000}
LAG_REGRESSIONS = [229, 387, 942, 1012, 3190, 3330, 4262, 4652, 4954]


@pytest.mark.parametrize("seed", REGRESSIONS)
@pytest.mark.parametrize("found_with", [False, True], ids=["shipped", "found-with"])
def test_regression_seed(seed: int, found_with: bool) -> None:
    _check(seed, **(FOUND_WITH if found_with else {}))


# the membership model before the adapter heartbeated during its rebalances (2026-11-27), and
# the plan before a restarted task that answered was reset (2026-11-28): the seeds of some tests
# below were found in those histories, and run with them
HELD_REBALANCES: dict[str, object] = {
    "heartbeat_while_rebalancing": False,
    "reset_answered_fresh": False,
    "fresh_until_read": False,
}
# Before 2026-12-03 a life was fresh only until its first generation (Rules.fresh_until_read)
# and the leader waited for the answers of fresh members it resets anyway
# (Rules.plan_without_fresh_answers): since then more restarted tasks are reset, and sooner,
# which changes the histories of the seeds teeth tests found before, so their broken runs keep
# the old rules (their controls run today's).
FRESH_UNTIL_ASSIGNED: dict[str, object] = {
    "fresh_until_read": False,
    "plan_without_fresh_answers": False,
}
# The histories the lag regressions were found in had no resets (protocol/planner.py): a seed
# that resets now may miss the hole it found, so each also runs without the group reporting
# fresh lives.
NO_RESETS: dict[str, object] = {
    **SHORT_WAIT,
    "report_fresh": False,
    "resume_on_answer": False,
    **HELD_REBALANCES,
}


@pytest.mark.parametrize("seed", LAG_REGRESSIONS)
@pytest.mark.parametrize(
    "variant", [{}, SHORT_WAIT, NO_RESETS], ids=["shipped", "found-with", "found-with-no-resets"]
)
def test_lag_regression_seed(seed: int, variant: dict[str, object]) -> None:
    _check(seed, **variant)


def test_a_finished_partitions_end_waits_for_its_child_offers() -> None:
    """Seed 3212 (found by the sweep with heartbeats during rebalances): a task read a partition
    to its end while its plan's epoch was on its way, so the share section with its offer of
    one child was held back; its state message carried the parent's end (naming the child) and
    the task died: the child was known to nobody and never read. The parent's end now waits
    for the share section (protocol/task.py, ``_diff``, the rule of ``release_with_offer``);
    with that rule off the child is lost again."""
    _check(3212)
    _check(3212, **HELD_REBALANCES)
    broken = run(sim_params(seed=3212, release_with_offer=False, **FRESH_UNTIL_ASSIGNED))
    assert "p00037 is owned by []" in broken.violation, broken


def test_a_move_between_live_members_is_not_dealt_out_for_a_dead_tasks_stale_share() -> None:
    """Seed 5799 (found by the sweep with heartbeats during rebalances): t03 released a move of
    p00045 to t02, which had answered it; the leader's plan counted p00045 ownerless because a
    dropped task still showed an old released move of it, and dealt it to t03. t02 gave its
    take-over up to the plan, t03 never picks up an offer of what it is handing away, and the
    partition (and its merged child) was never read again. ``planner.ownerless`` holds an
    answered hand-off between two members; with that rule off the seed fails again. (Holding
    every move between members, answered or not, made seed 723 fail safety.)"""
    _check(5799)
    _check(5799, **HELD_REBALANCES)  # passes in the old membership model's history
    _check(723)
    broken = run(sim_params(seed=5799, hold_handoffs=False, **FRESH_UNTIL_ASSIGNED))
    assert "is owned by []" in broken.violation, broken


def test_runs_are_deterministic() -> None:
    assert run(sim_params(seed=3)) == run(sim_params(seed=3))


def test_a_cap_is_respected_under_faults() -> None:
    for seed in range(5):
        _check(seed, cap=6, roots=10)


def test_sync_appends_that_fail_are_survived() -> None:
    # A tenth of the appends are reported failed, half of those lost and half landing anyway.
    # Seed 68 found a task whose lost answer left it with nothing to send, so it never read one
    # of its messages back and was never allowed to read.
    for seed in (*range(8), 68):
        _check(seed, append_fail_p=0.1)


# Each teeth test below breaks one rule on the seeds where that rule's absence shows (found by
# sweeping seeds 0-29 with the rule off, 2026-11-28; `python -m bench sim` replays any seed), and
# the same seeds with every rule on are its control: CI runs a few seeds each, not 30.
MERGE_CHILD_SEEDS = (0, 1)
EPOCH_FENCE_SEEDS = (2, 6)
ADOPT_SEEDS = (0, 3)
PLANNER_SEEDS = (0, 3)
TEETH_SEEDS = tuple(sorted({*MERGE_CHILD_SEEDS, *EPOCH_FENCE_SEEDS, *ADOPT_SEEDS, *PLANNER_SEEDS}))


def _violations(seeds: tuple[int, ...] | range = TEETH_SEEDS, **broken: object) -> list[str]:
    found = []
    for seed in seeds:
        result = run(sim_params(seed=seed, **broken))
        if not result.passed:
            found.append(result.violation)
    return found


def test_teeth_seeds_pass_with_every_rule_on() -> None:
    """The same-seed control of the teeth tests below that sweep ``TEETH_SEEDS`` with one rule
    broken (the merge child, epoch fencing, adopting its own state): with the rules on, every
    one of those seeds passes, so what the teeth find is the broken rule's doing."""
    assert _violations() == []


def test_teeth_planner_moving_survivors_without_handoff() -> None:
    """With the receiving side's defence off, so the planner's fault is not masked; the control
    is the same seeds, the same defence off, the shipped planner: they all pass."""
    found = _violations(
        PLANNER_SEEDS, broken_planner=True, refuse_owned_offers=False, **FRESH_UNTIL_ASSIGNED
    )
    assert all("both read" in v or "both own" in v for v in found), found
    assert len(found) == len(PLANNER_SEEDS), found
    assert _violations(PLANNER_SEEDS, refuse_owned_offers=False) == []


# Readers set up 2-10 steps after their task decided to read (a change-stream query starting):
# a partition two tasks own then shows as owned twice before either reads it. Seeds 0-9 all
# fire "both own" with the planner broken and pass with it whole (swept 2026-11-28).
SLOW_START = (2, 10)
OWN_SEEDS = (0, 3)


def test_teeth_both_own_fires_while_readers_are_being_set_up() -> None:
    """The "both own" check has teeth: with readers slow to start, the planner that moves
    survivors' partitions without a hand-off is caught as two owners (not yet two readers);
    the control is the same seeds, the same slow starts and defence off, the shipped planner."""
    broken = _violations(
        OWN_SEEDS, broken_planner=True, refuse_owned_offers=False, reader_start_steps=SLOW_START
    )
    assert len(broken) == len(OWN_SEEDS), broken
    assert all("both own" in v for v in broken), broken
    assert _violations(OWN_SEEDS, refuse_owned_offers=False, reader_start_steps=SLOW_START) == []


def test_refusing_offers_of_owned_partitions_keeps_a_bad_planner_mostly_safe() -> None:
    # Defence in depth: a task does not pick up a 'new' offer for a partition a member owns,
    # so that broken planner gets far fewer partitions read by two tasks. Not always none: it
    # can leave two leaders' 'new' offers of one partition that nobody owns yet (seeds 4 and
    # 11 did, once), and it can lose one (it deals out only what tasks own, forgetting offers a
    # dead task held). Over seeds 0-29 on 2026-11-28: 0 doubles defended, 25 undefended.
    def doubles(found: list[str]) -> int:
        return sum("both read" in v or "both own" in v for v in found)

    seeds = range(10)
    defended = doubles(_violations(seeds, broken_planner=True))
    undefended = doubles(_violations(seeds, broken_planner=True, refuse_owned_offers=False))
    assert defended <= 2 < undefended, (defended, undefended)


def test_teeth_merge_child_read_when_first_parent_finishes() -> None:
    found = _violations(MERGE_CHILD_SEEDS, readable=first_parent_readable)
    assert len(found) == len(MERGE_CHILD_SEEDS), found
    assert all("before its parent" in v for v in found), found


def test_teeth_no_epoch_fencing() -> None:
    """Without epoch fencing a stale epoch's offers are followed beside a newer one's: the
    violations are of safety (two readers or owners of one partition, a watermark going back)
    or a partition left to nobody; the control is ``test_teeth_seeds_pass_with_every_rule_on``."""
    found = _violations(EPOCH_FENCE_SEEDS, fence_epochs=False)
    assert len(found) == len(EPOCH_FENCE_SEEDS), "stale messages went unnoticed without fencing"
    kinds = ("both read", "both own", "went back", "owned by []", "not being read")
    unexplained = [v for v in found if not any(k in v for k in kinds)]
    assert not unexplained, unexplained


def test_teeth_restart_under_the_same_id_without_adopting_its_state() -> None:
    # A task restarted under its old id that ignores what the CIM credits to it leaves those
    # partitions owned by nobody who reads them.
    found = _violations(ADOPT_SEEDS, adopt_own_state=False)
    assert len(found) == len(ADOPT_SEEDS), found
    assert all("owned by []" in v or "not being read" in v for v in found), found


# The crash-loop rules (a fresh leader beside survivors yields its partitions; a restarted member
# on probation gets none for TaskConfig.probation) change who reads what after every restart.
# The teeth below were found before them, and show their broken rule in those histories: with
# both off. Each test's control runs the shipped rules.
BEFORE_PROBATION: dict[str, object] = {"probation_us": 0, "reset_fresh_leader": False}

# the seeds of 0-29 where a leader that does not re-send a failed epoch loses a partition
HEAVY_APPEND_FAILURES = (6, 8, 18)


def test_a_quarter_of_appends_failing_every_seed_passes() -> None:
    """The control of the next test: the same seeds with the re-send rule on."""
    for seed in HEAVY_APPEND_FAILURES:
        _check(seed, append_fail_p=0.25)


def test_teeth_a_leader_that_does_not_resend_a_failed_epoch() -> None:
    # Its generation has no epoch: nobody shares, a task that joined in it never reads, and
    # what a dead task owned is dealt out to nobody. (At 10 % failing appends this shows on
    # few seeds since leases hold through rebalances; at 25 % on several.)
    found = []
    for seed in HEAVY_APPEND_FAILURES:
        result = run(
            sim_params(
                seed=seed,
                append_fail_p=0.25,
                resend_failed_epoch=False,
                **BEFORE_PROBATION,
                **FRESH_UNTIL_ASSIGNED,
            )
        )
        if not result.passed:
            found.append(result.violation)
    assert len(found) == len(HEAVY_APPEND_FAILURES), found
    assert all("owned by []" in v or "not being read" in v for v in found), found


# A leader that acts on a generation the group has left behind: back from a pause past its
# lease it plans from a CIM that has read nothing since, and the offers of an epoch that was
# fenced go out in a state message of a later generation (docs/design.md#epochs).
STALE_LEADER_CASES: list[tuple[int, dict[str, object]]] = [
    (824, {}),
    (0, {"append_fail_p": 0.25}),
]


def test_teeth_a_leader_acting_on_a_superseded_generation() -> None:
    """With both leader rules of protocol/task.py off (planning only under a valid lease once
    its answer is in its CIM; a plan's offers only in its epoch) a root read to its end is dealt
    out again and its watermark goes back; each rule alone prevents it on these seeds, and
    ``test_regression_seed`` is the control (the same seeds pass)."""
    broken = {"lead_under_lease": False, "plan_offers_in_epoch_only": False}
    for seed, params in STALE_LEADER_CASES:
        params = {**FOUND_WITH, **params}
        result = run(sim_params(seed=seed, **broken, **params))
        assert "went back" in result.violation, (seed, result)
        for rule in broken:
            _check(seed, **{**params, rule: False})


@pytest.mark.parametrize(
    ("seed", "rule"), [(8291, "release_with_offer"), (8675, "keep_later_answers")]
)
def test_teeth_a_partition_held_by_nobody(seed: int, rule: str) -> None:
    """Each rule off (a removal travels with the offer carrying the partition; an epoch keeps a
    dropped task's answer to a later generation) loses a partition on the seed that found it;
    ``test_regression_seed`` is the control. CIM rule 2a (an answer to a later generation fences
    the older epoch) now keeps such an epoch from landing at all: the second rule is defence in
    depth behind it, and bites with it off."""
    behind = {"fence_superseded_epochs": False} if rule == "keep_later_answers" else {}
    result = run(sim_params(seed=seed, **FOUND_WITH, **behind, **{rule: False}))
    assert "owned by []" in result.violation, result


def test_teeth_refusing_an_epoch_that_landed_before_its_assignment() -> None:
    """protocol/epochs.py rule 5 off: a follower whose assignment comes after its leader's epoch
    landed (the followers' lag, up to 2 s, outlasts the 0.5 s answer timeout) refuses it as
    stale and rejoins; the next generation's leader plans before the same late answer, and the
    group rebalances for ever, reading nothing. The same seeds with the rule on (and the sweep)
    are the control. (Seed 5 no longer fails this way: its looping follower is a restarted task
    that never takes an assignment, so it stays fresh and each epoch deals out its partitions:
    ``protocol/planner.py``, reset. Seed 7 neither, since a rejoined task reads on its answer.)"""
    for seed in (1, 4, 13, 14):
        broken = run(
            sim_params(
                seed=seed,
                accept_landed_epochs=False,
                **SHORT_WAIT,
                **HELD_REBALANCES,
                **BEFORE_PROBATION,
            )
        ).violation
        assert "not being read" in broken, (seed, broken)
        _check(seed, **SHORT_WAIT, **HELD_REBALANCES)
        _check(seed, **SHORT_WAIT)


def test_teeth_picking_up_an_old_offer_beside_its_re_plan() -> None:
    """Only the newest of several 'new' offers of one partition is picked up (protocol/task.py,
    ``_follow_offers``); off, the seed that found it has two readers of one partition (in the
    history it was found in: without resets, which now happen to avoid it), and
    ``test_lag_regression_seed`` is the control."""
    result = run(sim_params(seed=942, newest_offer_only=False, **NO_RESETS))
    assert "both read" in result.violation, result
    # a released move to a task an epoch dropped, re-planned by the leader, the target back
    # under its id (found with the shipped 2 s wait)
    result = run(sim_params(seed=387, newest_offer_only=False, **HELD_REBALANCES))
    assert "both read" in result.violation, result


# the seeds of 0-29 where a restarted group's epochs, taken as given, lose a partition
GROUP_RESTART_SEEDS = (5, 6, 9)


def test_a_group_whose_generations_start_over_keeps_epochs_going_up() -> None:
    """The control: the group's generations start over now and then (its metadata lost, as
    when a broker restarts) while the sync log keeps its epochs; with the epoch rules of
    protocol/epochs.py every seed passes."""
    for seed in GROUP_RESTART_SEEDS:
        _check(seed, group_restart_p=0.1)


def test_teeth_epochs_taken_from_the_generations_as_given() -> None:
    # Without the rules a restarted group's epochs go back: the CIM fences the new epochs as
    # stale, so nobody is dealt the partitions they bring.
    found = _violations(
        GROUP_RESTART_SEEDS,
        group_restart_p=0.1,
        epoch_rules=False,
        **BEFORE_PROBATION,
        **FRESH_UNTIL_ASSIGNED,
    )
    assert len(found) == len(GROUP_RESTART_SEEDS), found
    assert all(
        "owned by []" in v or "not being read" in v or "not within one" in v for v in found
    ), found


# -- the reader core (protocol/reader.py) under a sink that fails batches ----------------------

READER_SEEDS = range(6)
CHECK_SEEDS = READER_SEEDS[:2]


def test_a_sink_that_fails_batches_loses_nothing() -> None:
    """The control of the two teeth below (same seeds): a tenth of the batches fail at the
    simulated sink; each reader re-reads from its committed position and drops by identity
    what it had committed, so every record reaches the sink and no reader sends one twice."""
    for seed in READER_SEEDS:
        _check(seed, sink_fail_p=0.1)


def test_teeth_a_reader_that_does_not_drop_re_reads() -> None:
    found = [
        run(sim_params(seed=s, sink_fail_p=0.1, reader_rules=ReaderRules(drop_rereads=False)))
        for s in READER_SEEDS
    ]
    assert all("re-read not dropped" in r.violation for r in found), found


def test_teeth_a_reader_that_resumes_past_its_committed_position() -> None:
    # after a failed batch it goes on from what it had read, not from what was committed
    broken = ReaderRules(resume_at_committed=False)
    found = [run(sim_params(seed=s, sink_fail_p=0.1, reader_rules=broken)) for s in READER_SEEDS]
    assert all("never reached the sink" in r.violation for r in found), found


# -- exactly once (docs/design.md#exactly-once-output) -----------------------------------------

# The run's end in simulated time (from its start), and a moment after the horizon of the
# "every record reached the sink" check (5 s before the end): the checks of the extra and the
# doubled records look at every record the sink committed, to the end. (They used to stop at
# that horizon, and the late cases below went unnoticed; an invented record was never tried.)
RUN_US = SimParams().churn_us + SimParams().quiet_us
LATE_US = RUN_US - 2_000_000


@pytest.mark.parametrize("at_us", [10_000_000, LATE_US], ids=["early", "after-the-horizon"])
def test_teeth_a_record_the_stream_never_committed_is_caught(at_us: int) -> None:
    """The source invents one record, early or after the horizon, and a reader hands it to the
    sink: the run fails naming it. The control is the same seeds untouched
    (``test_exactly_once_with_the_sinks_durable_position_at_take_over``)."""
    for seed in CHECK_SEEDS:
        result = run(sim_params(seed=seed, invent_record_at_us=at_us))
        assert "1 records reached the sink that were never committed" in result.violation, result
        assert "'invented'" in result.violation, result


@pytest.mark.parametrize("at_us", [10_000_000, LATE_US], ids=["early", "after-the-horizon"])
def test_teeth_a_record_the_sink_commits_twice_is_caught(at_us: int) -> None:
    """The sink commits one record of a batch twice, early or after the horizon: the run fails
    as not exactly once (the same control as above)."""
    for seed in CHECK_SEEDS:
        result = run(sim_params(seed=seed, double_record_at_us=at_us))
        assert "not exactly once: 1 records reached the sink more than once" in result.violation, (
            result
        )


def test_exactly_once_with_the_sinks_durable_position_at_take_over() -> None:
    """The control: a task killed between its sink's commit and its watermark's publication
    leaves batches the sync log does not know of; the new owner starts from the sink's newer
    position and writes none of them twice (the sweep checks exactly once on every seed)."""
    for seed in READER_SEEDS:
        _check(seed)


def test_teeth_take_over_without_the_sinks_durable_position() -> None:
    found = [run(sim_params(seed=s, sink_position=False)) for s in READER_SEEDS]
    caught = [r for r in found if "not exactly once" in r.violation]
    assert len(caught) >= len(READER_SEEDS) - 1, found
    assert all(r.passed or "not exactly once" in r.violation for r in found), found


# -- fenced abandoned batches (docs/design.md#exactly-once-output, rule 4) ---------------------

# a slow sink: commits take up to 3 s, past the simulated readers' 2 s drain timeout, so
# hand-offs abandon batches in flight (a longer quiet period lets the slow sink settle)
SLOW_SINK = {"commit_delay_steps": (1, 60), "quiet_us": 60_000_000}
FENCE_SEEDS = range(2)


def test_abandoned_batches_are_fenced_by_a_slow_sink() -> None:
    """The control: a reader stopped with batches in flight fences them; none commits after
    the partition was released, and every record reaches the sink exactly once."""
    for seed in FENCE_SEEDS:
        _check(seed, **SLOW_SINK)


# the fence race: a committed batch's acknowledgement reaches its reader up to 30 steps after
# its commit point, so a reader that stops meanwhile fences batches that already passed it
FENCE_RACE = {"ack_delay_steps": (1, 30)}


def test_a_fence_that_finds_batches_past_their_commit_point_credits_them() -> None:
    """The sink's fence answers which batches had passed their commit point
    (``BatchesFenced.committed``); the reader counts them as committed and the next owner
    starts after them: every seed passes every invariant, exactly once included, and the race
    did happen (batches answered as committed by a fence)."""
    raced = 0
    for seed in range(4):
        result = run(sim_params(seed=seed, **FENCE_RACE))
        assert result.passed, (seed, result.violation)
        raced += result.fence_committed
    assert raced > 0, "no fence found a batch past its commit point: the test proves nothing"


def test_teeth_a_sink_that_cannot_fence_writes_abandoned_batches_twice() -> None:
    found = [run(sim_params(seed=s, sink_fences=False, **SLOW_SINK)) for s in FENCE_SEEDS]
    assert all("not exactly once" in r.violation for r in found), found


# -- the membership lease through a rebalance (docs/design.md#membership-and-leases) ------------

# Survivors' JoinGroups are lost half the time during the churn (a lost one times out and is
# sent again, with no heartbeat meanwhile), and no crash, leave or pause adds its own noise; nor
# do followers' late assignments (the seeds were chosen before they lagged).
LOST_JOINS: dict[str, object] = {
    "follower_lag_us": (0, 0),
    "join_loss_p": 0.5,
    "crash_p": 0.0,
    "pause_p": 0.0,
    "leave_p": 0.0,
}
# A rebalance timeout shorter than the session: the join phase ends, removing who did not join,
# before their sessions would expire.
SHORT_REBALANCE: dict[str, object] = {
    **LOST_JOINS,
    "rebalance_timeout_us": 1_500_000,
    "heartbeat_us": 500_000,
    "lease_margin_us": 250_000,
}
LEASE_SEEDS = range(12)


def test_leases_through_lost_joins_and_short_rebalances_are_safe() -> None:
    """The control of the two teeth below (same seeds): with the lease of protocol/lease.py a
    member whose JoinGroup was lost stops reading before the coordinator can remove it."""
    for seed in LEASE_SEEDS:
        _check(seed, **LOST_JOINS)
        _check(seed, **SHORT_REBALANCE)


def test_teeth_a_lease_that_counts_a_join_in_flight() -> None:
    """A JoinGroup that never reached the coordinator extends the lease: the member reads on
    after its session expired and its partitions were dealt out. (Without heartbeats during the
    rebalance: a member cut off from the coordinator, whose heartbeats do not arrive either.)"""
    broken = LeaseRules(join_in_flight_counts=True)
    cut_off = {**LOST_JOINS, "heartbeat_while_rebalancing": False}
    found = [run(sim_params(seed=s, lease_rules=broken, **cut_off)) for s in LEASE_SEEDS]
    caught = [r for r in found if "both read" in r.violation]
    assert len(caught) >= 4, found  # 7 of the 12 seeds when this was written


def test_teeth_a_lease_not_bounded_by_the_rebalance_timeout() -> None:
    """A member told REBALANCE_IN_PROGRESS whose JoinGroup is lost is removed when the join
    phase ends; a lease bounded by the session alone outlives that."""
    broken = LeaseRules(rebalance_bound=False)
    found = [run(sim_params(seed=s, lease_rules=broken, **SHORT_REBALANCE)) for s in LEASE_SEEDS]
    caught = [r for r in found if "both read" in r.violation]
    assert len(caught) >= 8, found  # 11 of the 12 seeds when this was written


def test_restarted_members_reset_and_the_runs_still_pass() -> None:
    """A task restarted under its id that has not answered by the plan has its earlier life's
    partitions dealt out (``protocol/planner.py``, reset; CIM rule 5d). The seeds where that
    happens at the shipped settings pass every invariant (no partition read twice, exactly-once
    output, every partition read at the end)."""
    results = [run(sim_params(seed=seed, **HELD_REBALANCES)) for seed in (8, 37)]
    assert all(r.passed for r in results), [r.violation for r in results if not r.passed]
    assert [r.resets for r in results] == [1, 1]


def test_teeth_resetting_a_member_that_is_not_fresh() -> None:
    """``reset_only_fresh`` off: the leader resets every member that has not answered, survivors
    included; a survivor still reading under its lease then shares its partition with the reader
    it was dealt to. The same seeds with the rule on are the control."""
    for seed in (0, 3):
        broken = run(
            sim_params(seed=seed, reset_only_fresh=False, **HELD_REBALANCES, **BEFORE_PROBATION)
        ).violation
        assert "both read" in broken, (seed, broken)
        _check(seed)
        _check(seed, **HELD_REBALANCES)


def test_a_rejoined_task_reads_on_its_answer_and_teeth_without_the_superseded_epoch_fence() -> None:
    """A task back from a pause reads what the CIM credits to it once its answer is read back,
    before its generation's epoch (protocol/task.py, ``_resumed_on_answer``): seeds 19 and 20 do
    so and pass. Its safety is CIM rule 2a; with that rule off, an epoch planned while the task
    was away lands after its answer, and on seeds 0 and 204 hands a partition it reads to a
    second reader. With both off (reading waits for the epoch) the same seeds pass."""
    for seed in (19, 20):
        result = run(sim_params(seed=seed, **HELD_REBALANCES))
        assert result.passed, result
        assert result.read_on_answer > 0, result
    for seed in (0, 204):
        broken = run(sim_params(seed=seed, fence_superseded_epochs=False, **HELD_REBALANCES))
        assert "both read" in broken.violation, (seed, broken)
        _check(seed)
        _check(seed, **HELD_REBALANCES)
        _check(seed, fence_superseded_epochs=False, resume_on_answer=False, **HELD_REBALANCES)


# -- a task in a crash loop (docs/design.md#liveness-failover-and-health) ----------------------

# One task dies again and again from 12 s on (killed 0.7 s after each epoch listing it lands,
# back 1 s later), with no other fault and no partition churn, so every unread stretch is the
# loop's; a change-stream query takes 1-1.5 s to start (reader_start_steps), as a real one does.
CRASH_LOOP: dict[str, object] = {
    "crash_p": 0.0,
    "pause_p": 0.0,
    "leave_p": 0.0,
    "join_p": 0.0,
    "split_p": 0.0,
    "move_p": 0.0,
    "merge_p": 0.0,
    "reader_start_steps": (20, 30),
    "crash_loop_at_us": 12_000_000,
    "unread_limit_us": 8_000_000,
}
CRASH_LOOP_SEEDS = range(6)


@pytest.mark.parametrize("leads", [True, False], ids=["leader", "follower"])
def test_a_task_in_a_crash_loop_loses_its_partitions_to_the_survivors(leads: bool) -> None:
    """However often the task dies, one fault's recovery bounds a partition's unread time: 3.9
    to 5.5 s on these seeds when this was written, against the 8 s bound. Whether its lives lead
    (they join first, as a restarted process does on Kafka: the leader yields its own partitions,
    protocol/planner.py) or follow (they are reset), each life's epoch deals out what it holds,
    and balancing gives it nothing back while it is on probation (TaskConfig.probation)."""
    for seed in CRASH_LOOP_SEEDS:
        result = run(sim_params(seed=seed, crash_loop_leads=leads, **CRASH_LOOP))
        assert result.passed, (seed, result.violation)
        assert result.crash_loop_kills == 3
        assert (result.yields if leads else result.resets) >= 1, result
        assert 0 < result.max_unread_us <= 8_000_000


@pytest.mark.parametrize(
    ("leads", "rule"),
    [
        (True, {"reset_fresh_leader": False}),
        (True, {"probation_us": 0}),
        (False, {"probation_us": 0}),
    ],
    ids=["leader-keeps-its-partitions", "leader-gets-them-back", "follower-gets-them-back"],
)
def test_teeth_a_crash_loop_holds_partitions_unread(leads: bool, rule: dict[str, object]) -> None:
    """Each rule off fails the bound on every seed (12.9 to 15.6 s unread when this was
    written): a leader that keeps what its earlier life held (bench chaos --seed 3: 28.5 s),
    or a restarted task handed its share back by balancing the moment its epoch lands, dies
    again before reading it, life after life. The test above is the control."""
    for seed in CRASH_LOOP_SEEDS:
        result = run(sim_params(seed=seed, crash_loop_leads=leads, **CRASH_LOOP, **rule))
        assert "unread for" in result.violation, (seed, result)


# Each life of the looping task joins last, and the leader of its first generation dies once it
# has sent the assignments, before it plans: the life is assigned that generation but never
# permitted to read in it (bench chaos --seed 1: leaders killed back to back with an owner).
LEADER_DIES: dict[str, object] = {
    **CRASH_LOOP,
    "crash_loop_leads": False,
    "crash_loop_leader_dies": True,
    "unread_limit_us": 14_500_000,
}


def test_a_life_whose_first_generation_came_to_nothing_is_still_reset() -> None:
    """The looping life still says it is fresh at its next join (TaskCore.joining): that
    generation's leader resets it, the survivors read what its earlier life held, and its
    next death costs them nothing. Two faults' recoveries (the owner's, then its leader's)
    bound a partition's unread time: 12.6 to 14.2 s on these seeds when this was written,
    against the 14.5 s bound."""
    for seed in CRASH_LOOP_SEEDS:
        result = run(sim_params(seed=seed, **LEADER_DIES))
        assert result.passed, (seed, result.violation)
        assert result.loop_leaders_killed >= 1, result
        assert result.resets >= 1, result
        assert 0 < result.max_unread_us <= 14_500_000


def test_teeth_a_life_fresh_only_until_its_first_generation_holds_partitions_unread() -> None:
    """With ``fresh_until_read`` off the life is taken for a survivor in its second
    generation, keeps its earlier life's partitions, and dies again holding them: a third
    recovery: 15.6 to 22.4 s unread on these seeds when this was written (seeds 2 and 4 of
    the control's came within 0.6 s of it, and are left out). The test above is the control."""
    for seed in (0, 1, 3, 5):
        result = run(sim_params(seed=seed, **LEADER_DIES, fresh_until_read=False))
        assert "unread for" in result.violation, (seed, result)
