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

T is the minimum of those bounds over every partition of every task. Every task computes the
same T from the same log, so any of them may export it.
"""

from __future__ import annotations

from protocol.cim import Cim
from protocol.messages import Partition


def low_watermark(cim: Cim) -> int | None:
    """The completeness watermark of the connector whose consolidated state is ``cim``."""
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
    if bound is None:  # every partition finished, every child known: nothing is left to read
        return max(p.watermark for p in parts.values())
    return bound
