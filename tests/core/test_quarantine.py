"""The quarantine rule (protocol/task.py, docs/design.md#poison-partitions): exact command
lists for given events and ``now``."""

from __future__ import annotations

from random import Random

import msgspec

from protocol import messages
from protocol.cim import Cim
from protocol.completeness import held_by, low_watermark
from protocol.events import Alert, ReaderCommitted, ReaderFailed, ReaderStopped, StopReason
from protocol.messages import (
    EpochMessage,
    Partition,
    Quarantine,
    ReleaseMessage,
    Share,
    StateMessage,
    TaskState,
)
from protocol.planner import plan
from protocol.task import (
    Joined,
    Lease,
    PlanReady,
    Publish,
    StartReader,
    StopReader,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
)

ERROR = "sink failed a batch: TypedError('value 1e400 is not a FLOAT64')"
RECORD = "5 t1 1"


class _Log:
    """The sync topic of one test: what the cores published, read back in order."""

    def __init__(self) -> None:
        self.offset = -1

    def read_back(self, core: TaskCore, out: list[TaskCommand], now: int) -> list[TaskCommand]:
        more: list[TaskCommand] = []
        for command in out:
            if isinstance(command, Publish):
                more += self.deliver(core, command.message, now)
        return more

    def deliver(self, core: TaskCore, message: messages.SyncMessage, now: int) -> list[TaskCommand]:
        self.offset += 1
        return core.handle(SyncRead(self.offset, message), now)


def _reading(after: int = 3) -> tuple[TaskCore, _Log]:
    """Task ``a`` leads epoch 1 alone and reads r1 and r2; its messages are read back."""
    log = _Log()
    core = TaskCore(TaskConfig("a", cap=0, quarantine_after=after))
    (answer,) = core.handle(Joined(1, "a", ("a",)), 0)
    assert isinstance(answer, Publish)
    log.deliver(core, answer.message, 0)
    core.handle(Lease(10**9), 0)
    roots = (Partition("r1", 0), Partition("r2", 0))
    p = plan(core.cim, ("a",), "a", 1, 0, 0, Random(0), roots=roots, stream_start=0)
    (publish,) = core.handle(PlanReady(p), 1)
    assert isinstance(publish, Publish)
    out = log.deliver(core, publish.message, 2)
    assert [c for c in out if isinstance(c, StartReader)] == [
        StartReader("r1", 0, ()),
        StartReader("r2", 0, ()),
    ]
    assert log.read_back(core, out, 3) == []
    return core, log


def _quarantine(since: int, watermark: int = 0) -> Quarantine:
    return Quarantine(
        since=since, failures=3, error=ERROR, position=watermark, record=RECORD, task="a"
    )


def _state(core: TaskCore, now: int, *parts: Partition) -> Publish:
    return Publish(
        StateMessage(
            task_id="a",
            message_timestamp=now,
            epoch=1,
            sync_epoch=core.cim.sync_epoch,
            connector_state=(TaskState(task_id="a", state_timestamp=now, data=parts),),
        )
    )


def test_a_partition_failing_in_a_row_while_another_advances_is_parked() -> None:
    core, log = _reading()
    assert core.handle(ReaderFailed("r1", ERROR, RECORD), 10) == []
    assert core.handle(ReaderCommitted("r2", 100), 20) == []
    assert core.handle(ReaderFailed("r1", ERROR, RECORD), 30) == []
    assert core.handle(ReaderCommitted("r2", 200), 40) == []
    out = core.handle(ReaderFailed("r1", ERROR, RECORD), 50)
    parked = Partition("r1", 0, quarantine=_quarantine(50))
    assert out == [
        Alert(
            "quarantined",
            f"partition r1 parked at its watermark 0 after 3 failures in a row: {ERROR}; "
            f"record: {RECORD}",
        ),
        StopReader("r1", StopReason.QUARANTINED, drain=False),
        _state(core, 50, parked, Partition("r2", 0, watermark=200)),
    ]
    assert core.counters["quarantined"] == 1
    assert core.quarantined() == [parked]
    # the reader's end changes nothing; no reader starts again; the CIM holds it parked
    assert core.handle(ReaderStopped("r1", 0), 60) == []
    assert log.read_back(core, out, 70) == []
    assert core.handle(ReaderFailed("r1", ERROR, RECORD), 80) == []  # (a late report)
    assert "r1" not in core.reading
    assert held_by(core.cim) == ("r1",)
    assert low_watermark(core.cim) == -1  # held back at the parked watermark


