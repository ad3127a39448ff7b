"""When a bounded connector (``--end-at``) has nothing left to read: a pure rule over the CIM.

With an end, every partition query ends at the end timestamp, so every partition finishes
(``runtime/bounded.py``): those that split or merge before the end hand over to children, which
finish in turn; the rest end at the end with no children. The connector is done when its CIM
says so:

1. the stream was started: the leader's epoch recorded ``stream_start`` (before that the roots
   are not even known), and
2. no task's state holds a partition that is not ``finished`` (owned, whether read, queued or
   waiting for a parent; or ``incoming``), and
3. no task's share section holds an offer (an offered partition, a child or one dealt out by
   the leader, is not in its new owner's state yet), and
4. no unfinished orphan waits for the leader's offer (``Cim`` rule 5c: a dropped task's claim
   the epoch's plan did not deal out), and
5. every partition of the connector's snapshot, if it has one, is done
   (``protocol/snapshot.py``, rule 5).

A child is registered in the same state message that finishes its parent (in the finder's own
state or as an offer in its share section), and the roots arrive in the epoch message that
records ``stream_start``; so no partition to read can hide between two messages. Every process
replays the same sync topic, so each decides alone, from its own CIM, that nothing is left:
several processes end a bounded run without talking to each other.
"""

from __future__ import annotations

from protocol.cim import Cim

__all__ = ["empty_first_window", "nothing_left"]


def nothing_left(cim: Cim) -> bool:
    """Whether the CIM shows a started stream with every partition finished (the rules above)."""
    if cim.stream_start < 0 or not cim.snapshot.complete():
        return False
    if any(p.status != "finished" for p in cim.orphans.values()):
        return False  # an orphan the leader is to offer (Cim rule 5c)
    for view in cim.tasks.values():
        if view.share:
            return False
        if any(p.status != "finished" for p in view.partitions.values()):
            return False
    return True


def empty_first_window(recorded_start: int, stream_start: int, end_at: int) -> bool:
    """Whether a connector's run would read nothing because its window is empty: it has no
    recorded start yet (``recorded_start < 0``: its first start), so it starts at
    ``stream_start`` (``start_at``, or now), and its end ``end_at`` (``>= 0``) lies before that.
    A connector that already started is not judged here: it resumes from its watermarks, and
    an end before now is how a bounded run that was stopped is finished."""
    return recorded_start < 0 and 0 <= end_at < stream_start
