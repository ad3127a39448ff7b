"""The durable shell of the retry queue and dead-letter queue (``docs/design.md``, "Retry and
dead-letter queues"), shared by the Kafka output sink (:mod:`runtime.kafka.sink`) and the Spark
bridge's keyed path (:mod:`runtime.spark.keyed_path`).

:class:`RetryQueue` drives the pure core :class:`protocol.retry.RetryCore` and does its I/O:

* **Durable state.** The core's log entries (:data:`protocol.retry.LogEntry`) go to two Kafka
  composite topics, the RQ and the DLQ, as :class:`InternalMessage` (msgpack: the entry, and on
  ``ParkInRetry``/``SendToDlq`` the record's payload), routed by the record's ordering-key hash
  (:func:`protocol.routing.key_hash`) with the design-003 router. At start a queue writes a marker
  to every RQ/DLQ partition it owns and reads each from the beginning until its marker comes back
  (``end_offsets`` is wrong on the embedded broker), folds the entries with
  :func:`protocol.retry.from_log`, and retries what is due. So **a new owner over the same topics
  resumes the state** of a dead one.
* **Settlement.** :meth:`RetryQueue.submit` takes records (id, ordering key, payload) and returns
  a future that resolves once each is settled: delivered, or durably written to the RQ or the DLQ.
  ``submit(..., failed=error)`` hands over records whose first delivery already failed elsewhere
  (the Spark bridge isolated them): they are parked without being sent again at once.
* **Delivery** goes through the owner's ``send`` callback, one record at a time per key (the core
  never has two records of a key in flight); the owner answers every send exactly once with
  :meth:`RetryQueue.delivered` or :meth:`RetryQueue.failed`, from any task or callback.
* :meth:`RetryQueue.blocks` says whether a key's next record must go through the queue (it has a
  record in flight, waiting, in the RQ, or, with ``dlq_blocks``, in the DLQ): a sink that delivers
  most records on its own (the Spark bridge) sends those keys' records here to keep per-key order.

Operators: :meth:`RetryQueue.dlq_records`, :meth:`RetryQueue.replay_dlq`,
:meth:`RetryQueue.discard_dlq`, and :func:`load_dlq` (a read-only listing).

**Several owners** (``driver=`` given: every shoal process over the same RQ/DLQ, each reading
some change-stream partitions):

* Each queue reads the RQ and DLQ topics from the beginning and **keeps reading** them, folding
  every owner's entries into its core (``Observe``; versions are a Lamport clock, so what it
  writes next is newer than what it has seen). So every owner knows which keys are blocked.
* Every owner sends its own new records directly, and parks them when their key is blocked
  (or their delivery fails). **Only the driver sends the RQ's records** (retries, and records
  parked by anyone). ``driver()`` says whether this queue may drive; shoal passes "a task of
  this process leads the heartbeat group with a valid lease". A queue stops driving as soon as
  ``driver()`` says no; it starts only after ``takeover_grace_s`` (the old driver's sends in
  flight end: a send slower than that may be delivered again, after its key's next record) and
  a barrier.
* :meth:`RetryQueue.barrier`: a marker round trip through every RQ/DLQ partition. A reader that
  starts on a change-stream partition calls it (``Sink.prepare``) before it delivers anything,
  so it sees what the partition's previous owner parked: those keys' records wait behind.
* Markers stay in the topics (one per partition per barrier; barriers of one moment share one).
* The DLQ replay subcommand runs its own driving queue: stop the processes first.

**Shard-count changes** (docs/design.md#retry-and-dead-letter-queues): with a ``gate`` (the
sink's :class:`runtime.kafka.output_meta.ProducerSession`), every RQ/DLQ write asks the gate for
the layout to write to (and waits while a change is pending); :meth:`RetryQueue.relayout` moves
the queue to a committed layout (it writes there, and tails the new storage topics too).
:func:`feed` copies what the old storage topics still hold to the newest ones, by the rule of
:func:`protocol.retry.feed_plan`.

Failures are not swallowed: a failed RQ/DLQ write kills the queue's driver (logged), every pending
future fails with :class:`RetryQueueError`, and the exception leaves ``__aexit__``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO, Protocol, Self

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from protocol import trace as tracing
from protocol.retry import (
    Command,
    Deliver,
    DeliveryFailed,
    DeliveryOk,
    DiscardDlq,
    Discarded,
    Drive,
    DriverElection,
    Duplicate,
    Event,
    FeedPlan,
    ForgetSettled,
    LogEntry,
    Observe,
    ParkInRetry,
    Released,
    ReplayDlq,
    RetryCommand,
    RetryCore,
    RetryEvent,
    RetryPolicy,
    SendToDlq,
    SendToSink,
    Tick,
    feed_plan,
    from_log,
)
from protocol.routing import CompositeTopic, StorageTopic, key_hash
from runtime.kafka.config import KafkaConfig
from runtime.kafka.topics import ensure_topic
from runtime.output_record import ordering_key, split_key

__all__ = [
    "InternalMessage",
    "LoadedLog",
    "PendingSend",
    "RetryQueue",
    "RetryQueueConfig",
    "RetryQueueError",
    "RetryQueueStats",
    "WriteGate",
    "feed",
    "internal_topic",
    "load_dlq",
    "ordering_key",
    "replay_via_driver",
    "split_key",
]

log = logging.getLogger(__name__)


class RetryQueueError(RuntimeError):
    """The queue failed or was closed; pending batches will not be settled by it."""


# --- wire format -----------------------------------------------------------------------------


class InternalMessage(msgspec.Struct, frozen=True, kw_only=True):
    """A message of the RQ or DLQ topic: a core log entry with the record, or a read marker."""

    entry: LogEntry | None = None
    payload: bytes | None = None  # the record (the sink's format), on ParkInRetry and SendToDlq
    marker: str | None = None


_int_encoder = msgspec.msgpack.Encoder()
_int_decoder: msgspec.msgpack.Decoder[InternalMessage] = msgspec.msgpack.Decoder(InternalMessage)


def internal_topic(name: str, partitions: int, base: int = 1) -> CompositeTopic:
    """An RQ or DLQ composite topic of one storage topic. It is a scaled copy of an output topic
    whose base is ``base`` when ``partitions`` is a multiple of it (``K = partitions / base``,
    else 1), so a key's RQ/DLQ partition belongs to the same shard as its output partition."""
    k = partitions // base if partitions % base == 0 else 1
    return CompositeTopic(name, (StorageTopic(name, partitions, k),))


