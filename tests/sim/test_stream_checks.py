"""The checks the command-line tests build from the stream model alone (``tests/helpers.py``)
have teeth: on one seeded model, the exact output passes (the control), and an output with a
row missing, a row extra, a row written twice, a gap inside a partition or a child read before
its parent's rows fails."""

from __future__ import annotations

import pytest

from runtime.sim.stream import StreamModel, StreamParams
from tests.helpers import (
    assert_catches_a_double,
    assert_no_row_twice,
    assert_one_cut,
    assert_read_without_gaps,
    partition_rows,
    stream_rows,
)

START = 1_700_000_000_000_000
PARAMS = StreamParams(
    seed=3, roots=3, start_ts=START, round_us=1_000_000, split_p=0.3, merge_p=0.3, move_p=0.1
)
CUT = START + 6_000_000
LATEST = START + 9_000_000


def _model() -> StreamModel:
    return StreamModel(PARAMS)


def _rows_to(cut: int) -> list[str]:
    return sorted(stream_rows(_model(), cut))


def test_the_model_has_children_to_check() -> None:
    model = _model()
    model.generate_until(CUT)
    children = [p for p in model.partitions.values() if p.parents and p.start_ts < CUT]
    assert len(children) >= 3
    assert any(len(p.parents) == 2 for p in children), "a merge"


def test_one_cut_control_passes_and_returns_the_cut() -> None:
    rows = stream_rows(_model(), CUT)
    cut = assert_one_cut(_model(), list(rows), earliest=CUT - 1_000_000, latest=LATEST)
    assert cut == max(rows.values())


def test_one_cut_catches_a_missing_row() -> None:
    rows = _rows_to(CUT)
    with pytest.raises(AssertionError, match=r"1 of .* missing"):
        assert_one_cut(_model(), rows[1:], earliest=CUT - 1_000_000, latest=LATEST)


def test_one_cut_catches_an_extra_row() -> None:
    with pytest.raises(AssertionError, match="never produced"):
        assert_one_cut(_model(), [*_rows_to(CUT), "1/x/0/0"], earliest=START, latest=LATEST)


def test_one_cut_catches_a_row_written_twice() -> None:
    rows = _rows_to(CUT)
    with pytest.raises(AssertionError, match="1 rows written more than once"):
        assert_one_cut(_model(), [*rows, rows[3]], earliest=START, latest=LATEST)


def test_no_row_twice_counts_raw_rows_and_its_control_helper_bites() -> None:
    assert assert_no_row_twice(["a", "b"]) == {"a": 1, "b": 1}
    with pytest.raises(AssertionError, match="1 rows written more than once: \\['b'\\]"):
        assert_no_row_twice(["a", "b", "b"])
    assert_catches_a_double(assert_no_row_twice, ["a", "b", "c"])
    with pytest.raises(AssertionError, match="passed rows with one of them written twice"):
        assert_catches_a_double(lambda rows: set(rows) == {"a", "b", "c"}, ["a", "b", "c"])


def test_one_cut_catches_a_cut_before_the_earliest_instant() -> None:
    with pytest.raises(AssertionError, match="missing"):
        assert_one_cut(_model(), _rows_to(CUT - 2_000_000), earliest=CUT, latest=LATEST)


def test_one_cut_catches_a_row_after_the_latest_instant() -> None:
    with pytest.raises(AssertionError, match="never produced"):
        assert_one_cut(_model(), _rows_to(LATEST), earliest=START, latest=CUT)


def _per_partition_prefix() -> tuple[StreamModel, set[str]]:
    """Each partition read to a different instant; children only of finished parents."""
    model = _model()
    per = partition_rows(model, LATEST)
    written: set[str] = set()
    for n, (token, rows) in enumerate(sorted(per.items())):
        info = model.partitions[token]
        if info.end_ts is not None and info.end_ts <= CUT:
            written |= rows.keys()  # finished: all of it
        elif info.start_ts <= CUT:
            stop = CUT + (n % 3) * 500_000
            written |= {i for i, ts in rows.items() if ts <= stop}
    return model, written


def test_without_gaps_control_passes() -> None:
    model, written = _per_partition_prefix()
    cuts = assert_read_without_gaps(model, written, floor=CUT, latest=LATEST)
    assert set(model.roots) <= cuts.keys()


def test_without_gaps_catches_a_gap_inside_a_partition() -> None:
    model, written = _per_partition_prefix()
    token = model.roots[0]
    rows = sorted(partition_rows(model, LATEST)[token].items(), key=lambda kv: kv[1])
    written.discard(rows[len(rows) // 2][0])
    with pytest.raises(AssertionError, match=f"{token}: 1 rows before its newest"):
        assert_read_without_gaps(model, written, floor=START, latest=LATEST)


def test_without_gaps_catches_a_child_read_before_its_parent_finished() -> None:
    model, written = _per_partition_prefix()
    per = partition_rows(model, LATEST)
    child = next(
        p for p in model.partitions.values() if p.parents and per[p.token].keys() & written
    )
    parent = child.parents[0]
    last = max(per[parent].values())
    newest = {i for i, ts in per[parent].items() if ts == last}
    written -= newest  # the parent's last record: what is left is still a prefix of the parent
    with pytest.raises(AssertionError, match=f"its parent {parent} lacks {len(newest)} rows"):
        assert_read_without_gaps(model, written, floor=START, latest=LATEST)


def test_without_gaps_catches_a_lagging_partition() -> None:
    model, written = _per_partition_prefix()
    with pytest.raises(AssertionError, match=r"before .* \(the lag bound\) missing"):
        assert_read_without_gaps(model, written, floor=CUT + 2_000_000, latest=LATEST)


def test_without_gaps_catches_a_row_written_twice() -> None:
    model, written = _per_partition_prefix()
    rows = sorted(written)
    with pytest.raises(AssertionError, match="1 rows written more than once"):
        assert_read_without_gaps(model, [*rows, rows[0]], floor=START, latest=LATEST)


def test_without_gaps_catches_an_extra_row() -> None:
    model, written = _per_partition_prefix()
    with pytest.raises(AssertionError, match="never produced"):
        assert_read_without_gaps(model, {*written, "1/x/0/0"}, floor=START, latest=LATEST)
