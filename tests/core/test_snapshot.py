"""Snapshot partitions as work items (protocol/snapshot.py): exact commands of the task core,
the CIM's record of the snapshot, the planner, the completeness watermark and a bounded run's
end."""

from __future__ import annotations

from random import Random

import msgspec

from protocol import messages as m
from protocol import snapshot as snapshots
from protocol.bounds import nothing_left
from protocol.cim import Cim
from protocol.completeness import low_watermark
from protocol.messages import (
    CheckpointMessage,
    EpochMessage,
    Partition,
    Share,
    SnapshotItem,
    SnapshotPlan,
    StateMessage,
    TaskState,
)
from protocol.planner import ownerless, plan
from protocol.task import (
    Joined,
    Lease,
    PlanReady,
    Publish,
    ReaderFinished,
    RequestPlan,
    StartReader,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
    TaskTick,
)

T = 1_000
S0 = snapshots.work_token("Orders", 0)
S1 = snapshots.work_token("Orders", 1)
S2 = snapshots.work_token("Items", 0)


def _snapshot(*tokens: str) -> SnapshotPlan:
    items = tuple(SnapshotItem(t, t.split(":")[1].split("/")[0], t.encode()) for t in tokens)
    return SnapshotPlan(read_ts=T, total=len(items), chunk_rows=100, items=items)


def _joined_leader(config: TaskConfig) -> tuple[TaskCore, list[TaskCommand]]:
    core = TaskCore(config)
    (answer,) = core.handle(Joined(1, "a", ("a",)), 0)
    assert isinstance(answer, Publish)
    core.handle(Lease(10**9), 0)
    return core, core.handle(SyncRead(0, answer.message), 1)


def _started(cap: int = 0) -> tuple[TaskCore, list[TaskCommand], EpochMessage]:
    """A leader whose first epoch recorded the stream's start T and a snapshot of S0, S1."""
    core, _ = _joined_leader(TaskConfig("a", cap=cap, snapshot=True))
    roots = (Partition("r1", snapshots.stream_after(T)),)
    p = plan(
        core.cim,
        ("a",),
        "a",
        1,
        2,
        cap,
        Random(0),
        roots,
        stream_start=T,
        snapshot=_snapshot(S0, S1),
    )
    (publish,) = core.handle(PlanReady(p), 3)
    assert isinstance(publish, Publish)
    assert isinstance(publish.message, EpochMessage)
    return core, core.handle(SyncRead(1, publish.message), 4), publish.message


def test_the_leader_that_starts_the_stream_asks_for_the_snapshot() -> None:
    _, out = _joined_leader(TaskConfig("a", snapshot=True, answer_timeout=0))
    assert out == [RequestPlan(1, ("a",), need_roots=True, snapshot=True)]
    _, out = _joined_leader(TaskConfig("a", answer_timeout=0))
    assert out == [RequestPlan(1, ("a",), need_roots=True, snapshot=False)]


def test_a_started_stream_takes_no_snapshot() -> None:
    core = TaskCore(TaskConfig("a", snapshot=True, answer_timeout=0))
    # the log already holds an epoch that started the stream (without a snapshot)
    core.handle(SyncRead(0, EpochMessage(task_id="x", epoch=0, members=("x",), stream_start=5)), 0)
    (answer,) = core.handle(Joined(1, "a", ("a",)), 1)
    core.handle(Lease(10**9), 1)
    assert isinstance(answer, Publish)
    assert core.handle(SyncRead(1, answer.message), 2) == [
        RequestPlan(1, ("a",), need_roots=False, snapshot=False)
    ]


def test_the_epoch_records_the_snapshot_and_deals_its_partitions_oldest_first() -> None:
    core, out, epoch = _started(cap=2)
    assert epoch.stream_start == T
    assert epoch.snapshot == _snapshot(S0, S1)
    (leader,) = epoch.connector_state
    assert [(s.token, s.partition.start_ts, s.target) for s in leader.share or ()] == [
        ("r1", T + 1, "a"),
        (S0, T, "a"),
        (S1, T, None),  # over the cap of 2: parked
    ]
    assert core.cim.snapshot.progress() == (0, 2)
    # snapshot partitions start at T, before the stream's roots at T + 1: read first
    starts = [c for c in out if isinstance(c, StartReader)]
    assert starts == [StartReader(S0, T, ()), StartReader("r1", T + 1, ())]
    # the completeness watermark stays below T while the snapshot is not done
    assert low_watermark(core.cim) == T - 1


