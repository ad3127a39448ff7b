"""The MUTABLE_KEY_RANGE rules in the task and reader cores (protocol/mutable.py, rules 5-7;
protocol/task.py; protocol/reader.py, rule 13): exact commands for each event. A destination
held at a move-in is read again only once the CIM shows every source past the event; the next
reader is given the hold and passes exactly its events; announced partitions are claims, read
once the CIM credits them, and of two claims of one token the first to land wins; a finished partition stays while an unfinished one resumes at or before its end."""

from __future__ import annotations

from random import Random

from protocol import mutable
from protocol.cim import Cim
from protocol.dedup import Position
from protocol.events import PartitionsAnnounced
from protocol.messages import (
    EpochMessage,
    MoveInHold,
    Partition,
    Share,
    StateMessage,
    SyncMessage,
    TaskState,
)
from protocol.mutable import PartitionEnd, PartitionEvent, PartitionStart
from protocol.reader import (
    BatchCommitted,
    CancelQuery,
    Chunk,
    Done,
    FlushBatches,
    PutBatch,
    QueryEnded,
    ReaderConfig,
    ReaderCore,
    Report,
    Start,
    StartQuery,
)
from protocol.records import DataChange, Heartbeat, Mod
from protocol.task import (
    Joined,
    Lease,
    Publish,
    ReaderCommitted,
    ReaderFinished,
    ReaderStopped,
    Rules,
    StartReader,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
    TaskTick,
)

T0 = 1_700_000_000_000_000
T = T0 + 50  # the move-in's commit timestamp
HOLD = MoveInHold(T, ("s",), ("3",))


def _epoch(n: int, *offers: Share) -> EpochMessage:
    return EpochMessage(
        task_id="x",
        epoch=n,
        members=("a", "x"),
        connector_state=(TaskState("x", 10**9 + n, share=offers),),
    )


def _x_state(ts: int, *parts: Partition) -> StateMessage:
    return StateMessage(
        task_id="x",
        epoch=1,
        connector_state=(TaskState("x", 2 * 10**9 + ts, data=parts, share=()),),
    )


def _starts(out: list[TaskCommand]) -> list[StartReader]:
    return [c for c in out if isinstance(c, StartReader)]


class _Member:
    """Task ``a`` of a mutable connector, reading ``d``; ``x`` owns the source ``s``."""

    def __init__(self, *, mutable_mode: bool = True, rules: Rules | None = None) -> None:
        config = TaskConfig(task_id="a", cap=0, mutable=mutable_mode, rules=rules or Rules())
        self.c = TaskCore(config, Random(0))
        self.offset = 0
        self.read(_epoch(0))
        self.c.handle(Lease(until=10**12), now=2)
        (answer,) = self.c.handle(Joined(generation=1, leader="x", members=("a", "x")), now=3)
        assert isinstance(answer, Publish)
        offer = Share(Partition("d", T0), target="a", kind="new", since=4)
        out = self.read(_epoch(1, offer))
        assert _starts(out) == [StartReader("d", T0, ())]
        self.read(answer.message)
        self.read(_x_state(0, Partition("s", T0)))

    def read(self, message: SyncMessage, now: int = 10) -> list[TaskCommand]:
        out = self.c.handle(SyncRead(self.offset, message), now=now)
        self.offset += 1
        return out


def test_a_destination_held_at_a_move_in_is_read_again_only_once_its_source_is_past_it() -> None:
    m = _Member()
    out = m.c.handle(ReaderStopped("d", T, (("tx", "1"),), HOLD), now=20)
    assert _starts(out) == []
    assert m.c.mine["d"].hold == HOLD
    assert m.c.counters["move_in_holds"] == 1
    # the source's watermark at the event is not past it (records at T may be uncommitted)
    assert _starts(m.read(_x_state(1, Partition("s", T0, watermark=T)), now=21)) == []
    out = m.read(_x_state(2, Partition("s", T0, watermark=T + 1)), now=22)
    assert _starts(out) == [StartReader("d", T, (), (("tx", "1"),), HOLD)]
    # once its watermark is past the event the hold is dropped: no read starts before it
    m.c.handle(ReaderCommitted("d", T + 7), now=23)
    assert m.c.mine["d"].hold is None


def test_a_finished_source_releases_the_hold_and_an_unknown_one_keeps_it() -> None:
    m = _Member()
    unknown = MoveInHold(T, ("s", "u"), ("3",))
    assert _starts(m.c.handle(ReaderStopped("d", T, (), unknown), now=20)) == []
    assert _starts(m.read(_x_state(1, Partition("s", T0, status="finished", watermark=T)))) == []
    out = m.read(_x_state(2, Partition("u", T0, status="finished", watermark=T - 9)))
    assert _starts(out) == [StartReader("d", T, (), (), unknown)]


