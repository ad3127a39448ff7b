"""Share rules: children go to the most underloaded task; balancing never worsens spread."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import share


def test_child_goes_to_most_underloaded_task() -> None:
    assert share.place_child("a", {"a": 3, "b": 1, "c": 2}, cap=0) == "b"


def test_child_stays_with_finder_when_it_is_least_loaded() -> None:
    assert share.place_child("a", {"a": 1, "b": 1, "c": 2}, cap=0) == "a"


def test_child_is_parked_when_every_task_is_at_cap() -> None:
    assert share.place_child("a", {"a": 2, "b": 2}, cap=2) is None


def test_balance_offers_surplus_to_underloaded() -> None:
    assert share.balance("a", {"a": 5, "b": 1}, cap=0) == [("b", 2)]


loads_st = st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 20), min_size=2)


@settings(max_examples=200, deadline=None)
@given(loads=loads_st, cap=st.integers(0, 25))
def test_balance_never_makes_spread_worse(loads: dict[str, int], cap: int) -> None:
    after = dict(loads)
    for donor, target, count in share.balance_moves(loads, cap):
        after[donor] -= count
        after[target] += count
    assert sum(after.values()) == sum(loads.values())
    assert max(after.values()) - min(after.values()) <= max(loads.values()) - min(loads.values())
