"""Epoch numbering: which epoch a group generation gets, and which epochs a member accepts.

Pure functions (no I/O, no clock); the member core (:mod:`protocol.membership`) combines them for
the Kafka membership adapter and the fault simulator alike. See ``docs/design.md``, "Epochs".

An *epoch* numbers a generation of the heartbeat-topic group in the sync topic, where it fences
older messages (:mod:`protocol.cim`). Epochs must never go back, but Kafka's generations do: they
start over when the group is gone (the embedded broker restarted, or a real Kafka deleted the
empty group's metadata) while the sync topic keeps the old epochs. So the epoch is decided here,
not taken from Kafka:

1. **What a member knows.** A member knows the newest epoch it was assigned and the newest epoch
   it read in the sync topic (its CIM's epoch); it knows the larger (:func:`newest`). Nothing
   known is :data:`NO_EPOCH` (-1). Each member tells the group leader what it knows when it
   joins.
2. **Numbering.** The group leader gives generation ``g`` the epoch ``max(g, n + 1)``, ``n``
   being the newest epoch the leader or any member knows (:func:`number`). While Kafka keeps its
   generations, the epoch *is* the generation; after the group started over, epochs go on from
   the newest known one.
3. **An assignment without an epoch.** A leader that predates epochs sends :data:`NO_EPOCH` (any
   negative number counts as none); its assignment stands for the generation itself
   (:func:`receive`).
4. **Acceptance.** A member accepts an assigned epoch only if it is newer than every epoch it
   knows (:func:`receive` returns :class:`Accepted`). Otherwise (:class:`Stale`: the leader had
   not read as far, e.g. a race at the first join, or the group started over and nobody told
   the leader) it refuses it: it counts the refusal, treats its membership as lost and rejoins,
   and so tells the next leader the epoch it knows. Rule 2 then gives a newer epoch.
5. **The assignment's own epoch, landed first.** A follower's assignment can reach it after the
   leader has planned and the epoch is already in the follower's CIM: the leader plans once the
   answers are in *or its answer timeout ran out*, and a coordinator may answer one member's
   join or sync seconds after the leader's (the embedded broker holds followers' JoinGroups;
   Kafka answers a SyncGroup late to a member on a slow connection). That epoch is not newer
   than what the member knows, yet it is this very generation's: the same number, opened by
   the assignment's leader for the assignment's members, and never assigned to this member
   before (:func:`landed_first`). Refusing it would be wrong twice over: the member would
   rejoin, start another generation, whose leader would plan before the same late answer, and
   the group would rebalance for ever. So the member accepts it (``receive(..., own=True)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

__all__ = [
    "NO_EPOCH",
    "Accepted",
    "Logged",
    "Stale",
    "fresh_tasks",
    "landed_first",
    "newest",
    "number",
    "receive",
]

NO_EPOCH: Final = -1


class Accepted(msgspec.Struct, frozen=True):
    """The member takes the assignment; this is the generation's epoch."""

    epoch: int


class Stale(msgspec.Struct, frozen=True):
    """The member refuses the assignment: ``epoch`` is not newer than the ``known`` one."""

    epoch: int
    known: int

    @property
    def reason(self) -> str:
        return f"assigned a stale epoch {self.epoch} (epoch {self.known} is known here)"


class Logged(msgspec.Struct, frozen=True):
    """The newest epoch a member's CIM holds from the sync topic: its number, the leader that
    opened it and its member list."""

    epoch: int = NO_EPOCH
    leader: str = ""
    members: tuple[str, ...] = ()


def newest(*epochs: int) -> int:
    """The newest of the epochs a member knows (rule 1); :data:`NO_EPOCH` if none."""
    return max(epochs, default=NO_EPOCH)


def number(generation: int, known: Iterable[int]) -> int:
    """The epoch the group leader gives ``generation``, given the epochs the leader and the
    members know (rule 2): ``max(generation, newest known + 1)``."""
    return max(generation, newest(*known) + 1)


def receive(assigned: int, generation: int, known: int, *, own: bool = False) -> Accepted | Stale:
    """What a member makes of an assignment carrying epoch ``assigned`` (:data:`NO_EPOCH` from
    a leader that predates epochs: rule 3) in ``generation``, when it knows epoch ``known``
    (rule 4); ``own``: the epoch it knows is this assignment's own, landed first (rule 5,
    :func:`landed_first`)."""
    epoch = assigned if assigned >= 0 else generation
    if epoch < known or (epoch == known and not own):
        return Stale(epoch=epoch, known=known)
    return Accepted(epoch=epoch)


def landed_first(
    assigned: int, leader: str, members: Sequence[str], seen: int, logged: Logged
) -> bool:
    """Whether the newest epoch in the member's CIM (``logged``) is the one this assignment
    announces, written by its leader before the assignment reached the member (rule 5): the
    same number, leader and members, and newer than every epoch the member was assigned
    (``seen``). An assignment without an epoch (rule 3) never is."""
    return (
        0 <= assigned == logged.epoch
        and assigned > seen
        and logged.leader == leader
        and logged.members == tuple(members)
    )


def rebalancing(group_in_progress: bool, member: bool, epoch: int, generation: int) -> bool:
    """Whether a task is inside a rebalance: its group says one is in progress (a JoinGroup in
    flight, or the coordinator answered "rebalancing"), or it is a member of a generation whose
    epoch is not in its CIM yet (sharing waits for that epoch)."""
    return group_in_progress or (member and epoch < generation)


def fresh_tasks(members: Iterable[tuple[str, bool]]) -> tuple[str, ...]:
    """The task ids of a generation that are *fresh*, from each group member's (task id, fresh)
    as it said in its join (fresh: its process has read nothing, never assigned a generation
    or never permitted to read in those it was): those all of whose members are fresh. A task id that also has an older member (an
    earlier life whose member is still in the group) is not: that life may still read. The
    leader may reset a fresh task that has not answered (``protocol/planner.py``)."""
    said = list(members)
    stale = {task for task, fresh in said if not fresh}
    return tuple(sorted({task for task, _ in said} - stale))
