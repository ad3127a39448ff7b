"""Following the share sections (docs/design.md#partition-sharing): what a task does, after every
event, with the offers addressed to it, with the take-overs it has under way, and with its own
offers. Functions over one :class:`~protocol.task.TaskCore`'s state, called by it in this order
(:func:`follow`, then :func:`take_orphans`); each rule is one function with its rule as its
docstring. Sharing waits for the generation's epoch (``TaskCore.sharing_enabled``).

An offer *hands a partition out* (:func:`hands_out`) when whoever takes it owns the partition at
once: a ``new`` offer, or a ``move`` whose offerer released it with its final watermark. An
unreleased ``move`` is answered with ``incoming`` and completed once it is released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from protocol import share
from protocol.messages import Partition, Share

if TYPE_CHECKING:
    from protocol.task import TaskCore

__all__ = [
    "abort_move",
    "drop_offer",
    "finished",
    "follow",
    "hands_out",
    "release",
    "retarget",
    "start_release",
    "take_orphans",
]

Rank = tuple[int, str]  # an offer's (since, holder): the newest is the greatest


def hands_out(offer: Share) -> bool:
    """Whoever takes the offer owns the partition at once: a ``new`` offer or a released move."""
    return offer.kind == "new" or offer.released


def follow(core: TaskCore, now: int) -> None:
    """One pass over the offers: those addressed to this task (:func:`answer`), the take-overs
    whose offerer gave up (:func:`drop_abandoned_takeovers`), and this task's own offers
    (:func:`follow_own`)."""
    enabled = core.sharing_enabled(now)
    live = set(core.cim.members)
    offers = list(core.cim.offers())
    newest = newest_offers(core, offers, live)
    for holder, offer in offers:
        if offer.target == core.me:
            answer(core, holder, offer, live, newest, enabled)
    if core.consumed:
        # an offer picked up is remembered while it stands (it is not picked up twice)
        core.consumed &= {(h, o.token, o.since) for h, o in core.cim.offers()}
    drop_abandoned_takeovers(core, live)
    for token, offer in list(core.shares.items()):
        follow_own(core, token, offer, live, enabled)


# -- offers addressed to this task ------------------------------------------------------------
def newest_offers(
    core: TaskCore, offers: list[tuple[str, Share]], live: set[str]
) -> dict[str, Rank]:
    """Of several offers of one partition by members that hand it out (:func:`hands_out`),
    only the newest (by ``since``, then holder) may be picked up: an older one is a plan a later
    one re-made (an offer or a released move to a task an epoch dropped, re-planned by the
    leader, and the target back under the same id before its holder withdrew it). Every task
    orders them alike, so at most one target picks the partition up, whatever the offerers'
    clocks say. An offer to a task that is moving the partition away itself is not ranked: that
    task never takes it (it hands the partition over instead), so the released move stands.
    Returns the newest rank per token (empty when no offer is addressed to this task, or
    ``Rules.newest_offer_only`` is off)."""
    newest: dict[str, Rank] = {}
    if not core.config.rules.newest_offer_only or not any(o.target == core.me for _, o in offers):
        return newest
    for holder, offer in offers:
        if not hands_out(offer) or holder not in live:
            continue
        if offer.target is not None:
            theirs = core.cim.view(offer.target).share.get(offer.token)
            if theirs is not None and theirs.kind == "move":
                continue
        rank = (offer.since, holder)
        newest[offer.token] = max(newest.get(offer.token, rank), rank)
    return newest


def answer(
    core: TaskCore,
    holder: str,
    offer: Share,
    live: set[str],
    newest: dict[str, Rank],
    enabled: bool,
) -> None:
    """An offer addressed to this task: a released move of a partition it takes over completes
    the hand-off (:func:`complete_handoff`); otherwise, while sharing is enabled, from a member,
    once per offer, and unless a rule refuses it (:func:`ignored`, :func:`refusal`), it is
    picked up (:func:`pick_up`)."""
    token = offer.token
    have = core.mine.get(token)
    if have is not None:
        complete_handoff(core, holder, offer, have, enabled)
        return
    key = (holder, token, offer.since)
    if not enabled or holder not in live or key in core.consumed:
        return
    if ignored(core, token):
        return
    refused = refusal(core, holder, offer, live, newest)
    if refused is not None:
        core.counters[refused] += 1
        return
    pick_up(core, holder, offer, key)


def complete_handoff(
    core: TaskCore, holder: str, offer: Share, have: Partition, enabled: bool
) -> None:
    """A take-over (``incoming``) becomes ownership, from the offer's watermark, on the release of
    the move it answered: from the offerer it named, not a stale released offer another holder
    still shows for the partition. Completing a hand-off is a pick-up too: not during a
    rebalance, before its epoch is in the CIM (the offerer may be dropped by it, and the leader
    may have dealt its partition out; a survivor's lease holds through the rebalance, so it
    would read beside the partition's new owner)."""
    released = offer.kind == "move" and offer.released and have.source == holder
    if have.status == "incoming" and released and enabled:
        core.mine[offer.token] = msgspec.structs.replace(offer.partition, status="owned", source="")
        core.counters["handoffs_in"] += 1
        core._urgent = True


def ignored(core: TaskCore, token: str) -> bool:
    """An offer of a partition this task finished, or is handing away itself right now, or
    that the CIM shows finished (a snapshot partition it records done is finished) is not
    picked up."""
    outgoing = core.shares.get(token)
    if token in core.retired or (outgoing is not None and outgoing.kind == "move"):
        return True
    found = core.cim.find(token)
    return (found is not None and found.status == "finished") or core.cim.snapshot.done(token)


def refusal(
    core: TaskCore, holder: str, offer: Share, live: set[str], newest: dict[str, Rank]
) -> str | None:
    """Why an offer is refused (the counter to raise), or ``None``: it is superseded by a newer
    one (:func:`newest_offers`), or re-planned by the leader (:func:`replanned`), or the
    partition is claimed by another member (:func:`owned_elsewhere`)."""
    token = offer.token
    if hands_out(offer) and newest.get(token, (offer.since, holder)) != (offer.since, holder):
        return "offer_superseded"
    if replanned(core, holder, offer):
        return "offer_superseded"
    if (
        hands_out(offer)
        and core.config.rules.refuse_owned_offers
        and owned_elsewhere(core, token, live)
    ):
        return "offer_already_owned"
    return None


def replanned(core: TaskCore, holder: str, offer: Share) -> bool:
    """A ``new`` offer of a partition the leader offers too was re-planned by the leader (the
    offerer's target had died; the offerer, frozen, never withdrew its offer, and the target
    came back under the same id): the leader's offer stands, this one does not."""
    leader = core.cim.leader
    return offer.kind == "new" and holder != leader and offer.token in core.cim.view(leader).share


def owned_elsewhere(core: TaskCore, token: str, live: set[str]) -> bool:
    """A member of this epoch owns the partition, or is taking it over from another member
    (:func:`claimed`): an offer that hands it out came from a plan made before that claim was
    known (or one that never became the epoch), and is refused (``Rules.refuse_owned_offers``).
    A released move this task has no take-over of is a pick-up like a ``new`` offer: its target
    may have died and come back under the same id after the leader dealt the partition out."""
    return any(
        t != core.me and t in live and claimed(core, t, p, live) for t, p in core.cim.holders(token)
    )


def claimed(core: TaskCore, task: str, part: Partition, live: set[str]) -> bool:
    """``task`` owns ``part``, or takes it over in a hand-off from a member that offers it
    to ``task`` (a correct plan never deals out a partition between two members)."""
    if part.status == "owned":
        return True
    if part.status != "incoming" or part.source not in live:
        return False
    offer = core.cim.view(part.source).share.get(part.token)
    return offer is not None and offer.kind == "move" and offer.target == task


def pick_up(core: TaskCore, holder: str, offer: Share, key: tuple[str, str, int]) -> None:
    """An offer that hands the partition out is taken into this task's state as owned (an offer
    of its own for the partition, superseded by the one picked up, is withdrawn); an unreleased
    move is answered with ``incoming`` from its offerer (the target is ready)."""
    token = offer.token
    core.consumed.add(key)
    if hands_out(offer):
        core.mine[token] = msgspec.structs.replace(offer.partition, status="owned", source="")
        core.counters["picked_up"] += 1
        if token in core.shares:
            del core.shares[token]
    else:
        core.mine[token] = msgspec.structs.replace(
            offer.partition, status="incoming", source=holder
        )
        core.counters["incoming"] += 1
    core._urgent = True


def drop_abandoned_takeovers(core: TaskCore, live: set[str]) -> None:
    """A take-over (``incoming``) whose offerer left, or no longer offers the move to this
    task, is dropped."""
    for token, part in list(core.mine.items()):
        if part.status != "incoming":
            continue
        source_offer = core.cim.view(part.source).share.get(token)
        if part.source not in live or source_offer is None or source_offer.target != core.me:
            del core.mine[token]
            core.counters["incoming_dropped"] += 1
            core._urgent = True


# -- this task's own offers ---------------------------------------------------------------------
def follow_own(core: TaskCore, token: str, offer: Share, live: set[str], enabled: bool) -> None:
    """One of this task's offers: dropped once taken (:func:`taken`); an unreleased move is
    aborted when its target left, and released once the target answered ``incoming``
    (:func:`start_release`); an offer to a task that left is dropped when the leader re-planned
    it, else re-targeted (:func:`retarget`), once the CIM holds an epoch and sharing is
    enabled."""
    target = offer.target
    if target is None:
        return
    # what this task holds is what it has now, not its claim in the CIM: that may be one it
    # gave up in a message still on its way (a released move re-targeted when the epoch
    # dropping its target landed first), and counting it dropped the offer and lost the
    # partition
    got = core.mine.get(token) if target == core.me else core.cim.view(target).partitions.get(token)
    if taken(core, token, offer, got, enabled):
        if token in core.moves:
            core.counters["handoffs_out"] += 1
        drop_offer(core, token)
        return
    if offer.kind == "move" and not offer.released:
        if target not in live:
            abort_move(core, token)
        elif got is not None and got.source == core.me:
            start_release(core, token)
        return
    if target not in live and core.cim.epoch >= 0 and enabled:
        leader_offer = core.cim.view(core.cim.leader).share.get(token)
        if core.cim.leader != core.me and leader_offer is not None:
            drop_offer(core, token)  # the leader re-planned it
        else:
            retarget(core, token)
        core._urgent = True


def taken(core: TaskCore, token: str, offer: Share, got: Partition | None, enabled: bool) -> bool:
    """An offer is taken once its target holds the partition (not as ``incoming``). One that
    hands the partition out is also taken, once the CIM holds this generation's epoch (before,
    it may still show claims, or a zombie's word that it finished the partition, that the
    epoch removes, and a plan of their partitions must not be lost), when the partition is
    read to its end (:func:`finished`: nobody picks it up, so the offer would stand for ever
    and count in its target's load), or when a member other than this task has it (a task
    the group dropped does not count: its partitions are what the leader offers; a released
    move too: the leader may have dealt it out while its target was not a member, and the
    target, back under the same id, never picks it up)."""
    if got is not None and got.status != "incoming":
        return True
    if not (hands_out(offer) and enabled):
        return False
    if finished(core, token):
        core.counters["offers_of_finished_dropped"] += 1
        return True
    return any(
        t != core.me and t in core.members and p.status != "incoming"
        for t, p in core.cim.holders(token)
    )


def finished(core: TaskCore, token: str) -> bool:
    """``token`` is read to its end: this task finished it, some state in the CIM says so, or
    the CIM records the snapshot partition done."""
    if token in core.retired or core.cim.snapshot.done(token):
        return True
    mine = core.mine.get(token)
    if mine is not None and mine.status == "finished":
        return True
    return any(p.status == "finished" for _, p in core.cim.holders(token))


# -- the hand-off (protocol/handoff.py) -----------------------------------------------------------
def drop_offer(core: TaskCore, token: str) -> None:
    """Withdraw this task's offer of ``token`` (and the move behind it)."""
    core.shares.pop(token, None)
    core.moves.pop(token, None)
    core._urgent = True


def abort_move(core: TaskCore, token: str) -> None:
    """The target of an unreleased move left: withdraw the offer; a move with a pending
    target left after aborting (``Move.abort``) is offered to it instead."""
    move = core.moves.get(token)
    core.counters["moves_aborted"] += 1
    del core.shares[token]
    if move is None:
        return
    move = move.abort()
    if move.pending is None or token not in core.mine:
        del core.moves[token]
    else:
        core.moves[token] = move
        core.shares[token] = Share(
            core.mine[token], target=move.pending, kind="move", since=core._now
        )
    core._urgent = True


def start_release(core: TaskCore, token: str) -> None:
    """The target answered ``incoming``: stop reading ``token`` and then release it
    (:func:`release`); a partition not being read is released at once."""
    if token in core.releasing or token not in core.mine:
        return
    move = core.moves.get(token)
    if move is not None and move.pending is not None and not move.ready_seen:
        core.moves[token] = move.ready()
    core.releasing.add(token)
    if token not in core.reading:
        release(core, token)  # not being read: nothing to stop (002: stateless moves at once)


def release(core: TaskCore, token: str) -> None:
    """The old owner stopped reading: hand over with the final committed watermark (the
    partition leaves this task's state for the released offer; an aborted move keeps it)."""
    core.releasing.discard(token)
    part = core.mine.pop(token)
    offer = core.shares.get(token)
    if offer is None:  # the move was aborted meanwhile: keep it
        core.mine[token] = part
        return
    core.shares[token] = msgspec.structs.replace(offer, partition=part, released=True)
    core._urgent = True


def retarget(core: TaskCore, token: str, members: tuple[str, ...] | None = None) -> None:
    """Re-offer ``token`` as ``new`` to the member with the most room (of ``members``, when
    given), or parked (no target) when every one is at the cap."""
    loads = core._loads()
    if members is not None:
        loads = {m: loads.get(m, 0) for m in members}
    target = share.room_for_parked(loads, core.config.cap)
    offer = core.shares[token]
    core.shares[token] = Share(offer.partition, target=target, kind="new", since=core._now)
    core.counters["offers_retargeted"] += 1


# -- orphans (Cim rule 5c) ----------------------------------------------------------------------
def take_orphans(core: TaskCore, now: int) -> None:
    """Cim rule 5c: the leader takes what an epoch dropped that no state holds (claims that
    landed after the CIM it planned from): a finished orphan into its own state (children
    refer to it), an unfinished one offered like a child, to the most underloaded member
    within the cap, from its newest watermark. Once the epoch is in the CIM, and not while
    a plan's epoch is on its way (its offers may deal them out)."""
    if (
        not core.cim.orphans
        or core.leader != core.me
        or core.cim.leader != core.me
        or core._plan_out is not None
        or not core.sharing_enabled(now)
    ):
        return
    loads: dict[str, int] | None = None
    for token, part in sorted(core.cim.orphans.items()):
        if token in core.mine or token in core.shares or token in core.retired:
            continue
        core.counters["orphans_taken"] += 1
        core._urgent = True
        if part.status == "finished":
            core.mine[token] = part
            continue
        if loads is None:
            loads = core._placing_loads()
        target = share.place_child(core.me, loads, core.config.cap)
        if target == core.me:
            core.mine[token] = part
        else:
            core.shares[token] = Share(part, target=target, kind="new", since=now)
        if target is not None:
            loads[target] = loads.get(target, 0) + 1
