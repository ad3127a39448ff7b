"""One test per rule of the pure cores, asserting exact outputs: the CIM after a message
sequence, the planner's offers, the share decisions, the move state machine, and the task
core's exact command lists. (The seeded many-task simulation is in ``test_faultsim.py``.)"""

from __future__ import annotations

from random import Random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import lifecycle, messages, share
from protocol.cim import Cim
from protocol.handoff import Move, MoveError
from protocol.messages import (
    CheckpointMessage,
    EpochMessage,
    Partition,
    Share,
    StateMessage,
    SyncDecodeError,
    SyncMessage,
    TaskState,
)
from protocol.planner import plan
from protocol.records import ChildPartition
from protocol.task import (
    Alert,
    Drain,
    Joined,
    Joining,
    Lease,
    Lost,
    PlanReady,
    Publish,
    PublishFailed,
    ReaderCommitted,
    ReaderFinished,
    ReaderStopped,
    RequestPlan,
    Rules,
    StartReader,
    StopReader,
    StopReason,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
    TaskTick,
    own_state_ts,
)

T0 = 1_700_000_000_000_000


def part(
    token: str, wm: int = 0, status: str = "owned", parents: tuple[str, ...] = ()
) -> Partition:
    """A partition started at T0 whose committed watermark is ``wm`` micros after T0."""
    wm = T0 + wm if wm else 0
    return Partition(token, T0, parents=parents, status=status, watermark=wm)  # type: ignore[arg-type]


def state(
    task: str,
    ts: int,
    *parts: Partition,
    removed: tuple[str, ...] = (),
    share: tuple[Share, ...] | None = None,
) -> StateMessage:
    """A state message; its state timestamps come after every epoch message's below."""
    return StateMessage(
        task_id=task,
        epoch=0,
        connector_state=(
            TaskState(task, 2 * 10**9 + ts, data=parts, removed=removed, share=share),
        ),
    )


def epoch(leader: str, n: int, members: tuple[str, ...], *offers: Share) -> EpochMessage:
    return EpochMessage(
        task_id=leader,
        epoch=n,
        members=members,
        connector_state=(TaskState(leader, 10**9 + n, share=offers),),
    )


def owned(cim: Cim, task: str) -> dict[str, int]:
    return {t: p.watermark - T0 for t, p in cim.view(task).partitions.items()}


# -- CIM merge (protocol/cim.py) ---------------------------------------------------------------
def test_cim_latest_state_by_state_timestamp_wins() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 0, ("a", "b")))
    cim.apply(1, state("b", 20, part("p1", 5)))
    assert cim.apply(2, state("b", 10, part("p1", 3))) == "older-state"
    assert owned(cim, "b") == {"p1": 5}


def test_cim_a_task_changes_only_its_own_state() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 0, ("a", "b")))
    forged = StateMessage(
        task_id="b", epoch=0, connector_state=(TaskState("a", 5, data=(part("p9"),)),)
    )
    assert cim.apply(1, forged) == "foreign-state"
    assert owned(cim, "a") == {}


def test_cim_epochs_fence_older_messages_and_only_the_epoch_drops_tasks() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 3, ("a", "b")))
    cim.apply(1, state("b", 1, part("p1", 7)))
    stale = StateMessage(task_id="a", epoch=2, connector_state=(TaskState("a", 5),))
    assert cim.apply(2, stale) == "stale-epoch"
    cim.apply(3, epoch("a", 4, ("a",)))
    assert "b" not in cim.tasks
    assert cim.members == ("a",)
    assert cim.apply(4, epoch("a", 4, ("a", "b"))) == "stale-epoch"


def test_cim_rule_2b_a_dropped_task_claims_nothing_until_an_epoch_includes_it() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 5, ("a",)))
    late = StateMessage(task_id="b", epoch=6, connector_state=(TaskState("b", 9, (part("p1"),)),))
    assert cim.apply(1, late) == "not-a-member"
    assert owned(cim, "b") == {}
    assert cim.view("b").epoch_seen == 6  # its answer counts for the leader


def test_cim_rule_5b_an_offer_resumes_from_the_newest_watermark_in_the_cim() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 0, ("a", "b")))
    cim.apply(1, state("b", 1, part("p1", 900)))  # b's last report, after the leader planned
    offer = Share(part("p1", 400), target="a", kind="new")
    cim.apply(2, epoch("a", 1, ("a",), offer))
    assert cim.view("a").share["p1"].partition.watermark == T0 + 900


def test_cim_duplicate_offsets_are_ignored() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 0, ("a",)))
    assert cim.apply(0, state("a", 1, part("p1"))) == "duplicate"


def test_cim_replay_from_a_checkpoint_equals_a_full_replay() -> None:
    log: list[messages.SyncMessage] = [
        epoch("a", 0, ("a", "b")),
        state("a", 1, part("p1", 10)),
        state("b", 2, part("p2", 20)),
    ]
    full = Cim()
    for i, m in enumerate(log):
        full.apply(i, m)
    ckpt = full.checkpoint("a", now=5)
    tail: list[messages.SyncMessage] = [
        state("b", 3, part("p2", 30)),
        state("a", 4, removed=("p1",)),
    ]
    for i, m in enumerate(tail, start=len(log) + 1):
        full.apply(i, m)
    resumed = Cim()
    resumed.apply(len(log), ckpt)
    for i, m in enumerate(tail, start=len(log) + 1):
        resumed.apply(i, m)
    assert isinstance(ckpt, CheckpointMessage)
    assert {t: owned(resumed, t) for t in resumed.tasks} == {t: owned(full, t) for t in full.tasks}
    assert (resumed.epoch, resumed.members) == (full.epoch, full.members)


def test_malformed_and_newer_schema_messages_are_typed_errors() -> None:
    with pytest.raises(SyncDecodeError) as bad:
        messages.decode(b"{not json")
    assert bad.value.reason == "malformed"
    newer = msgspec.json.encode({"kind": "state", "taskID": "a", "v": 99})
    with pytest.raises(SyncDecodeError) as future:
        messages.decode(newer)
    assert future.value.reason == "newer-schema"


# -- partition lifecycle (protocol/lifecycle.py) -----------------------------------------------
def test_a_merged_child_is_registered_once_by_its_smallest_parent() -> None:
    child = ChildPartition("c", ("p2", "p1"))
    assert lifecycle.registers("p1", child)
    assert not lifecycle.registers("p2", child)


def test_a_merged_child_is_readable_only_after_every_parent_finished() -> None:
    parts = {"p1": part("p1", status="finished"), "p2": part("p2")}
    child = part("c", parents=("p1", "p2"))
    assert not lifecycle.readable(child, parts.get)
    parts["p2"] = part("p2", status="finished")
    assert lifecycle.readable(child, parts.get)
    assert not lifecycle.readable(part("d", parents=("unknown",)), parts.get)


# -- sharing (protocol/share.py) ---------------------------------------------------------------
def test_children_go_to_the_most_underloaded_task_within_the_cap() -> None:
    assert share.place_child("a", {"a": 5, "b": 2, "c": 3}, cap=0) == "b"
    assert share.place_child("a", {"a": 2, "b": 2}, cap=0) == "a"  # not strictly less: keep it
    assert share.place_child("a", {"a": 4, "b": 4}, cap=4) is None  # everyone full: park it


def test_a_join_moves_each_donors_surplus_and_nothing_else() -> None:
    loads = {"a": 10, "b": 10, "c": 10, "d": 0}
    assert share.goals(loads) == {"a": 8, "b": 8, "c": 7, "d": 7}
    assert share.balance_moves(loads, cap=0) == [("a", "d", 2), ("b", "d", 2), ("c", "d", 3)]
    assert share.balance("a", loads, cap=0) == [("d", 2)]
    assert share.balance_moves({"a": 5, "b": 4, "c": 4}, cap=0) == []  # within one already


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 60), min_size=2))
def test_balancing_reaches_loads_within_one_moving_only_surplus(loads: dict[str, int]) -> None:
    goal = share.goals(loads)
    after = dict(loads)
    moved_out: dict[str, int] = {}
    for donor, target, count in share.balance_moves(loads, cap=0):
        assert loads[donor] > goal[donor]
        assert loads[target] < goal[target]
        after[donor] -= count
        after[target] += count
        moved_out[donor] = moved_out.get(donor, 0) + count
    assert sum(after.values()) == sum(loads.values())
    assert max(after.values()) - min(after.values()) <= 1
    assert all(moved_out[d] == loads[d] - goal[d] for d in moved_out)


# -- planner (protocol/planner.py) -------------------------------------------------------------
def test_the_planner_deals_a_dead_tasks_partitions_to_the_least_loaded_under_the_cap() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 0, ("a", "b", "c")))
    cim.apply(1, state("a", 1, part("p1"), part("p2")))
    cim.apply(2, state("c", 1, part("p3", 30), part("p4", 40), part("p5", 50)))
    p = plan(cim, ("a", "b"), "a", 1, now=7, cap=2, rng=Random(1))
    assert [(o.token, o.target, o.partition.watermark - T0) for o in p.offers] == [
        ("p3", "b", 30),
        ("p4", "b", 40),
        ("p5", None, 50),  # everyone at the cap: parked
    ]
    assert plan(cim, ("a", "b"), "a", 1, 7, 2, Random(1)) == p  # deterministic


def test_survivors_keep_what_they_own() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 0, ("a", "b")))
    cim.apply(1, state("a", 1, part("p1")))
    cim.apply(2, state("b", 1, part("p2")))
    assert plan(cim, ("a", "b", "c"), "a", 1, 0, 0, Random(0)).offers == ()


