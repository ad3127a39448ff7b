"""``TaskCore.next_deadline``: each time-driven rule, exactly. A tick one microsecond before the
deadline does nothing, a tick at it does what the rule says; an idle task has no deadline.
(The same promise on the fault simulator's states: ``tests/stateful/test_deadlines.py``.)"""

from __future__ import annotations

from protocol.messages import CheckpointMessage, StateMessage
from protocol.task import (
    Joined,
    Lease,
    Publish,
    PublishFailed,
    ReaderCommitted,
    ReaderFinished,
    RequestPlan,
    StopReader,
    StopReason,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
    TaskTick,
)
from tests.deadlines import quiet_before_deadline
from tests.helpers import epoch, part, state

LEASE = 10**9


def _follower(b_owns: int = 2) -> TaskCore:
    """Task ``a`` in epoch 1 led by ``b``: it reads p0 and p1, its messages are all read back,
    its last negotiation round was at 10 and found nothing to do; ``b`` owns ``b_owns``."""
    c = TaskCore(TaskConfig("a"))
    c.handle(SyncRead(0, epoch("b", 1, "a", "b")), 0)
    c.handle(SyncRead(1, state("a", 1, part("p0"), part("p1"), epoch=1)), 0)
    theirs = [part(f"q{i}") for i in range(b_owns)]
    c.handle(SyncRead(2, state("b", 1, *theirs, epoch=1)), 0)
    (answer,) = c.handle(Joined(1, "b", ("a", "b")), 10)
    assert isinstance(answer, Publish)
    assert len(c.handle(Lease(LEASE), 10)) == 2  # two StartReader
    assert c.handle(SyncRead(3, answer.message), 20) == []
    return c


def _exactly(c: TaskCore, due: int) -> list[TaskCommand]:
    """``due`` is the deadline, a tick just before it does nothing: the tick at it, its output."""
    assert c.next_deadline() == due
    quiet_before_deadline(c, times=[c._now, due - 1])
    return c.handle(TaskTick(), due)


def _published(out: list[TaskCommand]) -> StateMessage:
    (command,) = out
    assert isinstance(command, Publish)
    assert isinstance(command.message, StateMessage)
    return command.message


def test_an_idle_reader_waits_only_for_its_lease() -> None:
    c = _follower()
    assert c.next_deadline() == LEASE
    quiet_before_deadline(c)


def test_lease_expiry_stops_the_readers() -> None:
    out = _exactly(_follower(), LEASE)
    assert out == [
        StopReader("p0", StopReason.NOT_PERMITTED, False),
        StopReader("p1", StopReason.NOT_PERMITTED, False),
    ]


def test_no_readers_no_deadline_for_the_lease() -> None:
    c = _follower()
    c.handle(Lease(LEASE + 5), 30)  # (a lease in the future does not change what is read)
    c.stopping.update(c.reading)  # as if both were stopping already
    assert c.next_deadline() is None
    quiet_before_deadline(c)


def test_failing_appends_stop_the_readers_after_sync_timeout() -> None:
    c = _follower()
    # nothing of its own on its way: a probe goes out at once (and fails too, unanswered)
    probe = _published(c.handle(PublishFailed("timeout", 1234), 1_000))
    c.handle(PublishFailed("timeout", probe.connector_state[0].state_timestamp), 2_000)
    out = _exactly(c, 1_000 + c.config.sync_timeout)
    assert {type(x) for x in out} == {StopReader}


def test_watermarks_are_coalesced_for_publish_interval() -> None:
    c = _follower()
    assert c.handle(ReaderCommitted("p0", 50), 100_000) == []
    message = _published(_exactly(c, 10 + c.config.publish_interval))  # the answer went at 10
    assert message.connector_state[0].data == (part("p0", 50),)


def test_group_commit_holds_an_urgent_change_for_coalesce_wait() -> None:
    c = _follower()
    assert c.handle(ReaderCommitted("p0", 50), 300_000) != []  # published: on its way, unread
    finished = ReaderFinished("p1", 70, (), 70)
    assert c.handle(finished, 350_000) == []  # urgent, held behind the unread message
    message = _published(_exactly(c, 300_000 + c.config.coalesce_wait))
    assert message.connector_state[0].removed == ("p1",)  # finished, and nothing refers to it


def test_a_negotiation_round_is_due_only_when_it_would_offer_something() -> None:
    c = _follower()
    assert c.next_deadline() == LEASE  # balanced: no round due, however long it waits
    c.handle(SyncRead(4, state("b", 2, epoch=1)), 50_000)  # b gave its partitions up
    message = _published(_exactly(c, 10 + c.config.negotiate_interval))
    (offer,) = message.connector_state[0].share or ()
    assert (offer.token, offer.target, offer.kind) == ("p0", "b", "move")


def test_the_leader_waits_answer_timeout_for_the_answers() -> None:
    c = TaskCore(TaskConfig("a"))
    (answer,) = c.handle(Joined(1, "a", ("a", "b")), 0)
    assert isinstance(answer, Publish)
    c.handle(Lease(LEASE), 0)
    c.handle(SyncRead(0, answer.message), 5)  # b never answers
    out = _exactly(c, c.config.answer_timeout)
    assert out == [RequestPlan(1, ("a", "b"), need_roots=True)]
    assert c.next_deadline() is None  # asked once


def test_the_leader_checkpoints_every_checkpoint_interval() -> None:
    c = TaskCore(TaskConfig("a"))
    c.handle(SyncRead(0, epoch("a", 1, "a")), 0)
    # its epoch is in the CIM already: the first checkpoint goes out with the answer
    checkpoint, answer = c.handle(Joined(1, "a", ("a",)), 10)
    assert isinstance(checkpoint, Publish)
    assert isinstance(checkpoint.message, CheckpointMessage)
    assert isinstance(answer, Publish)
    c.handle(SyncRead(1, answer.message), 20)
    (command,) = _exactly(c, 10 + c.config.checkpoint_interval)
    assert isinstance(command, Publish)
    assert isinstance(command.message, CheckpointMessage)
    assert c.next_deadline() == 10 + 2 * c.config.checkpoint_interval
