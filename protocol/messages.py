"""The sync-topic wire protocol (``<connector>_connector_sync``; docs/design.md#sync-topic-and-cim).

A message keeps the design's structure: ``syncEpoch``, ``taskID``, ``messageTimestamp`` and
``connectorState`` (task states), each state with ``taskID``, ``stateTimestamp``, the owned
partitions (``data``) and the partitions it wants to share (``share``).

Two things are added so replay stays cheap and messages stay small (Debezium hit message-size
limits when every message carried every task's whole state):

* A task's state in a ``state`` message is *incremental*: ``data`` holds only partitions that
  changed (absolute values, so applying one twice changes nothing), ``removed`` the tokens it
  dropped, ``share`` the whole share section when it changed (``None``: unchanged). ``full=True``
  replaces the task's state.
* ``kind`` (the msgspec tag) says what the message is: ``state``, ``epoch``, ``checkpoint`` or
  ``marker``; see the classes below.

A connector that starts with a snapshot records it once, in the epoch message that starts its
stream (:class:`SnapshotPlan`, kind ``snapshot``: the read timestamp T and its partitions), so
the snapshot's work items and what describes them land together; checkpoints carry what is left
of it (``protocol/snapshot.py``).

Every field name on the wire is the design's camelCase; the schema version is ``v``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

SCHEMA_VERSION = 1

PartitionStatus = Literal["owned", "incoming", "finished"]
"""``owned``: this task is responsible for reading it (reading, queued, or waiting for parents).
``incoming``: this task picked up a *move* offer and is ready; the offerer still reads it.
``finished``: read to its end; kept until no partition refers to it any more."""

ShareKind = Literal["new", "move"]
"""``new``: a partition nobody reads yet (a child, or an orphan handed out by the leader).
``move``: a partition the offerer reads now and hands over once the target is ready."""


class Quarantine(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    """A partition parked by the quarantine rule (``protocol/task.py``;
    docs/design.md#poison-partitions): its reader failed ``failures`` times in a row without its
    committed position moving, while the task's other partitions advanced. Nobody reads it while this is set; the
    partition's ``watermark`` is where a release resumes it. ``(token, since)`` names it: an
    operator's :class:`ReleaseMessage` releases the quarantine it names, not a later one."""

    since: int  # when it was parked (micros, the parking task's clock)
    failures: int
    error: str
    position: int = 0  # the committed watermark it was parked at
    record: str = ""  # the record the failing batch began with, if known
    task: str = ""  # the task that parked it


class MoveInHold(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    """A ``MUTABLE_KEY_RANGE`` partition's reader met move-in events at ``ts`` (their record
    sequences: ``sequences``) naming ``sources`` (``protocol/mutable.py``): it reads past them
    only once every source has processed every record ``<= ts``. Kept, once released, until
    the partition's watermark is past ``ts``: a reader starting at ``ts`` passes those events."""

    ts: int
    sources: tuple[str, ...]
    sequences: tuple[str, ...] = ()


class Partition(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    token: str
    start_ts: int
    parents: tuple[str, ...] = ()
    status: PartitionStatus = "owned"
    watermark: int = 0  # the sink has committed every record before this time
    source: str = ""  # for ``incoming``: the offerer it moves from
    children: tuple[str, ...] = ()  # for ``finished``: the partitions it handed over to
    # the (transaction id, record sequence) of the records committed at exactly ``watermark``:
    # with it the watermark is an exact position (protocol/dedup.py, ``Position``)
    tail: tuple[tuple[str, str], ...] = ()
    # set while the partition is quarantined: parked at ``watermark``, read by nobody
    quarantine: Quarantine | None = None
    # MUTABLE_KEY_RANGE only: the move-in events its reader stopped at (protocol/mutable.py)
    hold: MoveInHold | None = None
    # MUTABLE_KEY_RANGE only: registered by this task from a partition start and not yet
    # credited by the CIM; nobody reads it until the CIM has it (protocol/mutable.py, rule 8)
    claim: bool = False

    def resume_ts(self) -> int:
        """Where a reader of this partition starts: its committed watermark, else its start."""
        return max(self.start_ts, self.watermark)

    def resume_tail(self) -> tuple[tuple[str, str], ...]:
        """The identities a reader starting at :meth:`resume_ts` skips."""
        return self.tail if self.watermark >= self.start_ts else ()


class Share(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    partition: Partition
    target: str | None  # None: parked, waiting for a task with capacity
    kind: ShareKind = "new"
    released: bool = False  # ``move``: the offerer stopped reading; partition.watermark is final
    since: int = 0  # when the holder made this offer: (holder, token, since) names it

    @property
    def token(self) -> str:
        return self.partition.token


class TaskState(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    task_id: str = msgspec.field(name="taskID")
    state_timestamp: int = 0
    data: tuple[Partition, ...] = ()
    removed: tuple[str, ...] = ()
    share: tuple[Share, ...] | None = None
    full: bool = False
    epoch_seen: int = -1  # checkpoint only: the newest epoch this task wrote in


class SnapshotItem(msgspec.Struct, frozen=True, array_like=True):
    """One snapshot partition: its work-item token (``protocol.snapshot.work_token``), its table,
    and what a reader needs to read it, in the source's own encoding (opaque here)."""

    token: str
    table: str
    source: bytes = b""


class SnapshotPlan(
    msgspec.Struct,
    frozen=True,
    rename="camel",
    omit_defaults=True,
    tag="snapshot",
    tag_field="kind",
):
    """A snapshot of the watched tables at read timestamp ``read_ts`` (T), split into partitions.

    In the epoch message that records it, ``items`` lists every partition; in a checkpoint,
    only those not read to their end yet (``total`` stays the count of all). ``chunk_rows`` is
    fixed with T: a partition re-read at T yields the same chunks only in chunks of the same
    size, and a chunk's number is its identity in the output."""

    read_ts: int
    total: int
    chunk_rows: int
    items: tuple[SnapshotItem, ...] = ()


class _Message(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True, tag_field="kind"):
    task_id: str = msgspec.field(name="taskID")
    message_timestamp: int = 0
    epoch: int = -1  # the group generation the sender knows; older-epoch messages are ignored
    sync_epoch: str = ""  # the epoch's uuid, set by the leader that opened it
    v: int = SCHEMA_VERSION


class StateMessage(_Message, frozen=True, tag="state"):
    """A task's incremental change of its own state (and, as a rebalance answer, its liveness)."""

    connector_state: tuple[TaskState, ...] = ()


class EpochMessage(_Message, frozen=True, tag="epoch"):
    """The leader opens a new epoch: the live members, and the leader's own state change (the
    ownerless partitions it shares out)."""

    members: tuple[str, ...] = ()
    connector_state: tuple[TaskState, ...] = ()
    stream_start: int = -1  # set once the root partitions were discovered
    # members whose state the epoch drops: restarted under their ids, their earlier lives'
    # partitions are dealt out (protocol/cim.py, rule 5d)
    reset: tuple[str, ...] = ()
    # the connector's snapshot, recorded with the stream's start (protocol/snapshot.py)
    snapshot: SnapshotPlan | None = None
    # the leader is a restarted task too: this epoch's own state gives up what its earlier
    # life held (protocol/planner.py, leader_yields)
    yielded: bool = False


class CheckpointMessage(_Message, frozen=True, tag="checkpoint"):
    """The whole consolidated state as of log offset ``as_of``; a replay may start from it."""

    as_of: int = -1
    leader: str = ""
    members: tuple[str, ...] = ()
    connector_state: tuple[TaskState, ...] = ()
    stream_start: int = -1
    orphans: tuple[Partition, ...] = ()  # the CIM's orphans (protocol/cim.py, rule 5c)
    snapshot: SnapshotPlan | None = None  # what is left of the snapshot (protocol/snapshot.py)
    # the quarantine releases asked for (ReleaseMessage): (token, the quarantine's since)
    releases: tuple[tuple[str, int], ...] = ()


class MarkerMessage(_Message, frozen=True, tag="marker"):
    """Produced by a replaying task; reading it back means it has read everything before it."""

    marker: str = ""


class ReleaseMessage(_Message, frozen=True, tag="release"):
    """An operator's request (``python -m actors.runtime quarantine release``) that the
    partition ``token``, quarantined since ``since`` (:class:`Quarantine`), be read again. It
    changes no task's state: a task changes only its own, so the partition's owner applies it
    (clears the quarantine in its next state message and reads from the watermark). ``taskID``
    names who asked."""

    token: str = ""
    since: int = 0


SyncMessage = StateMessage | EpochMessage | CheckpointMessage | MarkerMessage | ReleaseMessage


class SyncDecodeError(Exception):
    """A sync message could not be used: the caller counts it and skips it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[SyncMessage] = msgspec.json.Decoder(SyncMessage)


def encode(message: SyncMessage) -> bytes:
    return _encoder.encode(message)


def decode(payload: bytes) -> SyncMessage:
    """Decode one sync message; raise :class:`SyncDecodeError` for garbage or a newer schema."""
    try:
        message = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise SyncDecodeError("malformed", str(exc)) from exc
    if message.v > SCHEMA_VERSION:
        raise SyncDecodeError(
            "newer-schema", f"v={message.v}, this build reads v<={SCHEMA_VERSION}"
        )
    return message