# --- configuration and figures ----------------------------------------------------------------


class RetryQueueConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The RQ and DLQ topics of one owner and how it behaves."""

    rq: CompositeTopic
    dlq: CompositeTopic
    # (topic, partition) of the RQ and DLQ this owner reads at start; None: all of them
    partitions: tuple[tuple[str, int], ...] | None = None
    policy: RetryPolicy = msgspec.field(default_factory=RetryPolicy)
    max_unsettled: int = 20_000  # records submitted but not yet settled (backpressure)
    linger_ms: int = 2
    fetch_max_wait_ms: int = 50
    load_timeout_s: float = 60.0
    close_timeout_s: float = 10.0  # a clean exit waits this long for unsettled records
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_unsettled <= 0:
            raise ValueError("max_unsettled must be positive")

    def read_partitions(self) -> list[tuple[str, int]]:
        if self.partitions is not None:
            return list(self.partitions)
        return [
            (st.name, p)
            for t in (self.rq, self.dlq)
            for st in t.storage_topics
            for p in range(st.partitions)
        ]


class RetryQueueStats(msgspec.Struct, frozen=True):
    records_accepted: int  # records submitted (duplicates included)
    records_settled: int
    records_delivered: int  # by the queue (sends answered delivered)
    delivery_failures: int
    rq_writes: int
    dlq_writes: int
    duplicates: int
    unsettled: int
    held: int  # in flight, waiting, in the RQ or in the DLQ
    in_dlq: int
    loaded_entries: int  # log entries read back at start
    missing_payloads: int  # resumed records whose payload was not found (they will fail)
    barriers: int = 0  # catch-up barriers begun (a reader taking a partition over, shared mode)


class PendingSend(msgspec.Struct, frozen=True):
    """One delivery the owner must make; answer with ``delivered`` or ``failed``."""

    record_id: str
    key: str
    attempts: int  # failures so far
    payload: bytes


Send = Callable[[PendingSend], Awaitable[None]]


# --- the loader ------------------------------------------------------------------------------


class LoadedLog(msgspec.Struct):
    entries: list[LogEntry]
    payloads: dict[str, bytes]
    topics: list[str] = msgspec.field(default_factory=list)  # the topic of each entry


async def check_partitions(producer: AIOKafkaProducer, topic: CompositeTopic) -> None:
    for st in topic.storage_topics:
        found = await producer.partitions_for(st.name)
        if set(found) != set(range(st.partitions)):
            raise RetryQueueError(
                f"topic {st.name!r} has partitions {sorted(found)}, {st.partitions} expected: "
                "routing would change; fix the configuration or the topic"
            )


async def load_log(
    config: KafkaConfig,
    producer: AIOKafkaProducer,
    partitions: Sequence[tuple[str, int]],
    *,
    fetch_max_wait_ms: int,
    timeout_s: float,
) -> LoadedLog:
    """Read ``partitions`` from the beginning up to a fresh marker written to each."""
    marker = uuid.uuid4().hex
    want: dict[TopicPartition, int] = {}
    raw_marker = _int_encoder.encode(InternalMessage(marker=marker))
    sends = [
        (TopicPartition(t, p), await producer.send(t, raw_marker, partition=p))
        for t, p in partitions
    ]
    for tp, fut in sends:
        want[tp] = (await fut).offset
    entries: list[LogEntry] = []
    topics: list[str] = []
    payloads: dict[str, tuple[int, bytes]] = {}
    consumer = AIOKafkaConsumer(
        **config.client_kwargs(),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=fetch_max_wait_ms,
    )
    await consumer.start()
    try:
        consumer.assign(list(want))
        await consumer.seek_to_beginning(*want)
        pending = set(want)
        async with asyncio.timeout(timeout_s):
            while pending:
                batches = await consumer.getmany(*pending, timeout_ms=500)
                for tp, msgs in batches.items():
                    for m in msgs:
                        if m.offset >= want[tp]:
                            pending.discard(tp)
                            break
                        if m.value is None:
                            continue
                        try:
                            msg = _int_decoder.decode(m.value)
                        except msgspec.DecodeError:
                            log.exception("undecodable message in %s at offset %d", tp, m.offset)
                            raise
                        if msg.entry is None:
                            continue  # an older marker
                        entries.append(msg.entry)
                        topics.append(tp.topic)
                        if msg.payload is not None:
                            rid, ver = msg.entry.record_id, msg.entry.version
                            if rid not in payloads or payloads[rid][0] < ver:
                                payloads[rid] = (ver, msg.payload)
    finally:
        await consumer.stop()
    return LoadedLog(entries, {rid: p for rid, (_, p) in payloads.items()}, topics)


def make_producer(config: KafkaConfig, linger_ms: int = 2) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        **config.client_kwargs(), acks="all", enable_idempotence=False, linger_ms=linger_ms
    )


async def load_dlq(
    config: KafkaConfig, queue: RetryQueueConfig
) -> list[tuple[SendToDlq, bytes | None]]:
    """The DLQ of ``queue`` (each entry with its payload, if found), read from the RQ and DLQ
    topics; nothing is delivered, only a read marker is written."""
    producer = make_producer(config)
    await producer.start()
    try:
        for topic in (queue.rq, queue.dlq):
            await check_partitions(producer, topic)
        loaded = await load_log(
            config,
            producer,
            queue.read_partitions(),
            fetch_max_wait_ms=queue.fetch_max_wait_ms,
            timeout_s=queue.load_timeout_s,
        )
    finally:
        await producer.stop()
    core = from_log(loaded.entries, queue.policy)
    return [(e, loaded.payloads.get(e.record_id)) for e in core.dlq_records()]


async def feed(
    config: KafkaConfig,
    rq: CompositeTopic,
    dlq: CompositeTopic,
    *,
    fetch_max_wait_ms: int = 50,
    timeout_s: float = 60.0,
) -> FeedPlan:
    """Copy every record still held in the old storage topics of ``rq`` and ``dlq`` (all but
    the one each produces to) to the one it produces to, by :func:`protocol.retry.feed_plan`, and
    wait until Kafka acknowledged every copy. Reads every storage topic from the beginning up to
    a fresh marker, so it is idempotent: run again after a crash, it copies only what is missing.
    The caller runs it after the shard-count change committed (nobody writes to the old storage
    topics any more) and then appends ``Fed``."""
    producer = make_producer(config)
    await producer.start()
    try:
        for topic in (rq, dlq):
            await check_partitions(producer, topic)
        parts = [
            (st.name, p) for t in (rq, dlq) for st in t.storage_topics for p in range(st.partitions)
        ]
        loaded = await load_log(
            config, producer, parts, fetch_max_wait_ms=fetch_max_wait_ms, timeout_s=timeout_s
        )
        newest = {rq.producing.name, dlq.producing.name}
        plan = feed_plan(
            zip(loaded.entries, (t in newest for t in loaded.topics), strict=True),
            loaded.payloads,
        )
        acks = []
        for c in plan.copies:
            target = rq if isinstance(c.entry, ParkInRetry) else dlq
            table, keys = split_key(c.entry.key)
            _, partition = target.route(key_hash(table, keys))
            raw = _int_encoder.encode(InternalMessage(entry=c.entry, payload=c.payload))
            acks.append(
                await producer.send(
                    target.producing.name, raw, key=c.entry.key.encode(), partition=partition
                )
            )
        await asyncio.gather(*acks)
    finally:
        await producer.stop()
    if plan.missing_payloads:
        log.error("feed: %d held record(s) had no payload to copy", plan.missing_payloads)
    return plan


class WriteGate(Protocol):
    """Where RQ/DLQ entries go while the layout may change (a ``ProducerSession``)."""

    async def acquire_layout(self) -> tuple[int, CompositeTopic, CompositeTopic]: ...

    def release_layout(self, layout: int) -> None: ...


async def replay_via_driver(
    config: KafkaConfig,
    queue: RetryQueueConfig,
    record_ids: Iterable[str] | None = None,
    *,
    timeout_s: float = 60.0,
    gate: WriteGate | None = None,
) -> list[str]:
    """Put DLQ records (all, or those named) back into the RQ **for the running driver** (the
    shoal process that leads the group) to deliver, and wait until it did (or dead-lettered
    them again). Nothing is sent from here, so the shoal processes keep running. Raises
    :class:`RetryQueueError` when no driver delivered them within ``timeout_s``."""

    async def never(p: PendingSend) -> None:
        raise RetryQueueError(f"a replay helper does not send records ({p.record_id})")

    timed_out = False
    async with RetryQueue(
        config, queue, never, name="dlq-replay", driver=lambda: False, gate=gate
    ) as rq:
        chosen = rq.replay_dlq(record_ids)
        try:
            async with asyncio.timeout(timeout_s):
                await rq.wait_replayed(chosen)
        except TimeoutError:
            timed_out = True  # raised outside: an error in the body would come out grouped
    if timed_out:
        raise RetryQueueError(
            f"{len(chosen)} replayed record(s) were not delivered within {timeout_s:g}s: "
            "is a shoal process over these topics running (its leader delivers them)?"
        )
    return chosen


# --- the shell -------------------------------------------------------------------------------


@dataclass
class _Batch:
    remaining: int
    future: asyncio.Future[None]


@dataclass
class _Written:
    """An RQ/DLQ write was acknowledged (settles ``record_id`` if it is a park)."""

    record_id: str
    settles: bool


@dataclass
class _WriteFailed:
    what: str
    error: BaseException


@dataclass
class _Stop:
    pass


@dataclass
class _Observed:
    """An entry the tail read, with its record's payload (on ParkInRetry and SendToDlq)."""

    entry: LogEntry
    payload: bytes | None


