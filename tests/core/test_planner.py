"""Planner: ownerless roots offered to the least loaded member, never twice, cap respected."""

from __future__ import annotations

from random import Random

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.cim import Cim
from protocol.messages import Partition, Share, StateMessage, TaskState
from protocol.planner import plan
from tests.helpers import epoch, part, state


def _offers(task: str, *offers: Share, data: tuple[Partition, ...] = ()) -> StateMessage:
    """``task``'s whole state in epoch 1: ``data`` and the offers ``offers``."""
    return StateMessage(
        task_id=task,
        epoch=1,
        connector_state=(
            TaskState(task_id=task, state_timestamp=2, data=data, share=offers, full=True),
        ),
    )


def test_roots_are_dealt_to_least_loaded_and_parked_past_cap() -> None:
    roots = tuple(Partition(f"r{i}", start_ts=0) for i in range(3))
    result = plan(Cim(), ("a", "b"), "a", 1, now=7, cap=1, rng=Random(0), roots=roots)
    assert result.offers == (
        Share(partition=roots[0], target="a", kind="new", since=7),
        Share(partition=roots[1], target="b", kind="new", since=7),
        Share(partition=roots[2], target=None, kind="new", since=7),
    )


@settings(max_examples=100, deadline=None)
@given(
    n_roots=st.integers(0, 12),
    members=st.lists(st.sampled_from("abcde"), min_size=1, unique=True),
    cap=st.integers(0, 4),
)
def test_planner_never_assigns_twice_and_respects_cap(
    n_roots: int, members: list[str], cap: int
) -> None:
    roots = tuple(Partition(f"r{i}", start_ts=0) for i in range(n_roots))
    result = plan(Cim(), tuple(members), members[0], 1, 0, cap, Random(0), roots=roots)
    tokens = [s.token for s in result.offers]
    assert sorted(tokens) == sorted(r.token for r in roots)
    for m in members:
        assigned = sum(1 for s in result.offers if s.target == m)
        assert cap <= 0 or assigned <= cap


def test_offers_of_a_dead_task_do_not_count_in_the_survivors_loads() -> None:
    """A dead task had offered two of its partitions to s1, which had not picked them up yet.
    The planner deals those partitions out again (they are ownerless), so s1 must not also be
    counted as loaded with them: the loads after the epoch are within one of each other."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s1", "s2", "d"))
    for offset, (task, token) in enumerate((("L", "a"), ("s1", "b"), ("s2", "c")), start=2):
        cim.apply(offset, state(task, offset, part(token)))
    dead = tuple(part(t) for t in ("p1", "p2", "p3"))
    offered = tuple(Share(partition=p, target="s1", kind="move", since=4) for p in dead[:2])
    cim.apply(
        5,
        StateMessage(
            task_id="d",
            epoch=1,
            connector_state=(
                TaskState(task_id="d", state_timestamp=5, data=dead, share=offered, full=True),
            ),
        ),
    )
    result = plan(cim, ("L", "s1", "s2"), "L", 2, now=9, cap=0, rng=Random(0))
    assert sorted(s.token for s in result.offers) == ["p1", "p2", "p3"]
    after = {m: 1 + sum(1 for s in result.offers if s.target == m) for m in ("L", "s1", "s2")}
    assert after == {"L": 2, "s1": 2, "s2": 2}


def test_offers_of_a_live_task_still_count_in_their_targets_load() -> None:
    """The control: an offer from a member to a member is still on its way, and counts."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s1"))
    offered = (Share(partition=part("x"), target="s1", kind="move", since=2),)
    cim.apply(
        2,
        StateMessage(
            task_id="L",
            epoch=1,
            connector_state=(
                TaskState(
                    task_id="L",
                    state_timestamp=2,
                    data=(part("a"), part("x")),
                    share=offered,
                    full=True,
                ),
            ),
        ),
    )
    # x counts at its destination: s1 owns nothing yet and is loaded with the offer
    assert cim.loads(("L", "s1")) == {"L": 1, "s1": 1}


