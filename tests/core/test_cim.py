"""CIM merge rules (protocol/cim.py docstring, rules 1-7), exact contents after a sequence."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.cim import Cim
from protocol.messages import (
    EpochMessage,
    MarkerMessage,
    Share,
    StateMessage,
    SyncMessage,
    TaskState,
)
from tests.helpers import epoch, part, state


def _fold(log: list[SyncMessage]) -> Cim:
    cim = Cim()
    for offset, message in enumerate(log):
        cim.apply(offset, message)
    return cim


def _contents(cim: Cim) -> tuple[object, ...]:
    cp = cim.checkpoint("x", 0)
    return (cim.offset, cim.epoch, cim.members, cim.leader, cp.connector_state, cp.orphans)


def test_cim_keeps_latest_state_by_state_timestamp() -> None:
    cim = _fold([epoch("a", 1, "a"), state("a", 5, part("p", 50)), state("a", 3, part("p", 30))])
    assert cim.tasks["a"].partitions == {"p": part("p", 50)}
    assert cim.ignored["older-state"] == 1


def test_task_changes_only_its_own_state() -> None:
    foreign = StateMessage(
        task_id="a",
        epoch=1,
        connector_state=(TaskState(task_id="b", state_timestamp=1, data=(part("q"),), full=True),),
    )
    cim = _fold([epoch("a", 1, "a", "b"), foreign])
    assert cim.view("b").partitions == {}
    assert cim.ignored["foreign-state"] == 1


def test_only_leader_epoch_removes_dead_tasks() -> None:
    cim = _fold([epoch("a", 1, "a", "b"), state("a", 1, part("p")), state("b", 1, part("q"))])
    assert set(cim.tasks) == {"a", "b"}
    cim.apply(3, epoch("a", 2, "a"))
    assert set(cim.tasks) == {"a"}
    assert cim.members == ("a",)


def test_epochs_fence_older_messages() -> None:
    cim = _fold([epoch("a", 2, "a"), state("a", 1, part("p"), epoch=1), epoch("a", 1, "a")])
    assert cim.view("a").partitions == {}
    assert cim.epoch == 2
    assert cim.ignored["stale-epoch"] == 2


def test_duplicate_offset_is_ignored() -> None:
    cim = _fold([epoch("a", 1, "a"), state("a", 1, part("p"))])
    assert cim.apply(1, state("a", 9, part("z"))) == "duplicate"
    assert cim.tasks["a"].partitions == {"p": part("p")}


def test_marker_changes_nothing() -> None:
    cim = _fold([epoch("a", 1, "a"), state("a", 1, part("p"))])
    before = _contents(cim)
    assert cim.apply(2, MarkerMessage(task_id="a", epoch=1)) is None
    assert _contents(cim)[1:] == before[1:]


def test_replay_from_checkpoint_gives_same_cim_as_full_replay() -> None:
    log: list[SyncMessage] = [
        epoch("a", 1, "a", "b"),
        state("a", 1, part("p", 10)),
        state("b", 1, part("q", 20)),
    ]
    full = _fold(log)
    cp = full.checkpoint("a", 0)
    tail: list[SyncMessage] = [state("a", 2, part("p", 15)), epoch("a", 2, "a")]
    for i, m in enumerate(tail, start=3):
        full.apply(i, m)
    seeded = Cim()
    seeded.apply(2, cp)
    assert seeded.offset == cp.as_of
    for i, m in enumerate(tail, start=3):
        seeded.apply(i, m)
    assert _contents(seeded) == _contents(full)
    assert full.orphans == {"q": part("q", 20)}  # b's, dropped by the epoch (rule 5c)
    # a checkpoint carries the orphans
    again = Cim()
    again.apply(5, full.checkpoint("a", 0))
    assert again.orphans == full.orphans


_msgs = st.lists(
    st.one_of(
        st.builds(
            lambda t, ts, w: state(t, ts, part("p", w)),
            st.sampled_from("ab"),
            st.integers(0, 5),
            st.integers(0, 50),
        ),
        st.builds(lambda n: epoch("a", n, "a", "b"), st.integers(1, 3)),
    ),
    max_size=12,
)


@settings(max_examples=100, deadline=None)
@given(log=_msgs)
def test_cim_idempotent_under_duplicate_replay(log: list[SyncMessage]) -> None:
    once = _fold(log)
    twice = _fold(log)
    for offset, message in enumerate(log):
        assert twice.apply(offset, message) == "duplicate"
    assert _contents(twice) == _contents(once)


def test_watermark_only_advances_when_leader_reoffers_a_dead_tasks_partition() -> None:
    stale_offer = Share(partition=part("p", 10), target="a", kind="new", since=1)
    reoffer = EpochMessage(
        task_id="a",
        epoch=2,
        members=("a",),
        connector_state=(TaskState(task_id="a", state_timestamp=1, share=(stale_offer,)),),
    )
    cim = _fold([epoch("a", 1, "a", "b"), state("b", 1, part("p", 50)), reoffer])
    assert set(cim.tasks) == {"a"}
    assert cim.tasks["a"].share["p"].partition.watermark == 50


@settings(max_examples=100, deadline=None)
@given(
    a_ts=st.lists(st.integers(0, 5), max_size=4),
    b_ts=st.lists(st.integers(0, 5), max_size=4),
    seed=st.randoms(use_true_random=False),
)
def test_states_of_different_tasks_commute(
    a_ts: list[int], b_ts: list[int], seed: random.Random
) -> None:
    """Only the relative order of one task's own messages matters (rule 4)."""
    a = [state("a", ts, part("p", ts)) for ts in a_ts]
    b = [state("b", ts, part("q", ts)) for ts in b_ts]
    merged: list[SyncMessage] = []
    ia = ib = 0
    while ia < len(a) or ib < len(b):
        if ib >= len(b) or (ia < len(a) and seed.random() < 0.5):
            merged.append(a[ia])
            ia += 1
        else:
            merged.append(b[ib])
            ib += 1
    head: list[SyncMessage] = [epoch("a", 1, "a", "b")]
    one = _fold([*head, *a, *b]).checkpoint("x", 0).connector_state
    two = _fold([*head, *merged]).checkpoint("x", 0).connector_state
    assert one == two


