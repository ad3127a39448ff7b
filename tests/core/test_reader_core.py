"""Rung 1 for the partition reader's rules (protocol/reader.py): the exact commands the core
returns for given events, the time passed in by hand."""

from __future__ import annotations

import pytest

from protocol.dedup import Position
from protocol.events import ReaderCommitted, ReaderFailed, ReaderFinished, ReaderStopped, StopReason
from protocol.reader import (
    BatchCommitted,
    BatchesFenced,
    BatchFailed,
    CancelQuery,
    Chunk,
    Done,
    FenceBatches,
    FlushBatches,
    PutBatch,
    QueryEnded,
    QueryError,
    ReaderCommand,
    ReaderConfig,
    ReaderCore,
    ReaderEvent,
    ReaderTick,
    Report,
    Start,
    StartQuery,
    StopRequested,
    resume_position,
)
from protocol.records import ChildPartition, ChildPartitions, DataChange, Heartbeat, Mod

T0 = 1_700_000_000_000_000
TOK = "p1"
S = 1_000_000  # one second in micros


def rec(ts: int, txn: str, seq: str = "0") -> DataChange:
    return DataChange(
        commit_ts=ts,
        record_sequence=seq,
        server_transaction_id=txn,
        is_last_record_in_transaction_in_partition=True,
        table="T",
        column_types=(),
        mods=(Mod('{"Id":1}', "{}", "{}"),),
        mod_type="INSERT",
    )


class Driver:
    """A core, its clock, and validate() after every event."""

    def __init__(self, start: Position | None = None, **config: int) -> None:
        self.core = ReaderCore(ReaderConfig(TOK, **config), start or Position(T0))  # type: ignore[arg-type]
        self.now = 0

    def __call__(self, event: ReaderEvent, at: int | None = None) -> list[ReaderCommand]:
        if at is not None:
            self.now = at
        out = self.core.handle(event, self.now)
        self.core.validate()
        return out

    def started(self, sink: Position | None = None) -> list[ReaderCommand]:
        return self(Start(sink))


def test_start_queries_from_the_given_position() -> None:
    d = Driver()
    assert d.started() == [StartQuery(1, T0)]
    assert d.core.next_deadline() == 30 * S  # the stall deadline of the first query


def test_a_chunk_is_cut_into_batches_each_with_its_watermark() -> None:
    d = Driver(batch_records=2)
    d.started()
    r = [rec(T0 + i, f"t{i}") for i in range(1, 6)]
    assert d(Chunk(1, (*r, Heartbeat(T0 + 9)))) == [
        PutBatch(1, (r[0], r[1]), T0 + 2),
        PutBatch(2, (r[2], r[3]), T0 + 4),
        PutBatch(3, (r[4],), T0 + 9),
    ]


def test_a_heartbeat_advances_the_position_once() -> None:
    d = Driver()
    d.started()
    assert d(Chunk(1, (Heartbeat(T0 + 5),))) == [PutBatch(1, (), T0 + 5)]
    assert d(Chunk(1, (Heartbeat(T0 + 5),))) == []  # nothing new
    assert d(BatchCommitted(1)) == [Report(ReaderCommitted(TOK, T0 + 5))]


def test_child_partitions_commit_one_microsecond_before_their_start() -> None:
    d = Driver()
    d.started()
    r1 = rec(T0 + 10, "a")
    child = ChildPartition("c1", (TOK,))
    end = ChildPartitions(T0 + 100, "0", (child,))
    assert d(Chunk(1, (r1, end))) == [PutBatch(1, (r1,), T0 + 99)]
    # not finished before the batch is committed; the sink is asked not to hold it (rule 10)
    assert d(QueryEnded(1)) == [FlushBatches()]
    assert d(BatchCommitted(1)) == [
        Report(ReaderCommitted(TOK, T0 + 99)),
        Done(ReaderFinished(TOK, T0 + 99, (child,), T0 + 100)),
    ]
    assert d(Chunk(1, (rec(T0 + 101, "late"),))) == []  # done: nothing more


def test_finished_only_after_every_batch_is_committed_in_order() -> None:
    d = Driver(batch_records=1)
    d.started()
    a, b = rec(T0 + 1, "a"), rec(T0 + 2, "b")
    end = ChildPartitions(T0 + 10, "0", ())
    assert d(Chunk(1, (a, b, end))) == [PutBatch(1, (a,), T0 + 1), PutBatch(2, (b,), T0 + 9)]
    assert d(QueryEnded(1)) == [FlushBatches()]
    assert d(BatchCommitted(2)) == []  # waits for batch 1
    assert d(BatchCommitted(1)) == [
        Report(ReaderCommitted(TOK, T0 + 9)),
        Done(ReaderFinished(TOK, T0 + 9, (), T0 + 10)),
    ]