# -- hand-off state machine (protocol/handoff.py) ----------------------------------------------
def test_a_move_goes_stable_pending_stable_and_a_newer_target_is_planned() -> None:
    m = Move("p", stable="a").request("b", revision=10)
    assert (m.phase, m.pending) == ("pending", "b")
    m = m.request("c", revision=11)
    assert (m.pending, m.planned) == ("b", "c")
    assert m.request("c", revision=11) == m  # a replayed decision is applied once
    m = m.ready()
    assert m.phase == "ready"
    done = m.complete("b")
    assert (done.stable, done.pending, done.planned) == ("b", None, None)
    assert m.abort().pending == "c"  # the target died: the planned one is next
    with pytest.raises(MoveError):
        done.ready()
    with pytest.raises(MoveError):
        m.complete("x")


# -- task core exact command lists (protocol/task.py) ------------------------------------------
def read_back(c: TaskCore, sent: list[TaskCommand], first_offset: int, now: int) -> int:
    """Feed ``c`` its own published messages (and those they lead to) until it has none on the
    way; returns the next free offset."""
    offset = first_offset
    queue = [cmd.message for cmd in sent if isinstance(cmd, Publish)]
    while queue:
        more = c.handle(SyncRead(offset, queue.pop(0)), now=now)
        queue += [cmd.message for cmd in more if isinstance(cmd, Publish)]
        offset += 1
    return offset


def core(task: str = "a") -> TaskCore:
    return TaskCore(TaskConfig(task_id=task, cap=2), Random(0))


def test_a_task_reads_its_partitions_only_after_the_epoch_that_includes_it_and_within_its_cap() -> (
    None
):
    c = core()
    assert c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1) == []
    c.handle(Lease(until=10**12), now=2)
    joined = c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
    assert not any(isinstance(cmd, StartReader) for cmd in joined)  # no epoch 1 yet
    assert any(isinstance(cmd, Publish) for cmd in joined)  # its answer to the rebalance
    offers = tuple(
        Share(part(f"p{i}", 100 * i), target="a", kind="new", since=4) for i in (1, 2, 3)
    )
    out = c.handle(SyncRead(1, epoch("x", 1, ("a", "x"), *offers)), now=5)
    starts = [cmd for cmd in out if isinstance(cmd, StartReader)]
    assert [(s.token, s.start_ts - T0) for s in starts] == [("p1", 100), ("p2", 200)]  # cap 2
    assert sorted(c.mine) == ["p1", "p2", "p3"]


def test_an_epoch_message_with_a_foreign_state_is_counted_and_still_opens_its_epoch() -> None:
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1)
    c.handle(Lease(until=10**12), now=2)
    c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
    offer = Share(part("p1", 100), target="a", kind="new", since=4)
    message = epoch("x", 1, ("a", "x"), offer)
    forged = TaskState("a", 10**9, data=(part("p9"),))
    message = msgspec.structs.replace(message, connector_state=(*message.connector_state, forged))
    out = c.handle(SyncRead(1, message), now=5)
    assert c.counters["sync_ignored.foreign-state"] == 1
    assert c.cim.epoch == 1
    assert [(cmd.token, cmd.start_ts - T0) for cmd in out if isinstance(cmd, StartReader)] == [
        ("p1", 100)
    ]
    assert "p9" not in c.mine


def test_an_epoch_that_drops_the_task_evicts_it_even_with_a_foreign_state_in_it() -> None:
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1)
    c.handle(Lease(until=10**12), now=2)
    c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
    offer = Share(part("p1", 100), target="a", kind="new", since=4)
    c.handle(SyncRead(1, epoch("x", 1, ("a", "x"), offer)), now=5)
    assert sorted(c.mine) == ["p1"]
    dropping = epoch("x", 2, ("x",))
    forged = TaskState("a", 10**9, data=(part("p9"),))
    dropping = msgspec.structs.replace(
        dropping, connector_state=(*dropping.connector_state, forged)
    )
    c.handle(SyncRead(2, dropping), now=6)
    assert c.counters["evicted"] == 1
    assert c.mine == {}


def _double_owned(task: str) -> tuple[TaskCore, list[list[TaskCommand]]]:
    """``task`` (a or b) reads p1, offered to it in epoch 1; then the log shows a owning p1 at
    watermark 100 and b owning it at 300 in that epoch (a foreign writer, or a bug): the
    commands of each step."""
    c = core(task)
    c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1)
    c.handle(Lease(until=10**12), now=2)
    c.handle(Joined(generation=1, leader="x", members=("a", "b", "x")), now=3)
    offer = Share(part("p1", 100), target=task, kind="new", since=4)
    steps = [c.handle(SyncRead(1, epoch("x", 1, ("a", "b", "x"), offer)), now=5)]
    claims = [
        StateMessage(
            task_id=t, epoch=1, connector_state=(TaskState(t, ts, data=(part("p1", wm),)),)
        )
        for t, ts, wm in (("a", 5, 100), ("b", 6, 300))
    ]
    steps.append(c.handle(SyncRead(2, claims[0]), now=6))
    steps.append(c.handle(SyncRead(3, claims[1]), now=7))
    steps.append(c.handle(SyncRead(4, state("b", 9, part("p1", 400))), now=8))
    return c, steps


def test_two_owners_in_one_epoch_the_older_watermark_gives_up_and_both_report_it() -> None:
    older, steps = _double_owned("a")
    assert [type(cmd).__name__ for cmd in steps[0]] == ["StartReader"]
    alerts = [cmd for cmd in steps[2] if isinstance(cmd, Alert)]
    assert [a.kind for a in alerts] == ["double-owner"]
    assert "a gives it up" in alerts[0].detail
    assert [(cmd.token, cmd.reason) for cmd in steps[2] if isinstance(cmd, StopReader)] == [
        ("p1", "not-wanted")
    ]
    assert "p1" not in older.mine
    assert older.counters["double_owner"] == 1
    assert older.counters["double_owner_yielded"] == 1
    assert not any(isinstance(cmd, Alert) for cmd in steps[3])  # reported once

    newer, steps = _double_owned("b")
    alerts = [cmd for cmd in steps[2] if isinstance(cmd, Alert)]
    assert [a.kind for a in alerts] == ["double-owner"]
    assert "a gives it up" in alerts[0].detail  # the same decision, seen from the other side
    assert not any(isinstance(cmd, StopReader) for cmd in steps[2] + steps[3])
    assert "p1" in newer.mine
    assert newer.counters["double_owner_yielded"] == 0


def test_a_task_whose_lease_lapsed_stops_every_reader() -> None:
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1)
    c.handle(Lease(until=100), now=2)
    c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
    offer = Share(part("p1", 50), target="a", kind="new", since=4)
    c.handle(SyncRead(1, epoch("x", 1, ("a", "x"), offer)), now=5)
    assert c.reading == {"p1": T0 + 50}
    out = c.handle(Lease(until=100), now=150)
    assert [cmd for cmd in out if isinstance(cmd, StopReader)] == [
        StopReader("p1", StopReason.NOT_PERMITTED, drain=False)
    ]


def test_a_restarted_task_adopts_what_the_cim_credits_to_it() -> None:
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("a", "x"))), now=1)
    c.handle(SyncRead(1, state("a", 2, part("p7", 70))), now=2)  # its previous life's report
    c.handle(Lease(until=10**12), now=3)
    c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=4)
    assert c.mine == {"p7": part("p7", 70)}
    assert c.counters["adopted"] == 1


def test_sync_messages_round_trip_through_the_wire_format() -> None:
    m = epoch("a", 3, ("a", "b"), Share(part("p1", 5), target="b", kind="move", released=True))
    assert messages.decode(messages.encode(m)) == m
    wire = messages.encode(m)
    assert b'"taskID"' in wire
    assert b'"kind":"epoch"' in wire
    assert msgspec.json.decode(messages.encode(m))["connectorState"][0]["taskID"] == "a"


def test_a_draining_task_stops_its_readers_for_good_and_publishes() -> None:
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1)
    c.handle(Lease(until=10**12), now=2)
    sent = c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
    offer = Share(part("p1", 50), target="a", kind="new", since=4)
    sent += c.handle(SyncRead(1, epoch("x", 1, ("a", "x"), offer)), now=5)
    read_back(c, sent, first_offset=2, now=5)  # nothing of ours in flight
    out = c.handle(Drain(), now=6)
    assert [cmd for cmd in out if isinstance(cmd, StopReader)] == [
        StopReader("p1", StopReason.SHUTDOWN, drain=True)
    ]
    stopped = c.handle(ReaderStopped("p1", T0 + 80), now=7)
    published = [cmd.message for cmd in stopped if isinstance(cmd, Publish)]
    assert [
        [p.watermark - T0 for s in m.connector_state for p in s.data]  # type: ignore[union-attr]
        for m in published
    ] == [[80]]  # the final watermark goes out at once
    later = c.handle(TaskTick(), now=10**6)
    assert not any(isinstance(cmd, StartReader) for cmd in later)


def test_a_task_whose_sync_appends_keep_failing_stops_reading_until_one_is_read_back() -> None:
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1)
    c.handle(Lease(until=10**12), now=2)
    c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
    offer = Share(part("p1", 50), target="a", kind="new", since=4)
    c.handle(SyncRead(1, epoch("x", 1, ("a", "x"), offer)), now=5)
    assert c.reading == {"p1": T0 + 50}
    assert not any(
        isinstance(cmd, StopReader) for cmd in c.handle(PublishFailed("down"), now=1_000_000)
    )
    out = c.handle(TaskTick(), now=1_000_000 + c.config.sync_timeout)
    assert [cmd for cmd in out if isinstance(cmd, StopReader)] == [
        StopReader("p1", StopReason.NOT_PERMITTED, drain=False)
    ]
    c.handle(ReaderStopped("p1", T0 + 60), now=5_000_000)
    back = c.handle(SyncRead(2, state("a", 99, part("p1", 60))), now=5_000_001)
    assert [cmd.token for cmd in back if isinstance(cmd, StartReader)] == ["p1"]