def test_without_the_hold_rule_a_held_destination_is_read_at_once() -> None:
    m = _Member(rules=Rules(move_in_holds=False))
    out = m.c.handle(ReaderStopped("d", T, (), HOLD), now=20)
    assert _starts(out) == [StartReader("d", T, (), (), HOLD)]


def test_a_held_partition_does_not_count_against_the_cim_load() -> None:
    m = _Member()
    m.c.handle(ReaderStopped("d", T, (), HOLD), now=20)
    held = m.c.mine["d"]
    assert m.c.cim.waits(held)
    assert not m.c.cim.waits(Partition("d", T0))


def _published(out: list[TaskCommand]) -> StateMessage:
    (publish,) = [c for c in out if isinstance(c, Publish)]
    assert isinstance(publish.message, StateMessage)
    return publish.message


def _claim_of(task: str, token: str, ts: int = 1) -> StateMessage:
    """``task``'s state claiming ``token``, registered from a partition start of its own."""
    return StateMessage(
        task_id=task,
        epoch=1,
        connector_state=(
            TaskState(task, 3 * 10**9 + ts, data=(Partition(token, T0 + 70, claim=True),)),
        ),
    )


def test_an_announced_partition_is_a_claim_read_once_the_cim_credits_it() -> None:
    m = _Member()
    out = m.c.handle(PartitionsAnnounced("d", T0 + 70, ("n1", "d", "s")), now=20)
    assert _starts(out) == []  # a claim: nobody reads it before the CIM has it
    assert m.c.mine["n1"] == Partition("n1", T0 + 70, claim=True)
    assert m.c.counters["partitions_announced"] == 1
    assert list(m.c.owned_unfinished()) == ["d"]  # a claim is not owned yet
    m.c.validate()
    # (goes out with the next message: one of the member's own is still on its way)
    message = _published(m.c.handle(TaskTick(), now=10**6))
    (state,) = message.connector_state
    assert Partition("n1", T0 + 70, claim=True) in state.data
    # announced again (another partition, or a re-read) before the claim lands: known
    m.c.handle(PartitionsAnnounced("d", T0 + 70, ("n1",)), now=22)
    assert m.c.counters["partitions_announced"] == 1
    # the claim lands first: credited (an ordinary partition in the CIM) and read
    out = m.read(message, now=23)
    assert m.c.cim.view("a").partitions["n1"] == Partition("n1", T0 + 70)
    assert m.c.mine["n1"] == Partition("n1", T0 + 70)
    assert m.c.counters["announced_claims_won"] == 1
    assert _starts(out) == [StartReader("n1", T0 + 70, ())]
    m.c.validate()


def test_of_two_claims_of_one_token_the_first_to_land_is_read_and_the_other_given_up() -> None:
    m = _Member()
    m.c.handle(PartitionsAnnounced("d", T0 + 70, ("n1",)), now=20)
    mine = _published(m.c.handle(TaskTick(), now=10**6))
    # x's partition announced n1 too, and x's claim landed first
    assert _starts(m.read(_claim_of("x", "n1"), now=22)) == []
    assert "n1" not in m.c.mine
    assert m.c.counters["announced_claims_lost"] == 1
    assert m.c.cim.view("x").partitions["n1"] == Partition("n1", T0 + 70)
    # our claim lands after it: the CIM drops it (CIM rule 10), nobody else reads it
    assert _starts(m.read(mine, now=23)) == []
    assert "n1" not in m.c.cim.view("a").partitions
    assert m.c.cim.ignored["claim-lost"] == 1
    assert [t for t, _ in m.c.cim.holders("n1")] == ["x"]
    m.c.validate()


def test_a_claim_offered_to_another_member_is_credited_in_the_share_section() -> None:
    cim = Cim()
    offer = Share(Partition("n1", T0 + 70, claim=True), target="b", kind="new", since=5)
    state = TaskState("a", 7, share=(offer,))
    cim.apply(0, StateMessage(task_id="a", epoch=0, connector_state=(state,)))
    credited = cim.view("a").share["n1"]
    assert credited.partition == Partition("n1", T0 + 70)
    assert credited.target == "b"
    # a second claim, by c's state, of the offered token is dropped
    cim.apply(1, _claim_of("c", "n1"))
    assert "n1" not in cim.view("c").partitions
    assert cim.ignored["claim-lost"] == 1
    # an ordinary partition (a hand-off, not a claim) is applied as before
    cim.apply(2, _x_state(3, Partition("n1", T0 + 70, status="incoming", source="a")))
    assert cim.view("x").partitions["n1"].status == "incoming"


