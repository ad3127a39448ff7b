"""Partition sharing decisions (design 000 "Partition sharing protocol", design 001 cap and fair
spread). Pure functions over loads; ``protocol/task.py`` applies them to a task's own state.

* Load: unfinished partitions a task owns or is taking over, plus offers addressed to it that it
  has not picked up yet (``Cim.loads``), so an offer in flight already counts at its target.
* The most underloaded member is the one with the smallest load, ties broken by task id.
* A new child goes to the most underloaded member when that member is strictly less loaded than
  the task that found the child; otherwise the finder keeps it. Nobody is given more than the
  per-task cap (``cap <= 0``: no cap); when every member is full the child is parked (offered to
  nobody) and offered as soon as some member has room.
* Balancing: only the most loaded member offers (ties: smallest task id), and only when its load
  exceeds the least loaded member's by two or more; it offers half the difference, never more than
  the target's free capacity. One task at a time offering keeps concurrent offers from piling up
  on one target; repeating this converges to loads within one of each other.
"""

from __future__ import annotations

from collections.abc import Mapping


def most_underloaded(loads: Mapping[str, int], exclude: str = "") -> str | None:
    candidates = [(load, task) for task, load in loads.items() if task != exclude]
    return min(candidates)[1] if candidates else None


def has_room(load: int, cap: int) -> bool:
    return cap <= 0 or load < cap


def place_child(me: str, loads: Mapping[str, int], cap: int) -> str | None:
    """Who should own a new child partition found by ``me``; ``None``: park it."""
    mine = loads.get(me, 0)
    other = most_underloaded({t: n for t, n in loads.items() if has_room(n, cap)}, exclude=me)
    if other is not None and loads[other] < mine:
        return other
    if me in loads and has_room(mine, cap):
        return me
    return other


def room_for_parked(loads: Mapping[str, int], cap: int) -> str | None:
    """Target for a parked partition: the most underloaded member with room."""
    return most_underloaded({t: n for t, n in loads.items() if has_room(n, cap)})


def balance(me: str, loads: Mapping[str, int], cap: int) -> tuple[str, int] | None:
    """``(target, count)`` when ``me`` should offer ``count`` partitions to ``target``."""
    if me not in loads or len(loads) < 2:
        return None
    top = min(loads.items(), key=lambda kv: (-kv[1], kv[0]))[0]
    if top != me:
        return None
    target = most_underloaded(loads, exclude=me)
    assert target is not None
    gap = loads[me] - loads[target]
    if gap < 2:
        return None
    count = gap // 2
    if cap > 0:
        count = min(count, cap - loads[target])
    return (target, count) if count > 0 else None