@dataclass
class _BarrierDone:
    """Every entry before a barrier's markers has been handed to the core (FIFO after them)."""

    future: asyncio.Future[None]


_Item = Event | _Written | _WriteFailed | _Stop | _BarrierDone | _Observed


@dataclass
class _Counters:
    accepted: int = 0
    settled: int = 0
    delivered: int = 0
    failures: int = 0
    rq_writes: int = 0
    dlq_writes: int = 0
    loaded: int = 0
    missing_payloads: int = 0
    barriers: int = 0


class RetryQueue:
    """RQ + DLQ for one owner. ``async with RetryQueue(kafka, config, send) as rq:``.

    ``also_topics`` are created and checked with the RQ and DLQ (the Kafka sink's output topic:
    it shares the queue's producer, :attr:`producer`)."""

    def __init__(
        self,
        config: KafkaConfig,
        queue: RetryQueueConfig,
        send: Send,
        *,
        also_topics: Sequence[CompositeTopic] = (),
        clock: Callable[[], float] = time.time,
        name: str = "retry-queue",
        driver: Callable[[], bool] | None = None,
        takeover_grace_s: float = 10.0,
        steer_interval_s: float = 0.25,
        gate: WriteGate | None = None,
        trace: BinaryIO | None = None,
        validate: bool = False,
    ) -> None:
        """``trace``: record the retry core's inputs and commands there (protocol/trace.py);
        ``validate``: check the core's invariants after every event (debugging)."""
        self._config = config
        self.gate = gate  # RQ/DLQ writes ask it for the layout (a shard-count change may hold)
        # Several owners over these topics (see "Several owners" in the module docstring):
        # ``driver()`` says whether this one may drive the RQ now; None: the only owner.
        self._is_driver = driver
        self._shared = driver is not None
        self._grace = takeover_grace_s
        self._steer_interval = steer_interval_s
        self._driving = not self._shared
        self._tail_task: asyncio.Task[None] | None = None
        self._helpers: list[asyncio.Task[None]] = []  # the tails and the steering loop
        self._tailing: set[tuple[str, int]] = set()
        self._barriers: dict[str, tuple[set[tuple[str, int]], asyncio.Future[None]]] = {}
        self._next_barrier: asyncio.Future[None] | None = None
        self.queue_config = queue
        self.rq = queue.rq
        self.dlq = queue.dlq
        self._send = send
        self._also = tuple(also_topics)
        self._clock = clock
        self.name = name
        self.core = RetryCore(queue.policy, queue.seed, shared=driver is not None)
        self._trace = trace
        if trace is not None:
            start = tracing.RetryStart(name, queue.policy, queue.seed, shared=self._shared)
            trace.write(tracing.encode(start))
        self._validate = validate
        self._payloads: dict[str, bytes] = {}
        self._waiters: dict[str, list[_Batch]] = {}
        self._doomed: dict[str, str] = {}  # record id -> error of a failure that happened already
        self._pending_keys: Counter[str] = Counter()  # keys of Deliver events not handled yet
        self._replay_pending: set[str] = set()  # ReplayDlq events not handled yet
        self._replay_keys: dict[str, str] = {}  # replayed record id -> its key
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._room = asyncio.Event()  # set while fewer than max_unsettled are unsettled
        self._room.set()
        self._producer: AIOKafkaProducer | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._driver: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self._idle = asyncio.Event()
        self._n = _Counters()

    def __repr__(self) -> str:
        return f"RetryQueue({self.name!r}, rq={self.rq.name!r}, dlq={self.dlq.name!r})"

    @property
    def producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise RetryQueueError(f"{self!r} has no producer (not started, or closed)")
        return self._producer

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._start()
        tg = asyncio.TaskGroup()
        await tg.__aenter__()
        self._tg = tg
        self._driver = tg.create_task(self._drive(), name=f"retry-queue-{self.name}")
        if self._shared:
            parts = self.queue_config.read_partitions()
            self._tailing = set(parts)
            self._tail_task = tg.create_task(
                self._tail(parts), name=f"retry-queue-tail-{self.name}"
            )
            self._helpers.append(self._tail_task)
            try:
                await self.barrier()  # everything written so far is folded in
            except BaseException:
                self._driver.cancel()
                self._tail_task.cancel()
                try:
                    await tg.__aexit__(None, None, None)  # the tasks were cancelled: wait
                finally:
                    await self._stop_producer()
                raise
            held = self.core.held_count()
            if held:
                log.info("%r sees %d record(s) in the RQ/DLQ", self, held)
            self._helpers.append(
                tg.create_task(self._steer(), name=f"retry-queue-steer-{self.name}")
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None and self._driver is not None and not self._driver.done():
            try:
                async with asyncio.timeout(self.queue_config.close_timeout_s):
                    await self.wait_idle(include_rq=False)
            except TimeoutError:
                log.warning(
                    "%r: closing with %d record(s) unsettled after %.1f s; their batches fail",
                    self,
                    len(self._waiters),
                    self.queue_config.close_timeout_s,
                )
            except RetryQueueError as err:  # the driver failed: the task group below raises it
                log.warning("%r: closing a failed queue: %s", self, err)
            self._queue.put_nowait(_Stop())
        elif self._driver is not None:
            self._driver.cancel()
        try:
            if self._helpers and self._driver is not None:
                try:
                    await asyncio.wait([self._driver])  # it ends after _Stop (or was cancelled)
                finally:
                    for task in self._helpers:
                        task.cancel()
        finally:
            try:
                if self._tg is not None:
                    await self._tg.__aexit__(exc_type, exc, tb)
            finally:
                closed = RetryQueueError(f"{self!r} is closed")
                self._fail_all(closed)
                self._fail_barriers(closed)
                await self._stop_producer()

    async def abort(self) -> None:
        """Die abruptly (for tests of a task's death): stop processing at once, write nothing
        more to the RQ/DLQ, fail every pending batch. The context manager still has to exit."""
        tasks = [t for t in (self._driver, *self._helpers) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)  # returns when they ended; raises nothing
        aborted = RetryQueueError(f"{self!r} was aborted")
        self._fail_all(aborted)
        self._fail_barriers(aborted)

    async def _start(self) -> None:
        topics = (*self._also, self.rq, self.dlq)
        for topic in topics:
            for st in topic.storage_topics:
                await ensure_topic(self._config, st.name, partitions=st.partitions)
        producer = make_producer(self._config, self.queue_config.linger_ms)
        self._producer = producer
        try:
            await producer.start()
            for topic in topics:
                await check_partitions(producer, topic)
            if self._shared:
                self._step(Drive(False))  # until driver() says so
                return  # the tail reads the topics, the first barrier waits for it
            loaded = await load_log(
                self._config,
                producer,
                self.queue_config.read_partitions(),
                fetch_max_wait_ms=self.queue_config.fetch_max_wait_ms,
                timeout_s=self.queue_config.load_timeout_s,
            )
        except BaseException:
            await self._stop_producer()
            raise
        self.core = from_log(loaded.entries, self.queue_config.policy, self.queue_config.seed)
        self._n.loaded = len(loaded.entries)
        for e in self.core.durable_state():
            payload = loaded.payloads.get(e.record_id)
            if payload is None:
                log.error("%r: no payload for held record %s; it cannot be sent", self, e.record_id)
                self._n.missing_payloads += 1
                continue
            self._payloads[e.record_id] = payload
        held = len(self.core.durable_state())
        if held:
            log.info("%r resumed %d record(s) from the RQ/DLQ", self, held)

    async def _stop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    def _fail_all(self, error: BaseException) -> None:
        batches = {id(b): b for bs in self._waiters.values() for b in bs}
        self._waiters.clear()
        for b in batches.values():
            if not b.future.done():
                b.future.set_exception(error)
                b.future.exception()  # retrieved: a caller that dropped it is not warned about

    # -- submitting ------------------------------------------------------------------------

    async def submit(
        self, records: Sequence[tuple[str, str, bytes]], *, failed: str | None = None
    ) -> asyncio.Future[None]:
        """Accept records ``(record id, ordering key, payload)`` in order (waits while
        ``max_unsettled`` records are not yet settled); the future resolves when every one is
        delivered or durably in the RQ/DLQ. With ``failed``, their first delivery already failed
        with that error (they are parked, the key's first one counted as one failure)."""
        self.check_alive()
        loop = asyncio.get_running_loop()
        tracker = _Batch(len(records), loop.create_future())
        if not records:
            tracker.future.set_result(None)
            return tracker.future
        limit = self.queue_config.max_unsettled
        while self._waiters and len(self._waiters) + len(records) > limit:
            self._room.clear()
            await self._room.wait()
            self.check_alive()
        self._idle.clear()
        for rid, key, payload in records:
            self._n.accepted += 1
            if rid in self._waiters:
                self._waiters[rid].append(tracker)  # an unsettled copy: settle together
            elif self.core.holds(rid):
                self._settled_one(tracker)  # durably in the RQ/DLQ already
            else:
                self._waiters[rid] = [tracker]
                self._payloads[rid] = payload
                if failed is not None:
                    self._doomed[rid] = failed
                self._pending_keys[key] += 1
                self._queue.put_nowait(Deliver(rid, key))
        return tracker.future

    def delivered(self, record_id: str) -> None:
        """The owner delivered a record ``send`` gave it."""
        self._queue.put_nowait(DeliveryOk(record_id))

    def failed(self, record_id: str, error: str) -> None:
        """The owner could not deliver a record ``send`` gave it."""
        self._queue.put_nowait(DeliveryFailed(record_id, error))

    def check_alive(self) -> None:
        if self._dead is not None:
            raise RetryQueueError(f"{self!r} failed: {self._dead!r}") from self._dead
        if self._driver is None or self._driver.done():
            raise RetryQueueError(f"{self!r} is not running (use 'async with')")

    # -- queries ---------------------------------------------------------------------------

    def blocks(self, key: str) -> bool:
        """Whether a new record of ``key`` must go through the queue to keep the key's order."""
        return self._pending_keys[key] > 0 or self.core.blocks(key)

    def busy(self) -> bool:
        """Whether any key may be blocked (cheap; ``False`` means :meth:`blocks` is ``False``
        for every key)."""
        return bool(self._pending_keys) or self.core.held_count() > 0

    def holds(self, record_id: str) -> bool:
        return self.core.holds(record_id)

    def payload(self, record_id: str) -> bytes | None:
        return self._payloads.get(record_id)

    def dlq_records(self) -> list[tuple[SendToDlq, bytes | None]]:
        return [(e, self._payloads.get(e.record_id)) for e in self.core.dlq_records()]

    async def wait_idle(self, *, include_rq: bool = True) -> None:
        """Wait until nothing is unsettled and (``include_rq``) nothing is in flight or in the RQ:
        only DLQ records (and, for blocking keys, the records parked behind them) remain."""
        while True:
            self.check_alive()
            if self._is_idle(include_rq):
                return
            self._idle.clear()
            await self._idle.wait()

    def _is_idle(self, include_rq: bool) -> bool:
        if self._waiters or not self._queue.empty():
            return False
        if not include_rq:
            return True
        # nothing in flight and no retry timer: the RQ holds only records blocked by the DLQ
        return self.core.in_flight_count() == 0 and self.core.next_deadline() is None

    def statistics(self) -> RetryQueueStats:
        core = self.core.statistics()
        return RetryQueueStats(
            records_accepted=self._n.accepted,
            records_settled=self._n.settled,
            records_delivered=self._n.delivered,
            delivery_failures=self._n.failures,
            rq_writes=self._n.rq_writes,
            dlq_writes=self._n.dlq_writes,
            duplicates=core.duplicates,
            unsettled=len(self._waiters),
            held=core.held,
            in_dlq=len(self.core.dlq_records()),
            loaded_entries=self._n.loaded,
            missing_payloads=self._n.missing_payloads,
            barriers=self._n.barriers,
        )

    # -- operator actions ------------------------------------------------------------------

    def replay_dlq(self, record_ids: Iterable[str] | None = None) -> list[str]:
        """Put DLQ records (all, or those named) back into the RQ; return their ids."""
        self.check_alive()
        held = {e.record_id: e.key for e in self.core.dlq_records()}
        chosen = sorted(held if record_ids is None else set(record_ids) & set(held))
        for rid in chosen:
            self._replay_pending.add(rid)
            self._replay_keys[rid] = held[rid]
            self._queue.put_nowait(ReplayDlq(rid))
        if chosen:
            self._idle.clear()
        return chosen

    def discard_dlq(self, record_ids: Iterable[str]) -> list[str]:
        self.check_alive()
        held = {e.record_id for e in self.core.dlq_records()}
        chosen = sorted(set(record_ids) & held)
        for rid in chosen:
            self._queue.put_nowait(DiscardDlq(rid))
        return chosen

    async def wait_replayed(self, record_ids: Sequence[str]) -> None:
        """Wait until each of ``record_ids`` (from :meth:`replay_dlq`) was delivered together
        with the records of its key parked behind it, or was dead-lettered again."""
        while True:
            self.check_alive()
            if all(self._replay_done(rid) for rid in record_ids):
                return
            await asyncio.sleep(0.05)

    def _replay_done(self, record_id: str) -> bool:
        if record_id in self._replay_pending:
            return False
        key = self._replay_keys.get(record_id)
        if key is None:
            return True
        g = self.core.group_state(key)
        if g.in_flight is not None or g.waiting:
            return False
        return not g.rq or (self.core.policy.dlq_blocks and bool(g.dlq))

    # -- several owners --------------------------------------------------------------------

    async def barrier(self) -> None:
        """Return once every RQ/DLQ entry written before this call, by any owner, has been
        folded into this queue's core: a fresh marker is written to each partition this queue
        reads and read back. Callers in the same moment share one round trip. A new reader of
        a change-stream partition calls it (through its sink's ``prepare``) before it delivers
        anything, so it sees the records the partition's previous owner parked (their keys stay
        blocked). A single owner returns at once."""
        if not self._shared:
            return
        self.check_alive()
        future = self._next_barrier
        if future is None:
            future = self._next_barrier = asyncio.get_running_loop().create_future()
            assert self._tg is not None
            self._tg.create_task(self._run_barrier(future), name=f"retry-queue-barrier-{self.name}")
        try:
            async with asyncio.timeout(self.queue_config.load_timeout_s):
                await asyncio.shield(future)
        except TimeoutError:
            raise RetryQueueError(
                f"{self!r}: reading the RQ/DLQ up to a fresh marker did not finish within "
                f"{self.queue_config.load_timeout_s:.0f}s"
            ) from None

    async def _run_barrier(self, future: asyncio.Future[None]) -> None:
        await asyncio.sleep(0)  # callers of this same moment join it
        if self._next_barrier is future:
            self._next_barrier = None  # later callers need markers written after their call
        marker = uuid.uuid4().hex
        parts = self.queue_config.read_partitions()
        self._barriers[marker] = ({(t, p) for t, p in parts}, future)
        # once it completes, settled records' versions up to here can be forgotten
        future.add_done_callback(functools.partial(self._barrier_passed, upto=self.core.clock))
        self._n.barriers += 1
        raw = _int_encoder.encode(InternalMessage(marker=marker))
        try:
            acks = [await self.producer.send(t, raw, partition=p) for t, p in parts]
            await asyncio.gather(*acks)
        except Exception as exc:
            self._barriers.pop(marker, None)
            if not future.done():
                future.set_exception(RetryQueueError(f"{self!r}: barrier failed: {exc!r}"))
                future.exception()  # retrieved here: the callers get it through the shield

    def _barrier_passed(self, future: asyncio.Future[None], *, upto: int) -> None:
        if not future.cancelled() and future.exception() is None:
            self._step(ForgetSettled(upto))

    def _fail_barriers(self, error: BaseException) -> None:
        futures = [f for _, f in self._barriers.values()]
        if self._next_barrier is not None:
            futures.append(self._next_barrier)
        self._barriers.clear()
        for f in futures:
            if not f.done():
                f.set_exception(error)
                f.exception()

    def relayout(
        self,
        rq: CompositeTopic,
        dlq: CompositeTopic,
        partitions: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        """A shard-count change committed: RQ/DLQ entries go to the newest storage topics of
        ``rq`` and ``dlq`` from now on (the gate routes each write; this keeps the queue's view
        in step), and the queue reads ``partitions`` (None: every partition of both) as well as
        what it read before: a shared queue tails the new ones from the beginning."""
        old = self.queue_config.read_partitions()
        fresh = msgspec.structs.replace(self.queue_config, rq=rq, dlq=dlq, partitions=None)
        wanted = fresh.read_partitions() if partitions is None else list(partitions)
        merged = list(dict.fromkeys([*old, *wanted]))
        self.queue_config = msgspec.structs.replace(fresh, partitions=tuple(merged))
        self.rq, self.dlq = rq, dlq
        if not self._shared or self._tg is None:
            return  # not tailing (yet): __aenter__ reads the new set
        new = [tp for tp in merged if tp not in self._tailing]
        if new:
            self._tailing.update(new)
            self._helpers.append(
                self._tg.create_task(self._tail(new), name=f"retry-queue-tail-{self.name}")
            )

    async def _tail(self, read: Sequence[tuple[str, int]]) -> None:
        """Read RQ and DLQ partitions ``read`` from the beginning, for as long as the queue runs:
        every entry goes to the core (``Observe``), in order with this queue's other events."""
        parts = [TopicPartition(t, p) for t, p in read]
        consumer = AIOKafkaConsumer(
            **self._config.client_kwargs(),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=self.queue_config.fetch_max_wait_ms,
        )
        try:
            await consumer.start()
            try:
                consumer.assign(parts)
                await consumer.seek_to_beginning(*parts)
                while True:
                    batches = await consumer.getmany(*parts, timeout_ms=500)
                    for tp, msgs in batches.items():
                        for m in msgs:
                            if m.value is not None:
                                self._tailed(tp, m.offset, m.value)
            finally:
                await consumer.stop()
        except Exception:
            log.exception("%r: reading the RQ/DLQ failed; the queue stops", self)
            raise

    def _tailed(self, tp: TopicPartition, offset: int, raw: bytes) -> None:
        try:
            msg = _int_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            # skipping it could lose a parked record: stop the queue, loudly
            raise RetryQueueError(
                f"{self!r}: undecodable message in {tp.topic}[{tp.partition}] at offset "
                f"{offset}: {exc}"
            ) from exc
        if msg.marker is not None:
            waiting = self._barriers.get(msg.marker)
            if waiting is not None:
                waiting[0].discard((tp.topic, tp.partition))
                if not waiting[0]:
                    del self._barriers[msg.marker]
                    self._queue.put_nowait(_BarrierDone(waiting[1]))
            return
        if msg.entry is None:
            return
        self._n.loaded += 1
        self._queue.put_nowait(_Observed(msg.entry, msg.payload))

    async def _steer(self) -> None:
        """Follow ``driver()`` by the take-over rule of ``protocol.retry.DriverElection``: stop
        driving at once when it says no; when it says yes, wait ``takeover_grace_s``, catch up
        with the log (a barrier: its last entries are folded in), then drive."""
        assert self._is_driver is not None
        election = DriverElection(self._grace)
        while True:
            step = election.step(self._is_driver(), time.monotonic())
            if step.stop:
                self._driving = False
                self._queue.put_nowait(Drive(False))
                log.info("%r: not driving the RQ any more", self)
            elif step.catch_up:
                try:
                    await self.barrier()
                except RetryQueueError as exc:
                    election.caught_up(ok=False, eligible=self._is_driver())
                    if self._dead is not None or self._driver is None or self._driver.done():
                        return  # the queue failed: its driver says why
                    log.warning("%r: cannot take the RQ over yet: %s", self, exc)
                else:
                    if election.caught_up(ok=True, eligible=self._is_driver()):
                        self._driving = True
                        self._queue.put_nowait(Drive(True))
                        log.info("%r: driving the RQ", self)
            await asyncio.sleep(self._steer_interval)

    @property
    def driving(self) -> bool:
        """Whether this queue sends the RQ's records (always, for a single owner)."""
        return self._driving

    # -- the driver ------------------------------------------------------------------------

    async def _drive(self) -> None:
        try:
            await self._loop()
        except BaseException as exc:
            self._dead = exc
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("%r: the retry-queue driver failed", self)
            self._fail_all(RetryQueueError(f"{self!r} failed: {exc!r}"))
            self._fail_barriers(RetryQueueError(f"{self!r} failed: {exc!r}"))
            self._idle.set()
            self._room.set()
            raise

    async def _loop(self) -> None:
        await self._handle(Tick())  # records resumed from the RQ that are due now
        while True:
            deadline = self.core.next_deadline()
            wait = None if deadline is None else deadline - self._clock()
            if wait is not None and wait <= 0:
                item: _Item = Tick()
            elif not self._queue.empty():
                item = self._queue.get_nowait()
            else:
                try:
                    item = await asyncio.wait_for(self._queue.get(), wait)
                except TimeoutError:
                    item = Tick()
            match item:
                case _Stop():
                    break
                case _WriteFailed(what=what, error=error):
                    raise RetryQueueError(f"{self!r}: writing {what} failed: {error!r}") from error
                case _Written(record_id=rid, settles=settles):
                    if settles:
                        self._settle(rid)
                case _BarrierDone(future=future):
                    if not future.done():
                        future.set_result(None)
                case _Observed(entry=entry, payload=payload):
                    rid = entry.record_id
                    if payload is not None and rid not in self._payloads:
                        self._payloads[rid] = payload
                    await self._handle(Observe(entry))
                    if not self.core.holds(rid) and rid not in self._waiters:
                        self._payloads.pop(rid, None)
                case Event():
                    await self._handle(item)
            if self._is_idle(include_rq=False):
                self._idle.set()  # wait_idle() re-checks its own condition
        producer = self._producer
        if producer is not None:
            await producer.flush()

    def _step(self, event: Event) -> list[Command]:
        """One event through the core (traced and checked when asked)."""
        now = self._clock()
        cmds = self.core.handle(event, now)
        if self._trace is not None:
            assert isinstance(event, RetryEvent), event
            recorded = tuple(c for c in cmds if isinstance(c, RetryCommand))
            assert len(recorded) == len(cmds), cmds
            step = tracing.RetryStep(self.name, now, event, recorded)
            self._trace.write(tracing.encode(step))
        if self._validate:
            self.core.validate()
        return cmds

    async def _handle(self, event: Event) -> None:
        if isinstance(event, DeliveryOk):
            self._n.delivered += 1
            self._settle(event.record_id)
        elif isinstance(event, DeliveryFailed):
            self._n.failures += 1
        cmds = self._step(event)
        if isinstance(event, ReplayDlq):
            self._replay_pending.discard(event.record_id)
        if isinstance(event, Deliver):
            self._pending_keys[event.key] -= 1
            if self._pending_keys[event.key] <= 0:
                del self._pending_keys[event.key]
        for cmd in cmds:
            match cmd:
                case SendToSink(record_id=rid, key=key, attempts=attempts):
                    await self._deliver(rid, key, attempts)
                case ParkInRetry() | Released():
                    self._n.rq_writes += 1
                    payload = self._payloads.get(cmd.record_id)
                    await self._write(False, cmd, payload if isinstance(cmd, ParkInRetry) else None)
                case SendToDlq() | Discarded():
                    self._n.dlq_writes += 1
                    payload = self._payloads.get(cmd.record_id)
                    await self._write(True, cmd, payload if isinstance(cmd, SendToDlq) else None)
                    if isinstance(cmd, Discarded):
                        self._payloads.pop(cmd.record_id, None)
                case Duplicate():
                    pass  # counted by the core; submit() settled it
        if isinstance(event, DeliveryOk) and not self.core.holds(event.record_id):
            # (another owner's park of the same record, deferred meanwhile, may hold it again)
            self._payloads.pop(event.record_id, None)

    async def _deliver(self, rid: str, key: str, attempts: int) -> None:
        doomed = self._doomed.pop(rid, None)
        if doomed is not None:
            self._queue.put_nowait(DeliveryFailed(rid, doomed))
            return
        payload = self._payloads.get(rid)
        if payload is None:
            self._queue.put_nowait(DeliveryFailed(rid, "no payload for this record"))
            return
        await self._send(PendingSend(rid, key, attempts, payload))

    async def _write(self, dlq: bool, entry: LogEntry, payload: bytes | None) -> None:
        gate, layout = self.gate, -1
        if gate is None:
            topic = self.dlq if dlq else self.rq
        else:  # the layout a shard-count change committed last (waits while one is pending)
            layout, rq_topic, dlq_topic = await gate.acquire_layout()
            topic = dlq_topic if dlq else rq_topic
        table, keys = split_key(entry.key)
        idx, partition = topic.route(key_hash(table, keys))
        name = topic.storage_topics[idx].name
        raw = _int_encoder.encode(InternalMessage(entry=entry, payload=payload))
        settles = isinstance(entry, ParkInRetry | SendToDlq)
        what = f"{type(entry).__name__} of {entry.record_id} to {name}"
        try:
            fut = await self.producer.send(name, raw, key=entry.key.encode(), partition=partition)
        except KafkaError as exc:
            if gate is not None:
                gate.release_layout(layout)
            raise RetryQueueError(f"{self!r}: writing {what} failed: {exc!r}") from exc
        rid = entry.record_id

        def done(f: asyncio.Future[object]) -> None:
            if gate is not None:
                gate.release_layout(layout)
            if f.cancelled():
                self._queue.put_nowait(_WriteFailed(what, RetryQueueError("cancelled")))
            elif (exc := f.exception()) is not None:
                self._queue.put_nowait(_WriteFailed(what, exc))
            else:
                self._queue.put_nowait(_Written(rid, settles))

        fut.add_done_callback(done)

    def _settle(self, rid: str) -> None:
        self._doomed.pop(rid, None)
        batches = self._waiters.pop(rid, None)
        if batches is None:
            return
        for b in batches:
            self._settled_one(b)
        if len(self._waiters) < self.queue_config.max_unsettled:
            self._room.set()

    def _settled_one(self, b: _Batch) -> None:
        self._n.settled += 1
        b.remaining -= 1
        if b.remaining == 0 and not b.future.done():
            b.future.set_result(None)