def test_without_the_claim_rule_an_announced_partition_is_read_at_once() -> None:
    """The teeth (``Rules.claim_announced=False``): read at once, so a token announced by two
    partitions on two tasks is read by both (the fault simulator's ``--ignore-claims``)."""
    m = _Member(rules=Rules(claim_announced=False))
    out = m.c.handle(PartitionsAnnounced("d", T0 + 70, ("n1",)), now=20)
    assert _starts(out) == [StartReader("n1", T0 + 70, ())]


def test_an_immutable_connector_ignores_announcements() -> None:
    m = _Member(mutable_mode=False)
    out = m.c.handle(PartitionsAnnounced("d", T0 + 70, ("n1",)), now=20)
    assert _starts(out) == []
    assert "n1" not in m.c.mine
    assert m.c.counters["announced_ignored"] == 1


def test_a_finished_partition_stays_while_another_resumes_at_or_before_its_end() -> None:
    m = _Member()
    m.read(_x_state(1, Partition("s", T0, watermark=T)))
    m.c.handle(ReaderFinished("d", T, (), T), now=20)
    assert m.c.mine["d"].status == "finished"  # s resumes at T: it may still name d
    m.read(_x_state(2, Partition("s", T0, watermark=T + 1)), now=21)
    assert "d" not in m.c.mine
    assert "d" in m.c.retired


def test_an_immutable_connector_removes_a_finished_partition_at_once() -> None:
    m = _Member(mutable_mode=False)
    m.read(_x_state(1, Partition("s", T0, watermark=T)))
    m.c.handle(ReaderFinished("d", T, (), T), now=20)
    assert "d" not in m.c.mine


def test_the_pure_rules() -> None:
    find = {"s": Partition("s", T0, watermark=T + 1), "u": Partition("u", T0, watermark=T)}.get
    assert mutable.released(Partition("d", T0), find)
    assert mutable.released(Partition("d", T0, hold=MoveInHold(T, ("s",))), find)
    assert not mutable.released(Partition("d", T0, hold=MoveInHold(T, ("s", "u"))), find)
    assert not mutable.released(Partition("d", T0, hold=MoveInHold(T, ("gone",))), find)
    passed_already = Partition("d", T0, watermark=T + 1, hold=MoveInHold(T, ("gone",)))
    assert mutable.released(passed_already, find)
    event = PartitionEvent(T, "4", "d", move_in_from=("u",))
    assert not mutable.passes(None, event)
    assert not mutable.passes(HOLD, event)  # another event at the same timestamp
    assert mutable.passes(MoveInHold(T, ("s",), ("3", "4")), event)
    assert mutable.passes(MoveInHold(T + 1, ("s",), ("9",)), event)  # older than the hold
    assert mutable.held_at(HOLD, event) == MoveInHold(T, ("s", "u"), ("3", "4"))
    assert mutable.held_at(None, event) == MoveInHold(T, ("u",), ("4",))
    done = Partition("p", T0, status="finished", watermark=T)
    assert mutable.removable(done, [Partition("q", T0, watermark=T + 1)])
    assert not mutable.removable(done, [Partition("q", T0, watermark=T)])
    assert not mutable.removable(done, [Partition("q", T)])  # starts at its end
    assert not mutable.removable(Partition("p", T0), [])


# -- the reader core (protocol/reader.py, rule 13) ---------------------------------------------
def _write(ts: int, txn: str) -> DataChange:
    return DataChange(ts, "1", txn, True, "Keys", (), (Mod('{"Id":"k"}', "{}", "{}"),), "UPDATE")


def _reader(hold: MoveInHold | None = None, start: int = T0) -> ReaderCore:
    r = ReaderCore(ReaderConfig("d", batch_records=10, mutable=True), Position(start), hold)
    assert r.handle(Start(), now=0) == [StartQuery(1, start)]
    return r


MOVE_IN = PartitionEvent(T, "3", "d", move_in_from=("s",))


def test_a_reader_stops_at_a_move_in_once_everything_before_it_is_committed() -> None:
    r = _reader()
    before, after = _write(T, "t1"), _write(T + 5, "t2")
    out = r.handle(Chunk(1, (before, MOVE_IN, after, Heartbeat(T + 9))), now=1)
    assert out == [PutBatch(1, (before,), T), CancelQuery(1), FlushBatches()]
    out = r.handle(BatchCommitted(1), now=2)
    tail = (("t1", "1"),)
    assert out == [
        Report(ReaderCommitted("d", T, tail)),
        Done(ReaderStopped("d", T, tail, MoveInHold(T, ("s",), ("3",)))),
    ]