def _picking_up_p1(c: TaskCore) -> tuple[Publish, Publish]:
    """``c`` joins generation 1 led by ``x``, reads the epoch offering it p1 and its own answer
    to the rebalance back; returns (answer, pick-up), the pick-up not read back yet."""
    c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1)
    c.handle(Lease(until=10**12), now=2)
    (answer,) = c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
    offer = Share(part("p1", 50), target="a", kind="new", since=4)
    held = c.handle(SyncRead(1, epoch("x", 1, ("a", "x"), offer)), now=5)
    assert not any(isinstance(cmd, Publish) for cmd in held)  # group commit: answer unread
    assert isinstance(answer, Publish)
    (pickup,) = [
        cmd for cmd in c.handle(SyncRead(2, answer.message), now=6) if isinstance(cmd, Publish)
    ]
    return answer, pickup


def test_a_redelivered_or_retried_copy_of_an_own_message_is_not_a_second_read_back() -> None:
    # Regression (sim seed 731): each copy counted as a read-back, so the task thought nothing
    # was on its way, saw the CIM lag behind what it had sent, and re-sent it; copies of the
    # re-sends did the same, a storm that grew without bound.
    c = core()
    answer, pickup = _picking_up_p1(c)
    assert c.handle(SyncRead(2, answer.message), now=7) == []  # the consumer re-delivers it
    assert c.handle(SyncRead(3, answer.message), now=8) == []  # a producer retry wrote it twice
    assert c.counters["resync"] == 0
    assert c.handle(SyncRead(4, pickup.message), now=9) == []
    assert c.cim.view("a").partitions == {"p1": part("p1", 50)}


def test_a_failed_append_is_re_sent_at_once_and_no_longer_awaited() -> None:
    c = core()
    _, pickup = _picking_up_p1(c)
    out = c.handle(PublishFailed("down", own_state_ts(pickup.message)), now=7)
    again = [cmd.message for cmd in out if isinstance(cmd, Publish)]
    assert [[p.token for p in m.connector_state[0].data] for m in again] == [["p1"]]  # type: ignore[union-attr]
    # once the re-sent one is read back nothing is awaited: a watermark goes out on time
    c.handle(SyncRead(3, again[0]), now=8)
    later = c.handle(ReaderCommitted("p1", T0 + 60), now=7 + c.config.publish_interval)
    (sent,) = [cmd.message for cmd in later if isinstance(cmd, Publish)]
    assert [p.watermark - T0 for p in sent.connector_state[0].data] == [60]  # type: ignore[union-attr]


def test_a_task_with_nothing_to_say_whose_append_failed_still_sends_one_to_read_back() -> None:
    # Regression (sim with failing appends, seed 68): a newcomer's answer was lost; it had
    # nothing new to send, so it never read one of its messages back, and never read again.
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("x",))), now=1)
    c.handle(Lease(until=10**12), now=2)
    (answer,) = c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
    assert isinstance(answer, Publish)
    out = c.handle(PublishFailed("timed out", own_state_ts(answer.message)), now=4)
    (probe,) = [cmd.message for cmd in out if isinstance(cmd, Publish)]
    assert isinstance(probe, StateMessage)
    assert probe.epoch == 1
    assert probe.connector_state[0].data == ()
    assert c.handle(TaskTick(), now=5) == []  # one on its way at a time
    offer = Share(part("p1", 50), target="a", kind="new", since=6)
    c.handle(SyncRead(1, epoch("x", 1, ("a", "x"), offer)), now=4 + c.config.sync_timeout)
    assert c.reading == {}  # appends failing for sync_timeout: not allowed to read
    out = c.handle(SyncRead(2, probe), now=5 + c.config.sync_timeout)
    assert [cmd.token for cmd in out if isinstance(cmd, StartReader)] == ["p1"]


def test_a_leader_whose_epoch_append_fails_sends_the_same_plan_again() -> None:
    # Without it the generation had no epoch until the next rebalance: nobody shared, and a
    # task that joined in it (or the dead task's partitions) waited that long.
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("a", "x"), Share(part("p1", 5), target="x"))), now=1)
    c.handle(Lease(until=10**12), now=2)
    (answer,) = c.handle(Joined(generation=1, leader="a", members=("a", "b")), now=3)
    assert isinstance(answer, Publish)
    c.handle(SyncRead(1, answer.message), now=4)
    (request,) = c.handle(TaskTick(), now=4 + c.config.answer_timeout)
    assert isinstance(request, RequestPlan)
    assert (request.generation, request.members) == (1, ("a", "b"))
    the_plan = plan(c.cim, ("a", "b"), "a", 1, now=5, cap=2, rng=Random(0))
    assert [(o.token, o.target) for o in the_plan.offers] == [("p1", "a")]  # x's, x is gone
    (first,) = c.handle(PlanReady(the_plan), now=6)
    assert isinstance(first, Publish)
    assert isinstance(first.message, EpochMessage)

    out = c.handle(PublishFailed("timed out", own_state_ts(first.message)), now=7)
    (again,) = [cmd.message for cmd in out if isinstance(cmd, Publish)]
    assert isinstance(again, EpochMessage)
    assert (again.epoch, again.members, again.sync_epoch) == (1, ("a", "b"), the_plan.sync_epoch)
    assert [s.token for s in again.connector_state[0].share or ()] == ["p1"]
    assert c.counters["epoch_resent"] == 1

    c.handle(SyncRead(2, again), now=8)  # it landed: a late failure report changes nothing
    assert c.cim.epoch == 1
    assert c.handle(PublishFailed("late", own_state_ts(again)), now=9) == []
    assert c.counters["epoch_resent"] == 1


def test_an_epoch_append_failing_after_a_newer_rebalance_is_not_sent_again() -> None:
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, ("a", "x"))), now=1)
    c.handle(Lease(until=10**12), now=2)
    (answer,) = c.handle(Joined(generation=1, leader="a", members=("a", "x")), now=3)
    assert isinstance(answer, Publish)
    c.handle(SyncRead(1, answer.message), now=4)
    c.handle(TaskTick(), now=4 + c.config.answer_timeout)
    the_plan = plan(c.cim, ("a", "x"), "a", 1, now=5, cap=2, rng=Random(0))
    (first,) = c.handle(PlanReady(the_plan), now=6)
    assert isinstance(first, Publish)
    c.handle(Joined(generation=2, leader="x", members=("a", "x")), now=7)
    out = c.handle(PublishFailed("timed out", own_state_ts(first.message)), now=8)
    assert not any(isinstance(cmd.message, EpochMessage) for cmd in out if isinstance(cmd, Publish))
    assert c.counters["epoch_resent"] == 0


def _leader_of_generation_1(lease: int = 10**12, rules: Rules | None = None) -> TaskCore:
    """``a`` leads generation 1 (members a, b) under a lease until ``lease``, its answer read
    back; x, the leader of epoch 0, offered p1 and is gone, so a plan deals p1 out."""
    c = TaskCore(TaskConfig(task_id="a", cap=2, rules=rules or Rules()), Random(0))
    c.handle(SyncRead(0, epoch("x", 0, ("a", "x"), Share(part("p1", 5), target="x"))), now=1)
    c.handle(Lease(until=lease), now=2)
    (answer,) = c.handle(Joined(generation=1, leader="a", members=("a", "b")), now=3)
    assert isinstance(answer, Publish)
    c.handle(SyncRead(1, answer.message), now=4)
    return c


def test_a_leader_whose_lease_ran_out_plans_only_once_it_holds_again() -> None:
    # A leader paused past its lease may have been removed and its generation superseded; a
    # process paused that long has read nothing meanwhile (seeds 597, 824, 1502, 1869).
    c = _leader_of_generation_1(lease=1_000)
    due = 4 + c.config.answer_timeout
    assert c.next_deadline() is None  # the plan is not due under a lease that ran out
    assert c.handle(TaskTick(), now=due) == []
    assert c.handle(Lease(until=due + 3), now=due + 1) == [
        RequestPlan(1, ("a", "b"), need_roots=True)
    ]
    # its plan comes back after the lease ran out again: not acted on, asked for again
    the_plan = plan(c.cim, ("a", "b"), "a", 1, now=due + 2, cap=2, rng=Random(0))
    assert c.handle(PlanReady(the_plan), now=due + 3) == []
    assert c.counters["plan_discarded"] == 1
    (request,) = c.handle(Lease(until=10**12), now=due + 4)
    assert request == RequestPlan(1, ("a", "b"), need_roots=True)


def test_a_leader_plans_only_once_its_own_answer_is_in_its_cim() -> None:
    # Back from a pause, its timer may come before it has read anything: its CIM may not have
    # seen the epochs of the generations it missed (it would deal out the roots again).
    c = core()
    c.handle(Lease(until=10**12), now=1)
    (answer,) = c.handle(Joined(generation=1, leader="a", members=("a", "b")), now=2)
    assert isinstance(answer, Publish)
    assert c.handle(TaskTick(), now=2 + c.config.answer_timeout) == []
    assert c.next_deadline() is None
    # what it reads first: the epoch the group went on with while it was away; its answer is
    # then fenced, and generation 1 is never planned
    c.handle(SyncRead(0, epoch("b", 2, ("b",))), now=3 + c.config.answer_timeout)
    assert c.handle(SyncRead(1, answer.message), now=4 + c.config.answer_timeout) == []
    assert c.next_deadline() is None


def test_a_plan_whose_epoch_is_fenced_withdraws_its_offers_and_never_publishes_them() -> None:
    # A plan's offers reach the CIM only in its epoch: published in a later generation's state
    # message they deal out a partition from a CIM long gone (seeds 597, 824, 1502, 1869).
    c = _leader_of_generation_1()
    c.handle(TaskTick(), now=4 + c.config.answer_timeout)
    the_plan = plan(c.cim, ("a", "b"), "a", 1, now=5, cap=2, rng=Random(0))
    assert [(o.token, o.target) for o in the_plan.offers] == [("p1", "a")]
    (first,) = c.handle(PlanReady(the_plan), now=6)
    assert isinstance(first, Publish)
    assert isinstance(first.message, EpochMessage)
    assert [s.token for s in first.message.connector_state[0].share or ()] == ["p1"]
    # a newer rebalance before the epoch landed: the answer (held by group commit while the
    # epoch is on its way) does not carry the plan's offers
    assert c.handle(Joined(generation=2, leader="b", members=("a", "b")), now=7) == []
    (answer,) = c.handle(TaskTick(), now=3 + c.config.coalesce_wait)
    assert isinstance(answer, Publish)
    assert isinstance(answer.message, StateMessage)
    assert answer.message.connector_state[0].share is None
    # b's epoch 2 lands first and fences a's epoch 1: its offer is withdrawn
    c.handle(SyncRead(2, epoch("b", 2, ("a", "b"))), now=8)
    assert c.shares == {}
    assert c.counters["plan_fenced"] == 1
    assert c.counters["plan_offers_withdrawn"] == 1
    assert c.handle(SyncRead(3, first.message), now=9) == []  # ignored: a stale epoch
    assert c.cim.view("a").share == {}
    assert c.shares == {}


