"""Lifecycle: a merged child is registered once (min parent), read only after all parents."""

from __future__ import annotations

from protocol import lifecycle
from protocol.messages import Partition
from protocol.records import ChildPartition
from tests.helpers import part


def _lookup(*parts: Partition) -> lifecycle.Lookup:
    known = {p.token: p for p in parts}
    return known.get


def test_merged_child_registered_by_exactly_one_parent() -> None:
    child = ChildPartition(token="c", parent_tokens=("p2", "p1", "p3"))
    assert [p for p in ("p1", "p2", "p3") if lifecycle.registers(p, child)] == ["p1"]


def test_merged_child_readable_only_after_all_parents_finished() -> None:
    child = part("c", parents=("p1", "p2"))
    p1 = part("p1", status="finished")
    assert not lifecycle.readable(child, _lookup(p1))  # p2 unknown: unfinished
    assert not lifecycle.readable(child, _lookup(p1, part("p2")))
    assert lifecycle.readable(child, _lookup(p1, part("p2", status="finished")))


def test_finished_parent_removable_only_when_children_finished() -> None:
    parent = part("p", status="finished", children=("c",))
    assert not lifecycle.removable(parent, _lookup(part("c")))
    assert lifecycle.removable(parent, _lookup(part("c", status="finished")))
    assert not lifecycle.removable(part("q"), _lookup())
