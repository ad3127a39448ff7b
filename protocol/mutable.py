"""The partition lifecycle of a ``MUTABLE_KEY_RANGE`` change stream, as a pure core.

A change stream created with ``partition_mode = 'MUTABLE_KEY_RANGE'`` answers its
``READ_<stream>`` function with one ``ChangeRecord`` column holding a serialized
``google.spanner.v1.ChangeStreamRecord`` (``runtime/spanner/mutable_decode.py`` turns it into the
records below): data-change and heartbeat records as in the other mode, and instead of
child-partition records three lifecycle records:

* **partition start** (:class:`PartitionStart`): partitions to schedule, each read from
  ``start_ts``. The root query (no token) answers with one; a partition may announce more.
* **partition end** (:class:`PartitionEnd`): the last record of a partition; every change it
  carries has a timestamp ``<= end_ts``.
* **partition event** (:class:`PartitionEvent`): key ranges moving between live partitions at
  ``commit_ts``. A *move-in* (the destination's record, naming its sources) means the
  destination must not go past the event until every source has processed everything up to
  ``commit_ts``; a *move-out* (the source's record, naming its destinations) means the source
  has reached it, so the destinations may go on. Without this wait a key's changes could come
  out of timestamp order: the destination's newer change before the source's older one.

The rules (:class:`MutableLifecycle`, events in, commands out):

1. A partition start schedules every token not already known (:class:`Schedule`), once: several
   partitions may announce one token, and a restart replays starts already seen.
2. A partition's progress (:class:`Progress`: every record ``<= ts`` processed) raises its
   watermark; a partition end marks it finished (:class:`Finish`), and a finished partition
   counts as having processed everything.
3. A move-in at ``T`` holds the destination at the event (:class:`Hold`: deliver nothing after
   it) unless every source already satisfies the wait; the hold is released
   (:class:`Release`) once, for every source, its watermark is ``>= T``, or it finished, or it
   reported the matching move-out (to this destination, at ``>= T``).
4. Events of unknown partitions are not errors: a source may be announced later, or be read
   by another task (its progress arrives as events too); until then it has not processed
   anything.

Query ends (:func:`query_end`): a MUTABLE_KEY_RANGE query needs an end timestamp at most
30 minutes after its start (Beam's SpannerIO notes this), so a partition is read by a chain of
queries, each from where the previous one ended, until its partition end record.

The same rules in the terms of the task core (``protocol/task.py``), where they hold across
tasks, hand-offs and restarts because everything they decide from is in the sync topic:

5. A destination's hold is part of its partition's state (``Partition.hold``,
   :class:`~protocol.messages.MoveInHold`): its reader stops by itself at a move-in event it
   has not passed (:func:`passes`), once everything before the event is committed, and reports
   it (``ReaderStopped.hold``). The partition is readable again only once :func:`released`:
   every source, as the CIM (or the task's own state) shows it, has finished or has a
   committed watermark past the event's timestamp (a watermark ``W`` means every record
   before ``W`` is committed, so ``W > T`` means every record ``<= T`` is). A source the
   CIM does not know yet has not processed anything. The next reader is given the released
   hold and passes exactly those events; once the partition's watermark is past the hold's
   timestamp the hold is dropped (no read starts before it any more).
6. A partition start read by a reader is reported at once (``PartitionsAnnounced``), before
   its committed position passes the record; the task registers each token it does not know
   (in its state, the CIM, the offers or the orphans) like a child partition: to the most
   underloaded member within the cap (``protocol/share.py``, ``place_child``).
7. A finished partition of this mode may be a source some destination still waits for, and
   a source the CIM no longer holds would hold that destination for ever. So it is removed
   only once every unfinished partition the CIM knows (owned, taken over, offered or orphaned)
   resumes past its end (:func:`removable`): a move-in naming it has a timestamp at or before
   its end, and a partition not registered yet is announced by one that has not passed the
   announcement (a partition start at ``S`` in a partition resuming at ``<= S``), which
   blocks the removal too when ``S`` is at or before the end.
8. Several partitions may announce one token, and their readers may run on different tasks
   at the same time, each finding the token unknown. So a partition registered from a
   partition start is a *claim* (``Partition.claim``), read by nobody until the CIM credits
   it: the CIM keeps the first claim of a token to land and drops any later one (``Cim``
   rule 10). The task whose claim landed first reads it (or its offer's target does); a task
   that finds the token held elsewhere gives its claim up. No claim can land after the token
   is removed: an announcer's watermark reaches the CIM only with its claims, and rule 7
   removes a finished partition only once every announcer resumes past its end.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Final

import msgspec

from protocol.messages import MoveInHold, Partition
from protocol.records import Micros

__all__ = [
    "MAX_QUERY_SPAN_US",
    "Command",
    "Finish",
    "Hold",
    "MoveIn",
    "MoveOut",
    "MutableLifecycle",
    "PartitionEnd",
    "PartitionEvent",
    "PartitionStart",
    "Progress",
    "Release",
    "Schedule",
    "passes",
    "query_end",
    "released",
    "removable",
]

MAX_QUERY_SPAN_US: Final = 30 * 60 * 1_000_000


# -- the records of this mode (beside protocol.records' DataChange and Heartbeat) --------------
class PartitionStart(msgspec.Struct, frozen=True, tag="pstart", tag_field="k", array_like=True):
    start_ts: Micros
    record_sequence: str
    tokens: tuple[str, ...]


class PartitionEnd(msgspec.Struct, frozen=True, tag="pend", tag_field="k", array_like=True):
    end_ts: Micros
    record_sequence: str
    token: str


class PartitionEvent(msgspec.Struct, frozen=True, tag="pevent", tag_field="k", array_like=True):
    commit_ts: Micros
    record_sequence: str
    token: str
    move_in_from: tuple[str, ...] = ()  # source partitions of key ranges moving in
    move_out_to: tuple[str, ...] = ()  # destination partitions of key ranges moving out


# -- events --------------------------------------------------------------------------------
class Progress(msgspec.Struct, frozen=True):
    """The reader of ``token`` processed every record with a timestamp ``<= ts``."""

    token: str
    ts: Micros


class MoveIn(msgspec.Struct, frozen=True):
    token: str
    ts: Micros
    sources: tuple[str, ...]


class MoveOut(msgspec.Struct, frozen=True):
    token: str
    ts: Micros
    destinations: tuple[str, ...]


# -- commands ------------------------------------------------------------------------------
class Schedule(msgspec.Struct, frozen=True):
    token: str
    start_ts: Micros


class Hold(msgspec.Struct, frozen=True):
    """Deliver nothing of ``token`` after its move-in event at ``ts`` until released."""

    token: str
    ts: Micros


class Release(msgspec.Struct, frozen=True):
    token: str
    ts: Micros


class Finish(msgspec.Struct, frozen=True):
    token: str
    end_ts: Micros


Command = Schedule | Hold | Release | Finish
_DONE: Final = 2**62  # the watermark of a finished partition: past every timestamp


class MutableLifecycle:
    """Rules 1–4 of the module docstring for one connector's view of the stream."""

    def __init__(self) -> None:
        self.scheduled: dict[str, Micros] = {}  # token -> start
        self.watermarks: dict[str, Micros] = {}  # token -> every record <= it processed
        self.finished: set[str] = set()
        # destination -> (T, sources still awaited): at most one hold per destination, as a
        # reader stops at its first unmet move-in and reports nothing past it
        self.holds: dict[str, tuple[Micros, frozenset[str]]] = {}
        self.moved_out: dict[tuple[str, str], Micros] = {}  # (source, destination) -> newest T

    # -- events ------------------------------------------------------------------------------
    def on_record(
        self, token: str | None, record: PartitionStart | PartitionEnd | PartitionEvent
    ) -> list[Command]:
        """A lifecycle record read from partition ``token`` (None: the root query)."""
        match record:
            case PartitionStart():
                return self._start(record)
            case PartitionEnd():
                return self._end(record.token, record.end_ts)
            case PartitionEvent():
                out: list[Command] = []
                if record.move_out_to:
                    out += self.on_move_out(
                        MoveOut(record.token, record.commit_ts, record.move_out_to)
                    )
                if record.move_in_from:
                    out += self.on_move_in(
                        MoveIn(record.token, record.commit_ts, record.move_in_from)
                    )
                return out

    def _start(self, record: PartitionStart) -> list[Command]:
        out: list[Command] = []
        for token in record.tokens:
            if token in self.scheduled:
                continue
            self.scheduled[token] = record.start_ts
            self.watermarks.setdefault(token, record.start_ts - 1)
            out.append(Schedule(token, record.start_ts))
        return out

    def _end(self, token: str, end_ts: Micros) -> list[Command]:
        if token in self.finished:
            return []
        self.finished.add(token)
        self.watermarks[token] = _DONE
        return [Finish(token, end_ts), *self._releases()]

    def on_progress(self, event: Progress) -> list[Command]:
        if event.ts <= self.watermarks.get(event.token, -1):
            return []
        self.watermarks[event.token] = event.ts
        return self._releases()

    def on_move_out(self, event: MoveOut) -> list[Command]:
        for destination in event.destinations:
            key = (event.token, destination)
            self.moved_out[key] = max(self.moved_out.get(key, -1), event.ts)
        return self._releases()

    def on_move_in(self, event: MoveIn) -> list[Command]:
        waiting = frozenset(s for s in event.sources if not self._reached(s, event.token, event.ts))
        if not waiting:
            return []
        self.holds[event.token] = (event.ts, waiting)
        return [Hold(event.token, event.ts)]

    # -- rules -------------------------------------------------------------------------------
    def _reached(self, source: str, destination: str, ts: Micros) -> bool:
        """Rule 3 for one source of a move-in at ``ts``."""
        return (
            self.watermarks.get(source, -1) >= ts
            or source in self.finished
            or self.moved_out.get((source, destination), -1) >= ts
        )

    def _releases(self) -> list[Command]:
        out: list[Command] = []
        for destination, (ts, waiting) in list(self.holds.items()):
            left = frozenset(s for s in waiting if not self._reached(s, destination, ts))
            if left:
                self.holds[destination] = (ts, left)
            else:
                del self.holds[destination]
                out.append(Release(destination, ts))
        return out

    def validate(self) -> None:
        """Invariants: every hold waits on at least one source not yet at its timestamp;
        finished partitions have the finished watermark."""
        for destination, (ts, waiting) in self.holds.items():
            assert waiting, destination
            assert not all(self._reached(s, destination, ts) for s in waiting), destination
        for token in self.finished:
            assert self.watermarks[token] == _DONE, token