def test_without_the_rule_a_fenced_plans_offer_goes_out_in_the_next_generation() -> None:
    """The control of the test above: the teeth of the simulator's test turn the rule off."""
    c = _leader_of_generation_1(rules=Rules(plan_offers_in_epoch_only=False))
    c.handle(TaskTick(), now=4 + c.config.answer_timeout)
    the_plan = plan(c.cim, ("a", "b"), "a", 1, now=5, cap=2, rng=Random(0))
    c.handle(PlanReady(the_plan), now=6)
    c.handle(Joined(generation=2, leader="b", members=("a", "b")), now=7)
    c.handle(SyncRead(2, epoch("b", 2, ("a", "b"))), now=8)
    assert [s.token for s in c.shares.values()] == ["p1"]


def test_a_plan_made_while_a_newer_epoch_landed_is_not_acted_on() -> None:
    c = _leader_of_generation_1()
    c.handle(TaskTick(), now=4 + c.config.answer_timeout)
    the_plan = plan(c.cim, ("a", "b"), "a", 1, now=5, cap=2, rng=Random(0))
    c.handle(SyncRead(2, epoch("b", 1, ("a", "b"))), now=6)  # (b led generation 1 as well)
    assert c.handle(PlanReady(the_plan), now=7) == []
    assert c.shares == {}


def test_a_hand_off_completes_only_once_the_epoch_of_the_rebalance_is_in_the_cim() -> None:
    # Seed 2126: the offerer, back from a pause past its lease and dropped by the rebalance,
    # released its move while the new generation's epoch was on its way; the target completed
    # the hand-off and read (its lease holds through the rebalance) while the leader had dealt
    # the dropped offerer's partition to another member.
    c = core()
    c.handle(SyncRead(0, epoch("x", 1, ("a", "x", "y"))), now=1)
    c.handle(Lease(until=10**12), now=2)
    c.handle(Joined(generation=1, leader="x", members=("a", "x", "y")), now=3)
    move = Share(part("p1", 50), target="a", kind="move", since=4)
    y_state = TaskState("y", 2 * 10**9, data=(part("p1", 50),), share=(move,))
    c.handle(SyncRead(1, StateMessage(task_id="y", epoch=1, connector_state=(y_state,))), now=4)
    assert c.mine["p1"].status == "incoming"  # a is ready; y still reads
    c.handle(Joined(generation=2, leader="x", members=("a", "x")), now=5)  # y is dropped
    released = msgspec.structs.replace(move, partition=part("p1", 60), released=True)
    y_release = TaskState("y", 2 * 10**9 + 1, removed=("p1",), share=(released,))
    out = c.handle(
        SyncRead(2, StateMessage(task_id="y", epoch=1, connector_state=(y_release,))), now=6
    )
    assert not any(isinstance(cmd, StartReader) for cmd in out)
    assert c.mine["p1"].status == "incoming"  # waits for the epoch of generation 2
    # the epoch drops y and deals its partition to x: the take-over is dropped, nobody here reads
    out = c.handle(SyncRead(3, epoch("x", 2, ("a", "x"), Share(part("p1", 50), "x"))), now=7)
    assert not any(isinstance(cmd, StartReader) for cmd in out)
    assert "p1" not in c.mine
    assert c.reading == {}


def test_a_new_offer_for_a_partition_moving_between_members_is_refused() -> None:
    # Defence in depth (the sim's teeth test with a planner that deals out survivors'
    # partitions): b is taking p1 over from y in a hand-off, so a 'new' offer of p1 to a, from
    # a plan made before the hand-off was known, is not picked up.
    c = core()
    members = ("a", "b", "x", "y")
    c.handle(SyncRead(0, epoch("x", 0, members)), now=1)
    move = Share(part("p1", 50), target="b", kind="move", released=True, since=2)
    c.handle(
        SyncRead(
            1,
            StateMessage(
                task_id="y", epoch=0, connector_state=(TaskState("y", 2 * 10**9, share=(move,)),)
            ),
        ),
        now=2,
    )
    incoming = msgspec.structs.replace(part("p1", 50), status="incoming", source="y")
    c.handle(SyncRead(2, state("b", 1, incoming)), now=3)
    c.handle(Lease(until=10**12), now=4)
    c.handle(Joined(generation=1, leader="x", members=members), now=5)
    bad = Share(part("p1", 50), target="a", kind="new", since=6)
    c.handle(SyncRead(3, epoch("x", 1, members, bad)), now=7)
    assert "p1" not in c.mine
    assert c.counters["offer_already_owned"] >= 1


def _a_given_p1_to_p3(rules: Rules | None = None) -> tuple[TaskCore, int]:
    """a is dealt p1..p3 in x's epoch 0 of a, b, x, y and spreads them (p1 moves to b), its
    messages read back; returns a and the next sync offset."""
    c = TaskCore(TaskConfig(task_id="a", cap=0, rules=rules or Rules()), Random(0))
    members = ("a", "b", "x", "y")
    c.handle(Lease(until=10**12), now=1)
    offset = read_back(c, c.handle(Joined(generation=0, leader="x", members=members), now=2), 0, 2)
    offers = tuple(Share(part(f"p{i}", 10 * i), target="a", kind="new", since=3) for i in (1, 2, 3))
    out = c.handle(SyncRead(offset, epoch("x", 0, members, *offers)), now=3)
    offset = read_back(c, out, offset + 1, now=3)
    return c, offset


def _released_to_b_before_the_epoch_dropping_b() -> tuple[TaskCore, int]:
    """a owns p1..p3 in an epoch of a, b, x, y and moves p1 to b; b answers, a releases p1 (its
    message saying so is on its way), and the rebalance that drops b and its epoch land first:
    the CIM still shows a owning p1."""
    c, offset = _a_given_p1_to_p3()
    assert {t: (s.target, s.kind) for t, s in c.shares.items()} == {
        "p1": ("b", "move"),
        "p2": ("x", "move"),
    }
    incoming = msgspec.structs.replace(part("p1", 10), status="incoming", source="a")
    out = c.handle(SyncRead(offset, state("b", 1, incoming)), now=4)
    assert out == [StopReader("p1", StopReason.HANDOFF, drain=True)]
    out = c.handle(ReaderStopped("p1", T0 + 15), now=5)
    assert "p1" not in c.mine
    assert c.shares["p1"].released
    assert [cmd.message.task_id for cmd in out if isinstance(cmd, Publish)] == ["a"]  # not read
    c.handle(Joined(generation=1, leader="x", members=("a", "x", "y")), now=6)
    c.handle(SyncRead(offset + 1, epoch("x", 1, ("a", "x", "y"))), now=7)
    assert c.cim.view("a").partitions["p1"].status == "owned"  # a's claim it gave up
    return c, offset + 2


def test_a_released_move_re_offered_after_its_target_left_is_kept_though_the_cim_shows_it_here() -> (
    None
):
    # Seed 5885: the offerer re-targeted its released move as a 'new' offer once the epoch that
    # dropped the target landed, then dropped that offer as taken, because the CIM still showed
    # its own claim, given up in the release message not yet read back. Nobody owned the
    # partition any more.
    c, offset = _released_to_b_before_the_epoch_dropping_b()
    offer = c.shares["p1"]
    assert (offer.target, offer.kind, offer.partition.watermark) == ("y", "new", T0 + 15)
    sent: list[TaskCommand] = []
    for now in (8, 1_000_000, 2_000_000):  # the ticks after: the offer stays
        sent += c.handle(TaskTick(), now=now)
    assert c.shares["p1"] == offer
    assert c.counters["handoffs_out"] == 0
    read_back(c, sent, offset, now=2_000_001)
    assert "p1" not in c.cim.view("a").partitions  # the release landed
    assert [(h, o.target) for h, o in c.cim.offers() if o.token == "p1"] == [("a", "y")]


def test_a_released_move_dealt_out_meanwhile_is_withdrawn_and_never_picked_up_beside_its_owner() -> (
    None
):
    # Seed 5897: the target died after answering a move, the leader dealt the released partition
    # to another member, the target came back under the same id; the offerer, restarted too,
    # adopted its released offer and kept it for ever (the target's load in everyone's eyes, so
    # nothing was balanced to it). The target, seeing the released offer, would take the
    # partition while its new owner reads it.
    members = ("a", "b", "x")
    move = Share(part("p1", 50), target="b", kind="move", released=True, since=2)
    a_release = StateMessage(
        task_id="a", epoch=0, connector_state=(TaskState("a", 2 * 10**9, share=(move,)),)
    )
    # (the epoch of the generation without b, which dealt p1 to x, is not needed here)
    log: list[SyncMessage] = [epoch("x", 0, members), a_release, state("x", 1, part("p1", 80))]
    # the offerer, restarted: it adopts its released offer, and withdraws it once x owns p1
    a = TaskCore(TaskConfig(task_id="a", cap=0), Random(0))
    for offset, message in enumerate(log):
        a.handle(SyncRead(offset, message), now=1)
    a.handle(Lease(until=10**12), now=2)
    a.handle(Joined(generation=1, leader="x", members=members), now=3)
    assert a.shares["p1"] == move  # adopted
    a.handle(SyncRead(3, epoch("x", 1, members)), now=4)
    assert "p1" not in a.shares
    # the target, restarted: it never picks the released offer up while x owns p1
    b = TaskCore(TaskConfig(task_id="b", cap=0), Random(0))
    for offset, message in enumerate(log):
        b.handle(SyncRead(offset, message), now=1)
    b.handle(Lease(until=10**12), now=2)
    b.handle(Joined(generation=1, leader="x", members=members), now=3)
    out = b.handle(SyncRead(3, epoch("x", 1, members)), now=4)
    assert "p1" not in b.mine
    assert not any(isinstance(cmd, StartReader) for cmd in out)
    assert b.counters["offer_already_owned"] == 1