def test_a_partition_finished_by_a_dead_task_is_adopted_not_offered_again() -> None:
    """Sim seed 4652: dead d1 had released a move of x to d2; d2 took it over, read it to its end
    and died too. d1's released move still carries x as owned at the watermark it was handed
    over at. Finished anywhere is finished: x is adopted, never dealt out (the offer would stand
    for ever, since no task takes a finished partition, and hold its holder's balancing)."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "d1", "d2"))
    moved = part("x", 5)
    cim.apply(2, _offers("d1", Share(partition=moved, target="d2", kind="move", released=True)))
    finished = part("x", 9, status="finished")
    cim.apply(3, state("d2", 3, finished))
    result = plan(cim, ("L",), "L", 2, now=9, cap=0, rng=Random(0))
    assert result.offers == ()
    assert result.adopt == (finished,)


def test_a_dead_tasks_move_it_had_not_released_is_dealt_out() -> None:
    """Sim seed 3330 (0.5 s answer wait): d's claim of x was written while its generation was
    fenced, so the CIM never held it; d then offered x to s in a move and died before
    releasing it. Its unreleased move is all the CIM knows of x: x is dealt out, from that
    move's watermark (s's take-over, 'incoming', does not own it)."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s", "d"))
    moving = part("x", 5)
    cim.apply(2, _offers("d", Share(partition=moving, target="s", kind="move")))
    cim.apply(3, state("s", 3, part("x", 5, status="incoming", source="d")))
    result = plan(cim, ("L", "s"), "L", 2, now=9, cap=0, rng=Random(0))
    assert [(s.token, s.partition.watermark) for s in result.offers] == [("x", 5)]


def test_a_live_tasks_move_it_has_not_released_is_not_dealt_out() -> None:
    """The control: a member's move to a dead target is still read by that member."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s", "d"))
    offer = Share(partition=part("x", 5), target="d", kind="move")
    cim.apply(2, _offers("s", offer, data=(part("x", 5),)))
    assert plan(cim, ("L", "s"), "L", 2, now=9, cap=0, rng=Random(0)).offers == ()


def _handoff_beside_a_stale_share(target_answered: bool) -> Cim:
    """s released a move of x (read to 8) to t; dead d still shows a move of x (at 5) that it
    released to s long ago. ``target_answered``: t's take-over of x from s is in the CIM."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s", "t", "d"))
    stale = Share(partition=part("x", 5), target="s", kind="move", released=True)
    cim.apply(2, _offers("d", stale))
    handed = Share(partition=part("x", 8), target="t", kind="move", released=True)
    cim.apply(3, _offers("s", handed))
    if target_answered:
        cim.apply(4, state("t", 4, part("x", 5, status="incoming", source="s")))
    return cim


def test_a_hand_off_between_members_is_held_whatever_a_dead_tasks_stale_share_says() -> None:
    """Sim seed 5799: the hand-off s -> t is in flight (s released it, t answered it). Dealt out
    for d's stale share, t gives its take-over up to the plan, s never picks up an offer of what
    it hands away, and nobody reads x. The plan holds it; without the rule it deals x out."""
    cim = _handoff_beside_a_stale_share(target_answered=True)
    members = ("L", "s", "t")
    assert plan(cim, members, "L", 2, now=9, cap=0, rng=Random(0)).offers == ()
    broken = plan(cim, members, "L", 2, now=9, cap=0, rng=Random(0), hold_handoffs=False)
    assert [s.token for s in broken.offers] == ["x"]


def test_a_released_move_its_target_never_answered_is_not_held() -> None:
    """Sim seed 723, the control: t is a fresh life under an old id that never answered s's
    released move (stale, like d's: another member may have read on since). Only an answered
    hand-off is held, so x is dealt out as before."""
    cim = _handoff_beside_a_stale_share(target_answered=False)
    result = plan(cim, ("L", "s", "t"), "L", 2, now=9, cap=0, rng=Random(0))
    assert [s.token for s in result.offers] == ["x"]