def test_re_reads_at_the_start_position_are_dropped_by_identity() -> None:
    d = Driver(Position(T0 + 10, (("a", "0"),)))
    d.started()
    old, a, b = rec(T0 + 5, "old"), rec(T0 + 10, "a"), rec(T0 + 10, "b")
    assert d(Chunk(1, (old, a, b))) == [PutBatch(1, (b,), T0 + 10)]
    assert d.core.dropped == 2
    assert d.core.out_of_order == 1  # old: before the query's start (a, at it, is a re-read)
    assert d(BatchCommitted(1)) == [Report(ReaderCommitted(TOK, T0 + 10, (("a", "0"), ("b", "0"))))]


def test_a_record_older_than_its_querys_position_is_counted_out_of_order() -> None:
    """Spanner returns a partition's records in commit-timestamp order, and a heartbeat says
    nothing older will come. A source that sends a record after a heartbeat past it (seen
    once from the emulator under load: a transaction missing from the middle of a partition's
    output) broke that promise: positions assume the order, so the record is dropped as the
    position has passed it, but it is counted (the shell logs it as an error), not taken for
    a re-read. A restarted query re-reading in order from its start counts nothing."""
    d = Driver()
    d.started()
    a, late = rec(T0 + 1, "a"), rec(T0 + 5, "late")
    assert d(Chunk(1, (a, Heartbeat(T0 + 9)))) == [PutBatch(1, (a,), T0 + 9)]
    assert d(Chunk(1, (late,))) == []
    assert (d.core.out_of_order, d.core.out_of_order_last) == (1, (T0 + 5, T0 + 9))
    assert d.core.dropped == 1
    # within one chunk alike
    d = Driver()
    d.started()
    assert d(Chunk(1, (Heartbeat(T0 + 9), late))) == [PutBatch(1, (late,), T0 + 9)]
    assert d.core.out_of_order == 1


def test_a_cut_inside_one_timestamp_commits_the_identities_at_it() -> None:
    d = Driver(batch_records=1)
    d.started()
    a, b = rec(T0 + 3, "a"), rec(T0 + 3, "b")
    assert d(Chunk(1, (a, b))) == [PutBatch(1, (a,), T0 + 3), PutBatch(2, (b,), T0 + 3)]
    assert d(BatchCommitted(1)) == [Report(ReaderCommitted(TOK, T0 + 3, (("a", "0"),)))]
    assert d(BatchCommitted(2)) == [Report(ReaderCommitted(TOK, T0 + 3, (("a", "0"), ("b", "0"))))]


def test_a_failed_batch_restarts_from_the_committed_position_after_a_backoff() -> None:
    d = Driver(batch_records=1)
    d.started()
    a, b, c = rec(T0 + 1, "a"), rec(T0 + 2, "b"), rec(T0 + 3, "c")
    assert d(Chunk(1, (a, b, c))) == [
        PutBatch(1, (a,), T0 + 1),
        PutBatch(2, (b,), T0 + 2),
        PutBatch(3, (c,), T0 + 3),
    ]
    assert d(BatchFailed(2, "boom"), at=10) == []  # batch 1 is not settled yet
    assert d(BatchCommitted(3)) == []
    assert d(BatchCommitted(1), at=20) == [
        Report(ReaderCommitted(TOK, T0 + 1, (("a", "0"),))),
        CancelQuery(1),
        # the report names the failed batch's first record (the quarantine rule logs it)
        Report(ReaderFailed(TOK, "sink failed a batch: boom", f"{T0 + 2} b 0")),
    ]
    assert d.core.pending == type(d.core.pending)()  # everything in flight dropped
    assert d.core.next_deadline() == 20 + 100_000
    assert d(ReaderTick(), at=20 + 99_999) == []
    assert d(ReaderTick(), at=20 + 100_000) == [StartQuery(2, T0 + 1)]
    # what was handed after the commit is read and handed again; only the committed is dropped
    assert d(Chunk(2, (a, b, c))) == [PutBatch(4, (b,), T0 + 2), PutBatch(5, (c,), T0 + 3)]
    assert d(Chunk(1, (rec(T0 + 4, "stale"),))) == []  # the cancelled query's answer