def _leader_releasing_p1_while_its_epoch_is_on_its_way(
    rules: Rules | None = None,
) -> tuple[TaskCore, list[TaskCommand], int]:
    """a owns p1..p3 and moves p1 to b; b answers; a becomes the leader of generation 1 and
    sends its epoch; then its reader of p1 stops: the release, while the epoch is on its way."""
    c, offset = _a_given_p1_to_p3(rules)
    members = ("a", "b", "x", "y")
    incoming = msgspec.structs.replace(part("p1", 10), status="incoming", source="a")
    out = c.handle(SyncRead(offset, state("b", 1, incoming)), now=4)
    assert out == [StopReader("p1", StopReason.HANDOFF, drain=True)]
    out = c.handle(Joined(generation=1, leader="a", members=members), now=5)
    offset = read_back(c, out, offset + 1, now=5)  # its answer
    (request,) = c.handle(TaskTick(), now=6 + c.config.answer_timeout)
    assert isinstance(request, RequestPlan)
    the_plan = plan(c.cim, members, "a", 1, now=7, cap=0, rng=Random(0))
    (sent_epoch,) = c.handle(PlanReady(the_plan), now=8 + c.config.answer_timeout)
    assert isinstance(sent_epoch, Publish)
    assert isinstance(sent_epoch.message, EpochMessage)
    out = c.handle(ReaderStopped("p1", T0 + 15), now=9 + c.config.answer_timeout)
    assert "p1" not in c.mine
    assert c.shares["p1"].released
    return c, [sent_epoch, *out], offset


def test_a_release_leaves_the_state_only_with_the_offer_that_carries_the_partition() -> None:
    # Seed 8291: the leader's share section waits while its epoch is on its way; the release
    # went out as a removal alone, the leader died, and its next life dropped the unreleased
    # move it found in the CIM: the partition, held by nobody, was lost.
    c, sent, offset = _leader_releasing_p1_while_its_epoch_is_on_its_way()
    states = [
        s
        for cmd in sent
        if isinstance(cmd, Publish) and isinstance(cmd.message, StateMessage)
        for s in cmd.message.connector_state
    ]
    assert all("p1" not in s.removed for s in states), states
    assert c.cim.view("a").partitions["p1"].status == "owned"
    # the epoch lands: the removal and the released offer go out together
    read_back(c, sent, offset, now=3_000_000)
    out = c.handle(TaskTick(), now=4_000_000)
    read_back(c, out, offset + len(sent), now=4_000_000)
    view = c.cim.view("a")
    assert "p1" not in view.partitions
    assert view.share["p1"].released
    assert view.share["p1"].partition.watermark == T0 + 15


def test_without_the_rule_the_removal_goes_out_alone() -> None:
    """The control of the test above: the simulator's teeth test turns the rule off."""
    _, sent, _ = _leader_releasing_p1_while_its_epoch_is_on_its_way(Rules(release_with_offer=False))
    alone = [
        s
        for cmd in sent
        if isinstance(cmd, Publish) and isinstance(cmd.message, StateMessage)
        for s in cmd.message.connector_state
        if "p1" in s.removed
    ]
    assert alone
    assert all(s.share is None for s in alone)


def _leader_finishing_p3_while_its_epoch_is_on_its_way(
    rules: Rules | None = None,
) -> tuple[TaskCore, list[TaskCommand], int]:
    """As above, then a's reader of p3 reads it to its end (children c1, c2) while the epoch is
    on its way: a keeps a child or offers it to the most underloaded member."""
    c, sent, offset = _leader_releasing_p1_while_its_epoch_is_on_its_way(rules)
    children = (ChildPartition("c1", ("p3",)), ChildPartition("c2", ("p3",)))
    now = 10 + c.config.answer_timeout
    out = c.handle(ReaderFinished("p3", T0 + 20, children, T0 + 21), now=now)
    out += c.handle(TaskTick(), now=now + 1_000_000)  # what it publishes meanwhile
    assert any(s.kind == "new" for t, s in c.shares.items() if t in ("c1", "c2")), c.shares
    return c, [*sent, *out], offset


def _states(sent: list[TaskCommand]) -> list[TaskState]:
    return [
        s
        for cmd in sent
        if isinstance(cmd, Publish) and isinstance(cmd.message, StateMessage)
        for s in cmd.message.connector_state
    ]


def test_a_partitions_end_goes_out_only_with_the_offers_of_its_children() -> None:
    # Sweep seed 3212: the end went out alone, naming a child only the held share section
    # offered; the leader died and the child was never read.
    c, sent, offset = _leader_finishing_p3_while_its_epoch_is_on_its_way()
    ended = [p for s in _states(sent) for p in s.data if p.token == "p3"]
    assert all(p.status != "finished" for p in ended), ended
    # the epoch lands: the end and the offers go out together
    published: list[TaskCommand] = []
    queue = [cmd for cmd in sent if isinstance(cmd, Publish)]
    while queue:
        more = c.handle(SyncRead(offset, queue.pop(0).message), now=3_000_000)
        offset += 1
        published += more
        queue += [cmd for cmd in more if isinstance(cmd, Publish)]
    out = c.handle(TaskTick(), now=4_000_000)
    published += out
    read_back(c, out, offset, now=4_000_000)
    together = [s for s in _states(published) if any(p.token == "p3" for p in s.data)]
    assert together, published
    assert all(s.share is not None for s in together), together
    view = c.cim.view("a")
    assert view.partitions["p3"].status == "finished"
    offered = {t for t, s in view.share.items() if s.kind == "new"}
    kept = {t for t in ("c1", "c2") if t in view.partitions}
    assert offered | kept == {"c1", "c2"}
    assert offered


def test_without_the_rule_the_end_goes_out_alone() -> None:
    """The control of the test above (the simulator's teeth test on seed 3212)."""
    _, sent, _ = _leader_finishing_p3_while_its_epoch_is_on_its_way(Rules(release_with_offer=False))
    alone = [
        s for s in _states(sent) if any(p.token == "p3" and p.status == "finished" for p in s.data)
    ]
    assert alone
    assert all(s.share is None for s in alone)


# -- a member whose assignment comes after its generation's epoch (protocol/epochs.py rule 5) ----
def _member_of_generation_1(members: tuple[str, ...]) -> TaskCore:
    """``a`` joined generation 1 (leader ``x``), its epoch and a's answer read back."""
    c = core()
    c.handle(SyncRead(0, epoch("x", 0, members)), now=1)
    c.handle(Lease(until=10**12), now=2)
    (answer,) = c.handle(Joined(generation=1, leader="x", members=members), now=3)
    c.handle(SyncRead(1, epoch("x", 1, members)), now=4)
    assert isinstance(answer, Publish)
    c.handle(SyncRead(2, answer.message), now=5)
    return c


def test_a_member_whose_assignment_is_late_shares_only_once_it_came() -> None:
    # The leader planned generation 2 before a answered (its answer timeout ran out) and the
    # epoch landed first; whatever a writes before its assignment comes carries generation 1
    # and is fenced, so it picks nothing up yet: it keeps reading, and picks up once it joined.
    c = _member_of_generation_1(("a", "x"))
    offer = Share(part("p1", 50), target="a", kind="new", since=6)
    c.handle(SyncRead(3, epoch("x", 2, ("a", "x"), offer)), now=7)
    assert not c.sharing_enabled(8)
    assert c.may_read(8)
    assert "p1" not in c.mine
    c.handle(Joined(generation=2, leader="x", members=("a", "x")), now=9)
    assert c.mine["p1"].status == "owned"


def test_an_answer_to_a_move_lost_to_a_new_epoch_is_given_again() -> None:
    # a answered y's move with 'incoming'; the next epoch landed before the answer and fenced
    # it, and a dropped the claim (y owns p1). y's offer still stands: a answers it again once
    # it joined the new generation. (Sim seed 1012 with followers' lag: the answer was marked
    # given for ever, the move never completed, and the hand-off held balancing for good.)
    members = ("a", "x", "y")
    c = _member_of_generation_1(members)
    move = Share(part("p1", 50), target="a", kind="move", since=6)
    offered = StateMessage(
        task_id="y",
        epoch=1,
        connector_state=(TaskState("y", 2 * 10**9, data=(part("p1", 50),), share=(move,)),),
    )
    c.handle(SyncRead(3, offered), now=6)
    assert c.mine["p1"].status == "incoming"
    c.handle(SyncRead(4, epoch("x", 2, members)), now=7)
    assert "p1" not in c.mine
    assert c.counters["claims_replanned"] == 1
    c.handle(Joined(generation=2, leader="x", members=members), now=8)
    assert c.mine["p1"].status == "incoming"
    assert c.mine["p1"].source == "y"


