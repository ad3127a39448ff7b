"""Snapshot, then stream: a connector's snapshot partitions as work items
(docs/design.md#snapshot-then-stream). Every rule of the snapshot that the cores follow is
here; the CIM (``protocol/cim.py``), the planner, the task core, the completeness watermark and
the end of a bounded run call these functions.

1. **T.** A connector that first starts with a snapshot reads it at T, its stream start
   (``--start-at``, else when the leader's process started): the leader that plans the
   connector's first epoch asks its shell for the snapshot's partitions at T
   (``RequestPlan.snapshot``), and its epoch message records both the stream's start
   (``stream_start`` = T) and the snapshot (:class:`~protocol.messages.SnapshotPlan`): both or
   neither. A plan whose epoch never lands
   (fenced) records nothing, and the next plan fixes T again; once recorded, the first record
   wins (:meth:`SnapshotState.record`).
2. **The stream starts after T.** The snapshot holds every commit at or before T, so the change
   stream's roots start at ``T + 1`` (:func:`stream_after`): no change is in both, none in
   neither.
3. **Work items.** Each snapshot partition is a :class:`~protocol.messages.Partition` named
   ``snapshot:<table>/<index>`` (:func:`work_token`), starting at T, without parents
   (:func:`work_items`). The plan deals them out with the roots; from then on they are capped,
   shared, handed off, orphaned, adopted and resumed by exactly the rules of change-stream
   partitions. Its reader reads the partition at T in chunks: records at commit timestamp T,
   transaction id ``snapshot:<table>/<index>``, record sequence = the chunk's number; it ends
   without children. Its committed position (T and the chunks committed) is exact, so a new
   owner, or a re-read after a failure, drops the chunks already committed (the reader's rule 2,
   ``protocol/dedup.py``).
4. **Done.** The CIM records a snapshot partition *done* when it applies a state that shows it
   ``finished`` (:meth:`SnapshotState.fold`; a task reports that only after every chunk
   committed). Done is never undone. A finished snapshot partition leaves its owner's state only
   once its CIM records it done (:func:`removable`), so the fact is in the log before the entry
   goes (a change-stream partition's children carry that fact instead). A snapshot partition
   the CIM records done counts as finished everywhere (:meth:`SnapshotState.done`): the planner
   never deals it out again and an offer of it is dropped.
5. **Completeness.** While a snapshot partition is not done, the connector's completeness
   watermark stays at most ``T - 1`` (:meth:`SnapshotState.bound`), and a bounded run is not
   over (``protocol/bounds.py``).
6. **Checkpoints** carry the snapshot with only the partitions not done yet
   (:meth:`SnapshotState.checkpoint`): what a replay needs to read them, and the count of all.
"""

from __future__ import annotations

import msgspec

from protocol.messages import Partition, SnapshotItem, SnapshotPlan

__all__ = [
    "PREFIX",
    "SnapshotState",
    "is_snapshot",
    "removable",
    "stream_after",
    "work_items",
    "work_token",
]

PREFIX = "snapshot:"
"""Snapshot work items' tokens start with this; a change stream's partition tokens never do
(Spanner's are base64 text, without a colon)."""


def work_token(table: str, index: int) -> str:
    """The work item (and output transaction id) of partition ``index`` of ``table``'s
    snapshot."""
    return f"{PREFIX}{table}/{index}"


def is_snapshot(token: str) -> bool:
    return token.startswith(PREFIX)


def stream_after(read_ts: int) -> int:
    """Rule 2: where the change stream of a connector snapshotted at ``read_ts`` starts."""
    return read_ts + 1


def work_items(plan: SnapshotPlan | None) -> tuple[Partition, ...]:
    """Rule 3: the partitions the first plan deals out with the stream's roots."""
    if plan is None:
        return ()
    return tuple(Partition(token=item.token, start_ts=plan.read_ts) for item in plan.items)


class SnapshotState(msgspec.Struct):
    """The connector's snapshot as the log tells it: the plan (``None``: no snapshot) and the
    partitions not done yet, by token (rules 1, 4, 5 and 6)."""

    plan: SnapshotPlan | None = None
    pending: dict[str, SnapshotItem] = msgspec.field(default_factory=dict)

    def record(self, plan: SnapshotPlan) -> None:
        """Rule 1: the first snapshot recorded (by an epoch, or a checkpoint's rest) wins."""
        if self.plan is None:
            self.plan = plan
            self.pending = {item.token: item for item in plan.items}

    def fold(self, parts: tuple[Partition, ...]) -> None:
        """Rule 4: partitions of an applied state that are ``finished`` are done."""
        if self.pending:
            for part in parts:
                if part.status == "finished":
                    self.pending.pop(part.token, None)

    def checkpoint(self) -> SnapshotPlan | None:
        """Rule 6: the plan with only the partitions not done yet."""
        if self.plan is None:
            return None
        return msgspec.structs.replace(self.plan, items=tuple(self.pending.values()))

    @property
    def read_ts(self) -> int:
        """T, or -1 without a snapshot."""
        return -1 if self.plan is None else self.plan.read_ts

    def done(self, token: str) -> bool:
        """A snapshot partition read to its end (rule 4). A snapshot token the plan does not
        hold counts as done too: no rule may deal out what no snapshot describes."""
        return self.plan is not None and is_snapshot(token) and token not in self.pending

    def item(self, token: str) -> SnapshotItem | None:
        """What a reader of ``token`` needs (``None``: done, or unknown)."""
        return self.pending.get(token)

    def progress(self) -> tuple[int, int]:
        """(partitions done, partitions in all); (0, 0) without a snapshot."""
        if self.plan is None:
            return (0, 0)
        return (self.plan.total - len(self.pending), self.plan.total)

    def complete(self) -> bool:
        """Every snapshot partition is done (or there is no snapshot)."""
        return not self.pending

    def bound(self) -> int | None:
        """Rule 5: the highest completeness watermark the snapshot allows (``None``: no
        bound)."""
        if self.plan is None or not self.pending:
            return None
        return self.plan.read_ts - 1


def removable(part: Partition, state: SnapshotState) -> bool:
    """Rule 4: a finished snapshot partition leaves its owner's state only once the CIM records
    it done; any other partition is not held back here."""
    return not is_snapshot(part.token) or state.done(part.token)
