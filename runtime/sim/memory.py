"""In-memory implementations of the ports, for unit tests of the actors and for demos without a
broker. They behave like the real parts where it matters to the protocol: the sync log is one
totally ordered log every reader sees in full; the group has generations, one leader per
generation and members that leave or time out; the sink commits batches after a delay and can be
told to fail.

Real-part tests of the same paths exist against the embedded broker, the Spanner emulator and
local Spark; these never replace them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator

from protocol import epochs
from protocol.dedup import PartitionTail, Position
from protocol.messages import SnapshotItem, SnapshotPlan
from protocol.records import DataChange
from runtime.ports import (
    GroupAssignment,
    GroupEvent,
    GroupLost,
    Membership,
    Sink,
    SinkBatch,
    SyncLog,
)


class MemorySyncLog(SyncLog):
    """The sync topic as a list in memory."""

    def __init__(self) -> None:
        self.entries: list[bytes] = []
        self._changed = asyncio.Condition()
        self._checkpoint: int | None = None
        self.fail_appends = False

    async def append(self, payload: bytes) -> int:
        if self.fail_appends:
            raise ConnectionError("sync log unavailable (injected)")
        async with self._changed:
            self.entries.append(payload)
            self._changed.notify_all()
            return len(self.entries) - 1

    async def read(self, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        offset = start
        while True:
            async with self._changed:
                while offset >= len(self.entries):
                    await self._changed.wait()
                batch = self.entries[offset:]
            for payload in batch:
                yield offset, payload
                offset += 1

    async def checkpoint_offset(self) -> int | None:
        return self._checkpoint

    async def record_checkpoint(self, offset: int) -> None:
        self._checkpoint = offset


class MemoryGroup:
    """A group coordinator: members join and leave; every change completes a rebalance after
    ``rebalance_delay`` seconds with a new generation, whose leader is the oldest member."""

    def __init__(self, rebalance_delay: float = 0.05, session_timeout: float = 1.0) -> None:
        self.generation = -1
        self.rebalance_delay = rebalance_delay
        self.session_timeout = session_timeout
        self._members: dict[str, MemoryMembership] = {}
        self._order = itertools.count()
        self._pending: asyncio.TimerHandle | None = None

    def join(self, task_id: str) -> MemoryMembership:
        member = MemoryMembership(self, task_id, next(self._order))
        self._members[task_id] = member
        self._schedule()
        return member

    def leave(self, task_id: str) -> None:
        if self._members.pop(task_id, None) is not None:
            self._schedule()

    def expel(self, task_id: str, reason: str = "session timeout") -> None:
        member = self._members.pop(task_id, None)
        if member is not None:
            member.events_queue.put_nowait(GroupLost(reason))
            member.lease = 0.0
            self._schedule()

    def _schedule(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        loop = asyncio.get_running_loop()
        self._pending = loop.call_later(self.rebalance_delay, self._complete)

    def _complete(self) -> None:
        self._pending = None
        if not self._members:
            return
        self.generation += 1
        members = tuple(sorted(self._members))
        leader = min(self._members.values(), key=lambda m: m.order).task_id
        fresh = epochs.fresh_tasks((t, not self._members[t].assigned) for t in members)
        for member in self._members.values():
            member.lease = time.monotonic() + self.session_timeout
            member.assigned = True
            event = GroupAssignment(self.generation, leader, members, fresh=fresh)
            member.events_queue.put_nowait(event)


class MemoryMembership(Membership):
    def __init__(self, group: MemoryGroup, task_id: str, order: int) -> None:
        self.group = group
        self.task_id = task_id
        self.order = order
        self.events_queue: asyncio.Queue[GroupEvent] = asyncio.Queue()
        self.lease = 0.0
        self.heartbeats = True
        self.assigned = False  # ever assigned a generation (else it is a fresh life)

    async def events(self) -> AsyncIterator[GroupEvent]:
        while True:
            yield await self.events_queue.get()

    def lease_valid_until(self) -> float:
        if self.heartbeats and self.task_id in self.group._members and self.lease > 0:
            self.lease = max(self.lease, time.monotonic() + self.group.session_timeout / 2)
        return self.lease

    async def close(self) -> None:
        self.group.leave(self.task_id)


class MemorySink(Sink):
    """Commits every batch after ``commit_delay`` seconds; ``fail_next`` fails that many puts.
    It keeps each partition's position with every batch it commits (``committed``), as a sink
    with its own durable record does (docs/design.md#exactly-once-output, rule 2)."""

    def __init__(self, commit_delay: float = 0.0, max_in_flight: int = 64) -> None:
        self.commit_delay = commit_delay
        self.rows: Counter[tuple[int, str, str]] = Counter()
        self.batches: list[SinkBatch] = []
        self.fail_next = 0
        self._tails: dict[str, PartitionTail] = {}
        self._slots = asyncio.Semaphore(max_in_flight)

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if self.fail_next > 0:
            self.fail_next -= 1
            self._slots.release()
            future.set_exception(RuntimeError("sink failed the batch (injected)"))
            return future

        def commit() -> None:
            self.batches.append(batch)
            for record in batch.records:
                self.rows[record.identity] += 1
            tail = self._tails.setdefault(batch.token, PartitionTail())
            tail.commit(batch.watermark, batch.records)
            self._slots.release()
            if not future.done():
                future.set_result(None)

        loop.call_later(self.commit_delay, commit)
        return future

    async def durable_position(self, token: str) -> Position | None:
        """The position up to which this sink has committed partition ``token``, if any."""
        tail = self._tails.get(token)
        return None if tail is None else tail.position()


class MemorySnapshots:
    """A :class:`~runtime.ports.SnapshotSource` over a seeded snapshot of ``partitions``
    partitions (``runtime.sim.stream.snapshot_records``): each chunk is one record, sent
    ``chunk_delay`` seconds after the one before it (so a task can stop in the middle of one)."""

    def __init__(
        self, seed: int, partitions: int, max_chunks: int, chunk_delay: float = 0.0
    ) -> None:
        self.seed = seed
        self.partitions = partitions
        self.max_chunks = max_chunks
        self.chunk_delay = chunk_delay
        self.records: dict[str, tuple[DataChange, ...]] = {}
        self.planned = 0  # plan_snapshot calls
        self.reads: Counter[str] = Counter()  # read_snapshot calls per partition

    async def plan_snapshot(self, read_ts: int) -> SnapshotPlan:
        from runtime.sim.stream import snapshot_records

        self.planned += 1
        self.records = snapshot_records(self.seed, read_ts, self.partitions, self.max_chunks)
        items = tuple(
            SnapshotItem(token, chunks[0].table if chunks else "", token.encode())
            for token, chunks in self.records.items()
        )
        return SnapshotPlan(read_ts=read_ts, total=len(items), chunk_rows=1, items=items)

    async def read_snapshot(
        self, item: SnapshotItem, chunk_rows: int
    ) -> AsyncIterator[tuple[DataChange, ...]]:
        self.reads[item.token] += 1
        for record in self.records[item.token]:
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            yield (record,)