def test_of_two_new_offers_of_one_partition_only_the_newest_is_picked_up() -> None:
    # x (epoch 0's leader) offered p1 to a; a was dropped, y (epoch 1's leader) re-planned p1
    # to b; a came back (epoch 2, led by z) before x withdrew its offer. Picking x's offer up
    # would put a beside b (sim seed 942): a leaves it, b takes the newer one; with the rule
    # off a takes it.
    members = ("a", "b", "x", "y", "z")
    old = Share(part("p1", 50), target="a", kind="new", since=10)
    replan = Share(part("p1", 50), target="b", kind="new", since=20)

    def offered(holder: str, offer: Share) -> StateMessage:
        return StateMessage(
            task_id=holder, epoch=1, connector_state=(TaskState(holder, 2 * 10**9, share=(offer,)),)
        )

    def takes_p1(me: str, rules: Rules) -> bool:
        c = TaskCore(TaskConfig(task_id=me, cap=2, rules=rules), Random(0))
        c.handle(SyncRead(0, offered("x", old)), now=1)
        c.handle(SyncRead(1, offered("y", replan)), now=2)
        c.handle(Lease(until=10**12), now=3)
        (answer,) = c.handle(Joined(generation=2, leader="z", members=members), now=4)
        assert isinstance(answer, Publish)
        c.handle(SyncRead(2, epoch("z", 2, members)), now=5)
        c.handle(SyncRead(3, answer.message), now=6)
        return "p1" in c.mine

    assert not takes_p1("a", Rules())
    assert takes_p1("b", Rules())
    assert takes_p1("a", Rules(newest_offer_only=False))


def test_an_offer_of_a_partition_read_to_its_end_is_dropped() -> None:
    # Seed 4652: a leader's plan dealt out a dead task's released move of p1 as 'new', while
    # another dead task had read p1 to its end; the leader adopted that finished p1 and kept the
    # offer. Its target never picks a finished partition up, so the offer stood for ever,
    # counted in the target's load, and balancing stopped with loads 3, 1, 3, 2.
    members = ("a", "b", "x")
    offer = Share(part("p1", 50), target="b", kind="new", since=2)
    mine = state("a", 0, part("p1", 80, status="finished"), share=(offer,))
    log: list[SyncMessage] = [epoch("x", 0, members), mine]

    def restarted(task: str) -> tuple[TaskCore, list[TaskCommand]]:
        """``task`` replays the log, joins x's generation 1 and reads its epoch."""
        c = TaskCore(TaskConfig(task_id=task, cap=0), Random(0))
        for offset, message in enumerate(log):
            c.handle(SyncRead(offset, message), now=1)
        c.handle(Lease(until=10**12), now=2)
        c.handle(Joined(generation=1, leader="x", members=members), now=3)
        return c, c.handle(SyncRead(2, epoch("x", 1, members)), now=4)

    a, _ = restarted("a")
    assert "p1" not in a.shares  # adopted, then dropped
    assert a.counters["offers_of_finished_dropped"] == 1
    b, out = restarted("b")  # the target would never have taken it
    assert "p1" not in b.mine
    assert not any(isinstance(cmd, StartReader) for cmd in out)


def test_a_task_an_epoch_dropped_answers_a_released_move_to_it_again_once_back() -> None:
    # Seed 4954 (0.5 s answer wait): b took p1 over from a, then was paused; the epoch without b
    # dealt p1 out to a, the move's own offerer, which never takes an offer of what it is
    # handing over, so a's released move to b stood. b, back in the next epoch, had forgotten
    # its claim (the epoch dropped it) but not that it had answered the move: nobody held p1.
    members = ("a", "b", "x")
    move = Share(part("p1", 50), target="b", kind="move", since=2)
    a_offers = state("a", 0, part("p1", 50), share=(move,))
    released = msgspec.structs.replace(move, released=True)
    a_releases = state("a", 1, removed=("p1",), share=(released,))
    b = TaskCore(TaskConfig(task_id="b", cap=0), Random(0))
    b.handle(Lease(until=10**12), now=1)
    b.handle(Joined(generation=0, leader="x", members=members), now=2)
    b.handle(SyncRead(0, epoch("x", 0, members)), now=3)
    out = b.handle(SyncRead(1, a_offers), now=4)
    status = [b.mine["p1"].status]
    offset = read_back(b, out, 2, now=4)
    out = b.handle(SyncRead(offset, a_releases), now=5)
    status.append(b.mine["p1"].status)
    assert status == ["incoming", "owned"]
    offset = read_back(b, out, offset + 1, now=5)
    # the epoch without b (its plan offered p1 to a, which does not take it)
    replanned = Share(part("p1", 50), target="a", kind="new", since=6)
    b.handle(SyncRead(offset, epoch("x", 1, ("a", "x"), replanned)), now=6)
    assert not b.mine
    b.handle(ReaderStopped("p1", T0 + 60), now=6)  # its reader stopped
    # b is back
    b.handle(Joined(generation=2, leader="x", members=members), now=7)
    out = b.handle(SyncRead(offset + 1, epoch("x", 2, members)), now=8)
    assert b.mine["p1"].status == "owned"
    assert b.counters["picked_up"] == 1
    out += b.handle(TaskTick(), now=1_000_000)
    assert any(isinstance(cmd, StartReader) and cmd.token == "p1" for cmd in out)


def _orphans_of_d(task: str) -> tuple[TaskCore, list[TaskCommand], Partition]:
    """``task`` in x's epoch 2 of (x, s), which dropped d after d's last claims (f read to its
    end, its child p1 registered and read on to 70) landed after x's plan was made."""
    finished = msgspec.structs.replace(part("f", 90, status="finished"), children=("p1",))
    claims = (part("p1", 70), finished)
    log: list[SyncMessage] = [
        epoch("x", 1, ("x", "s", "d")),
        msgspec.structs.replace(state("x", 1, part("a", 5)), epoch=1),
        msgspec.structs.replace(state("d", 2, *claims), epoch=1),
        epoch("x", 2, ("x", "s")),
    ]
    c = TaskCore(TaskConfig(task_id=task, cap=0), Random(0))
    out: list[TaskCommand] = []
    for offset, message in enumerate(log):  # a restarted task's replay
        out += c.handle(SyncRead(offset, message), now=1)
    c.handle(Lease(until=10**12), now=2)
    out += c.handle(Joined(generation=2, leader="x", members=("x", "s")), now=3)
    return c, out, finished


def test_the_leader_offers_what_its_epoch_dropped_that_no_state_holds() -> None:
    # Seed 4262 (0.5 s answer wait): a dropped task's last claims landed between the leader's
    # plan and its epoch; the epoch dropped them, no plan had dealt them out, and a merged
    # child was registered again from its start (its watermark went back).
    x, out, finished = _orphans_of_d("x")
    assert set(x.cim.orphans) == {"p1", "f"}
    assert x.counters["orphans_taken"] == 2
    assert x.mine["f"] == finished  # adopted (p1 refers to it)
    # p1 offered from its newest watermark to the least loaded member (x owns a)
    assert (x.shares["p1"].target, x.shares["p1"].partition.watermark) == ("s", T0 + 70)
    read_back(x, out, 4, now=4)  # its checkpoint (with the orphans) and its state
    assert x.cim.orphans == {}
    # a member that is not the leader takes nothing itself: it waits for the offer
    s, _, _ = _orphans_of_d("s")
    assert "p1" not in s.mine
    assert "orphans_taken" not in s.counters


# -- restarted members: reset (protocol/planner.py, CIM rule 5d) -------------------------------
def _leading_restarts(
    rules: Rules | None = None, answered: tuple[str, ...] = ()
) -> tuple[TaskCore, int, list[TaskCommand]]:
    """``a`` leads generation 1 of members a, b, c, d. The CIM credits p7 to b and p8 to c; d
    holds nothing. The group says b and d are fresh lives (restarted or new); c is not.
    ``answered``: the members whose answers to generation 1 are in a's CIM; the commands their
    reading brought are returned."""
    c = TaskCore(TaskConfig(task_id="a", cap=2, rules=rules or Rules()), Random(0))
    c.handle(SyncRead(0, epoch("x", 0, ("a", "b", "c", "x"))), now=1)
    c.handle(SyncRead(1, state("b", 1, part("p7", 70))), now=1)
    c.handle(SyncRead(2, state("c", 2, part("p8", 80))), now=1)
    c.handle(Lease(until=10**12), now=2)
    members = ("a", "b", "c", "d")
    (answer,) = c.handle(Joined(1, "a", members, fresh=("b", "d")), now=3)
    assert isinstance(answer, Publish)
    c.handle(SyncRead(3, answer.message), now=4)
    out: list[TaskCommand] = []
    for offset, task in enumerate(answered, start=4):
        answer_of = StateMessage(
            task_id=task, epoch=1, connector_state=(TaskState(task, 2 * 10**9 + 9),)
        )
        out += c.handle(SyncRead(offset, answer_of), now=5)
    return c, 4 + c.config.answer_timeout, out


def test_a_leader_resets_a_fresh_member_that_holds_partitions_and_has_not_answered() -> None:
    """b restarted under its id and has not answered when the answer wait is over: its earlier
    life's partitions are dealt out (b's new life has read nothing). c, not fresh, may still be
    reading under its lease: it keeps p8. d is fresh but holds nothing."""
    c, due, _ = _leading_restarts()
    assert c.handle(TaskTick(), now=due) == [
        RequestPlan(1, ("a", "b", "c", "d"), need_roots=True, reset=("b",))
    ]
    assert c.counters["plan_without_all_answers"] == 1


def test_a_fresh_member_that_answered_is_reset_too_while_survivors_are_members() -> None:
    """b answered in time, but its earlier life died holding p7 and a and c are survivors (no
    fresh lives): p7 goes to them, so a b that dies again soon (a crash loop) does not hold it
    unread through another recovery. c, answered and not fresh, keeps p8."""
    _, _, out = _leading_restarts(answered=("b", "c", "d"))
    assert [cmd for cmd in out if isinstance(cmd, RequestPlan)] == [
        RequestPlan(1, ("a", "b", "c", "d"), need_roots=True, reset=("b",))
    ]