def test_a_query_error_backs_off_exponentially_and_keeps_batches_in_flight() -> None:
    d = Driver(max_backoff=300_000)
    d.started()
    a = rec(T0 + 1, "a")
    assert d(Chunk(1, (a,))) == [PutBatch(1, (a,), T0 + 1)]
    assert d(QueryError(1, "Unavailable: x"), at=0) == [Report(ReaderFailed(TOK, "Unavailable: x"))]
    assert d.core.next_deadline() == 100_000
    assert d(ReaderTick(), at=100_000) == [StartQuery(2, T0)]  # the committed timestamp
    assert d(QueryError(2, "Unavailable: y"), at=100_000) == [
        Report(ReaderFailed(TOK, "Unavailable: y"))
    ]
    assert d.core.next_deadline() == 100_000 + 200_000
    assert d(ReaderTick(), at=300_000) == [StartQuery(3, T0)]
    assert d(QueryError(3, "z"), at=300_000) == [Report(ReaderFailed(TOK, "z"))]
    assert d.core.next_deadline() == 300_000 + 300_000  # capped by max_backoff
    assert d(ReaderTick(), at=600_000) == [StartQuery(4, T0)]
    # the re-read of the batch still in flight is dropped (it was handed); the answer resets
    b = rec(T0 + 2, "b")
    assert d(Chunk(4, (a, b))) == [PutBatch(2, (b,), T0 + 2)]
    assert d(QueryError(4, "w"), at=700_000) == [Report(ReaderFailed(TOK, "w"))]
    assert d.core.next_deadline() == 700_000 + 100_000


def test_stalls_in_a_row_wait_twice_as_long_up_to_eight_times() -> None:
    d = Driver(stall_timeout=S, max_backoff=0)
    d.started()
    waits = []
    query = 1
    for _ in range(5):
        deadline = d.core.next_deadline()
        assert deadline is not None
        waits.append(deadline - d.now)
        out = d(ReaderTick(), at=deadline)
        seconds = waits[-1] // S
        error = f"QueryStalled: partition {TOK}: nothing from the source for {seconds}s"
        assert out == [
            CancelQuery(query),
            # marked stalled: the quarantine rule does not count it (no record failed)
            Report(ReaderFailed(TOK, f"{error} (not even a heartbeat)", stalled=True)),
            StartQuery(query + 1, T0),  # a zero backoff: at once
        ]
        query += 1
    assert waits == [S, 2 * S, 4 * S, 8 * S, 8 * S]
    assert d(Chunk(query, (Heartbeat(T0 + 1),))) == [PutBatch(1, (), T0 + 1)]
    assert d.core.next_deadline() == d.now + S  # any answer resets the count


def test_a_lapsed_lease_stops_before_the_sink_gets_anything() -> None:
    d = Driver(Position(T0, (("a", "0"),)))
    d.started()
    assert d(Chunk(1, (rec(T0, "a"),), permitted=False)) == []  # nothing to hand: not asked
    assert d(Chunk(1, (rec(T0 + 1, "b"),), permitted=False)) == [
        CancelQuery(1),
        Done(ReaderStopped(TOK, T0, (("a", "0"),))),
    ]


def test_a_drain_lets_in_flight_batches_commit() -> None:
    d = Driver()
    d.started()
    a = rec(T0 + 1, "a")
    d(Chunk(1, (a,)))
    assert d(StopRequested(StopReason.HANDOFF, drain=True), at=50) == [
        CancelQuery(1),
        FlushBatches(),
    ]
    assert d.core.next_deadline() == 50 + 5 * S
    assert d(BatchCommitted(1)) == [
        Report(ReaderCommitted(TOK, T0 + 1, (("a", "0"),))),
        Done(ReaderStopped(TOK, T0 + 1, (("a", "0"),))),
    ]


def test_a_drain_ends_at_its_deadline_or_at_a_failed_batch() -> None:
    d = Driver(drain_timeout=S)
    d.started()
    d(Chunk(1, (rec(T0 + 1, "a"),)))
    assert d(StopRequested(StopReason.SHUTDOWN, drain=True), at=0) == [
        CancelQuery(1),
        FlushBatches(),
    ]
    assert d(ReaderTick(), at=S - 1) == []
    assert d(ReaderTick(), at=S) == [FenceBatches((1,))]  # rule 12: fenced before the end
    assert d.core.next_deadline() is None  # waits for the sink's answer
    assert d(BatchesFenced()) == [Done(ReaderStopped(TOK, T0))]
    assert d.core.fenced == 1
    d = Driver()
    d.started()
    d(Chunk(1, (rec(T0 + 1, "a"),)))
    d(StopRequested(StopReason.HANDOFF, drain=True))
    assert d(BatchFailed(1, "down")) == [Done(ReaderStopped(TOK, T0))]  # nothing else in flight