def test_a_finished_snapshot_partition_is_removed_only_once_the_log_records_it_done() -> None:
    core, out, _ = _started()
    (pickups,) = [
        c.message for c in out if isinstance(c, Publish) and isinstance(c.message, StateMessage)
    ]
    core.handle(SyncRead(2, pickups), 5)  # read back
    out = core.handle(ReaderFinished(S0, T, (), T, (("snapshot:Orders/0", "0"),)), 10)
    (publish,) = [c for c in out if isinstance(c, Publish)]
    (state,) = publish.message.connector_state  # type: ignore[union-attr]
    assert [(p.token, p.status) for p in state.data] == [(S0, "finished")]
    assert state.removed == ()  # kept: the CIM does not know it done yet
    assert core.cim.snapshot.progress() == (0, 2)
    assert core.handle(SyncRead(3, publish.message), 11) == []
    assert core.cim.snapshot.progress() == (1, 2)
    assert S0 not in core.mine
    assert S0 in core.retired
    # the removal goes out with the next message, like any finished partition's
    assert core.next_deadline() == 10 + core.config.publish_interval
    (removal,) = core.handle(TaskTick(), 10 + core.config.publish_interval)
    assert isinstance(removal, Publish)
    publish = removal
    (state,) = publish.message.connector_state  # type: ignore[union-attr]
    assert state.removed == (S0,)
    assert low_watermark(core.cim) == T - 1  # S1 is not done yet


def _cim_with_snapshot() -> Cim:
    cim = Cim()
    leader = TaskState(
        task_id="a",
        state_timestamp=1,
        share=(
            Share(Partition("r1", T + 1), "b", "new"),
            Share(Partition(S0, T), "b", "new"),
            Share(Partition(S1, T), "b", "new"),
        ),
    )
    epoch = EpochMessage(
        task_id="a",
        epoch=1,
        members=("a", "b"),
        connector_state=(leader,),
        stream_start=T,
        snapshot=_snapshot(S0, S1),
    )
    assert cim.apply(0, epoch) is None
    return cim


def _state(task: str, ts: int, *parts: Partition, removed: tuple[str, ...] = ()) -> StateMessage:
    return StateMessage(
        task_id=task,
        epoch=1,
        connector_state=(TaskState(task_id=task, state_timestamp=ts, data=parts, removed=removed),),
    )


def test_the_cim_records_done_from_applied_states_only() -> None:
    cim = _cim_with_snapshot()
    finished = Partition(S0, T, status="finished", watermark=T)
    # a task that is not a member writes nothing the CIM takes
    assert cim.apply(1, _state("zombie", 1, finished)) == "not-a-member"
    assert cim.snapshot.progress() == (0, 2)
    assert cim.apply(2, _state("b", 1, finished)) is None
    assert cim.snapshot.progress() == (1, 2)
    assert cim.snapshot.done(S0)
    assert not cim.snapshot.done(S1)
    assert not cim.snapshot.done("r1")  # a change-stream partition is never "done" here
    # removed afterwards: still done, never undone
    assert cim.apply(3, _state("b", 2, Partition(S0, T, watermark=T), removed=())) is None
    assert cim.snapshot.done(S0)


def test_the_first_snapshot_recorded_wins() -> None:
    cim = _cim_with_snapshot()
    later = EpochMessage(task_id="b", epoch=2, members=("a", "b"), snapshot=_snapshot(S2))
    assert cim.apply(1, later) is None
    assert cim.snapshot.plan == _snapshot(S0, S1)