def test_a_reader_given_the_released_hold_passes_its_move_in() -> None:
    r = _reader(HOLD, start=T)
    after = _write(T + 5, "t2")
    out = r.handle(Chunk(1, (MOVE_IN, after)), now=1)
    assert out == [PutBatch(1, (after,), T + 5)]


def test_a_reader_reports_a_partition_start_and_a_move_out_is_progress() -> None:
    r = _reader()
    out = r.handle(
        Chunk(
            1,
            (
                PartitionStart(T0 + 10, "1", ("n1", "n2")),
                PartitionEvent(T0 + 20, "2", "d", move_out_to=("n1",)),
            ),
        ),
        now=1,
    )
    assert out == [
        Report(PartitionsAnnounced("d", T0 + 10, ("n1", "n2"))),
        PutBatch(1, (), T0 + 20),
    ]


def test_behind_the_sink_a_reader_reads_again_for_the_partition_starts_it_skipped() -> None:
    """Rule 13's rescan: the sink holds records to T + 30 (an earlier reader's commits) while
    the task's position is T0: the query starts at T0; the partition start between is reported
    again (its registration may never have reached the sync topic), the records the sink has are
    dropped, a move-in before the sink's position is passed; from T + 30 on reading is as ever."""
    sink = Position(T + 30, (("t3", "1"),))
    r = ReaderCore(ReaderConfig("d", batch_records=10, mutable=True), Position(T0))
    assert r.handle(Start(sink), now=0) == [StartQuery(1, T0)]
    assert [r.rescan] == [(T0, T + 30)]
    old, durable, new = _write(T0 + 5, "t1"), _write(T + 30, "t3"), _write(T + 40, "t4")
    start = PartitionStart(T0 + 10, "2", ("n1",))
    out = r.handle(Chunk(1, (old, start, MOVE_IN, durable, new)), now=1)
    assert out == [Report(PartitionsAnnounced("d", T0 + 10, ("n1",))), PutBatch(1, (new,), T + 40)]
    assert r.dropped == 2
    assert r.rescan is None
    # a move-in from the sink's position on is not passed without the task's hold
    r2 = ReaderCore(ReaderConfig("d", batch_records=10, mutable=True), Position(T0))
    r2.handle(Start(Position(T)), now=0)
    out = r2.handle(Chunk(1, (MOVE_IN, new)), now=1)
    assert PutBatch(1, (new,), T + 40) not in out
    assert r2.holding == MoveInHold(T, ("s",), ("3",))


def test_an_immutable_reader_starts_at_the_sink_position() -> None:
    """The control: in the other mode the sink's newer position is where the query starts."""
    r = ReaderCore(ReaderConfig("d", batch_records=10), Position(T0))
    assert r.handle(Start(Position(T + 30)), now=0) == [StartQuery(1, T + 30)]
    assert r.rescan is None


def test_a_query_ending_without_a_partition_end_finishes_the_partition_at_the_end_at() -> None:
    # the source ends a query only at the partition's end or at the connector's end_at
    r = _reader()
    r.handle(Chunk(1, (Heartbeat(T0 + 30),)), now=1)
    r.handle(BatchCommitted(1), now=2)
    assert r.handle(QueryEnded(1), now=3) == [Done(ReaderFinished("d", T0 + 30, (), T0, ()))]


def test_a_partition_end_finishes_the_partition_without_children() -> None:
    r = _reader()
    out = r.handle(Chunk(1, (PartitionEnd(T0 + 40, "5", "d"),)), now=1)
    assert out == [PutBatch(1, (), T0 + 40)]
    r.handle(BatchCommitted(1), now=2)
    assert r.handle(QueryEnded(1), now=3) == [Done(ReaderFinished("d", T0 + 40, (), T0, ()))]


def test_an_immutable_reader_finishes_at_the_end_of_its_query() -> None:
    r = ReaderCore(ReaderConfig("d"), Position(T0))
    r.handle(Start(), now=0)
    assert r.handle(QueryEnded(1), now=1) == [Done(ReaderFinished("d", T0, (), T0, ()))]


def test_why_unread_names_the_move_in_and_the_sources_behind_it() -> None:
    m = _Member()
    m.c.handle(ReaderStopped("d", T, (), MoveInHold(T, ("s", "u"), ("3",))), now=20)
    m.read(_x_state(1, Partition("s", T0, watermark=T + 1)))
    assert m.c.why_unread("d", 30) == (
        False,
        f"held at a move-in at {T} until its sources commit past it: u=unknown "
        f"(sync log read to offset {m.offset - 1})",
    )