def test_a_commit_of_the_partition_itself_breaks_the_row() -> None:
    core, _ = _reading()
    core.handle(ReaderFailed("r1", ERROR, RECORD), 10)
    core.handle(ReaderCommitted("r2", 100), 20)
    core.handle(ReaderFailed("r1", ERROR, RECORD), 30)
    core.handle(ReaderCommitted("r1", 35), 35)  # r1 advanced: not in a row any more
    core.handle(ReaderCommitted("r2", 200), 40)
    assert core.handle(ReaderFailed("r1", ERROR, RECORD), 50) == []
    assert core.counters["quarantined"] == 0
    assert core.quarantined() == []


def test_every_partition_failing_is_an_outage_not_poison() -> None:
    core, _ = _reading()
    for now in range(10, 200, 10):  # the sink fails everything: nothing advances
        assert core.handle(ReaderFailed("r1", ERROR), now) == []
        assert core.handle(ReaderFailed("r2", ERROR), now + 5) == []
    assert core.counters["quarantined"] == 0
    assert core.counters["quarantine_withheld"] > 0
    assert set(core.reading) == {"r1", "r2"}


def test_stalls_do_not_count() -> None:
    core, _ = _reading()
    for now in range(10, 500, 20):  # a silent query restarted again and again: no record failed
        core.handle(ReaderFailed("r1", "QueryStalled: partition r1: nothing", stalled=True), now)
        core.handle(ReaderCommitted("r2", now + 10), now + 10)
    assert core.quarantined() == []
    out = core.handle(ReaderFailed("r1", ERROR, RECORD), 600)
    assert out == []  # the first real failure starts the row


def test_rule_off_retries_for_ever() -> None:
    core, _ = _reading(after=0)
    for now in range(10, 500, 20):
        assert core.handle(ReaderFailed("r1", ERROR, RECORD), now) == []
        assert core.handle(ReaderCommitted("r2", now + 10), now + 10) == []
    assert core.quarantined() == []
    assert core.counters["reader_failed"] == 25


def _parked() -> tuple[TaskCore, _Log]:
    core, log = _reading()
    core.handle(ReaderCommitted("r1", 7, (("t0", "0"),)), 5)
    for now in (10, 30, 50):
        out = core.handle(ReaderFailed("r1", ERROR, RECORD), now)
        core.handle(ReaderCommitted("r2", now + 10), now + 10)
    core.handle(ReaderStopped("r1", 7, (("t0", "0"),)), 65)
    log.read_back(core, out, 66)
    return core, log


def test_release_resumes_exactly_at_the_watermark() -> None:
    core, log = _parked()
    assert core.quarantined()[0].quarantine == _quarantine(50, watermark=7)
    out = log.deliver(core, ReleaseMessage(task_id="op", token="r1", since=50), 80)
    assert out == [
        StartReader("r1", 7, (), (("t0", "0"),)),  # the watermark and the identities at it
        _state(
            core,
            80,
            Partition("r1", 0, watermark=7, tail=(("t0", "0"),)),
            Partition("r2", 0, watermark=60),  # (committed after the quarantine went out)
        ),
    ]
    assert core.counters["quarantine_released"] == 1
    assert log.read_back(core, out, 90) == []
    assert held_by(core.cim) == ()


def test_a_release_of_an_older_quarantine_does_not_release_a_newer_one() -> None:
    core, log = _parked()
    assert log.deliver(core, ReleaseMessage(task_id="op", token="r1", since=49), 80) == []
    assert log.deliver(core, ReleaseMessage(task_id="op", token="zz", since=50), 81) == []
    assert len(core.quarantined()) == 1


