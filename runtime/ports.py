"""The narrow ports every actor talks to. Real implementations (Kafka, Spanner, Spark) and
in-memory ones (for the deterministic simulator and unit tests) both satisfy these.

Each port is a ``typing.Protocol`` that says everything a port may do. What only some
implementations can do (a sink's ``fence``, a membership's ``set_epoch_floor``) has a default
body that does nothing, so an implementation declares the port in its class statement
(``class MemorySink(Sink)``), inherits the defaults it does not override, and mypy checks the
rest; callers call the method and never look it up by name. A wrapper around a sink says so with
:class:`SinkWrapper`, which hands every call it does not override to the sink inside. Nothing
here imports a client library.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Protocol

import msgspec

from protocol import epochs
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

    def read(self, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """Every message from offset ``start`` on, in order, waiting for new ones forever; a
        reader that stops early closes it (``aclose()``)."""
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
    # task ids whose every group member is a fresh life (it had read nothing when it joined)
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

    @property
    def rebalance_in_progress(self) -> bool:
        """Whether a rebalance is under way for this member (what the health sample reports);
        a membership that cannot tell says False."""
        return False

    def set_epoch_floor(
        self,
        epoch_floor: Callable[[], int],
        logged: Callable[[], epochs.Logged] | None = None,
        unread: Callable[[int], bool] | None = None,
    ) -> None:
        """Where the newest epoch this task has read in the sync topic comes from, and who
        opened it for which members (``logged``): a membership whose group's generations may
        start over (``KafkaMembership``) keeps its epochs newer than that; ``unread``
        (``TaskCore.joining``) tells, as it joins, whether the task has read nothing, so its
        leader may reset it. A membership whose generations never go back ignores them."""
        return


class ChangeStreamSource(Protocol):
    """A change stream (Spanner, the emulator, or the embedded simulator)."""

    def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        """Records of partition ``token`` from ``start_ts`` on, in batches; ``token=None`` gives
        the root partitions as a ``ChildPartitions`` record. The iterator ends when the partition
        ends (after its ``ChildPartitions`` records) or at ``end_ts``; a reader that stops early
        closes it (``aclose()``)."""
        ...

    async def watched_tables(self) -> tuple[str, ...] | None:
        """The tables the stream carries (the simulator, a GoogleSQL Spanner change stream), or
        None where the source cannot say."""
        return None


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
    """Where change records go (the Spark bridge, a Kafka output sink, the file sink, a
    callback). Only :meth:`put` has no default.

    A sink that stores its progress atomically with its data overrides :meth:`durable_position`,
    one with a shared retry queue :meth:`prepare`, one with a commit point :meth:`fence`, one
    that gathers batches by age :meth:`flush`."""

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        """Hand over a batch. Waits while too much is in flight (backpressure); the returned
        future resolves when the batch is durably committed, or fails if it never will be."""
        ...

    async def prepare(self, token: str) -> None:
        """A reader of partition ``token`` awaits this before it hands over anything. Sinks with
        a shared retry queue catch up with it here, so what the partition's previous owner
        parked keeps its keys blocked."""
        return

    async def durable_position(self, token: str) -> Position | None:
        """The position up to which this sink has durably written partition ``token`` by its
        own record, or None (it keeps none). A new owner resumes from the newer of that and the
        sync topic's position, so a batch the sink committed but whose watermark never reached
        the sync topic (a kill -9 in between) is not written twice."""
        return None

    async def flush(self, token: str) -> None:
        """The reader of ``token`` hands nothing more until what it handed commits (its query
        ended, or it drains; docs/design.md#reading-a-partition): a sink that gathers batches
        for a while before it writes them may write them now. A hint: ignoring it loses
        nothing."""
        return

    async def fence(self, batches: Sequence[SinkBatch]) -> list[bool] | None:
        """For each batch of ``batches`` it was handed and has not resolved yet, True if it
        passed the commit point already, else False, and then it never will; None from a sink
        without a commit point (docs/design.md#exactly-once-output, rule 4). A reader that stops
        with batches in flight fences them (:func:`fence_sink`) before its task releases the
        partition, so none is written after the next owner looked up its position."""
        return None


class SinkWrapper(Sink):
    """A sink around another one (counting, watching health): every call it does not override
    goes to ``inner``, so what ``inner`` can do the wrapper can do too."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        return await self.inner.put(batch)

    async def prepare(self, token: str) -> None:
        await self.inner.prepare(token)

    async def durable_position(self, token: str) -> Position | None:
        return await self.inner.durable_position(token)

    async def flush(self, token: str) -> None:
        await self.inner.flush(token)

    async def fence(self, batches: Sequence[SinkBatch]) -> list[bool] | None:
        return await fence_sink(self.inner, batches)


async def fence_sink(sink: Sink, batches: Sequence[SinkBatch]) -> list[bool] | None:
    """``await sink.fence(batches)``, checked: one answer per batch, or None (it cannot fence)."""
    answered = await sink.fence(batches)
    if answered is None:
        return None
    answer = list(answered)
    if len(answer) != len(batches):
        raise ValueError(f"{sink!r}.fence answered {len(answer)} of {len(batches)} batches")
    return answer
