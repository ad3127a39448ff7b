"""The partition lifecycle of a Spanner change stream (docs/design.md#partition-lifecycle-splits-and-merges).

* Roots come from the query with a NULL token, as one ``ChildPartitions`` record.
* Every partition ends with ``ChildPartitions`` record(s): a split names several children, a move
  one, a merge one child that every parent names, each time with all its parents.
* A child is registered exactly once: by the owner of its *responsible* parent, the smallest of
  its parent tokens. The other parents' owners only mark their partition finished.
* A partition may be read only when every parent has finished; a parent that is not known yet
  (not in any task's state) counts as unfinished.
* A finished partition stays in its owner's state (status ``finished``, with its children) for as
  long as something still refers to it: it is removed only when every child is known and has
  finished and none of its own parents is still kept. So the rule above can always be checked,
  and removal goes oldest first.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.messages import Partition
from protocol.records import ChildPartition

Lookup = Callable[[str], Partition | None]
"""Finds a partition by token in the best view a task has (its own state, then the CIM)."""


def responsible_parent(child: ChildPartition) -> str:
    """The parent whose owner registers ``child``."""
    return min(child.parent_tokens) if child.parent_tokens else ""


def registers(parent: str, child: ChildPartition) -> bool:
    return responsible_parent(child) == parent


def readable(part: Partition, lookup: Lookup) -> bool:
    """Every parent has finished (an unknown parent has not)."""
    for parent in part.parents:
        found = lookup(parent)
        if found is None or found.status != "finished":
            return False
    return True


def removable(part: Partition, lookup: Lookup) -> bool:
    """A finished partition nothing refers to any more."""
    if part.status != "finished":
        return False
    for child in part.children:
        found = lookup(child)
        if found is None or found.status != "finished":
            return False
    return all(lookup(parent) is None for parent in part.parents)


def child_partition(child: ChildPartition, start_ts: int) -> Partition:
    return Partition(token=child.token, start_ts=start_ts, parents=tuple(child.parent_tokens))
