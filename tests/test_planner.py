"""Planner: ownerless roots offered to the least loaded member, never twice, cap respected."""

from __future__ import annotations

from random import Random

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.cim import Cim
from protocol.messages import Partition, Share
from protocol.planner import plan


def test_roots_are_dealt_to_least_loaded_and_parked_past_cap() -> None:
    roots = tuple(Partition(f"r{i}", start_ts=0) for i in range(3))
    result = plan(Cim(), ("a", "b"), "a", 1, now=7, cap=1, rng=Random(0), roots=roots)
    assert result.offers == (
        Share(partition=roots[0], target="a", kind="new", since=7),
        Share(partition=roots[1], target="b", kind="new", since=7),
        Share(partition=roots[2], target=None, kind="new", since=7),
    )


@settings(max_examples=100, deadline=None)
@given(
    n_roots=st.integers(0, 12),
    members=st.lists(st.sampled_from("abcde"), min_size=1, unique=True),
    cap=st.integers(0, 4),
)
def test_planner_never_assigns_twice_and_respects_cap(
    n_roots: int, members: list[str], cap: int
) -> None:
    roots = tuple(Partition(f"r{i}", start_ts=0) for i in range(n_roots))
    result = plan(Cim(), tuple(members), members[0], 1, 0, cap, Random(0), roots=roots)
    tokens = [s.token for s in result.offers]
    assert sorted(tokens) == sorted(r.token for r in roots)
    for m in members:
        assigned = sum(1 for s in result.offers if s.target == m)
        assert cap <= 0 or assigned <= cap