def test_a_foreign_state_in_an_epoch_message_is_dropped_and_reported_like_in_a_state_message() -> (
    None
):
    cim = _fold([epoch("a", 1, "a", "b")])
    forged = EpochMessage(
        task_id="a",
        epoch=2,
        sync_epoch="e2",
        members=("a", "b"),
        connector_state=(TaskState(task_id="b", state_timestamp=1, data=(part("q"),), full=True),),
    )
    assert cim.apply(cim.offset + 1, forged) == "foreign-state"
    assert cim.ignored["foreign-state"] == 1
    assert cim.view("b").partitions == {}
    assert cim.epoch == 2  # the epoch itself is opened


def test_final_states_over_the_cims_of_several_tasks() -> None:
    from protocol.cim import FinalState, final_states

    behind = _fold([epoch("a", 1, "a", "b"), state("a", 1, part("p", 5)), state("b", 1)])
    ahead = _fold(
        [
            epoch("a", 1, "a", "b"),
            state("a", 1, part("p", 5)),
            state("b", 1),
            state("a", 2, part("p", 9), part("q", 3, status="finished")),
            StateMessage(
                task_id="b",
                epoch=1,
                connector_state=(
                    TaskState(
                        task_id="b",
                        state_timestamp=2,
                        share=(Share(partition=part("r", 4), target="a"),),
                    ),
                ),
            ),
        ]
    )
    assert final_states([behind, ahead]) == [
        FinalState("p", "owned", 9, "a"),
        FinalState("q", "finished", 3, "a"),
        FinalState("r", "owned", 4, "b"),
    ]