def test_orphans_left_from_an_earlier_epoch_are_dealt_out_or_adopted() -> None:
    """Cim rule 5c: what an earlier epoch dropped that nobody took since (the leader that
    should have offered it died first) is dealt out by the next plan, finished ones adopted."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s", "d"))
    finished = part("y", 9, status="finished", children=("x",))
    cim.apply(2, state("d", 2, part("x", 7), finished))
    cim.apply(3, epoch("L", 2, "L", "s"))
    assert set(cim.orphans) == {"x", "y"}
    result = plan(cim, ("M", "s"), "M", 3, now=9, cap=0, rng=Random(0))
    assert [(s.token, s.partition.watermark, s.target) for s in result.offers] == [("x", 7, "M")]
    assert result.adopt == (finished,)


def test_a_reset_members_partitions_go_to_the_others_not_back_to_it() -> None:
    """A task restarted under its id that had not answered when the leader planned (``reset``):
    what the CIM credits to it (its partitions, its offers, offers made to it) is dealt out like
    a dead task's, to the members that answered, never back to itself, and the plan names it."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s", "r"))
    cim.apply(2, state("s", 2, part("a")))
    to_r = Share(partition=part("z", 3), target="r", kind="new", since=2)
    cim.apply(3, _offers("L", to_r))
    released = Share(partition=part("w", 4), target="s", kind="move", released=True, since=2)
    cim.apply(4, _offers("r", released, data=(part("x", 5), part("y", 6, status="finished"))))
    result = plan(cim, ("L", "r", "s"), "L", 2, now=9, cap=0, rng=Random(0), reset=("r",))
    assert result.reset == ("r",)
    assert [(s.token, s.partition.watermark, s.target) for s in result.offers] == [
        ("w", 4, "L"),
        ("x", 5, "L"),
        ("z", 3, "s"),
    ]
    assert [p.token for p in result.adopt] == ["y"]


def test_the_reset_of_the_leader_or_of_a_non_member_is_ignored() -> None:
    """The leader answered (it plans only then), and a task that is not a member is dead
    anyway: neither is listed as reset."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s"))
    cim.apply(2, state("L", 2, part("a")))
    result = plan(cim, ("L", "s"), "L", 2, now=9, cap=0, rng=Random(0), reset=("L", "gone"))
    assert result.reset == ()
    assert result.offers == ()


def test_a_yielding_leader_deals_out_its_own_unfinished_partitions_and_keeps_its_offers() -> None:
    """``leader_yields`` (a fresh leader beside survivors): what the CIM credits to the leader's
    earlier life that is unfinished goes to the others, in load order; its finished partition
    and its offer to a member stay as they are, and the plan lists what it yielded."""
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s", "u"))
    cim.apply(2, state("s", 2, part("a")))
    to_u = Share(partition=part("z", 3), target="u", kind="new", since=2)
    done = part("y", 6, status="finished")
    cim.apply(3, _offers("L", to_u, data=(part("x", 5), part("w", 4), done)))
    result = plan(cim, ("L", "s", "u"), "L", 2, now=9, cap=0, rng=Random(0), leader_yields=True)
    assert result.yielded == ("w", "x")
    assert result.reset == ()
    assert [(s.token, s.partition.watermark, s.target) for s in result.offers] == [
        ("w", 4, "s"),
        ("x", 5, "u"),
    ]
    assert result.adopt == ()
    # the control: without it the leader keeps w and x
    kept = plan(cim, ("L", "s", "u"), "L", 2, now=9, cap=0, rng=Random(0))
    assert (kept.yielded, kept.offers) == ((), ())


def test_a_yielding_leader_keeps_what_no_other_member_has_room_for_and_alone_keeps_all() -> None:
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "s"))
    cim.apply(2, state("s", 2, part("a")))
    cim.apply(3, state("L", 3, part("x", 5), part("w", 4)))
    result = plan(cim, ("L", "s"), "L", 2, now=9, cap=2, rng=Random(0), leader_yields=True)
    assert [(s.token, s.target) for s in result.offers] == [("w", "s"), ("x", "L")]
    # every other member reset: nobody is there to take them; L keeps w and x, and s's a
    # waits for room (L is at the cap)
    alone = plan(
        cim, ("L", "s"), "L", 2, now=9, cap=2, rng=Random(0), reset=("s",), leader_yields=True
    )
    assert alone.yielded == ()
    assert [(s.token, s.target) for s in alone.offers] == [("a", None)]


def test_a_reset_members_partitions_are_parked_when_the_others_are_at_the_cap() -> None:
    cim = Cim()
    cim.apply(1, epoch("L", 1, "L", "r"))
    cim.apply(2, state("L", 2, part("a")))
    cim.apply(3, state("r", 3, part("x", 5)))
    result = plan(cim, ("L", "r"), "L", 2, now=9, cap=1, rng=Random(0), reset=("r",))
    assert [(s.token, s.target) for s in result.offers] == [("x", None)]
