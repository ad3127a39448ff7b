"""Registrations from partition starts (``protocol/mutable.py``, rules 6 and 8) in one task of
a ``MUTABLE_KEY_RANGE`` stream: the tokens a partition start announces that nobody knows are
registered, dealt like children, as *claims* (``Partition.claim``), read only once the CIM
credits them; of several claims of one token the first to land wins (CIM rule 10). Functions
over one :class:`~protocol.task.TaskCore`'s state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from protocol import share
from protocol.events import PartitionsAnnounced
from protocol.messages import Partition, Share

if TYPE_CHECKING:
    from protocol.task import TaskCore

__all__ = ["on_announced", "settle"]


def on_announced(core: TaskCore, event: PartitionsAnnounced) -> None:
    """Rule 6 of ``protocol/mutable.py``: register the announced partitions nobody knows,
    dealt like children (kept here while this task's share section waits for its plan's
    epoch: the announcer's watermark must not reach the CIM without them). Only for an owned
    partition of a mutable stream; each one a claim with ``Rules.claim_announced``."""
    part = core.mine.get(event.token)
    if not core.config.mutable or part is None or part.status != "owned":
        core.counters["announced_ignored"] += 1
        return
    loads = core._loads()
    claim = core.config.rules.claim_announced
    for token in event.tokens:
        if core._known(token):
            continue
        new = Partition(token=token, start_ts=event.start_ts, claim=claim)
        target = share.place_child(core.me, loads, core.config.cap)
        if target != core.me and core._plan_out is not None:
            target = core.me
        if target == core.me:
            core.mine[token] = new
        else:
            core.shares[token] = Share(new, target=target, kind="new", since=core._now)
        if claim:
            core._claims.add(token)
        if target is not None:
            loads[target] = loads.get(target, 0) + 1
        core.counters["partitions_announced"] += 1
        core._urgent = True


def settle(core: TaskCore) -> None:
    """Rule 8 of ``protocol/mutable.py``: a claim the CIM credits to this task (in its
    state or its share section) is confirmed and read; one the CIM holds elsewhere was won
    by another registration, which landed first: it is given up. Neither was read, so
    nothing is read twice; a claim whose message has not landed (or was fenced) waits."""
    view = core.cim.view(core.me)
    for token in list(core._claims):
        part = core.mine.get(token)
        offer = core.shares.get(token)
        if (part is None or not part.claim) and (offer is None or not offer.partition.claim):
            core._claims.discard(token)  # it left this task's hands meanwhile
            continue
        credited = view.partitions.get(token)
        shared = view.share.get(token)
        if credited is not None or shared is not None:
            core._claims.discard(token)
            if part is not None and part.claim and credited is not None:
                core.mine[token] = msgspec.structs.replace(part, claim=False)
                core._sent_parts[token] = credited
            if offer is not None and offer.partition.claim and shared is not None:
                confirmed = msgspec.structs.replace(offer.partition, claim=False)
                core.shares[token] = msgspec.structs.replace(offer, partition=confirmed)
                core._sent_share[token] = shared
            core.counters["announced_claims_won"] += 1
            core._urgent = True
        elif core.cim.known_elsewhere(token, core.me):
            core._claims.discard(token)
            if part is not None and part.claim:
                del core.mine[token]
                core._sent_parts.pop(token, None)
            if offer is not None and offer.partition.claim:
                del core.shares[token]
                core._sent_share.pop(token, None)
            core.counters["announced_claims_lost"] += 1
