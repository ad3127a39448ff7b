"""Balancing offers (docs/design.md#partition-sharing): every ``negotiate_interval``, while
sharing is enabled, a task gives its parked offers a target with room and offers moves of its
own partitions to underloaded members (``protocol/share.py``'s ``balance``), one round of moves
at a time. Functions over one :class:`~protocol.task.TaskCore`'s state; following the offers
once made is ``protocol/offers.py``'s.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import msgspec

from protocol import share
from protocol.handoff import Move
from protocol.messages import Share

if TYPE_CHECKING:
    from protocol.task import TaskCore

__all__ = ["due", "movable", "negotiate", "negotiation"]


def due(core: TaskCore, now: int) -> int | None:
    """When the next round is due, only if it would offer something (:func:`negotiation`)."""
    at = max(core._last_negotiate + core.config.negotiate_interval, now)
    if core.sharing_enabled(at) and any(negotiation(core)):
        return at
    return None


def negotiate(core: TaskCore, now: int) -> None:
    """A round, at most every ``negotiate_interval`` while sharing is enabled: carry out what
    :func:`negotiation` finds (a move's offer carries the partition as it is now)."""
    if not core.sharing_enabled(now):
        return
    if now - core._last_negotiate < core.config.negotiate_interval:
        return
    core._last_negotiate = now
    targeted, moves = negotiation(core)
    for token, offer in targeted:
        core.shares[token] = offer
        core._urgent = True
    for token, move in moves:
        assert move.pending is not None
        core.moves[token] = move
        core.shares[token] = Share(
            core.mine[token], target=move.pending, kind="move", since=core._now
        )
        core.counters["moves_offered"] += 1
        core._urgent = True


def negotiation(core: TaskCore) -> tuple[list[tuple[str, Share]], list[tuple[str, Move]]]:
    """What a negotiation round would change, without changing anything (so
    ``TaskCore.next_deadline`` can ask whether a round is worth a tick): parked offers given a
    target with room, and moves offered to underloaded members (one round of moves at a time:
    none while a move of this task is offered). Members on probation are left out of the
    loads (``TaskCore._placing_loads``)."""
    loads = core._placing_loads()
    targeted: list[tuple[str, Share]] = []
    for token, offer in core.shares.items():
        if offer.target is None:
            target = share.room_for_parked(loads, core.config.cap)
            if target is not None:
                targeted.append((token, msgspec.structs.replace(offer, target=target)))
                loads[target] += 1
    moves: list[tuple[str, Move]] = []
    if any(o.target is not None and o.kind == "move" for o in core.shares.values()) or any(
        o.kind == "move" for _, o in targeted
    ):
        return targeted, moves  # one round of moves at a time
    revision = core.cim.offset
    candidates = iter(movable(core))
    for target, count in share.balance(core.me, loads, core.config.cap):
        for token in itertools.islice(candidates, count):
            move = core.moves.get(token) or Move(token, stable=core.me)
            move = move.request(target, revision)
            if move.pending is not None:
                moves.append((token, move))
    return targeted, moves


def movable(core: TaskCore) -> list[str]:
    """Own partitions to offer, cheapest to move first: not being read, then being read. Not a
    parked (quarantined) one: moving it gains nothing; not a claim the CIM has not credited
    yet (protocol/mutable.py, rule 8); not one offered or being released already."""
    owned = [
        p
        for t, p in core.mine.items()
        if p.status == "owned"
        and p.quarantine is None  # parked: moving it gains nothing
        and not p.claim  # not the CIM's yet (protocol/mutable.py, rule 8)
        and t not in core.shares
        and t not in core.releasing
    ]
    owned.sort(key=lambda p: (p.token in core.reading, -p.start_ts, p.token))
    return [p.token for p in owned]
