"""The completeness watermark (protocol/completeness.py): exact values for each rule."""

from __future__ import annotations

from protocol.cim import Cim
from protocol.completeness import low_watermark
from protocol.messages import Partition, Share, SyncMessage
from tests.helpers import epoch, state


def _fold(*log: SyncMessage) -> Cim:
    cim = Cim()
    for offset, message in enumerate(log):
        cim.apply(offset, message)
    return cim


def _p(token: str, start: int, watermark: int = 0, **kw: object) -> Partition:
    return Partition(token, start_ts=start, watermark=watermark, **kw)  # type: ignore[arg-type]


def test_no_partition_known_means_no_watermark_yet() -> None:
    assert low_watermark(Cim()) is None
    assert low_watermark(_fold(epoch("a", 1, "a"))) is None


def test_the_slowest_unfinished_partition_bounds_it_one_before_its_position() -> None:
    cim = _fold(
        epoch("a", 1, "a", "b"),
        state("a", 1, _p("p", 100, 500)),
        state("b", 1, _p("q", 100, 300), _p("r", 100, 900)),
    )
    assert low_watermark(cim) == 299  # at 300 some records of q may not be committed yet


def test_a_partition_never_read_bounds_it_before_its_start() -> None:
    cim = _fold(epoch("a", 1, "a"), state("a", 1, _p("p", 100, 500), _p("new", 400)))
    assert low_watermark(cim) == 399


def test_finished_partitions_bound_nothing_once_their_children_are_known() -> None:
    cim = _fold(
        epoch("a", 1, "a"),
        state(
            "a",
            1,
            _p("parent", 100, 499, status="finished", children=("child",)),
            _p("child", 500, 800),
            _p("other", 100, 1000),
        ),
    )
    assert low_watermark(cim) == 799


def test_a_child_not_known_yet_holds_it_at_its_finished_parent() -> None:
    cim = _fold(
        epoch("a", 1, "a"),
        state(
            "a",
            1,
            _p("parent", 100, 499, status="finished", children=("child",)),
            _p("other", 100, 1000),
        ),
    )
    assert low_watermark(cim) == 499


def test_an_offered_partition_counts_from_its_offer() -> None:
    offer = Share(partition=_p("moving", 100, 250), target="b", kind="new")
    cim = _fold(epoch("a", 1, "a", "b"), state("a", 1, _p("p", 100, 900)))
    cim.tasks["a"].share["moving"] = offer
    assert low_watermark(cim) == 249


def test_the_newest_report_of_a_partition_wins_between_tasks() -> None:
    # the old owner's last report and the new owner's newer one: the newer one counts
    cim = _fold(
        epoch("a", 1, "a", "b"),
        state("a", 1, _p("p", 100, 300)),
        state("b", 1, _p("p", 100, 700), _p("q", 100, 900)),
    )
    assert low_watermark(cim) == 699


def test_everything_finished_is_complete_up_to_the_last_watermark() -> None:
    cim = _fold(
        epoch("a", 1, "a"),
        state("a", 1, _p("p", 100, 499, status="finished"), _p("q", 100, 699, status="finished")),
    )
    assert low_watermark(cim) == 699


def _started(*log: SyncMessage) -> Cim:
    from protocol.messages import EpochMessage

    return _fold(
        EpochMessage(task_id="a", epoch=1, sync_epoch="e1", members=("a",), stream_start=100),
        *log,
    )


def test_with_an_end_nothing_left_means_complete_up_to_the_end() -> None:
    """Finished partitions may be gone from the CIM by the end: the end itself is the mark."""
    done = _started(state("a", 1, _p("p", 100, 900, status="finished")))
    assert low_watermark(done, end=1000) == 1000
    assert low_watermark(_started(), end=1000) == 1000  # every partition finished and forgotten
    # control: one partition still reading bounds it as without an end
    reading = _started(state("a", 1, _p("p", 100, 900, status="finished"), _p("q", 100, 700)))
    assert low_watermark(reading, end=1000) == 699
    assert low_watermark(done) == 900  # without an end: the finished partitions' newest watermark
    assert low_watermark(Cim(), end=1000) is None  # not started: nothing is known


def test_the_mark_is_written_when_it_advances_at_most_once_a_second_and_at_the_end() -> None:
    from protocol.completeness import MARK_INTERVAL_S, mark_due

    assert mark_due(10, -1, -1.0, 0.0, final=False)  # the first
    assert not mark_due(11, 10, 5.0, 5.0 + MARK_INTERVAL_S / 2, final=False)  # too soon
    assert mark_due(11, 10, 5.0, 5.0 + MARK_INTERVAL_S / 2, final=True)  # the last: at once
    assert mark_due(11, 10, 5.0, 5.0 + MARK_INTERVAL_S, final=False)
    assert not mark_due(10, 10, 5.0, 99.0, final=True)  # not advanced
    assert not mark_due(-1, -1, -1.0, 99.0, final=True)  # no watermark yet
