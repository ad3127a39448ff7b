"""A Kafka output sink with a retry queue and a dead-letter queue (design 003).

:class:`KafkaSink` implements :class:`runtime.ports.Sink`. Every mod of every ``DataChange``
becomes one :class:`OutputRecord` (JSON), produced to the output composite topic ``<name>``
keyed by ``<table>:<primary-key JSON>``; the partition is ``Router(key_hash)`` of the storage
topic the produce pointer names (:mod:`protocol.routing`), so producers agree on it and it stays
shard consistent when the topic is scaled.

The rules of delivery are those of :mod:`protocol.retry` (the pure core this module drives):

* per key, records go out in commit order, one at a time (the next after the previous is
  acknowledged by Kafka); other keys are not held up by a failing key;
* a failed delivery is parked in the RQ topic ``<name>_rq`` and retried with backoff; the key's
  later records are parked behind it; after ``max_attempts`` failures it goes to the DLQ topic
  ``<name>_dlq``; a key with a DLQ record blocks or releases (``RetryPolicy.dlq_blocks``);
* the RQ and DLQ topics hold the core's log entries (each with its payload), routed by the same
  key hash, so **a new sink over the same topics resumes the state**: at start it writes a marker
  to every RQ/DLQ partition and reads each from the beginning until its marker comes back
  (``end_offsets`` is wrong on the embedded broker), folds the entries with
  :func:`protocol.retry.from_log` and retries what is due.

A batch's future (``put``) resolves when each of its records is settled: delivered to the output
topic, or durably written to the RQ or the DLQ. It fails if the sink dies first; the caller then
re-delivers from its watermark, and records the sink already holds are recognised by id.
Delivery is at least once: a crash after a retried record reached the output but before its
``Released`` entry was written delivers it again (``OutputRecord.record_id`` is the de-duplication
key).

:func:`list_dlq` and :func:`replay_dlq` are the operator helpers (the CLI calls them). Replay runs
a sink over the topics, so the regular owner must be stopped meanwhile (one owner at a time;
fencing is not implemented).

For tests, ``inject`` is a failure injector: ``inject(record, attempts)`` returns an error text to
fail that delivery (before anything is produced), or ``None``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from protocol.records import DataChange
from protocol.retry import (
    Deliver,
    DeliveryFailed,
    DeliveryOk,
    DiscardDlq,
    Discarded,
    Duplicate,
    Event,
    LogEntry,
    ParkInRetry,
    Released,
    ReplayDlq,
    RetryCore,
    RetryPolicy,
    SendToDlq,
    SendToSink,
    Tick,
    from_log,
)
from protocol.routing import (
    CompositeTopic,
    StorageTopic,
    key_hash,
    partitions_for_shard,
    shard_of_partition,
)
from runtime.kafka import KafkaConfig, ensure_topic
from runtime.ports import SinkBatch

log = logging.getLogger(__name__)


class SinkError(RuntimeError):
    """The sink failed or was closed; pending batches will not be committed by it."""


# --- wire formats --------------------------------------------------------------------------


class OutputRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One row change on the output topic (JSON)."""

    record_id: str  # "<commit_ts>/<server_transaction_id>/<record_sequence>/<mod index>"
    table: str
    keys: str  # primary-key JSON text, as Spanner sends it
    mod_type: str
    commit_ts: int
    server_transaction_id: str
    record_sequence: str
    mod_index: int
    new_values: str
    old_values: str

    @property
    def key(self) -> str:
        return ordering_key(self.table, self.keys)


class InternalMessage(msgspec.Struct, frozen=True, kw_only=True):
    """A message of the RQ or DLQ topic: a core log entry with the record, or a read marker."""

    entry: LogEntry | None = None
    payload: bytes | None = None  # the OutputRecord JSON, on ParkInRetry and SendToDlq
    marker: str | None = None


_out_encoder = msgspec.json.Encoder()
_out_decoder: msgspec.json.Decoder[OutputRecord] = msgspec.json.Decoder(OutputRecord)
_int_encoder = msgspec.msgpack.Encoder()
_int_decoder: msgspec.msgpack.Decoder[InternalMessage] = msgspec.msgpack.Decoder(InternalMessage)


