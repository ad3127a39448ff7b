"""The state machine of one partition move (docs/design.md#hand-off and #stable-pending-and-planned-assignments).

``stable`` is who reads the partition now, ``pending`` the task it is moving to, ``planned`` a
newer target that arrived while a move was pending; ``trigger`` is the revision (the sync-log
offset of the decision) that last changed the move, so a replayed decision is applied once.

* ``request(target, revision)``: ignored unless ``revision`` is newer than ``trigger``. With no
  pending move and a target other than ``stable``, the target becomes ``pending``. With a move
  pending to another target, the new target becomes ``planned``; asking again for the pending
  target drops the plan.
* ``ready()``: the pending target has warmed up (it is a member and has announced it can read
  at once) — the old owner may stop reading now, not before (no gap).
* ``complete(owner)``: the pending target owns the partition: it is ``stable``; what was
  ``planned`` is the new owner's business, so it is dropped here.
* ``abort()``: the pending target died or left before the old owner released the partition:
  ``planned`` (if any) becomes ``pending``, else the partition stays where it is.

Every transition returns a new frozen value; an event that does not apply raises
:class:`MoveError`, so a caller cannot silently take an illegal step.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Phase = Literal["stable", "pending", "ready"]


class MoveError(Exception):
    """An event that does not apply to the move in its current phase."""


class Move(msgspec.Struct, frozen=True):
    token: str
    stable: str
    pending: str | None = None
    planned: str | None = None
    ready_seen: bool = False
    trigger: int = -1

    @property
    def phase(self) -> Phase:
        if self.pending is None:
            return "stable"
        return "ready" if self.ready_seen else "pending"

    def request(self, target: str, revision: int) -> Move:
        if revision <= self.trigger:
            return self  # the same decision replayed: applied once
        if self.pending is None:
            if target == self.stable:
                return msgspec.structs.replace(self, trigger=revision)
            return msgspec.structs.replace(self, pending=target, trigger=revision)
        if target != self.pending:
            return msgspec.structs.replace(self, planned=target, trigger=revision)
        return msgspec.structs.replace(self, planned=None, trigger=revision)

    def ready(self) -> Move:
        if self.pending is None:
            raise MoveError(f"{self.token}: ready with no pending move")
        return msgspec.structs.replace(self, ready_seen=True)

    def complete(self, owner: str) -> Move:
        if self.pending is None or owner != self.pending:
            raise MoveError(f"{self.token}: {owner} completed a move pending to {self.pending}")
        return Move(self.token, stable=owner, trigger=self.trigger)

    def abort(self) -> Move:
        if self.pending is None:
            raise MoveError(f"{self.token}: abort with no pending move")
        return msgspec.structs.replace(self, pending=self.planned, planned=None, ready_seen=False)