def query_end(start_ts: Micros, end_at: Micros | None) -> Micros:
    """The end timestamp of a MUTABLE_KEY_RANGE partition query from ``start_ts``: at most
    30 minutes later, and not past the connector's ``end_at``. The next query of the chain
    starts where this one ended (the partition's read position; records at it already
    delivered are skipped by their identities, as for any re-read)."""
    end = start_ts + MAX_QUERY_SPAN_US
    return end if end_at is None else min(end, end_at)


def lifecycle_records(
    records: Sequence[object],
) -> list[PartitionStart | PartitionEnd | PartitionEvent]:
    """The lifecycle records of a decoded batch, in order."""
    return [r for r in records if isinstance(r, PartitionStart | PartitionEnd | PartitionEvent)]


# -- rules 5-7: the task core's terms ---------------------------------------------------------
def reached(source: Partition | None, ts: Micros) -> bool:
    """Rule 5 for one source: finished, or every record ``<= ts`` committed."""
    return source is not None and (source.status == "finished" or source.watermark > ts)


def released(part: Partition, lookup: Callable[[str], Partition | None]) -> bool:
    """Rule 5: ``part`` has no hold, or every source of its hold has reached the hold's
    timestamp (``lookup``: the best view a task has of a partition). A hold its partition's
    watermark is past was passed already (a copy that travelled without :func:`passed`, e.g. an
    offer whose watermark the CIM raised): its sources may be removed by now (rule 7)."""
    hold = part.hold
    return (
        hold is None
        or part.watermark > hold.ts
        or all(reached(lookup(s), hold.ts) for s in hold.sources)
    )