def test_beside_survivors_the_leader_plans_without_waiting_for_a_fresh_member_it_resets() -> None:
    """c, the survivor, answered; b (fresh, its earlier life's p7 credited to it) has not: the
    plan resets b whether it answers or not, so it is asked for at once, not at the end of the
    answer wait. d, fresh but holding nothing, may be offered partitions: it answered (it is
    waited for like any member that takes offers)."""
    c, due, out = _leading_restarts(answered=("c", "d"))
    assert [cmd for cmd in out if isinstance(cmd, RequestPlan)] == [
        RequestPlan(1, ("a", "b", "c", "d"), need_roots=True, reset=("b",))
    ]
    assert c.counters["plan_without_fresh_answers"] == 1
    assert "plan_without_all_answers" not in c.counters
    # a fresh member holding nothing is waited for: only c answered
    c, due, out = _leading_restarts(answered=("c",))
    assert not [cmd for cmd in out if isinstance(cmd, RequestPlan)]
    assert c.handle(TaskTick(), now=due) == [
        RequestPlan(1, ("a", "b", "c", "d"), need_roots=True, reset=("b",))
    ]


def test_without_the_rule_the_leader_waits_for_a_fresh_member_it_resets_anyway() -> None:
    c, due, out = _leading_restarts(Rules(plan_without_fresh_answers=False), answered=("c", "d"))
    assert not [cmd for cmd in out if isinstance(cmd, RequestPlan)]
    assert c.handle(TaskTick(), now=6) == []
    assert c.handle(TaskTick(), now=due) == [
        RequestPlan(1, ("a", "b", "c", "d"), need_roots=True, reset=("b",))
    ]


def test_without_the_rule_a_fresh_member_that_answered_keeps_what_it_adopted() -> None:
    _, _, out = _leading_restarts(Rules(reset_answered_fresh=False), answered=("b", "c", "d"))
    assert [cmd for cmd in out if isinstance(cmd, RequestPlan)] == [
        RequestPlan(1, ("a", "b", "c", "d"), need_roots=True)
    ]


def test_when_every_member_is_a_fresh_life_each_keeps_what_it_adopted() -> None:
    """The whole group restarted (every member fresh, the leader too): nobody is a survivor to
    hand the partitions to, so b keeps p7 once it has answered (and is still reset when it has
    not: the leader takes p7 then)."""

    def plan_of(answered: tuple[str, ...]) -> RequestPlan:
        c = TaskCore(TaskConfig(task_id="a", cap=2), Random(0))
        c.handle(SyncRead(0, epoch("x", 0, ("a", "b", "x"))), now=1)
        c.handle(SyncRead(1, state("b", 1, part("p7", 70))), now=1)
        c.handle(Lease(until=10**12), now=2)
        (answer,) = c.handle(Joined(1, "a", ("a", "b"), fresh=("a", "b")), now=3)
        assert isinstance(answer, Publish)
        out = c.handle(SyncRead(2, answer.message), now=4)
        for task in answered:
            answer_of = StateMessage(
                task_id=task, epoch=1, connector_state=(TaskState(task, 2 * 10**9 + 9),)
            )
            out += c.handle(SyncRead(3, answer_of), now=5)
        out += c.handle(TaskTick(), now=4 + c.config.answer_timeout)
        (request,) = [cmd for cmd in out if isinstance(cmd, RequestPlan)]
        return request

    assert plan_of(answered=("b",)).reset == ()
    assert plan_of(answered=()).reset == ("b",)


def test_without_the_rule_a_member_that_is_not_fresh_is_reset_too() -> None:
    """The simulator's teeth test turns ``reset_only_fresh`` off: c, which may be reading p8
    under its lease, loses it to another reader."""
    c, due, _ = _leading_restarts(Rules(reset_only_fresh=False))
    (request,) = c.handle(TaskTick(), now=due)
    assert isinstance(request, RequestPlan)
    assert request.reset == ("b", "c")


def _fresh_leader(rules: Rules | None = None, fresh: tuple[str, ...] = ("a",)) -> TaskCore:
    """``a`` restarted under its id (its earlier life died holding p7) and leads generation 1 of
    members a, b, c; the CIM credits p8 to c. The group says which members are fresh lives;
    b's and c's answers are read."""
    c = TaskCore(TaskConfig(task_id="a", cap=0, rules=rules or Rules()), Random(0))
    c.handle(SyncRead(0, epoch("a", 0, ("a", "b", "c"))), now=1)
    c.handle(SyncRead(1, state("a", 1, part("p7", 70))), now=1)
    c.handle(SyncRead(2, state("c", 2, part("p8", 80))), now=1)
    c.handle(Lease(until=10**12), now=2)
    (answer,) = c.handle(Joined(1, "a", ("a", "b", "c"), fresh=fresh), now=3)
    assert isinstance(answer, Publish)
    c.handle(SyncRead(3, answer.message), now=4)
    return c


def _answers(c: TaskCore, *tasks: str) -> list[TaskCommand]:
    out: list[TaskCommand] = []
    for offset, task in enumerate(tasks, start=4):
        answer_of = StateMessage(
            task_id=task, epoch=1, connector_state=(TaskState(task, 2 * 10**9 + 9),)
        )
        out += c.handle(SyncRead(offset, answer_of), now=5)
    return out


def test_a_fresh_leader_beside_survivors_yields_the_partitions_its_earlier_life_held() -> None:
    """The rule of ``_reset_members`` applied to the leader itself (bench chaos --seed 3: the
    owner came back under its id, led the next epoch keeping its partition and was killed
    again, 28.5 s unread). a is a fresh life beside survivors b and c: its plan deals out p7 to
    b, and its epoch message removes p7 from its own state in the same message as the offer,
    and says a yielded."""
    c = _fresh_leader()
    assert _answers(c, "b", "c") == [
        RequestPlan(1, ("a", "b", "c"), need_roots=True, leader_yields=True)
    ]
    result = plan(c.cim, ("a", "b", "c"), "a", 1, now=6, cap=0, rng=Random(0), leader_yields=True)
    assert result.yielded == ("p7",)
    offer = Share(partition=part("p7", 70), target="b", kind="new", since=6)
    assert result.offers == (offer,)
    (publish,) = c.handle(PlanReady(result), now=7)
    assert publish == Publish(
        EpochMessage(
            task_id="a",
            message_timestamp=7,
            epoch=1,
            sync_epoch=result.sync_epoch,
            members=("a", "b", "c"),
            connector_state=(TaskState("a", 2 * 10**9 + 3, removed=("p7",), share=(offer,)),),
            yielded=True,
        )
    )
    assert c.mine == {}
    assert c.counters["yielded"] == 1
    assert c.counters["claims_replanned"] == 0


def test_without_the_rule_a_fresh_leader_keeps_what_it_adopted() -> None:
    """The teeth test's rule off (``reset_fresh_leader``), and the whole group restarted (every
    member fresh: nobody is a survivor to take p7): the leader keeps p7 either way."""
    c = _fresh_leader(Rules(reset_fresh_leader=False))
    assert _answers(c, "b", "c") == [RequestPlan(1, ("a", "b", "c"), need_roots=True)]
    c = _fresh_leader(fresh=("a", "b", "c"))
    assert _answers(c, "b", "c") == [RequestPlan(1, ("a", "b", "c"), need_roots=True)]
    # a leader that is no fresh life (it read under its unbroken membership) keeps p7 too
    c = _fresh_leader(fresh=("b",))
    assert _answers(c, "b", "c") == [RequestPlan(1, ("a", "b", "c"), need_roots=True)]


def _donor(probation: int = 5_000_000) -> tuple[TaskCore, EpochMessage]:
    """c owns p1-p4 under epoch 1 of members a and c; epoch 2 (a leads, a yielded: a restarted
    task) lists a and c. Returns c before it reads epoch 2, and that epoch."""
    c = TaskCore(TaskConfig(task_id="c", cap=0, probation=probation), Random(0))
    c.handle(SyncRead(0, epoch("a", 1, ("a", "c"))), now=1)
    c.handle(Lease(until=10**15), now=1)
    c.handle(Joined(2, "a", ("a", "c")), now=2)
    parts = tuple(part(f"p{i}", 10 * i) for i in range(1, 5))
    c.handle(SyncRead(1, state("c", 1, *parts)), now=2)
    c.mine = {p.token: p for p in parts}  # (what its earlier messages said)
    c._sent_parts = dict(c.mine)
    second = msgspec.structs.replace(epoch("a", 2, ("a", "c")), yielded=True)
    return c, second


def test_a_restarted_member_gets_no_partition_while_on_probation() -> None:
    """A crash-looping task that came back (reset, or a leader that yielded) would get its
    share back by balancing at once and die again before reading it, through every life: it
    is on probation for ``TaskConfig.probation`` after the epoch that dealt out what it held.
    c would offer a two moves at once; on probation nothing, and the probation's end is c's
    next deadline, when the moves go out."""
    c, second = _donor()
    c.handle(SyncRead(2, second), now=10)
    assert c.cim.restarted == ("a",)
    assert c.on_probation("a")
    c.handle(TaskTick(), now=1_000_000)
    assert c.moves == {}
    assert c.shares == {}
    assert c.next_deadline() == 10 + 5_000_000
    c.handle(TaskTick(), now=10 + 5_000_000)
    assert sorted((t, m.pending) for t, m in c.moves.items()) == [("p1", "a"), ("p2", "a")]


def test_without_probation_the_restarted_member_gets_its_share_at_once() -> None:
    """The control (``probation`` 0, the simulator's teeth test of the crash loop): the moves
    to a go out at the first negotiation round after the epoch."""
    c, second = _donor(probation=0)
    c.handle(SyncRead(2, second), now=10)
    assert not c.on_probation("a")
    c.handle(TaskTick(), now=1_000_000)
    assert sorted((t, m.pending) for t, m in c.moves.items()) == [("p1", "a"), ("p2", "a")]


