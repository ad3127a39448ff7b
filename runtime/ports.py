"""The narrow ports every actor talks to. Real implementations (Kafka, Spanner, Spark) and
in-memory ones (for the deterministic simulator and unit tests) both satisfy these.

Each port is a ``typing.Protocol``; nothing here imports a client library.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import msgspec

from protocol.dedup import Position
from protocol.messages import SnapshotItem, SnapshotPlan
from protocol.records import ChangeRecord, DataChange


class Unrecoverable(RuntimeError):
    """A port's failure that retrying cannot mend (Spark died and could not be restarted, the
    database or change stream does not exist or may not be read, Kafka out of reach for longer
    than allowed, the sync topic lost under a running process). Raised by a port, it stops the
    process (exit 1) with its message, which names the part and the cause, instead of being
    retried forever (docs/operations.md, "When the parts around shoal fail")."""


class SyncLog(Protocol):
    """The sync topic: one totally ordered log every task appends to and reads in full."""

    async def append(self, payload: bytes) -> int:
        """Append one message; return its offset. Raises on failure after a bounded time."""
        ...

    def read(self, start: int) -> AsyncIterator[tuple[int, bytes]]:
        """Every message from offset ``start`` on, in order, waiting for new ones forever."""
        ...

    async def checkpoint_offset(self) -> int | None:
        """Offset of the latest checkpoint message, if one was recorded."""
        ...

    async def record_checkpoint(self, offset: int) -> None:
        """Remember ``offset`` as the latest checkpoint message."""
        ...


class GroupAssignment(msgspec.Struct, frozen=True):
    """A member's view of one completed rebalance of the heartbeat-topic group."""

    generation: int
    leader: str  # the task id of the group leader (the one whose assignor ran)
    members: tuple[str, ...]  # task ids of every member of this generation
    # task ids whose every group member is a fresh life (never assigned a generation before)
    fresh: tuple[str, ...] = ()


class GroupLost(msgspec.Struct, frozen=True):
    """This member lost its membership (session timeout, fenced, or the group is unreachable)."""

    reason: str


class GroupLease(msgspec.Struct, frozen=True):
    """This member's lease was renewed: it is surely a member until ``until`` (monotonic
    seconds). A membership whose lease moves pushes this; the task does not poll."""

    until: float


GroupEvent = GroupAssignment | GroupLost | GroupLease


class Membership(Protocol):
    """Membership of the heartbeat-topic consumer group, used only for its rebalance protocol."""

    def events(self) -> AsyncIterator[GroupEvent]:
        """Rebalances, losses and lease renewals, in the order they happen."""
        ...

    def lease_valid_until(self) -> float:
        """Monotonic time (seconds) until which this member is surely still a member: the last
        successful heartbeat plus the session timeout, minus a safety margin."""
        ...

    async def close(self) -> None:
        """Leave the group."""
        ...


class ChangeStreamSource(Protocol):
    """A change stream (Spanner, the emulator, or the embedded simulator)."""

    def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncIterator[Sequence[ChangeRecord]]:
        """Records of partition ``token`` from ``start_ts`` on, in batches; ``token=None`` gives
        the root partitions as a ``ChildPartitions`` record. The iterator ends when the partition
        ends (after its ``ChildPartitions`` records) or at ``end_ts``."""
        ...


class SnapshotSource(Protocol):
    """A database that can be read as it was at one timestamp, split into partitions
    (``protocol/snapshot.py``): the Spanner adapter, or a test's."""

    async def plan_snapshot(self, read_ts: int) -> SnapshotPlan:
        """Split the watched tables into partitions readable at ``read_ts`` (T), each described
        by a :class:`~protocol.messages.SnapshotItem` another process can read it from. Raises
        an :class:`Unrecoverable` one when T cannot be read (too old) or a table is missing."""
        ...

    def read_snapshot(
        self, item: SnapshotItem, chunk_rows: int
    ) -> AsyncIterator[Sequence[ChangeRecord]]:
        """The rows of ``item`` at its T, as ``SNAPSHOT`` records of at most ``chunk_rows`` rows
        each (chunk ``k``: record sequence ``k``, transaction id the item's token), in the same
        chunks every time it is read; then the iterator ends."""
        ...


class SinkBatch(msgspec.Struct, frozen=True):
    """Records of one partition handed to the sink, and the read position after them."""

    token: str
    records: tuple[DataChange, ...]
    watermark: int


class Sink(Protocol):
    """Where change records go (the Spark bridge, a Kafka output sink, a callback).

    A sink that stores its progress atomically with its data may also have ``async def
    durable_position(token) -> Position | None``: the position up to which it has durably written
    partition ``token`` by its own record (:func:`sink_committed`). A new owner then resumes
    from the newer of that and the sync topic's position, so a batch the sink committed but
    whose watermark never reached the sync topic (a kill -9 in between) is not written twice.

    A sink may also have ``async def prepare(token)``: a reader of partition ``token`` awaits
    it before it hands over anything (:func:`prepare_sink`). Sinks with a shared retry queue
    catch up with it there, so what the partition's previous owner parked keeps its keys
    blocked.

    A sink with a commit point may also have ``async def fence(batches) -> list[bool] | None``
    (:func:`fence_sink`; docs/design.md#exactly-once-output, rule 4): for each batch it was
    handed and has not resolved yet, True if it passed the commit point already, else False,
    and then it never will. A reader that stops with batches in flight fences them before its
    task releases the partition, so none is written after the next owner looked up its
    position."""

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        """Hand over a batch. Waits while too much is in flight (backpressure); the returned
        future resolves when the batch is durably committed, or fails if it never will be."""
        ...


async def prepare_sink(sink: Sink, token: str) -> None:
    """Call ``sink.prepare(token)`` if the sink has one (see :class:`Sink`)."""
    prepare = getattr(sink, "prepare", None)
    if prepare is not None:
        await prepare(token)


async def fence_sink(sink: Sink, batches: Sequence[SinkBatch]) -> list[bool] | None:
    """``await sink.fence(batches)`` if the sink can fence (see :class:`Sink`), else None."""
    fence = getattr(sink, "fence", None)
    if fence is None:
        return None
    answered: Sequence[bool] | None = await fence(batches)
    if answered is None:  # a wrapper around a sink that cannot fence
        return None
    answer = list(answered)
    if len(answer) != len(batches):
        raise ValueError(f"{sink!r}.fence answered {len(answer)} of {len(batches)} batches")
    return answer


async def sink_committed(sink: Sink, token: str) -> Position | None:
    """``await sink.durable_position(token)`` if the sink keeps its own durable record of what
    it wrote (see :class:`Sink`), else None."""
    lookup = getattr(sink, "durable_position", None)
    if lookup is None:
        return None
    position: Position | None = await lookup(token)
    return position