@pytest.mark.parametrize("reason", list(StopReason))
def test_a_stop_without_drain_ends_at_once(reason: StopReason) -> None:
    d = Driver()
    d.started()
    d(Chunk(1, (rec(T0 + 1, "a"),)))
    assert d(StopRequested(reason, drain=False)) == [CancelQuery(1), FenceBatches((1,))]
    assert d(BatchesFenced()) == [Done(ReaderStopped(TOK, T0))]
    d = Driver()
    d.started()
    d(Chunk(1, (Heartbeat(T0 + 1),)))
    d(BatchCommitted(1))
    assert d(StopRequested(reason, drain=False)) == [
        CancelQuery(1),
        Done(ReaderStopped(TOK, T0 + 1)),
    ]  # nothing in flight: nothing to fence


def test_batches_that_committed_before_the_fence_move_the_released_position() -> None:
    """Rule 12: the sink says batch 1 passed its commit point before the fence (its ack was
    still on its way): the position released covers it; 2 and 3 are fenced and re-read by the
    next owner."""
    d = Driver(batch_records=1, drain_timeout=S)
    d.started()
    a, b, c = rec(T0 + 1, "a"), rec(T0 + 2, "b"), rec(T0 + 3, "c")
    d(Chunk(1, (a, b, c)))
    d(StopRequested(StopReason.HANDOFF, drain=True), at=0)
    assert d(ReaderTick(), at=S) == [FenceBatches((1, 2, 3))]
    assert d(StopRequested(StopReason.SHUTDOWN, drain=False)) == []  # already ending
    assert d(BatchesFenced((1,))) == [
        Report(ReaderCommitted(TOK, T0 + 1, (("a", "0"),))),
        Done(ReaderStopped(TOK, T0 + 1, (("a", "0"),))),
    ]
    assert d.core.fenced == 2
    assert d(BatchCommitted(1)) == []  # its late ack changes nothing


def test_the_position_stops_at_a_batch_that_did_not_commit() -> None:
    """Only an in-order prefix moves the position: 2 committed but 1 did not (failed during
    the fence), so the released position stays before 1."""
    d = Driver(batch_records=1)
    d.started()
    a, b = rec(T0 + 1, "a"), rec(T0 + 2, "b")
    d(Chunk(1, (a, b)))
    assert d(StopRequested(StopReason.NOT_WANTED, drain=False)) == [
        CancelQuery(1),
        FenceBatches((1, 2)),
    ]
    assert d(BatchFailed(1, "down")) == []  # while fencing, a failure only marks the batch
    assert d(BatchesFenced((2,))) == [Done(ReaderStopped(TOK, T0))]


def test_a_failed_batch_during_a_drain_fences_the_ones_after_it() -> None:
    d = Driver(batch_records=1)
    d.started()
    d(Chunk(1, (rec(T0 + 1, "a"), rec(T0 + 2, "b"))))
    d(StopRequested(StopReason.HANDOFF, drain=True))
    assert d(BatchFailed(1, "down")) == [FenceBatches((2,))]
    assert d(BatchesFenced(held=False)) == [Done(ReaderStopped(TOK, T0))]
    assert (d.core.fenced, d.core.unfenced) == (0, 1)  # a sink that cannot fence: counted


def test_a_refused_permit_fences_what_is_in_flight() -> None:
    d = Driver()
    d.started()
    d(Chunk(1, (rec(T0 + 1, "a"),)))
    assert d(Chunk(1, (rec(T0 + 2, "b"),), permitted=False)) == [
        CancelQuery(1),
        FenceBatches((1,)),
    ]
    assert d(BatchesFenced()) == [Done(ReaderStopped(TOK, T0))]


def test_the_reader_resumes_from_the_newer_of_the_task_and_the_sink_position() -> None:
    ours = Position(T0 + 5)
    sinks = Position(T0 + 9, (("a", "0"),))
    assert resume_position(ours, sinks) == sinks
    assert resume_position(sinks, ours) == sinks
    assert resume_position(ours, None) == ours
    at_one_ts = Position(T0 + 9, (("a", "0"), ("b", "0")))
    assert resume_position(at_one_ts, sinks) == at_one_ts  # more committed at one timestamp
    d = Driver(ours)
    assert d.started(sinks) == [StartQuery(1, T0 + 9)]
    a, b = rec(T0 + 9, "a"), rec(T0 + 9, "b")
    assert d(Chunk(1, (a, b))) == [PutBatch(1, (b,), T0 + 9)]  # a was committed by the sink