def test_an_epoch_that_resets_a_restarted_task_drops_what_it_adopted_before_it_reads() -> None:
    """b's new life adopts p7 at its first join; the epoch of that generation resets it and
    deals p7 to a: b drops p7 and starts no reader. The control: an epoch without the reset,
    and b reads p7."""

    def restarted_b() -> TaskCore:
        b = core("b")
        b.handle(SyncRead(0, epoch("x", 0, ("b", "x"))), now=1)
        b.handle(SyncRead(1, state("b", 1, part("p7", 70))), now=1)  # its earlier life
        b.handle(Lease(until=10**12), now=2)
        (answer,) = b.handle(Joined(1, "a", ("a", "b"), fresh=("b",)), now=3)
        assert b.mine == {"p7": part("p7", 70)}
        assert isinstance(answer, Publish)
        b.handle(SyncRead(2, answer.message), now=4)
        return b

    b = restarted_b()
    dealt = Share(part("p7", 70), target="a", kind="new", since=3)
    reset = msgspec.structs.replace(epoch("a", 1, ("a", "b"), dealt), reset=("b",))
    out = b.handle(SyncRead(3, reset), now=5)
    assert not any(isinstance(cmd, StartReader | Alert) for cmd in out)
    assert b.mine == {}
    assert b.counters["reset"] == 1
    assert b.may_read(5)  # a member of the epoch, reading nothing
    control = restarted_b()
    out = control.handle(SyncRead(3, epoch("a", 1, ("a", "b"))), now=5)
    assert [cmd.token for cmd in out if isinstance(cmd, StartReader)] == ["p7"]


# -- a life is fresh until it has read (TaskCore._on_joining) -----------------------------------
def _joins(task: TaskCore, known: int, now: int) -> bool:
    """A JoinGroup goes out knowing epoch ``known``: what the task says of itself."""
    task.handle(Joining(known), now=now)
    return task.says_fresh


def _restarted_b_in_a_generation_that_came_to_nothing(
    rules: Rules | None = None,
) -> tuple[TaskCore, bool]:
    """b's new life (its earlier one held p7 in epoch 0) joins generation 1, saying it is
    fresh; the leader of generation 1 dies before planning, so epoch 1 never lands. Returns b
    and what it says at its next JoinGroup (knowing epoch 1)."""
    b = TaskCore(TaskConfig(task_id="b", cap=2, rules=rules or Rules()), Random(0))
    b.handle(SyncRead(0, epoch("x", 0, ("b", "x"))), now=1)
    b.handle(SyncRead(1, state("b", 1, part("p7", 70))), now=1)  # its earlier life
    b.handle(Lease(until=10**12), now=2)
    rule = b.config.rules.fresh_until_read
    assert _joins(b, 0, now=2) is rule  # its first JoinGroup: it has read nothing
    (answer,) = b.handle(Joined(1, "x", ("b", "x"), fresh=("b",)), now=3)
    assert isinstance(answer, Publish)
    b.handle(SyncRead(2, answer.message), now=4)
    assert not b.reading
    assert not b.may_read(4)  # epoch 1 is not in its CIM
    return b, _joins(b, 1, now=4)


def test_a_life_whose_first_generation_came_to_nothing_is_still_fresh() -> None:
    """b was assigned generation 1 but never permitted to read: at its next join it still says
    it is fresh (so that generation's leader resets it, and survivors read p7). Saying so binds
    it: it reads nothing until it takes a newer generation, and, counted fresh there, only from
    that generation's epoch. Once reading was permitted it is no fresh life any more."""
    b, fresh = _restarted_b_in_a_generation_that_came_to_nothing()
    assert fresh
    # epoch 1 lands late (its leader's append was on its way): b may not read from it now
    out = b.handle(SyncRead(3, epoch("x", 1, ("b", "x"))), now=5)
    assert not any(isinstance(cmd, StartReader) for cmd in out)
    assert not b.may_read(5)
    b.handle(Joined(2, "a", ("a", "b"), fresh=("b",)), now=6)
    assert not b.may_read(6)  # counted fresh in generation 2: only from its epoch
    dealt = Share(part("p7", 70), target="a", kind="new", since=6)
    reset = msgspec.structs.replace(epoch("a", 2, ("a", "b"), dealt), reset=("b",))
    out = b.handle(SyncRead(4, reset), now=7)
    assert not any(isinstance(cmd, StartReader) for cmd in out)
    assert b.mine == {}
    assert b.may_read(7)
    assert not _joins(b, 2, now=8)  # reading was permitted: no fresh life any more


def test_an_assignment_of_an_earlier_join_does_not_let_a_fresh_life_read() -> None:
    """b said it is fresh in a JoinGroup knowing epoch 1; the assignment of generation 1 (an
    earlier join's, queued to the core) reaches it only then, and epoch 1 lands: b still
    reads nothing, since the leader of the generation its JoinGroup makes may reset it."""
    b = TaskCore(TaskConfig(task_id="b", cap=2), Random(0))
    b.handle(SyncRead(0, epoch("x", 0, ("b", "x"))), now=1)
    b.handle(SyncRead(1, state("b", 1, part("p7", 70))), now=1)
    b.handle(Lease(until=10**12), now=2)
    assert _joins(b, 0, now=2)
    assert _joins(b, 1, now=2)  # the next JoinGroup, sent before generation 1's assignment
    b.handle(Joined(1, "x", ("b", "x"), fresh=("b",)), now=3)
    out = b.handle(SyncRead(2, epoch("x", 1, ("b", "x"))), now=4)
    assert not any(isinstance(cmd, StartReader) for cmd in out)
    out = b.handle(Joined(2, "x", ("b", "x"), fresh=("b",)), now=5)
    out += b.handle(SyncRead(3, epoch("x", 2, ("b", "x"))), now=6)
    assert [c.token for c in out if isinstance(c, StartReader)] == ["p7"]


def test_without_the_rule_a_life_is_fresh_only_until_its_first_generation() -> None:
    """The teeth: with ``fresh_until_read`` off the task core never says it is fresh (the
    member core still does for a life never assigned a generation), and b reads p7 from the
    late epoch 1."""
    b, fresh = _restarted_b_in_a_generation_that_came_to_nothing(Rules(fresh_until_read=False))
    assert not fresh
    out = b.handle(SyncRead(3, epoch("x", 1, ("b", "x"))), now=5)
    assert [c.token for c in out if isinstance(c, StartReader)] == ["p7"]


# -- a rejoined member reads on its answer (protocol/task.py, CIM rule 2a) ---------------------
def _rejoining(
    rules: Rules | None = None, fresh: tuple[str, ...] = (), missed: bool = False
) -> tuple[TaskCore, list[TaskCommand]]:
    """``a`` reads p1 in epoch 0, loses its membership (a pause past its lease), and rejoins in
    generation 2; generation 1 (without it) had no epoch yet. ``missed``: the epoch of
    generation 1, which dealt p1 to x, lands before a's answer. Returns a and the commands
    reading its answer back brought."""
    a = TaskCore(TaskConfig(task_id="a", cap=2, rules=rules or Rules()), Random(0))
    a.handle(SyncRead(0, epoch("x", 0, ("a", "x"))), now=1)
    a.handle(SyncRead(1, state("a", 1, part("p1", 10))), now=1)
    a.handle(Lease(until=100), now=2)
    first = a.handle(Joined(0, "x", ("a", "x")), now=3)
    assert a.reading == {"p1": T0 + 10}
    for cmd in first:
        if isinstance(cmd, Publish):
            a.handle(SyncRead(2, cmd.message), now=3)
    assert [c for c in a.handle(Lost("no heartbeat"), now=4) if isinstance(c, StopReader)] == [
        StopReader("p1", StopReason.NOT_PERMITTED, drain=False)
    ]
    a.handle(ReaderStopped("p1", T0 + 20), now=5)
    if missed:
        dealt = Share(part("p1", 10), target="x", kind="new", since=5)
        a.handle(SyncRead(3, epoch("x", 1, ("x",), dealt)), now=6)
    a.handle(Lease(until=10**12), now=7)
    out = a.handle(Joined(2, "x", ("a", "x"), fresh=fresh), now=8)
    assert not any(isinstance(cmd, StartReader) for cmd in out)  # its answer is not read back
    (answer,) = [cmd for cmd in out if isinstance(cmd, Publish)]
    assert answer.message.epoch == 2
    return a, a.handle(SyncRead(4, answer.message), now=9)


def test_a_rejoined_task_reads_what_the_cim_credits_it_once_its_answer_is_read_back() -> None:
    """No epoch of generation 2 yet: the answer, applied while epoch 0 lists a, is enough. An
    epoch of generation 1 that lands after it is ignored (CIM rule 2a): it was planned while a
    was away and would give p1 to x."""
    a, out = _rejoining()
    assert [(c.token, c.start_ts - T0) for c in out if isinstance(c, StartReader)] == [("p1", 20)]
    assert a.cim.epoch == 0
    dealt = Share(part("p1", 10), target="x", kind="new", since=5)
    a.handle(SyncRead(5, epoch("x", 1, ("x",), dealt)), now=10)
    assert (a.cim.epoch, a.cim.ignored["superseded-epoch"]) == (0, 1)
    assert a.reading == {"p1": T0 + 20}
    assert not a.sharing_enabled(10)  # sharing still waits for the epoch of its generation


def test_a_rejoined_task_waits_for_its_epoch_when_it_is_fresh_or_the_rule_is_off() -> None:
    """A fresh life may be reset by its generation's plan; with ``resume_on_answer`` off a
    rejoined task waits for that epoch (the behaviour before the rule). Either way it reads
    once the epoch lands."""
    for rules, fresh in ((None, ("a",)), (Rules(resume_on_answer=False), ())):
        a, out = _rejoining(rules, fresh)
        assert not any(isinstance(cmd, StartReader) for cmd in out)
        out = a.handle(SyncRead(5, epoch("x", 2, ("a", "x"))), now=10)
        assert [c.token for c in out if isinstance(c, StartReader)] == ["p1"]


def test_a_rejoined_task_that_an_epoch_dropped_before_its_answer_reads_nothing() -> None:
    """The epoch of generation 1 landed before a's answer: a saw it drop it and deal p1 to x,
    so it dropped its claims; its answer (rule 2b) counts, nothing is read."""
    a, out = _rejoining(missed=True)
    assert not any(isinstance(cmd, StartReader) for cmd in out)
    assert a.mine == {}
    assert a.counters["evicted"] == 1
    assert not a.may_read(10)
