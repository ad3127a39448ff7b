"""The shell of the composite output topic's metadata (:mod:`protocol.output_meta`, the rules):
the metadata topic ``<output>_meta`` (one partition) and a producer's session on it.

* :class:`MetaLog` appends entries and loads the state: it writes a fresh :class:`Marker` and
  folds the topic from the beginning until it reads the marker back (``end_offsets`` and
  compaction are not relied on; every Kafka shoal supports behaves alike).
* :func:`open_meta` loads the state and, on a first start, appends ``Created`` from the
  configuration (two first starts may race: the first in the log wins, both read it).
* :func:`seal` writes a seal marker (header :data:`SEAL_HEADER`, no key) to every partition of a
  storage topic the produce pointer has left, and appends ``Sealed`` with their offsets.
* :class:`ProducerSession` is one producer's part in the switch barrier. It joins with a lease
  (renewed every ``ttl / 3``; valid only once read back), tails the topic, and answers
  :meth:`ProducerSession.acquire` (the storage topic to send a record to, or waits: a switch is
  pending or the lease is about to run out) and :meth:`ProducerSession.release` (that send was
  acknowledged or failed). When a switch is prepared it holds new sends, waits until its sends to
  the old storage topic are all acknowledged, and appends ``Acked``; any session that sees the
  switch due appends ``SwitchCommitted``, and one that sees a storage topic committed but not
  sealed seals it. A clean close appends ``Left``.
  The same session gates the RQ/DLQ writes of its queue (:meth:`ProducerSession.acquire_layout`,
  :meth:`ProducerSession.release_layout`): from a ``ShardsPrepared`` it holds them, acks
  (``ShardsAcked``) once its writes to the current layout are acknowledged, commits when due, and
  tells its owner the new layout (``on_relayout``) before any write goes there.
* :func:`change_shards` is ``output shards N``: prepare, wait for the commit (committing it
  itself when due), then feed the old RQ/DLQ storage topics to the new ones
  (:func:`runtime.kafka.retry_queue.feed`) and append ``Fed``. Run again after a crash, it
  resumes where the log says it stopped.
* :func:`meta_session` opens a session for a short-lived writer of the RQ/DLQ (``dlq replay``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Self

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from protocol.output_meta import (
    Acked,
    Created,
    Entry,
    Joined,
    Left,
    Marker,
    MetaError,
    OutputMeta,
    Sealed,
    ShardsAcked,
    ShardsCommitted,
    SwitchCommitted,
    decode_entry,
    encode_entry,
    feed_due,
    meta_topic,
    shards_plan,
)
from protocol.retry import FeedPlan
from protocol.routing import CompositeTopic
from runtime.kafka.config import KafkaAdapterError, KafkaConfig
from runtime.kafka.topics import ensure_topic

__all__ = [
    "SEAL_HEADER",
    "MetaLog",
    "MetaOptions",
    "ProducerSession",
    "ShardsResult",
    "change_shards",
    "meta_session",
    "open_meta",
    "seal",
]

log = logging.getLogger(__name__)

SEAL_HEADER = "shoal-seal"
"""Header of a seal marker in an output storage topic (its value: the storage topic's index).
Consumers skip such messages; a reader of the composite topic stops reading the partition there."""


class MetaOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How a producer takes part in the switch barrier."""

    lease_ttl_s: float = 15.0  # a producer's lease; a dead producer holds a switch this long
    margin_s: float = 3.0  # a producer stops sending this long before its lease runs out
    grace_s: float = 2.0  # a lease counts as run out this long after its end
    poll_s: float = 0.1
    load_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.margin_s < self.lease_ttl_s / 2:
            raise ValueError("margin_s must be positive and below half of lease_ttl_s")


class MetaLog:
    """The metadata topic of composite output topic ``output``."""

    def __init__(self, config: KafkaConfig, output: str, *, load_timeout_s: float = 60.0):
        self._config = config
        self.topic = meta_topic(output)
        self.output = output
        self._timeout = load_timeout_s
        self._producer: AIOKafkaProducer | None = None

    async def __aenter__(self) -> Self:
        await ensure_topic(self._config, self.topic, partitions=1)
        self._producer = AIOKafkaProducer(
            **self._config.client_kwargs(), acks="all", enable_idempotence=False, linger_ms=0
        )
        await self._producer.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    @property
    def producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise KafkaAdapterError(f"the metadata log {self.topic!r} is not open")
        return self._producer

    async def append(self, entry: Entry) -> int:
        """Append ``entry``; returns its offset once Kafka acknowledged it."""
        meta = await self.producer.send_and_wait(self.topic, encode_entry(entry), partition=0)
        return int(meta.offset)

    async def load(self) -> tuple[OutputMeta, int]:
        """The state folded from the beginning up to a fresh marker; and the marker's offset
        (reading on from it sees every later entry)."""
        marker = await self.append(Marker(uuid.uuid4().hex))
        state = OutputMeta()
        consumer = self.consumer()
        await consumer.start()
        try:
            tp = TopicPartition(self.topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            async with asyncio.timeout(self._timeout):
                done = False
                while not done:
                    for msgs in (await consumer.getmany(tp, timeout_ms=500)).values():
                        for m in msgs:
                            if m.offset >= marker:
                                done = True
                                break
                            if m.value is not None:
                                state.apply(decode_entry(m.value))
        finally:
            await consumer.stop()
        return state, marker

    def consumer(self) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            **self._config.client_kwargs(),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=50,
        )


async def open_meta(
    log_: MetaLog, *, partitions: int, rq_partitions: int, dlq_partitions: int
) -> tuple[OutputMeta, int]:
    """The state of ``log_``'s composite topic; a first start creates it from these counts."""
    state, at = await log_.load()
    if not state.created:
        await log_.append(Created(log_.output, partitions, rq_partitions, dlq_partitions))
        state, at = await log_.load()
    elif state.composite().storage_topics[0].partitions != partitions:
        log.info(
            "%s: the composite topic exists (%s); the configured %d partitions apply only at the "
            "first start",
            log_.topic,
            ", ".join(f"{st.name}:{st.partitions}" for st in state.composite().storage_topics),
            partitions,
        )
    return state, at


async def seal(
    config: KafkaConfig, log_: MetaLog, state: OutputMeta, index: int, producer: AIOKafkaProducer
) -> tuple[int, ...]:
    """Write a seal marker to every partition of storage topic ``index`` (which the produce
    pointer has left) and append ``Sealed`` with their offsets."""
    st = state.composite().storage_topics[index]
    headers = [(SEAL_HEADER, str(index).encode())]
    value = msgspec.json.encode({"seal": index})
    futures = [
        await producer.send(st.name, value, partition=p, headers=headers)
        for p in range(st.partitions)
    ]
    results = await asyncio.gather(*futures, return_exceptions=True)
    offsets: list[int] = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        offsets.append(int(r.offset))
    await log_.append(Sealed(index, tuple(offsets)))
    log.info("sealed %s at offsets %s", st.name, offsets)
    return tuple(offsets)


class ProducerSession:
    """One producer's part in the switch barrier (see the module docstring).

    ``on_switch(state)`` is called (synchronously) when the produce pointer moved, before any
    send to the new storage topic."""

    def __init__(
        self,
        config: KafkaConfig,
        log_: MetaLog,
        state: OutputMeta,
        start_offset: int,
        producer: AIOKafkaProducer | None = None,  # unused (seals go through a fresh producer)
        *,
        options: MetaOptions | None = None,
        clock: Callable[[], float] = time.time,
        on_switch: Callable[[OutputMeta], None] | None = None,
        on_relayout: Callable[[OutputMeta], None] | None = None,
        name: str | None = None,
    ) -> None:
        self._config = config
        self._log = log_
        self.state = state
        self._offset = start_offset
        self.options = options or MetaOptions()
        self._clock = clock
        self._on_switch = on_switch
        self._on_relayout = on_relayout
        self._layout_in_flight: Counter[int] = Counter()  # RQ/DLQ layout -> unacknowledged writes
        self._shards_acked: int | None = None
        self._shards_committed: set[int] = set()
        self.me = name or f"producer-{uuid.uuid4().hex[:12]}"
        self._lease_until = 0.0  # of the latest renewal read back
        self._in_flight: Counter[int] = Counter()  # storage topic index -> unacknowledged sends
        self._changed = asyncio.Event()
        self._acked: int | None = None
        self._committed: set[int] = set()
        self._sealing: set[int] = set()
        self._task: asyncio.Task[None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self.holds = 0  # sends that had to wait (a switch, or the lease)

    def __repr__(self) -> str:
        return f"ProducerSession({self._log.output!r}, {self.me!r})"

    async def __aenter__(self) -> Self:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._task = self._tg.create_task(self._run(), name=f"output-meta-{self.me}")
        try:
            await self._renew()
            async with asyncio.timeout(self.options.load_timeout_s):
                while not self._lease_ok():
                    await self._wait_change(self.options.poll_s)
        except BaseException:
            self._task.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        assert self._tg is not None
        self._task.cancel()
        try:
            await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            if exc_type is None:
                await self._log.append(Left(self.me))

    def kill(self) -> None:
        """Stop at once without leaving (for tests of a producer's death)."""
        if self._task is not None:
            self._task.cancel()

    # -- the producer's side -------------------------------------------------------------------

    def _lease_ok(self) -> bool:
        return self._clock() < self._lease_until - self.options.margin_s

    async def acquire(self) -> int:
        """The storage topic index to send one record to; waits while a switch is pending or the
        lease is not valid. Every acquire is followed by exactly one :meth:`release`."""
        held = False
        while True:
            if self._task is not None and self._task.done():
                raise KafkaAdapterError(f"{self!r} stopped: {self._task!r}")
            target = self.state.target()
            if target is not None and self._lease_ok():
                self._in_flight[target] += 1
                return target
            if not held:
                held = True
                self.holds += 1
            await self._wait_change(self.options.poll_s)

    def release(self, index: int) -> None:
        self._in_flight[index] -= 1
        if self._in_flight[index] <= 0:
            del self._in_flight[index]
            self._changed.set()

    async def acquire_layout(self) -> tuple[int, CompositeTopic, CompositeTopic]:
        """The RQ/DLQ layout to write one entry to: its number and the RQ and DLQ composite
        topics (the newest storage topic of each is written to); waits while a shard-count
        change is pending or the lease is not valid. Followed by one :meth:`release_layout`."""
        held = False
        while True:
            if self._task is not None and self._task.done():
                raise KafkaAdapterError(f"{self!r} stopped: {self._task!r}")
            layout = self.state.layout()
            if layout is not None and self._lease_ok():
                self._layout_in_flight[layout] += 1
                return layout, self.state.rq(), self.state.dlq()
            if not held:
                held = True
                self.holds += 1
            await self._wait_change(self.options.poll_s)

    def release_layout(self, layout: int) -> None:
        self._layout_in_flight[layout] -= 1
        if self._layout_in_flight[layout] <= 0:
            del self._layout_in_flight[layout]
            self._changed.set()

    async def _wait_change(self, timeout: float) -> None:
        self._changed.clear()
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            pass  # the caller re-checks: a lease may have lapsed or a switch become due

    # -- the background part -------------------------------------------------------------------

    async def _renew(self) -> None:
        await self._log.append(Joined(self.me, self._clock() + self.options.lease_ttl_s))

    async def _run(self) -> None:
        consumer = self._log.consumer()
        await consumer.start()
        try:
            tp = TopicPartition(self._log.topic, 0)
            consumer.assign([tp])
            consumer.seek(tp, self._offset)
            renewed = self._clock()
            while True:
                batches = await consumer.getmany(tp, timeout_ms=int(self.options.poll_s * 1000))
                for msgs in batches.values():
                    for m in msgs:
                        if m.value is not None:
                            self._fold(decode_entry(m.value))
                now = self._clock()
                if now - renewed >= self.options.lease_ttl_s / 3:
                    renewed = now
                    await self._renew()
                await self._barrier(now)
        except Exception:
            log.exception("%r: the metadata session failed; sends stop", self)
            raise
        finally:
            await consumer.stop()

    def _fold(self, entry: Entry) -> None:
        before = self.state.composite().produce_pointer
        layout = self.state.shard_changes
        self.state.apply(entry)
        if isinstance(entry, Joined) and entry.producer == self.me:
            self._lease_until = max(self._lease_until, entry.until)
        if self.state.composite().produce_pointer != before:
            log.info("%r: producing to %s now", self, self.state.composite().producing.name)
            if self._on_switch is not None:
                self._on_switch(self.state)
        if self.state.shard_changes != layout:
            log.info(
                "%r: RQ/DLQ shard count %d, writing to %s and %s now",
                self,
                self.state.shards,
                self.state.rq().producing.name,
                self.state.dlq().producing.name,
            )
            if self._on_relayout is not None:
                self._on_relayout(self.state)
        self._changed.set()

    async def _barrier(self, now: float) -> None:
        state, opts = self.state, self.options
        pending = state.pending
        if pending is not None:
            old = pending.target - 1
            if self._acked != pending.target and self._in_flight[old] == 0:
                self._acked = pending.target
                await self._log.append(Acked(self.me, pending.target))
            if state.switch_due(now, opts.grace_s) and pending.target not in self._committed:
                self._committed.add(pending.target)
                await self._log.append(SwitchCommitted(pending.target))
        sp = state.shards_pending
        if sp is not None:
            if self._shards_acked != sp.change and self._layout_in_flight[sp.change - 1] == 0:
                self._shards_acked = sp.change
                await self._log.append(ShardsAcked(self.me, sp.change))
            if state.shards_due(now, opts.grace_s) and sp.change not in self._shards_committed:
                self._shards_committed.add(sp.change)
                await self._log.append(ShardsCommitted(sp.change))
        for index in state.unsealed():
            if index not in self._sealing:
                self._sealing.add(index)
                # a producer of its own: on the embedded broker the sink's long-lived producer
                # was answered NotLeaderForPartition for these markers, a fresh one is not
                producer = AIOKafkaProducer(
                    **self._config.client_kwargs(), acks="all", enable_idempotence=False
                )
                try:
                    await producer.start()
                    try:
                        await seal(self._config, self._log, state, index, producer)
                    finally:
                        await producer.stop()
                except KafkaError as exc:  # transient (e.g. a leader moving): try again later
                    self._sealing.discard(index)
                    log.warning("%r: sealing storage topic %d failed: %r", self, index, exc)


@asynccontextmanager
async def meta_session(
    config: KafkaConfig, output: str, options: MetaOptions | None = None
) -> AsyncIterator[ProducerSession | None]:
    """A producer session on ``output``'s metadata for a short-lived writer of its RQ/DLQ (the
    ``dlq replay`` commands): its writes take part in the shard-count barrier. None when the
    output has no metadata topic yet (it never ran with one)."""
    async with MetaLog(config, output) as log_:
        state, at = await log_.load()
        if not state.created:
            yield None
            return
        async with ProducerSession(config, log_, state, at, options=options) as session:
            yield session


class ShardsResult(msgspec.Struct, frozen=True):
    shards: int
    rq: str  # the RQ storage topic written to now
    dlq: str
    fed: FeedPlan | None  # what the feed copied (None: nothing to feed)


async def change_shards(
    config: KafkaConfig,
    log_: MetaLog,
    shards: int,
    *,
    grace_s: float,
    wait_s: float = 120.0,
    clock: Callable[[], float] = time.time,
    poll_s: float = 0.5,  # each look appends a read marker to the metadata topic
) -> ShardsResult:
    """``output shards N`` (rules: :mod:`protocol.output_meta`): create the new RQ/DLQ storage
    topics, prepare the change, wait until it is committed (the running producers ack and commit;
    this commits it too once it is due, e.g. when none runs), then feed the old storage topics'
    held records to the new ones and append ``Fed``. Every step is decided from the log, so after
    a crash the same call resumes: a pending change with these counts is waited for, a committed
    one not yet fed is fed. Raises :class:`protocol.output_meta.MetaError` when the log forbids it
    and ``TimeoutError`` when the change did not commit within ``wait_s``."""
    from runtime.kafka.retry_queue import feed

    state, _ = await log_.load()
    sp = state.shards_pending
    if sp is not None and sp.shards != shards:
        raise MetaError(f"shard-count change {sp.change} to {sp.shards} is pending; wait for it")
    if sp is None and not (state.unfed() and shards == state.shards):
        prepare = shards_plan(state, shards)
        after = copy.deepcopy(state)  # as the commit will leave it: create its topics first
        after.apply(prepare)
        after.apply(ShardsCommitted(prepare.change))
        for topic in (after.rq(), after.dlq()):
            st = topic.producing
            await ensure_topic(config, st.name, partitions=st.partitions)
        await log_.append(prepare)
        log.info("%s: shard-count change %d to %d prepared", log_.topic, prepare.change, shards)
    async with asyncio.timeout(wait_s):
        while True:
            state, _ = await log_.load()
            sp = state.shards_pending
            if sp is None:
                break
            if state.shards_due(clock(), grace_s):
                await log_.append(ShardsCommitted(sp.change))
            else:
                await asyncio.sleep(poll_s)
    fed: FeedPlan | None = None
    entry = feed_due(state)
    if entry is not None:
        # every storage topic from rq_from/dlq_from on is read; the newest are written to
        fed = await feed(config, state.rq(), state.dlq())
        await log_.append(entry)
        log.info(
            "%s: fed %d record(s) to the new RQ/DLQ storage topics", log_.topic, len(fed.copies)
        )
        state, _ = await log_.load()
    return ShardsResult(state.shards, state.rq().producing.name, state.dlq().producing.name, fed)
