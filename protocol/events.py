"""The task core's events and commands (``protocol/task.py``): frozen msgspec structs in two
tagged unions, ``TaskEvent`` (what happened: the core's inputs) and ``TaskCommand`` (what the
shell must do: its outputs). The tags are stable names on the wire, so a trace of a run's core
inputs and outputs (``protocol/trace.py``) can be written and replayed; renaming a class does
not change them. New fields get defaults."""

from __future__ import annotations

import enum

import msgspec

from protocol.messages import EpochMessage, MoveInHold, StateMessage, SyncMessage
from protocol.planner import Plan
from protocol.records import ChildPartition


class _Event(msgspec.Struct, frozen=True, tag_field="event"):
    pass


class _Command(msgspec.Struct, frozen=True, tag_field="command"):
    pass


# -- events ---------------------------------------------------------------------------------


class SyncRead(_Event, frozen=True, tag="sync-read"):
    offset: int
    message: SyncMessage


class SyncBad(_Event, frozen=True, tag="sync-bad"):
    offset: int
    reason: str


class Joined(_Event, frozen=True, tag="joined"):
    generation: int
    leader: str
    members: tuple[str, ...]
    # members whose every group member is a fresh life (it had read nothing when it joined:
    # restarted or new); see RequestPlan.reset
    fresh: tuple[str, ...] = ()


class Joining(_Event, frozen=True, tag="joining"):
    """The membership sends a JoinGroup now, knowing epoch ``known``; it asks the task at once
    whether it is a fresh life (``TaskCore.says_fresh``), which binds the task
    (``TaskCore._on_joining``)."""

    known: int


class Lost(_Event, frozen=True, tag="lost"):
    reason: str


class Lease(_Event, frozen=True, tag="lease"):
    until: int  # micros: the membership surely holds until then


class TaskTick(_Event, frozen=True, tag="tick"):
    """A timer: nothing happened, but time passed."""


Ids = tuple[tuple[str, str], ...]
"""The (server transaction id, record sequence) of the records committed at exactly a
watermark: with it, a watermark is an exact :class:`~protocol.dedup.Position`."""


class ReaderCommitted(_Event, frozen=True, tag="reader-committed"):
    token: str
    watermark: int
    tail: Ids = ()  # the identities committed at exactly ``watermark``


class ReadersCommitted(_Event, frozen=True, tag="readers-committed"):
    """Many readers' committed watermarks at once (the shell coalesces reports: a newer
    watermark of a partition supersedes an older one)."""

    watermarks: tuple[tuple[str, int], ...]
    tails: tuple[tuple[str, Ids], ...] = ()  # each partition's ``ReaderCommitted.tail``


class ReaderFinished(_Event, frozen=True, tag="reader-finished"):
    token: str
    watermark: int
    children: tuple[ChildPartition, ...]
    child_start: int
    tail: Ids = ()


class ReaderStopped(_Event, frozen=True, tag="reader-stopped"):
    token: str
    watermark: int
    tail: Ids = ()
    # MUTABLE_KEY_RANGE: the reader stopped by itself at move-in events it may not pass yet
    # (protocol/mutable.py); everything before them is committed
    hold: MoveInHold | None = None


class PartitionsAnnounced(_Event, frozen=True, tag="partitions-announced"):
    """MUTABLE_KEY_RANGE: the reader of ``token`` read a partition start record: the partitions
    ``tokens`` are to be read from ``start_ts`` (protocol/mutable.py). Reported when read, so
    before the reader's committed position passes the record."""

    token: str
    start_ts: int
    tokens: tuple[str, ...]


class ReaderFailed(_Event, frozen=True, tag="reader-failed"):
    token: str
    error: str
    # the record the failing batch began with, if known ("<commit ts> <transaction id>
    # <record sequence>"): the quarantine rule names it (protocol/task.py)
    record: str = ""
    # a query restarted because it sent nothing for the stall timeout: no record failed, so
    # the quarantine rule does not count it
    stalled: bool = False


class PlanReady(_Event, frozen=True, tag="plan-ready"):
    plan: Plan


class PublishFailed(_Event, frozen=True, tag="publish-failed"):
    """A message this task sent never reached the sync topic. ``state_ts`` is
    :func:`own_state_ts` of it: what the task no longer waits to read back."""

    error: str
    state_ts: int = -1


def own_state_ts(message: SyncMessage) -> int:
    """The ``stateTimestamp`` of the sender's own state in a state or epoch message, else -1."""
    if isinstance(message, StateMessage | EpochMessage):
        for state in message.connector_state:
            if state.task_id == message.task_id:
                return state.state_timestamp
    return -1


class Drain(_Event, frozen=True, tag="drain"):
    """The task is shutting down: stop reading (letting in-flight batches commit), take no new
    work, publish the final watermarks. Its partitions are handed over by the next epoch."""


TaskEvent = (
    Drain
    | SyncRead
    | SyncBad
    | Joined
    | Joining
    | Lost
    | Lease
    | TaskTick
    | ReaderCommitted
    | ReadersCommitted
    | ReaderFinished
    | ReaderStopped
    | ReaderFailed
    | PartitionsAnnounced
    | PlanReady
    | PublishFailed
)

# -- commands -------------------------------------------------------------------------------


class Publish(_Command, frozen=True, tag="publish"):
    message: SyncMessage


class StartReader(_Command, frozen=True, tag="start-reader"):
    token: str
    start_ts: int
    parents: tuple[str, ...]
    tail: Ids = ()  # the identities committed at exactly ``start_ts``: skip them
    # MUTABLE_KEY_RANGE: the partition's released move-in hold, whose events the reader passes
    hold: MoveInHold | None = None


class StopReason(enum.StrEnum):
    """Why the core stops a reader."""

    HANDOFF = "handoff"  # the partition moves: its new owner is ready
    SHUTDOWN = "shutdown"  # the task drains
    NOT_PERMITTED = "not-permitted"  # the lease lapsed, or no epoch lists the task
    NOT_WANTED = "not-wanted"  # the partition is no longer this task's (or over the cap)
    QUARANTINED = "quarantined"  # its reader keeps failing: parked at its watermark


class StopReader(_Command, frozen=True, tag="stop-reader"):
    """Stop reading ``token``. With ``drain`` the reader first lets in-flight batches commit
    (bounded), so the next owner starts as late as possible: on a hand-off and at shutdown. A
    task that may not read stops at once."""

    token: str
    reason: StopReason
    drain: bool


class RequestPlan(_Command, frozen=True, tag="request-plan"):
    generation: int
    members: tuple[str, ...]
    need_roots: bool
    reset: tuple[str, ...] = ()  # members the plan treats as restarted (planner.plan's reset)
    # the leader is such a restarted task itself: the plan deals out its own unfinished
    # partitions too (planner.plan's leader_yields)
    leader_yields: bool = False
    # with ``need_roots``: plan the connector's snapshot at the stream's start too
    # (protocol/snapshot.py, rule 1)
    snapshot: bool = False


class Alert(_Command, frozen=True, tag="alert"):
    """Something that must never happen did, or an operator must act on (``quarantined``: a
    partition parked by the quarantine rule): the shell logs it as an error (and counts it)."""

    kind: str
    detail: str


TaskCommand = Publish | StartReader | StopReader | RequestPlan | Alert
