"""The MUTABLE_KEY_RANGE partition lifecycle (protocol/mutable.py): exact commands for each
event — starts schedule once, ends finish, a move-in holds its destination until every source
has reached its timestamp (by progress, its end, or its move-out), and the chained query ends."""

from __future__ import annotations

from protocol.mutable import (
    MAX_QUERY_SPAN_US,
    Finish,
    Hold,
    MutableLifecycle,
    PartitionEnd,
    PartitionEvent,
    PartitionStart,
    Progress,
    Release,
    Schedule,
    query_end,
)

T = 1_000_000


def test_starts_schedule_each_token_once() -> None:
    core = MutableLifecycle()
    assert core.on_record(None, PartitionStart(T, "0", ("a", "b"))) == [
        Schedule("a", T),
        Schedule("b", T),
    ]
    assert core.on_record("a", PartitionStart(T + 5, "1", ("b", "c"))) == [Schedule("c", T + 5)]
    assert core.on_record("b", PartitionStart(T + 5, "0", ("c",))) == []
    core.validate()


def test_an_end_finishes_its_partition_once() -> None:
    core = MutableLifecycle()
    core.on_record(None, PartitionStart(T, "0", ("a",)))
    assert core.on_record("a", PartitionEnd(T + 9, "3", "a")) == [Finish("a", T + 9)]
    assert core.on_record("a", PartitionEnd(T + 9, "3", "a")) == []
    core.validate()


def _two_sources() -> MutableLifecycle:
    core = MutableLifecycle()
    core.on_record(None, PartitionStart(T, "0", ("p1", "p2", "p3")))
    return core


def test_a_move_in_holds_until_every_source_has_reached_it() -> None:
    core = _two_sources()
    move_in = PartitionEvent(T + 10, "0", "p1", move_in_from=("p2", "p3"))
    assert core.on_record("p1", move_in) == [Hold("p1", T + 10)]
    core.validate()
    assert core.on_progress(Progress("p2", T + 9)) == []  # not yet at T + 10
    assert core.on_progress(Progress("p2", T + 10)) == []  # p3 still behind
    assert core.on_progress(Progress("p3", T + 12)) == [Release("p1", T + 10)]
    assert core.holds == {}
    core.validate()


def test_a_move_out_or_an_end_of_a_source_releases_too() -> None:
    core = _two_sources()
    core.on_record("p1", PartitionEvent(T + 10, "0", "p1", move_in_from=("p2", "p3")))
    move_out = PartitionEvent(T + 10, "0", "p2", move_out_to=("p1",))
    assert core.on_record("p2", move_out) == []
    assert core.on_record("p3", PartitionEnd(T + 4, "0", "p3")) == [
        Finish("p3", T + 4),
        Release("p1", T + 10),
    ]
    # a move-out to another destination, or an older one, releases nothing
    core.on_record("p1", PartitionEvent(T + 20, "0", "p1", move_in_from=("p2",)))
    assert core.on_record("p2", PartitionEvent(T + 20, "1", "p2", move_out_to=("p9",))) == []
    assert core.on_record("p2", PartitionEvent(T + 15, "0", "p2", move_out_to=("p1",))) == []
    assert core.holds == {"p1": (T + 20, frozenset({"p2"}))}
    core.validate()


def test_a_move_in_whose_sources_are_already_past_it_does_not_hold() -> None:
    core = _two_sources()
    core.on_progress(Progress("p2", T + 30))
    core.on_record("p3", PartitionEnd(T + 5, "0", "p3"))
    assert core.on_record("p1", PartitionEvent(T + 10, "0", "p1", move_in_from=("p2", "p3"))) == []


def test_a_source_not_yet_known_is_waited_for() -> None:
    core = MutableLifecycle()
    core.on_record(None, PartitionStart(T, "0", ("p1",)))
    assert core.on_record("p1", PartitionEvent(T + 10, "0", "p1", move_in_from=("late",))) == [
        Hold("p1", T + 10)
    ]
    assert core.on_record("p1", PartitionStart(T + 11, "1", ("late",))) == [
        Schedule("late", T + 11)
    ]
    assert core.on_progress(Progress("late", T + 11)) == [Release("p1", T + 10)]


def test_control_a_progress_that_goes_back_changes_nothing() -> None:
    core = _two_sources()
    core.on_progress(Progress("p2", T + 30))
    assert core.on_progress(Progress("p2", T + 1)) == []
    assert core.watermarks["p2"] == T + 30


def test_query_ends_are_at_most_30_minutes_and_not_past_end_at() -> None:
    assert MAX_QUERY_SPAN_US == 1_800_000_000
    assert query_end(T, None) == T + MAX_QUERY_SPAN_US
    assert query_end(T, T + 5) == T + 5
    # the chain: each query starts where the previous one ended
    ends = []
    start = T
    for _ in range(3):
        start = query_end(start, T + 2 * MAX_QUERY_SPAN_US + 7)
        ends.append(start)
    assert ends == [
        T + MAX_QUERY_SPAN_US,
        T + 2 * MAX_QUERY_SPAN_US,
        T + 2 * MAX_QUERY_SPAN_US + 7,
    ]
