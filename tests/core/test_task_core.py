"""TaskCore: exact command lists for given events and ``now``."""

from __future__ import annotations

from random import Random

from protocol.messages import CheckpointMessage, Partition, Share, StateMessage, TaskState
from protocol.planner import plan
from protocol.task import (
    Joined,
    Lease,
    PlanReady,
    Publish,
    StartReader,
    SyncBad,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
)


def _leader_with_epoch(cap: int) -> tuple[TaskCore, list[TaskCommand]]:
    core = TaskCore(TaskConfig("a", cap=cap))
    (answer,) = core.handle(Joined(1, "a", ("a",)), 0)
    assert isinstance(answer, Publish)
    core.handle(SyncRead(0, answer.message), 0)  # read back: nothing of ours is on its way
    core.handle(Lease(10**9), 0)  # readers start only under a lease
    roots = (Partition("r1", 0), Partition("r2", 0))
    p = plan(core.cim, ("a",), "a", 1, 0, cap, Random(0), roots=roots, stream_start=0)
    (publish,) = core.handle(PlanReady(p), 1)
    assert isinstance(publish, Publish)
    return core, core.handle(SyncRead(1, publish.message), 2)


def test_join_answers_with_own_state() -> None:
    core = TaskCore(TaskConfig("a"))
    assert core.handle(Joined(1, "a", ("a",)), 0) == [
        Publish(
            StateMessage(
                task_id="a",
                message_timestamp=0,
                epoch=1,
                connector_state=(TaskState(task_id="a", state_timestamp=0),),
            )
        )
    ]


def test_cap_on_concurrent_partitions_parks_the_rest() -> None:
    _, out = _leader_with_epoch(cap=1)
    assert len(out) == 3
    assert isinstance(out[0], Publish)
    assert isinstance(out[0].message, CheckpointMessage)
    assert out[1] == StartReader(token="r1", start_ts=0, parents=())
    assert isinstance(out[2], Publish)
    msg = out[2].message
    assert isinstance(msg, StateMessage)
    assert msg.connector_state == (
        TaskState(
            task_id="a",
            state_timestamp=2,
            data=(Partition("r1", 0),),
            share=(Share(partition=Partition("r2", 0), target=None, kind="new", since=0),),
        ),
    )


def test_malformed_sync_message_is_counted_and_skipped() -> None:
    core = TaskCore(TaskConfig("a"))
    assert core.handle(SyncBad(3, "schema"), 0) == []
    assert core.counters["sync_bad.schema"] == 1


def test_why_unread_tells_expected_waits_from_faults() -> None:
    core, _ = _leader_with_epoch(cap=2)
    assert core.why_unread("r1", 3) == (False, "a reader is starting")
    assert core.why_unread("zz", 3) == (True, "not owned here (unknown)")
    del core.reading["r2"]  # as if its reader had vanished without a word
    assert core.why_unread("r2", 3) == (False, "no reader, and nothing keeps one from starting")
    core.config = TaskConfig("a", cap=1)
    assert core.why_unread("r2", 3) == (True, "waiting for room under the cap (1/1 reading)")
    # a merged child waits for its parents (one owned, one unknown)
    core.mine["m"] = Partition("m", 5, parents=("r1", "gone"))
    # (r1 is this task's: its own state in the CIM is not read back yet)
    assert core.why_unread("m", 3) == (
        False,
        "waiting for parents r1=owned (CIM: none), gone=unknown (CIM: none) "
        "(sync log read to offset 1)",
    )
    # the lease ran out: not permitted, as expected
    expected, why = core.why_unread("r2", 10**9 + 1)
    assert expected
    assert why.startswith("reading not permitted (member=True, lease in -0.0s")