def test_a_checkpoint_carries_what_is_left_of_the_snapshot() -> None:
    cim = _cim_with_snapshot()
    cim.apply(1, _state("b", 1, Partition(S0, T, status="finished", watermark=T)))
    checkpoint = cim.checkpoint("a", 9)
    assert checkpoint.snapshot == msgspec.structs.replace(
        _snapshot(S0, S1), items=_snapshot(S1).items
    )
    assert m.decode(m.encode(checkpoint)) == checkpoint
    fresh = Cim()  # a task that starts at the checkpoint
    assert fresh.apply(5, checkpoint) is None
    assert fresh.snapshot.pending == cim.snapshot.pending
    assert fresh.snapshot.read_ts == T
    assert fresh.snapshot.progress() == (1, 2)
    assert fresh.snapshot.item(S1) == _snapshot(S1).items[0]
    assert fresh.snapshot.item(S0) is None


def test_completeness_and_the_end_wait_for_every_snapshot_partition() -> None:
    cim = _cim_with_snapshot()
    assert low_watermark(cim) == T - 1
    for offset, token in enumerate((S0, S1), start=1):
        done = Partition(token, T, status="finished", watermark=T)
        cim.apply(offset, _state("b", offset, done))
    # both done; the root r1 (from T + 1, never read) bounds it by T
    assert low_watermark(cim) == T
    assert not nothing_left(cim)  # r1 is unfinished (an offer)
    # a CIM where every partition finished but a snapshot partition is not done (it was lost
    # from every state: defence in depth) is not over, and stays below T
    lost = _cim_with_snapshot()
    lost.tasks.clear()
    lost.apply(5, _state("a", 9, Partition("r1", T + 1, status="finished", watermark=2 * T)))
    assert not nothing_left(lost)
    assert low_watermark(lost) == T - 1


def test_a_done_snapshot_partition_is_never_dealt_out_again() -> None:
    cim = _cim_with_snapshot()
    cim.apply(1, _state("b", 1, Partition(S0, T, status="finished", watermark=T)))
    cim.apply(2, _state("b", 2, removed=(S0,)))
    # the leader's offers of S0 and S1 are still in its (old) share section, addressed to b;
    # b died: the plan deals out what it held and was offered, but not S0, which is done
    lost, adopt = ownerless(cim, ("a",), "a")
    assert sorted(lost) == ["r1", S1]
    assert adopt == {}


def _offered_to_b(done: bool) -> tuple[TaskCore, list[TaskCommand]]:
    core = TaskCore(TaskConfig("b"))
    epoch = EpochMessage(
        task_id="a",
        epoch=1,
        members=("a", "b"),
        stream_start=T,
        snapshot=_snapshot(S0),
        connector_state=(
            TaskState(task_id="a", state_timestamp=1, share=(Share(Partition(S0, T), "b", "new"),)),
        ),
    )
    core.handle(SyncRead(0, epoch), 0)
    if done:  # (another task finished it after a stale plan offered it here)
        core.cim.snapshot.fold((Partition(S0, T, status="finished"),))
    out = core.handle(Joined(1, "a", ("a", "b")), 1)
    out += core.handle(Lease(10**9), 1)
    return core, out + core.handle(SyncRead(1, _state("b", 1)), 2)


def test_an_offer_of_a_done_snapshot_partition_is_not_picked_up() -> None:
    core, out = _offered_to_b(done=True)
    assert S0 not in core.mine
    assert not [c for c in out if isinstance(c, StartReader)]
    # the control: not done, the same offer is picked up and read
    core, out = _offered_to_b(done=False)
    assert [c for c in out if isinstance(c, StartReader)] == [StartReader(S0, T, ())]


def test_messages_with_a_snapshot_round_trip_with_a_stable_tag() -> None:
    epoch = EpochMessage(task_id="a", epoch=1, stream_start=T, snapshot=_snapshot(S0, S2))
    raw = m.encode(epoch)
    assert b'"snapshot":{"kind":"snapshot","readTs":1000' in raw
    assert m.decode(raw) == epoch
    checkpoint = CheckpointMessage(task_id="a", snapshot=_snapshot(S2))
    assert m.decode(m.encode(checkpoint)) == checkpoint


def test_work_items_and_the_stream_start() -> None:
    assert snapshots.work_token("Orders", 3) == "snapshot:Orders/3"
    assert snapshots.is_snapshot(S0)
    assert not snapshots.is_snapshot("AbC/==")
    assert snapshots.stream_after(T) == T + 1
    assert snapshots.work_items(_snapshot(S0, S1)) == (Partition(S0, T), Partition(S1, T))
    assert snapshots.work_items(None) == ()
