"""Deliberately broken rules, for the fault simulator's teeth tests only: each breaks one rule
of the real cores (``protocol/planner.py``, ``protocol/lifecycle.py``) so a test can show that the
simulator's invariants catch it. Nothing but the simulator may import this module (an import
contract in pyproject.toml says so)."""

from __future__ import annotations

from random import Random

import msgspec

from protocol.cim import Cim
from protocol.lifecycle import Lookup
from protocol.messages import Partition, Share, SnapshotPlan
from protocol.planner import Plan, plan


def first_parent_readable(part: Partition, lookup: Lookup) -> bool:
    """A deliberately broken rule for the simulator's teeth tests: reads a merged child as soon
    as any one parent has finished."""
    if not part.parents:
        return True
    return any((p := lookup(t)) is not None and p.status == "finished" for t in part.parents)


def plan_moving_survivors(
    cim: Cim,
    members: tuple[str, ...],
    leader: str,
    generation: int,
    now: int,
    cap: int,
    rng: Random,
    roots: tuple[Partition, ...] = (),
    stream_start: int = -1,
    reset: tuple[str, ...] = (),
    snapshot: SnapshotPlan | None = None,
) -> Plan:
    """A deliberately broken planner for the simulator's teeth tests: it re-deals *every*
    unfinished partition round-robin, moving survivors' partitions without a hand-off."""
    good = plan(
        cim,
        members,
        leader,
        generation,
        now,
        cap,
        rng,
        roots,
        stream_start,
        reset,
        snapshot=snapshot,
    )
    everything: dict[str, Partition] = {s.token: s.partition for s in good.offers}
    for view in cim.tasks.values():
        for part in view.partitions.values():
            if part.status == "owned":
                everything[part.token] = part
    order = sorted(members)
    offers = tuple(
        Share(everything[t], target=order[(i + 1) % len(order)], kind="new", since=now)
        for i, t in enumerate(sorted(everything))
    )
    return msgspec.structs.replace(good, offers=offers)
