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