def test_an_epoch_keeps_a_dropped_tasks_answer_to_a_later_generation() -> None:
    # Seed 8675: a, back from a pause, answered generation 3 (it leads it) before the epoch of
    # generation 2, which dropped it, landed. The answer is a's only message; all of them read
    # back, a had no cause to write it again, and generation 3 waited for it for ever. Rule 2a
    # now ignores that epoch (superseded by the answer); rule 5 still keeps the answer when an
    # epoch of generation 2 lands with the rule off.
    log: list[SyncMessage] = [
        epoch("b", 1, "a", "b"),
        state("a", 1, part("p")),
        state("a", 2, epoch=3),  # a's answer to generation 3
        epoch("b", 2, "b"),  # generation 2 dropped a
    ]
    cim = Cim(fence_superseded_epochs=False)
    for offset, message in enumerate(log):
        cim.apply(offset, message)
    assert cim.members == ("b",)
    assert cim.view("a").epoch_seen == 3
    assert cim.view("a").partitions == {}  # its claims went with it
    assert list(cim.holders("p")) == []
    # an answer to the epoch's own generation or an older one goes with the task
    old = _fold([*log[:2], state("a", 2, epoch=2), epoch("b", 2, "b")])
    assert "a" not in old.tasks
    # without the rule (the simulator's teeth test) the answer is gone
    broken = Cim(keep_later_answers=False, fence_superseded_epochs=False)
    for offset, message in enumerate(log):
        broken.apply(offset, message)
    assert broken.view("a").epoch_seen == -1


def test_rule_2a_an_answer_to_a_later_generation_fences_an_older_epoch() -> None:
    """A task that rejoined answered generation 3 while the CIM's epoch 1 still listed it: the
    epoch of generation 2 (planned while it was away, dealing out its partition) lands after
    that answer and is ignored, as generation 3's epoch would have fenced it. The task keeps
    what it held; generation 3's epoch lands."""
    log: list[SyncMessage] = [
        epoch("b", 1, "a", "b"),
        state("a", 1, part("p", 5)),
        state("a", 2, part("p", 6), epoch=3),  # a's answer to generation 3
        EpochMessage(
            task_id="b",
            epoch=2,
            sync_epoch="e2",
            members=("b",),
            connector_state=(
                TaskState(task_id="b", state_timestamp=3, share=(Share(part("p", 5), "b"),)),
            ),
        ),
    ]
    cim = _fold(log)
    assert cim.ignored["superseded-epoch"] == 1
    assert (cim.epoch, cim.members) == (1, ("a", "b"))
    assert cim.newest_generation == 3
    assert cim.superseded(2)
    assert not cim.superseded(3)
    assert [t for t, _ in cim.holders("p")] == ["a"]
    assert list(cim.offers()) == []
    cim.apply(4, epoch("a", 3, "a", "b"))
    assert (cim.epoch, cim.leader) == (3, "a")
    # an epoch of the same generation as the newest answer lands (the leader's own answer is
    # in the log before its epoch)
    same = _fold([*log[:3], epoch("b", 3, "b", "a")])
    assert same.epoch == 3
    # a checkpoint carries the fence: a replay from it ignores the old epoch alike
    seeded = Cim()
    seeded.apply(10, _fold(log[:3]).checkpoint("a", 0))
    assert seeded.newest_generation == 3
    assert seeded.apply(11, log[3]) == "superseded-epoch"