def decode_output(raw: bytes) -> OutputRecord:
    return _out_decoder.decode(raw)


def ordering_key(table: str, keys: str) -> str:
    """The ordering key of a row (Spanner table names have no ':')."""
    return f"{table}:{keys}"


def split_key(key: str) -> tuple[str, str]:
    table, _, keys = key.partition(":")
    return table, keys


def output_records(change: DataChange) -> list[OutputRecord]:
    """One output record per mod of ``change``."""
    return [
        OutputRecord(
            record_id=f"{change.commit_ts}/{change.server_transaction_id}/"
            f"{change.record_sequence}/{i}",
            table=change.table,
            keys=mod.keys,
            mod_type=change.mod_type,
            commit_ts=change.commit_ts,
            server_transaction_id=change.server_transaction_id,
            record_sequence=change.record_sequence,
            mod_index=i,
            new_values=mod.new_values,
            old_values=mod.old_values,
        )
        for i, mod in enumerate(change.mods)
    ]


FailureInjector = Callable[[OutputRecord, int], str | None]


# --- configuration -------------------------------------------------------------------------


class KafkaSinkConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Topics and behaviour of one output sink. The output composite topic defaults to one
    storage topic ``name`` of ``partitions`` partitions; RQ and DLQ are ``<name>_rq`` and
    ``<name>_dlq`` (``rq_partitions``, ``dlq_partitions``).

    The RQ and DLQ are scaled copies of the output topic's base (``P / K`` of the storage topic
    produced to) when their partition count is a multiple of it (``K = r / base``, else 1), so a
    key's RQ/DLQ partition belongs to the same shard as its output partition. With
    ``shard_count > 1`` this sink is shard ``shard_id``: it accepts only keys whose output
    partition is in its range, and resumes only its ranges of the RQ and DLQ. The seed asks that
    ``shard_count`` divide the output base and the RQ/DLQ partition counts; this is checked."""

    name: str
    partitions: int = 4
    rq_partitions: int = 4
    dlq_partitions: int = 4
    output: CompositeTopic | None = None  # overrides name/partitions for the output topic
    policy: RetryPolicy = msgspec.field(default_factory=RetryPolicy)
    max_unsettled: int = 20_000  # records accepted but not yet settled (backpressure)
    linger_ms: int = 2
    fetch_max_wait_ms: int = 50
    load_timeout_s: float = 60.0
    close_timeout_s: float = 10.0  # a clean exit waits this long for unsettled records
    seed: int = 0
    shard_id: int = 0
    shard_count: int = 1

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("the sink needs a topic name")
        for attr in (
            "partitions",
            "rq_partitions",
            "dlq_partitions",
            "max_unsettled",
            "shard_count",
        ):
            if getattr(self, attr) <= 0:
                raise ValueError(f"{attr} must be positive")
        if not 0 <= self.shard_id < self.shard_count:
            raise ValueError(f"shard_id {self.shard_id} out of range for {self.shard_count} shards")
        base = self.output_topic().producing.base
        for label, n in (
            ("output base", base),
            ("rq_partitions", self.rq_partitions),
            ("dlq_partitions", self.dlq_partitions),
        ):
            if n % self.shard_count:
                raise ValueError(f"shard_count {self.shard_count} must divide the {label} ({n})")

    def _internal(self, name: str, partitions: int) -> CompositeTopic:
        base = self.output_topic().producing.base
        k = partitions // base if partitions % base == 0 else 1
        return CompositeTopic(name, (StorageTopic(name, partitions, k),))

    def owns(self, key: str) -> bool:
        """Whether this shard owns ``key`` (its output partition is in the shard's range)."""
        if self.shard_count == 1:
            return True
        table, keys = split_key(key)
        out = self.output_topic()
        _, partition = out.route(key_hash(table, keys))
        return shard_of_partition(partition, out.producing.partitions, self.shard_count) == (
            self.shard_id
        )

    def internal_partitions(self) -> list[tuple[str, int]]:
        """(topic, partition) of the RQ and DLQ this shard reads."""
        return [
            (st.name, p)
            for t in (self.rq_topic(), self.dlq_topic())
            for st in t.storage_topics
            for p in partitions_for_shard(self.shard_id, st.partitions, self.shard_count)
        ]

    def output_topic(self) -> CompositeTopic:
        return self.output or CompositeTopic.create(self.name, self.partitions)

    def rq_topic(self) -> CompositeTopic:
        return self._internal(f"{self.name}_rq", self.rq_partitions)

    def dlq_topic(self) -> CompositeTopic:
        return self._internal(f"{self.name}_dlq", self.dlq_partitions)


class KafkaSinkStats(msgspec.Struct, frozen=True):
    records_accepted: int
    records_settled: int
    records_delivered: int
    delivery_failures: int
    injected_failures: int
    rq_writes: int
    dlq_writes: int
    duplicates: int
    unsettled: int
    held: int  # in flight, waiting, in the RQ or in the DLQ
    in_dlq: int
    loaded_entries: int  # log entries read back at start
    missing_payloads: int  # resumed records whose payload was not found (they will fail)


class DlqRecord(msgspec.Struct, frozen=True):
    record_id: str
    key: str
    attempts: int
    error: str
    record: OutputRecord | None  # None if the payload could not be found or decoded


# --- the loader ----------------------------------------------------------------------------


class _Loaded(msgspec.Struct):
    entries: list[LogEntry]
    payloads: dict[str, bytes]


async def _check_partitions(producer: AIOKafkaProducer, topic: CompositeTopic) -> None:
    for st in topic.storage_topics:
        found = await producer.partitions_for(st.name)
        if set(found) != set(range(st.partitions)):
            raise SinkError(
                f"topic {st.name!r} has partitions {sorted(found)}, the sink expects "
                f"{st.partitions}: routing would change; fix the configuration or the topic"
            )


async def _load_internal(
    config: KafkaConfig,
    producer: AIOKafkaProducer,
    partitions: Sequence[tuple[str, int]],
    *,
    fetch_max_wait_ms: int,
    timeout_s: float,
) -> _Loaded:
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
                        if msg.payload is not None:
                            rid, ver = msg.entry.record_id, msg.entry.version
                            if rid not in payloads or payloads[rid][0] < ver:
                                payloads[rid] = (ver, msg.payload)
    finally:
        await consumer.stop()
    return _Loaded(entries, {rid: p for rid, (_, p) in payloads.items()})


# --- the sink ------------------------------------------------------------------------------


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


_Item = Event | _Written | _WriteFailed | _Stop


@dataclass
class _Counters:
    accepted: int = 0
    settled: int = 0
    delivered: int = 0
    failures: int = 0
    injected: int = 0
    rq_writes: int = 0
    dlq_writes: int = 0
    loaded: int = 0
    missing_payloads: int = 0


class KafkaSink:
    """The Kafka output sink. Use ``async with KafkaSink(config, sink_config) as sink:``."""

    def __init__(
        self,
        config: KafkaConfig,
        sink: KafkaSinkConfig,
        *,
        inject: FailureInjector | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self.sink_config = sink
        self.output = sink.output_topic()
        self.rq = sink.rq_topic()
        self.dlq = sink.dlq_topic()
        self._inject = inject
        self._clock = clock
        self._core = RetryCore(sink.policy, sink.seed)
        self._payloads: dict[str, bytes] = {}
        self._waiters: dict[str, list[_Batch]] = {}
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
        return f"KafkaSink({self.sink_config.name!r}, config={self._config!r})"

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._start()
        tg = asyncio.TaskGroup()
        await tg.__aenter__()
        self._tg = tg
        self._driver = tg.create_task(self._drive(), name=f"kafka-sink-{self.sink_config.name}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None and self._driver is not None and not self._driver.done():
            try:
                async with asyncio.timeout(self.sink_config.close_timeout_s):
                    await self.wait_idle(include_rq=False)
            except TimeoutError:
                log.warning(
                    "%r: closing with %d record(s) unsettled after %.1f s; their batches fail",
                    self,
                    len(self._waiters),
                    self.sink_config.close_timeout_s,
                )
            except SinkError as err:  # the driver failed: the task group below raises it
                log.warning("%r: closing a failed sink: %s", self, err)
            self._queue.put_nowait(_Stop())
        elif self._driver is not None:
            self._driver.cancel()
        try:
            if self._tg is not None:
                await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            self._fail_all(SinkError(f"{self!r} is closed"))
            await self._stop_producer()

    async def abort(self) -> None:
        """Die abruptly (for tests of a task's death): stop processing at once, write nothing
        more to the RQ/DLQ, fail every pending batch. The context manager still has to exit."""
        if self._driver is not None:
            self._driver.cancel()
            await asyncio.wait([self._driver])  # returns when it ended; raises nothing
        self._fail_all(SinkError(f"{self!r} was aborted"))

    async def _start(self) -> None:
        for topic in (self.output, self.rq, self.dlq):
            for st in topic.storage_topics:
                await ensure_topic(self._config, st.name, partitions=st.partitions)
        producer = AIOKafkaProducer(
            **self._config.client_kwargs(),
            acks="all",
            enable_idempotence=False,
            linger_ms=self.sink_config.linger_ms,
        )
        self._producer = producer
        try:
            await producer.start()
            for topic in (self.output, self.rq, self.dlq):
                await _check_partitions(producer, topic)
            loaded = await _load_internal(
                self._config,
                producer,
                self.sink_config.internal_partitions(),
                fetch_max_wait_ms=self.sink_config.fetch_max_wait_ms,
                timeout_s=self.sink_config.load_timeout_s,
            )
        except BaseException:
            await self._stop_producer()
            raise
        self._core = from_log(loaded.entries, self.sink_config.policy, self.sink_config.seed)
        self._n.loaded = len(loaded.entries)
        for e in self._core.durable_state():
            payload = loaded.payloads.get(e.record_id)
            if payload is None:
                log.error("%r: no payload for held record %s; it cannot be sent", self, e.record_id)
                self._n.missing_payloads += 1
                continue
            self._payloads[e.record_id] = payload
        held = len(self._core.durable_state())
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

    # -- the Sink port ---------------------------------------------------------------------

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        """Accept a batch (waits while ``max_unsettled`` records are not yet settled); the future
        resolves when every record is delivered or durably in the RQ/DLQ."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        records = [r for change in batch.records for r in output_records(change)]
        for rec in records:
            if not self.sink_config.owns(rec.key):
                raise ValueError(
                    f"record {rec.record_id} (key {rec.key}) belongs to another shard than "
                    f"{self.sink_config.shard_id} of {self.sink_config.shard_count}"
                )
        tracker = _Batch(len(records), loop.create_future())
        if not records:
            tracker.future.set_result(None)
            return tracker.future
        limit = self.sink_config.max_unsettled
        while self._waiters and len(self._waiters) + len(records) > limit:
            self._room.clear()
            await self._room.wait()
            self._check_alive()
        self._idle.clear()
        for rec in records:
            self._n.accepted += 1
            rid = rec.record_id
            if rid in self._waiters:
                self._waiters[rid].append(tracker)  # an unsettled copy: settle together
            elif self._core.holds(rid):
                self._settled_one(tracker)  # durably in the RQ/DLQ already
            else:
                self._waiters[rid] = [tracker]
                self._payloads[rid] = _out_encoder.encode(rec)
                self._queue.put_nowait(Deliver(rid, rec.key))
        return tracker.future

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise SinkError(f"{self!r} failed: {self._dead!r}") from self._dead
        if self._driver is None or self._driver.done():
            raise SinkError(f"{self!r} is not running (use 'async with')")

    # -- operator actions ------------------------------------------------------------------

    def dlq_records(self) -> list[DlqRecord]:
        out = []
        for e in self._core.dlq_records():
            raw = self._payloads.get(e.record_id)
            out.append(DlqRecord(e.record_id, e.key, e.attempts, e.error, _maybe_decode(raw)))
        return out

    def replay_dlq(self, record_ids: Iterable[str] | None = None) -> list[str]:
        """Put DLQ records (all, or those named) back into the RQ; return their ids."""
        self._check_alive()
        held = {e.record_id for e in self._core.dlq_records()}
        chosen = sorted(held if record_ids is None else set(record_ids) & held)
        for rid in chosen:
            self._queue.put_nowait(ReplayDlq(rid))
        if chosen:
            self._idle.clear()
        return chosen

    def discard_dlq(self, record_ids: Iterable[str]) -> list[str]:
        self._check_alive()
        held = {e.record_id for e in self._core.dlq_records()}
        chosen = sorted(set(record_ids) & held)
        for rid in chosen:
            self._queue.put_nowait(DiscardDlq(rid))
        return chosen

    def holds(self, record_id: str) -> bool:
        return self._core.holds(record_id)

    async def wait_idle(self, *, include_rq: bool = True) -> None:
        """Wait until nothing is unsettled and (``include_rq``) nothing is in flight or in the RQ:
        only DLQ records (and, for blocking keys, the records parked behind them) remain."""
        while True:
            self._check_alive()
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
        return self._core.in_flight_count() == 0 and self._core.next_deadline() is None

    def statistics(self) -> KafkaSinkStats:
        core = self._core.statistics()
        return KafkaSinkStats(
            records_accepted=self._n.accepted,
            records_settled=self._n.settled,
            records_delivered=self._n.delivered,
            delivery_failures=self._n.failures,
            injected_failures=self._n.injected,
            rq_writes=self._n.rq_writes,
            dlq_writes=self._n.dlq_writes,
            duplicates=core.duplicates,
            unsettled=len(self._waiters),
            held=core.held,
            in_dlq=len(self._core.dlq_records()),
            loaded_entries=self._n.loaded,
            missing_payloads=self._n.missing_payloads,
        )

    # -- the driver ------------------------------------------------------------------------

    async def _drive(self) -> None:
        try:
            await self._loop()
        except BaseException as exc:
            self._dead = exc
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("%r: the sink driver failed", self)
            self._fail_all(SinkError(f"{self!r} failed: {exc!r}"))
            self._idle.set()
            self._room.set()
            raise

    async def _loop(self) -> None:
        await self._handle(Tick())  # records resumed from the RQ that are due now
        while True:
            deadline = self._core.next_deadline()
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
                    raise SinkError(f"{self!r}: writing {what} failed: {error!r}") from error
                case _Written(record_id=rid, settles=settles):
                    if settles:
                        self._settle(rid)
                case Event():
                    await self._handle(item)
            if self._is_idle(include_rq=False):
                self._idle.set()  # wait_idle() re-checks its own condition
        producer = self._producer
        if producer is not None:
            await producer.flush()

    async def _handle(self, event: Event) -> None:
        if isinstance(event, DeliveryOk):
            self._n.delivered += 1
            self._settle(event.record_id)
        elif isinstance(event, DeliveryFailed):
            self._n.failures += 1
        for cmd in self._core.handle(event, self._clock()):
            match cmd:
                case SendToSink(record_id=rid, key=key, attempts=attempts):
                    await self._send(rid, key, attempts)
                case ParkInRetry() | Released():
                    self._n.rq_writes += 1
                    payload = self._payloads.get(cmd.record_id)
                    await self._write(
                        self.rq, cmd, payload if isinstance(cmd, ParkInRetry) else None
                    )
                case SendToDlq() | Discarded():
                    self._n.dlq_writes += 1
                    payload = self._payloads.get(cmd.record_id)
                    await self._write(
                        self.dlq, cmd, payload if isinstance(cmd, SendToDlq) else None
                    )
                    if isinstance(cmd, Discarded):
                        self._payloads.pop(cmd.record_id, None)
                case Duplicate():
                    pass  # counted by the core; put() settled it
        if isinstance(event, DeliveryOk):
            self._payloads.pop(event.record_id, None)

    async def _send(self, rid: str, key: str, attempts: int) -> None:
        payload = self._payloads.get(rid)
        if payload is None:
            self._queue.put_nowait(DeliveryFailed(rid, "no payload for this record"))
            return
        if self._inject is not None:
            error = self._inject(_out_decoder.decode(payload), attempts)
            if error is not None:
                self._n.injected += 1
                self._queue.put_nowait(DeliveryFailed(rid, error))
                return
        table, keys = split_key(key)
        idx, partition = self.output.route(key_hash(table, keys))
        topic = self.output.storage_topics[idx].name
        producer = self._live_producer()
        try:
            fut = await producer.send(topic, payload, key=key.encode(), partition=partition)
        except KafkaError as exc:
            log.warning("%r: producing %s failed: %r", self, rid, exc)
            self._queue.put_nowait(DeliveryFailed(rid, repr(exc)))
            return

        def done(f: asyncio.Future[object]) -> None:
            if f.cancelled():
                self._queue.put_nowait(DeliveryFailed(rid, "produce cancelled"))
            elif (exc := f.exception()) is not None:
                log.warning("%r: delivery of %s failed: %r", self, rid, exc)
                self._queue.put_nowait(DeliveryFailed(rid, repr(exc)))
            else:
                self._queue.put_nowait(DeliveryOk(rid))

        fut.add_done_callback(done)

    async def _write(self, topic: CompositeTopic, entry: LogEntry, payload: bytes | None) -> None:
        table, keys = split_key(entry.key)
        idx, partition = topic.route(key_hash(table, keys))
        name = topic.storage_topics[idx].name
        raw = _int_encoder.encode(InternalMessage(entry=entry, payload=payload))
        settles = isinstance(entry, ParkInRetry | SendToDlq)
        what = f"{type(entry).__name__} of {entry.record_id} to {name}"
        producer = self._live_producer()
        try:
            fut = await producer.send(name, raw, key=entry.key.encode(), partition=partition)
        except KafkaError as exc:
            raise SinkError(f"{self!r}: writing {what} failed: {exc!r}") from exc
        rid = entry.record_id

        def done(f: asyncio.Future[object]) -> None:
            if f.cancelled():
                self._queue.put_nowait(_WriteFailed(what, SinkError("cancelled")))
            elif (exc := f.exception()) is not None:
                self._queue.put_nowait(_WriteFailed(what, exc))
            else:
                self._queue.put_nowait(_Written(rid, settles))

        fut.add_done_callback(done)

    def _live_producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise SinkError(f"{self!r} has no producer (not started, or closed)")
        return self._producer

    def _settle(self, rid: str) -> None:
        batches = self._waiters.pop(rid, None)
        if batches is None:
            return
        for b in batches:
            self._settled_one(b)
        if len(self._waiters) < self.sink_config.max_unsettled:
            self._room.set()

    def _settled_one(self, b: _Batch) -> None:
        self._n.settled += 1
        b.remaining -= 1
        if b.remaining == 0 and not b.future.done():
            b.future.set_result(None)


def _maybe_decode(raw: bytes | None) -> OutputRecord | None:
    if raw is None:
        return None
    try:
        return _out_decoder.decode(raw)
    except msgspec.DecodeError:
        log.exception("a DLQ payload does not decode as an OutputRecord")
        return None


# --- operator helpers ----------------------------------------------------------------------


async def list_dlq(config: KafkaConfig, sink: KafkaSinkConfig) -> list[DlqRecord]:
    """The records in the DLQ of ``sink`` (read from the RQ and DLQ topics; nothing is sent)."""
    producer = AIOKafkaProducer(**config.client_kwargs(), acks="all", enable_idempotence=False)
    await producer.start()
    try:
        loaded = await _load_internal(
            config,
            producer,
            sink.internal_partitions(),
            fetch_max_wait_ms=sink.fetch_max_wait_ms,
            timeout_s=sink.load_timeout_s,
        )
    finally:
        await producer.stop()
    core: RetryCore = from_log(loaded.entries, sink.policy)
    return [
        DlqRecord(
            e.record_id, e.key, e.attempts, e.error, _maybe_decode(loaded.payloads.get(e.record_id))
        )
        for e in core.dlq_records()
    ]


async def replay_dlq(
    config: KafkaConfig,
    sink: KafkaSinkConfig,
    record_ids: Iterable[str] | None = None,
    *,
    timeout_s: float = 60.0,
) -> list[str]:
    """Send DLQ records (all, or those named) again, through a sink over the same topics, and
    wait until they are delivered (or dead-lettered again). Returns the ids replayed. The
    regular owner of the sink must not run meanwhile."""
    async with KafkaSink(config, sink) as s:
        chosen = s.replay_dlq(record_ids)
        async with asyncio.timeout(timeout_s):
            while True:
                dead = {d.record_id for d in s.dlq_records()}
                if not any(s.holds(rid) and rid not in dead for rid in chosen):
                    return chosen
                await asyncio.sleep(0.05)
