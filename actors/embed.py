"""Embedding shoal in an application that already runs an event loop.

``open_task`` runs one shoal task inside the caller's loop for the duration of an ``async with``
block, over a Kafka (the coordination topics) and a change-stream source, handing batches to a
sink or to a plain async callback::

    async def on_batch(batch: SinkBatch, batch_id: str) -> None:   # returns = committed
        await my_store.write(batch.records, idempotency_key=batch_id)

    async with open_task(kafka, connector="orders", task_id="app-1",
                         source=source, on_batch=on_batch) as node:
        await node.ready.wait()          # replayed the sync topic and joined the group
        ...                              # node.status() any time
    # leaving the block: the task stops taking work, lets in-flight batches commit,
    # publishes its final watermarks, and leaves the group; others take its partitions.

``on_batch(batch)`` also works; with a second parameter it gets the batch identity
(``protocol.commit.batch_identity``): computed from the batch's contents, the same when the
batch is delivered again after a failure or a take-over, so a write keyed on it is idempotent
(docs/operations.md, "Output and duplicates").

Any number of processes (or ``open_task`` blocks) with the same ``connector`` and Kafka share the
stream's partitions. ``examples/embed.py`` is a complete, tested program.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from actors.node import NodeConfig, TaskNode
from protocol.commit import batch_identity
from protocol.records import ChangeRecord
from protocol.task import TaskConfig
from runtime.ports import ChangeStreamSource, Membership, Sink, SinkBatch

if TYPE_CHECKING:
    from runtime.kafka import KafkaConfig

log = logging.getLogger("shoal.embed")

__all__ = ["CallbackSink", "GatedSource", "drain_node", "open_task"]


class GatedSource(ChangeStreamSource):
    """A source that can be closed for new work: once :meth:`close` is called, every query
    (running or new) waits at its next batch until it is cancelled. A task that drains keeps
    its readers from re-reading what they already handed over."""

    def __init__(self, inner: ChangeStreamSource) -> None:
        self.inner = inner
        self._open = asyncio.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        if token is not None:
            await self._open.wait()
        async for batch in self.inner.query(token, start_ts, end_ts):
            if token is not None:
                await self._open.wait()
            yield batch


OnBatch = Callable[[SinkBatch], Awaitable[None]] | Callable[[SinkBatch, str], Awaitable[None]]


class CallbackSink(Sink):
    """A ``Sink`` that calls ``on_batch(batch)`` — or ``on_batch(batch, batch_id)`` if it takes
    two parameters, ``batch_id`` being the deterministic batch identity — for every batch, one
    at a time, in the order handed over; a batch is committed when the callback returns, and
    failed (the partition is re-read from its committed watermark) when it raises. At most
    ``max_pending`` batches wait (``put`` blocks beyond: backpressure)."""

    def __init__(self, on_batch: OnBatch, *, max_pending: int = 64) -> None:
        self._on_batch: Callable[..., Awaitable[None]] = on_batch
        self._with_id = _positional_params(on_batch) >= 2
        self._queue: asyncio.Queue[tuple[SinkBatch, asyncio.Future[None]]] = asyncio.Queue(
            max_pending
        )
        self._worker: asyncio.Task[None] | None = None
        self.failures = 0

    async def __aenter__(self) -> CallbackSink:
        self._worker = asyncio.create_task(self._work(), name="callback-sink")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        while not self._queue.empty():
            _, future = self._queue.get_nowait()
            if not future.done():
                future.set_exception(RuntimeError("the callback sink is closed"))

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        if self._worker is None or self._worker.done():
            raise RuntimeError("the callback sink is not running")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._queue.put((batch, future))
        return future

    async def _work(self) -> None:
        while True:
            batch, future = await self._queue.get()
            try:
                if self._with_id:
                    await self._on_batch(batch, batch_identity([(batch.token, batch.records)]))
                else:
                    await self._on_batch(batch)
            except Exception as exc:
                self.failures += 1
                log.warning("on_batch failed for %s: %r; it will be re-read", batch.token, exc)
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(None)


def _positional_params(fn: Callable[..., object]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


async def drain_node(node: TaskNode, gate: GatedSource) -> bool:
    """Stop ``node`` taking work and drain it through its core (:meth:`TaskNode.drain`: the
    core stops its readers, letting in-flight batches commit, and publishes the final state),
    then wait until that state is read back from the sync topic. Returns whether it got that
    far (``False``: the task was not a member any more, so its state is the group's to settle).
    The gate keeps the draining readers from reading further. Bound it with
    ``asyncio.timeout``."""
    gate.close()
    return await node.drain(timeout=None)


@contextlib.asynccontextmanager
async def open_task(
    kafka: KafkaConfig,
    *,
    connector: str,
    task_id: str,
    source: ChangeStreamSource,
    sink: Sink | None = None,
    on_batch: OnBatch | None = None,
    task: TaskConfig | None = None,
    stream_start: int = -1,
    start_at: int | None = None,
    end_at: int | None = None,
    drain_timeout: float = 30.0,
    loop_lag: Callable[[], float] | None = None,
) -> AsyncIterator[TaskNode]:
    """Run one task in the caller's event loop; see the module docstring. Give exactly one of
    ``sink`` and ``on_batch``. ``stream_start`` (Unix micros) is where a never-started stream
    is read from (-1: now).

    ``start_at`` and ``end_at`` (Unix micros) are ``--start-at`` and ``--end-at``: with
    ``start_at`` the connector starts there when it first starts, no partition is read from
    before it, and entering the block raises :class:`actors.node.StartConflict` when the sync
    topic records a different start (a restart resumes from the watermarks); with ``end_at``
    every partition is read up to it (inclusive) and then finishes, and
    ``node.nothing_left()`` turns true once the whole connector got there (every task's CIM
    shows it): leave the block then. A first start (nothing in the sync topic) after
    ``end_at`` would read nothing: entering the block raises :class:`actors.node.EmptyWindow`.

    ``loop_lag``: how late (seconds) the caller's event loop has lately run, e.g. the
    ``recent`` method of a :class:`runtime.looplag.LoopLag` fed by ``watch_loop``; the lease
    margin grows by it (docs/design.md#membership-and-leases)."""
    from runtime.bounded import BoundedSource
    from runtime.kafka import KafkaMembership, KafkaSyncLog

    if (sink is None) == (on_batch is None):
        raise ValueError("give exactly one of sink and on_batch")
    if start_at is not None:
        stream_start = start_at
    if start_at is not None or end_at is not None:
        source = BoundedSource(source, start_at=start_at, end_at=end_at)
    task_config = task or TaskConfig(task_id=task_id)
    if task_config.task_id != task_id:
        raise ValueError(f"task.task_id {task_config.task_id!r} differs from {task_id!r}")

    async def join(member: str) -> Membership:
        membership = KafkaMembership(kafka, connector, member, loop_lag=loop_lag)
        await membership.start()
        return membership

    async with contextlib.AsyncExitStack() as stack:
        if sink is None:
            assert on_batch is not None
            sink = await stack.enter_async_context(CallbackSink(on_batch))
        sync_log = await stack.enter_async_context(KafkaSyncLog(kafka, connector))
        gate = GatedSource(source)
        node = TaskNode(
            NodeConfig(
                task=task_config,
                stream_start=stream_start,
                require_start=-1 if start_at is None else start_at,
                end_at=-1 if end_at is None else end_at,
            ),
            sync_log=sync_log,
            join=join,
            source=gate,
            sink=sink,
        )
        async with node:
            try:
                yield node
            finally:
                try:
                    async with asyncio.timeout(drain_timeout):
                        await drain_node(node, gate)
                except TimeoutError:
                    log.warning(
                        "task %s: drain took longer than %.0fs; leaving anyway",
                        task_id,
                        drain_timeout,
                    )