def test_rule_5c_what_an_epoch_drops_that_no_state_holds_is_an_orphan_until_a_state_takes_it() -> (
    None
):
    """Sim seed 4262 (0.5 s answer wait): d's last claims (a parent read to its end, its two
    children registered, one read on) landed after the CIM the leader planned from; the epoch
    dropped d, and the plan had dealt out only the parent. The children are orphans, with their
    newest watermarks; the parent, offered in the epoch, is not."""
    dealt = Share(partition=part("p", 10), target="s", kind="new", since=5)
    leader_epoch = EpochMessage(
        task_id="L",
        epoch=2,
        sync_epoch="e2",
        members=("L", "s"),
        connector_state=(TaskState(task_id="L", state_timestamp=9, share=(dealt,)),),
    )
    finished = part("p", 30, status="finished", children=("c1", "c2"))
    cim = _fold(
        [
            epoch("L", 1, "L", "s", "d"),
            state("d", 1, part("p", 10)),
            state("d", 2, finished, part("c1"), part("c2"), full=False),
            state("d", 3, part("c2", 40), full=False),
            leader_epoch,
        ]
    )
    assert cim.orphans == {"c1": part("c1"), "c2": part("c2", 40)}
    assert "d" not in cim.tasks
    # an orphan is one no more once a state holds or offers it
    offered = Share(partition=part("c2", 40), target="s", kind="new", since=9)
    cim.apply(
        5,
        StateMessage(
            task_id="L",
            epoch=2,
            connector_state=(
                TaskState(task_id="L", state_timestamp=10, share=(dealt, offered), full=False),
            ),
        ),
    )
    assert cim.orphans == {"c1": part("c1")}
    cim.apply(6, state("s", 11, part("c1", 5), epoch=2, full=False))
    assert cim.orphans == {}


def test_rule_5c_a_finished_orphan_wins_over_an_older_claim() -> None:
    """Two dropped tasks held x: one an offer of it, the other x read to its end."""
    offer = Share(partition=part("x", 50), target="e", kind="move", released=True, since=2)
    cim = _fold(
        [
            epoch("L", 1, "L", "d", "e"),
            StateMessage(
                task_id="d",
                epoch=1,
                connector_state=(TaskState(task_id="d", state_timestamp=2, share=(offer,)),),
            ),
            state("e", 3, part("x", 90, status="finished", children=("y",))),
            epoch("L", 2, "L"),
        ]
    )
    assert cim.orphans == {"x": part("x", 90, status="finished", children=("y",))}


def test_rule_5c_a_finished_orphan_nothing_refers_to_is_dropped() -> None:
    """A task would remove it at once (no child waits for it), never publishing it."""
    cim = _fold([epoch("L", 1, "L", "e"), state("e", 3, part("x", 90, status="finished"))])
    cim.apply(2, epoch("L", 2, "L"))
    assert cim.orphans == {}


def test_rule_5d_an_epoch_resets_a_member_keeping_its_answer() -> None:
    """r restarted under its id; the leader planned before its answer and dealt out x, which r's
    earlier life held. The epoch lists r as a member and in ``reset``: r's state is dropped, its
    answer (it answered after the plan) is kept, and the partition its earlier life claimed
    after the plan (y, never dealt out) is an orphan."""
    dealt = Share(partition=part("x", 5), target="s", kind="new", since=5)
    reset_epoch = EpochMessage(
        task_id="L",
        epoch=2,
        sync_epoch="e2",
        members=("L", "r", "s"),
        connector_state=(TaskState(task_id="L", state_timestamp=9, share=(dealt,)),),
        reset=("r", "gone"),
    )
    cim = _fold(
        [
            epoch("L", 1, "L", "r", "s"),
            state("r", 1, part("x", 5)),
            state("r", 2, part("y", 7), full=False),
            state("r", 3, epoch=2, full=False),  # the new life's answer, after the plan
            reset_epoch,
        ]
    )
    assert cim.members == ("L", "r", "s")
    assert cim.reset == ("r",)  # (a reset of a task that is no member means nothing)
    view = cim.view("r")
    assert (view.partitions, view.share, view.epoch_seen, view.state_ts) == ({}, {}, 2, 3)
    assert cim.orphans == {"y": part("y", 7)}
    assert [t for t, _ in cim.holders("x")] == []
    assert cim.view("L").share == {"x": dealt}
    # the next epoch resets nobody
    cim.apply(10, epoch("L", 3, "L", "r", "s"))
    assert not cim.reset
