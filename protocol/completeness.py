"""The connector's completeness watermark (docs/design.md#completeness-watermark).

The *low watermark* T is the newest commit time such that every change record with a commit
timestamp at or before T is durably in the output. It follows from the CIM alone, because a
task publishes a partition's position only after the sink committed everything before it:

* An unfinished partition (owned, taken over, or only offered so far) whose published position
  is ``ts`` holds every record before ``ts`` in the output, and at ``ts`` perhaps only some: it
  bounds T by ``ts - 1``. One that was never read bounds T by its start minus one (it has no
  record before its start).
* A finished partition was read to its end and bounds nothing, as long as every child it handed
  over is known; a child not in the CIM yet (registered by a message still on its way) bounds T
  by the finished parent's final watermark.
* With no partition known at all there is no T yet (``None``): the connector has not started.
* A connector that started with a snapshot at read timestamp S has T at most ``S - 1`` until
  every snapshot partition is done (``protocol/snapshot.py``, rule 5): the rows as of S are the
  changes at or before S.

* A quarantined partition (docs/design.md#poison-partitions) is unfinished and parked at its
  watermark: it bounds T like any unfinished partition, and holds T there until it is released.
  The mark then says so (``Mark.held_by``, :func:`held_by`): the output is held back by a
  quarantined partition, not merely behind.

T is the minimum of those bounds over every partition of every task. Every task computes the
same T from the same log, so any of them may export it.

With an end (``--end-at``), once nothing is left to read (``protocol.bounds.nothing_left``: every
partition's query ended at the end or before, and every partition finished) T is the end
itself, although the finished partitions may already be gone from the CIM: a bounded run that
ends leaves a mark at its end.
"""

from __future__ import annotations

import msgspec

from protocol.bounds import nothing_left
from protocol.cim import Cim
from protocol.messages import Partition

MARK_INTERVAL_S = 1.0  # the mark is rewritten at most this often while a run goes on


class Mark(msgspec.Struct, frozen=True):
    """The completeness mark a file or Spark output keeps per connector
    (``protocol.commit.completeness_path``): one JSON line a downstream job reads."""

    connector: str
    low_watermark: str  # RFC 3339, microseconds
    low_watermark_us: int
    written_at: str
    # quarantined partitions holding the mark back (parked until an operator releases them)
    held_by: tuple[str, ...] = ()


def mark_due(low: int, written: int, written_at: float, now: float, *, final: bool) -> bool:
    """Whether to write the mark ``low`` now: only when it advanced past the one ``written``
    (at ``written_at``, seconds on the clock of ``now``); while the run goes on at most once
    every :data:`MARK_INTERVAL_S`; at the run's end (``final``) always, so a bounded run that
    ends leaves its last mark — at or past its end — and not one up to a second older."""
    if low < 0 or low <= written:
        return False
    return final or now - written_at >= MARK_INTERVAL_S


def low_watermark(cim: Cim, end: int | None = None) -> int | None:
    """The completeness watermark of the connector whose consolidated state is ``cim``;
    ``end``: the connector's end, if it has one (see the module docstring)."""
    if end is not None and nothing_left(cim):
        return end
    parts: dict[str, Partition] = {}
    for view in cim.tasks.values():
        candidates = list(view.partitions.values())
        candidates.extend(share.partition for share in view.share.values())
        for part in candidates:
            seen = parts.get(part.token)
            if (
                seen is None
                or (part.status == "finished" and seen.status != "finished")
                or (seen.status != "finished" and part.watermark > seen.watermark)
            ):
                parts[part.token] = part
    if not parts:
        return None
    bound: int | None = None
    for part in parts.values():
        if part.status == "finished":
            if all(child in parts for child in part.children):
                continue
            limit = part.watermark
        else:
            limit = part.resume_ts() - 1
        bound = limit if bound is None else min(bound, limit)
    snapshot = cim.snapshot.bound()
    if snapshot is not None:
        bound = snapshot if bound is None else min(bound, snapshot)
    if bound is None:  # every partition finished, every child known: nothing is left to read
        return max(p.watermark for p in parts.values())
    return bound


def held_by(cim: Cim) -> tuple[str, ...]:
    """The quarantined partitions of ``cim`` (owned or offered by any task), sorted: while one
    is, the completeness watermark stays below its watermark."""
    tokens: set[str] = set()
    for view in cim.tasks.values():
        tokens.update(t for t, p in view.partitions.items() if p.quarantine is not None)
        tokens.update(t for t, s in view.share.items() if s.partition.quarantine is not None)
    return tuple(sorted(tokens))