def passes(hold: MoveInHold | None, event: PartitionEvent) -> bool:
    """Rule 5, the reader's side: whether a move-in ``event`` is one the released ``hold``
    already waited for (or older: the partition's watermark passed it)."""
    if hold is None:
        return False
    return event.commit_ts < hold.ts or (
        event.commit_ts == hold.ts and event.record_sequence in hold.sequences
    )


def held_at(hold: MoveInHold | None, event: PartitionEvent) -> MoveInHold:
    """Rule 5: the hold a reader reports for the move-in ``event`` it stops at; events at one
    timestamp add up (the reader stops at each, and must pass all of them)."""
    if hold is not None and hold.ts == event.commit_ts:
        return MoveInHold(
            event.commit_ts,
            tuple(sorted({*hold.sources, *event.move_in_from})),
            (*hold.sequences, event.record_sequence),
        )
    return MoveInHold(
        event.commit_ts, tuple(sorted(set(event.move_in_from))), (event.record_sequence,)
    )


def passed(part: Partition) -> Partition:
    """Rule 5: the hold dropped once the partition's watermark is past it."""
    if part.hold is not None and part.watermark > part.hold.ts:
        return msgspec.structs.replace(part, hold=None)
    return part


def removable(part: Partition, unfinished: Iterable[Partition]) -> bool:
    """Rule 7: a finished partition every unfinished partition resumes past."""
    if part.status != "finished":
        return False
    return all(p.resume_ts() > part.watermark for p in unfinished)
