"""Partition sharing decisions (docs/design.md#partition-sharing, #cap-and-fair-spread: cap and fair
spread). Pure functions over loads; ``protocol/task.py`` applies them to a task's own state.

* Load: unfinished partitions a task owns or is taking over, plus offers addressed to it that it
  has not picked up yet (``Cim.loads``), so an offer in flight already counts at its target.
* The most underloaded member is the one with the smallest load, ties broken by task id.
* A new child goes to the most underloaded member when that member is strictly less loaded than
  the task that found the child; otherwise the finder keeps it. Nobody is given more than the
  per-task cap (``cap <= 0``: no cap); when every member is full the child is parked (offered to
  nobody) and offered as soon as some member has room.
* Balancing: the total load split evenly gives each member a goal (the remainder to the most
  loaded, so loads within one of each other are balanced already). Every member above its goal
  offers exactly its surplus to members below theirs, matched in a fixed order every task
  computes alike from the same loads: donors act at once without piling onto one target, and a
  join moves about total/members partitions, not more (never past a target's cap).
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


def goals(loads: Mapping[str, int]) -> dict[str, int]:
    """The balanced load of each member: the total split evenly, the remainder going to the
    most loaded members (ties: task id), so loads already within one are their own goal."""
    if not loads:
        return {}
    base, extra = divmod(sum(loads.values()), len(loads))
    order = sorted(loads, key=lambda t: (-loads[t], t))
    return {t: base + (1 if i < extra else 0) for i, t in enumerate(order)}


def balance_moves(loads: Mapping[str, int], cap: int) -> list[tuple[str, str, int]]:
    """``(donor, target, count)``: every member above its goal gives exactly its surplus to
    members below theirs (never past a target's cap). Donors in order of load (ties: task id)
    fill targets in order of load (ties: task id); every task computes the same list from the
    same loads, so donors act at once without piling onto one target, and no partition moves
    between two members that are both at their goal."""
    goal = goals(loads)
    donors = [t for t in sorted(loads, key=lambda t: (-loads[t], t)) if loads[t] > goal[t]]
    surplus = {t: loads[t] - goal[t] for t in donors}
    need: dict[str, int] = {}
    for t in sorted(loads, key=lambda t: (loads[t], t)):
        room = goal[t] - loads[t]
        if cap > 0:
            room = min(room, cap - loads[t])
        if room > 0:
            need[t] = room
    targets = list(need)
    moves: list[tuple[str, str, int]] = []
    ti = 0
    for donor in donors:
        while surplus[donor] > 0 and ti < len(targets):
            target = targets[ti]
            count = min(surplus[donor], need[target])
            moves.append((donor, target, count))
            surplus[donor] -= count
            need[target] -= count
            if need[target] == 0:
                ti += 1
    return moves


def balance(me: str, loads: Mapping[str, int], cap: int) -> list[tuple[str, int]]:
    """``[(target, count)]``: what ``me`` should offer, from :func:`balance_moves`."""
    if me not in loads or len(loads) < 2:
        return []
    return [(t, n) for d, t, n in balance_moves(loads, cap) if d == me]