def test_a_task_taking_a_quarantined_partition_over_does_not_read_it() -> None:
    """The quarantine travels with the partition: the leader deals a dead owner's parked
    partition out to ``b``, which owns it and reads only the other one."""
    log = _Log()
    core = TaskCore(TaskConfig("b", cap=0))
    (answer,) = core.handle(Joined(2, "c", ("b", "c")), 0)
    assert isinstance(answer, Publish)
    log.deliver(core, answer.message, 0)
    core.handle(Lease(10**9), 0)
    parked = Partition("p", 0, watermark=40, quarantine=_quarantine(9, watermark=40))
    epoch = EpochMessage(
        task_id="c",
        epoch=2,
        sync_epoch="e2",
        members=("b", "c"),
        connector_state=(
            TaskState(
                task_id="c",
                state_timestamp=5,
                share=(
                    Share(parked, target="b", kind="new", since=5),
                    Share(Partition("q", 0, watermark=40), target="b", kind="new", since=5),
                ),
            ),
        ),
    )
    out = log.deliver(core, epoch, 10)
    assert [c for c in out if isinstance(c, StartReader)] == [StartReader("q", 40, ())]
    assert core.mine["p"] == parked
    (publish,) = [c for c in out if isinstance(c, Publish)]
    assert isinstance(publish.message, StateMessage)
    assert parked in publish.message.connector_state[0].data
    # nor does it offer it around when balancing (moving it gains nothing)
    assert "p" not in core._movable()


def test_an_orphan_keeps_its_quarantine() -> None:
    """Two dropped tasks held one partition at one watermark, one of them parked: the orphan
    the leader deals out is the parked copy, whichever came first (CIM rules 5c, 9)."""
    parked = Partition("p", 0, watermark=40, quarantine=_quarantine(9, watermark=40))
    plain = Partition("p", 0, watermark=40)
    for a, b in ((parked, plain), (plain, parked)):
        cim = Cim()
        cim.apply(0, EpochMessage(task_id="a", epoch=1, members=("a", "b")))
        cim.apply(1, StateMessage(task_id="a", epoch=1, connector_state=(TaskState("a", 1, (a,)),)))
        cim.apply(2, StateMessage(task_id="b", epoch=1, connector_state=(TaskState("b", 1, (b,)),)))
        cim.apply(3, EpochMessage(task_id="c", epoch=2, members=("c",)))
        assert cim.orphans == {"p": parked}


def test_messages_without_the_fields_still_decode() -> None:
    old = b'{"kind":"state","taskID":"a","epoch":1,"connectorState":[{"taskID":"a",' + (
        b'"data":[{"token":"p","startTs":3,"watermark":9}]}]}'
    )
    message = messages.decode(old)
    assert isinstance(message, StateMessage)
    assert message.connector_state[0].data == (Partition("p", 3, watermark=9),)
    parked = Partition("p", 3, watermark=9, quarantine=_quarantine(11, watermark=9))
    state = StateMessage(task_id="a", connector_state=(TaskState("a", 1, data=(parked,)),))
    assert messages.decode(messages.encode(state)) == state
    release = ReleaseMessage(task_id="op", token="p", since=11)
    assert messages.decode(messages.encode(release)) == release
    assert b'"kind":"release"' in messages.encode(release)


def test_a_checkpoint_carries_the_releases() -> None:
    cim = Cim()
    cim.apply(0, ReleaseMessage(task_id="op", token="p", since=11))
    cim.apply(1, ReleaseMessage(task_id="op", token="p", since=4))  # older: the newest stays
    assert cim.releases == {"p": 11}
    checkpoint = cim.checkpoint("a", 5)
    assert checkpoint.releases == (("p", 11),)
    fresh = Cim()
    fresh.apply(2, msgspec.structs.replace(checkpoint, as_of=1))
    assert fresh.releases == {"p": 11}
