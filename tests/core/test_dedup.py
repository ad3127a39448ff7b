"""The one de-duplication rule (protocol/dedup.py), used by the reader and every sink."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.dedup import PartitionTail, Tails
from protocol.records import DataChange


def rec(ts: int, txn: str = "t", seq: str = "0") -> DataChange:
    return DataChange(ts, seq, txn, False, "T", (), (), "INSERT")


def test_older_records_and_seen_ones_at_the_tail_are_re_reads() -> None:
    tail = PartitionTail()
    assert tail.fresh([rec(10), rec(10, seq="1"), rec(12)]) == [rec(10), rec(10, seq="1"), rec(12)]
    assert (tail.ts, tail.ids) == (12, {(12, "t", "0")})
    # a re-read from 10 inclusive: only what is new at 12 and after comes through
    again = [rec(10), rec(10, seq="1"), rec(12), rec(12, seq="1"), rec(13)]
    assert tail.fresh(again) == [rec(12, seq="1"), rec(13)]


def test_a_committed_batch_moves_the_tail_and_remembers_its_records_at_the_watermark() -> None:
    tail = PartitionTail(5)
    tail.commit(20, [rec(18), rec(20), rec(20, seq="1")])
    assert (tail.ts, tail.ids) == (20, {(20, "t", "0"), (20, "t", "1")})
    tail.commit(20, [rec(20, seq="2")])  # more of the same timestamp
    assert len(tail.ids) == 3
    tail.commit(30, [rec(25)])  # a heartbeat past the records: nothing at 30 to remember
    assert (tail.ts, tail.ids) == (30, set())
    assert not tail.seen(30, (30, "t", "0"))
    assert tail.seen(29, (29, "t", "0"))


def test_tails_keep_one_tail_per_partition() -> None:
    tails = Tails()
    assert tails.fresh("a", [rec(1), rec(2)]) == [rec(1), rec(2)]
    assert tails.fresh("b", [rec(1)]) == [rec(1)]
    assert tails.seen("a", rec(2))
    assert not tails.seen("b", rec(2))
    copy = tails.copy()
    tails.accept("b", (5, "t", "0"))
    assert tails.seen("b", rec(5))
    assert not copy.seen("b", rec(5))
    assert len(tails) == 2


@settings(max_examples=200, deadline=None)
@given(
    stamps=st.lists(st.integers(0, 6), min_size=1, max_size=30),
    restarts=st.lists(st.integers(0, 29), max_size=5),
)
def test_re_reading_from_any_earlier_watermark_inclusive_yields_each_record_once(
    stamps: list[int], restarts: list[int]
) -> None:
    """A partition's stream in commit order, read with restarts from the timestamp of some
    earlier record (inclusive): what comes through is the stream, each record once."""
    stream = [rec(ts, seq=str(i)) for i, ts in enumerate(sorted(stamps))]
    tail = PartitionTail()
    out: list[DataChange] = []
    pos = 0
    for stop in sorted(restarts):
        if not pos < stop <= len(stream):
            continue
        out += tail.fresh(stream[pos:stop])  # read up to here, then the query fails
        watermark = stream[stop - 1].commit_ts  # and restarts at this timestamp, inclusive
        pos = next(i for i, r in enumerate(stream) if r.commit_ts >= watermark)
    out += tail.fresh(stream[pos:])
    assert out == stream


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(-1, 6),
    stamps=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 3)), max_size=25),
)
def test_accepting_a_batch_at_once_equals_accepting_each_record(
    start: int, stamps: list[tuple[int, int]]
) -> None:
    """A committed micro-batch's records are accepted in one pass (the ledger does, after each
    commit): the tail ends where accepting them one by one, in their order, leaves it."""
    records = [rec(ts, seq=str(seq)) for ts, seq in stamps]
    one_by_one = PartitionTail(start, [(start, "t", "x")] if start >= 0 else [])
    at_once = one_by_one.copy()
    for r in records:
        one_by_one.accept(r.identity)
    at_once.accept_all(records)
    assert (at_once.ts, at_once.ids) == (one_by_one.ts, one_by_one.ids)
    tails, each = Tails(), Tails()
    tails.accept_all("p", records)
    for r in records:
        each.accept("p", r.identity)
    assert len(tails) == len(each)
    assert all(tails.seen("p", r) == each.seen("p", r) for r in records)
