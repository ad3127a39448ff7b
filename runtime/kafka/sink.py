"""A Kafka output sink with a retry queue and a dead-letter queue (``docs/design.md``, "Retry and
dead-letter queues", "Routing").

:class:`KafkaSink` implements :class:`runtime.ports.Sink`. Every mod of every ``DataChange``
becomes one :class:`OutputRecord` (JSON), produced to the output composite topic ``<name>``
keyed by ``<table>:<primary-key JSON>``; the partition is ``Router(key_hash)`` of the storage
topic the produce pointer names (:mod:`protocol.routing`), so producers agree on it and it stays
shard consistent when the topic is scaled.

The rules of delivery are those of :mod:`protocol.retry` (the pure core), carried out by the
shared durable shell :class:`runtime.kafka.retry_queue.RetryQueue`; this module is the output topic
and the per-record delivery port:

* per key, records go out in commit order, one at a time (the next after the previous is
  acknowledged by Kafka); other keys are not held up by a failing key;
* a failed delivery is parked in the RQ topic ``<name>_rq`` and retried with backoff; the key's
  later records are parked behind it; after ``max_attempts`` failures it goes to the DLQ topic
  ``<name>_dlq``; a key with a DLQ record blocks or releases (``RetryPolicy.dlq_blocks``);
* the RQ and DLQ topics hold the core's log entries (each with its payload, the
  :class:`OutputRecord` JSON), routed by the same key hash, so **a new sink over the same topics
  resumes the state** (see :mod:`runtime.kafka.retry_queue`).

A batch's future (``put``) resolves when each of its records is settled: delivered to the output
topic, or durably written to the RQ or the DLQ. It fails if the sink dies first; the caller then
re-delivers from its watermark, and records the sink already holds are recognised by id.
Delivery is at least once (docs/design.md#exactly-once-output: aiokafka cannot use Kafka's
transactions against every broker shoal supports): a crash after a record reached the output but
before its batch's watermark was committed delivers it again. Every message carries its row key
(``OutputRecord.record_id``) in the header ``shoal-record-id`` (:data:`ROW_KEY_HEADER`), so a
consumer de-duplicates without decoding the payload.

:func:`list_dlq` and :func:`replay_dlq` are the operator helpers (the CLI calls them). Replay runs
a sink over the topics that drives the RQ itself, so stop the shoal processes over those topics
meanwhile (nothing fences a replay from the group leader's driving queue), or use
:func:`runtime.kafka.retry_queue.replay_via_driver` (``dlq replay --via-leader``). Several shoal
processes share one sink's RQ/DLQ through ``driver=`` (see :mod:`runtime.kafka.retry_queue`).

For tests, ``inject`` is a failure injector: ``inject(record, attempts)`` returns an error text to
fail that delivery (before anything is produced), or ``None``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Self

import msgspec
from aiokafka.errors import KafkaError

from protocol.output_meta import OutputMeta, meta_topic
from protocol.retry import RetryCore, RetryPolicy
from protocol.routing import (
    CompositeTopic,
    key_hash,
    partitions_for_shard,
    shard_of_partition,
)
from runtime.kafka.config import KafkaConfig
from runtime.kafka.output_meta import MetaLog, MetaOptions, ProducerSession, open_meta
from runtime.kafka.retry_queue import (
    InternalMessage,
    PendingSend,
    RetryQueue,
    RetryQueueConfig,
    RetryQueueError,
    internal_topic,
    load_dlq,
)
from runtime.kafka.topics import topic_exists
from runtime.output_record import (
    OutputRecord,
    decode_output,
    ordering_key,
    output_records,
    split_key,
)
from runtime.ports import Sink, SinkBatch

__all__ = [
    "ROW_KEY_HEADER",
    "DlqRecord",
    "InternalMessage",
    "KafkaSink",
    "KafkaSinkConfig",
    "KafkaSinkError",
    "KafkaSinkStats",
    "OutputRecord",
    "decode_output",
    "list_dlq",
    "ordering_key",
    "output_records",
    "replay_dlq",
    "split_key",
    "with_meta",
]

log = logging.getLogger(__name__)


class KafkaSinkError(RetryQueueError):
    """The sink failed or was closed; pending batches will not be committed by it."""


# --- wire formats --------------------------------------------------------------------------


ROW_KEY_HEADER = "shoal-record-id"
"""The header holding a message's row key (``OutputRecord.record_id``): consumers de-duplicate
on it (the output is at least once)."""


_out_encoder = msgspec.json.Encoder()
_out_decoder: msgspec.json.Decoder[OutputRecord] = msgspec.json.Decoder(OutputRecord)


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
    partition is in its range, and resumes only its ranges of the RQ and DLQ. The design asks that
    ``shard_count`` divide the output base and the RQ/DLQ partition counts; this is checked."""

    name: str
    partitions: int = 4
    rq_partitions: int = 4
    dlq_partitions: int = 4
    output: CompositeTopic | None = None  # overrides name/partitions for the output topic
    rq: CompositeTopic | None = None  # overrides rq_partitions (the metadata topic's RQ)
    dlq: CompositeTopic | None = None  # overrides dlq_partitions
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
        return internal_topic(name, partitions, self.output_topic().producing.base)

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
        return self.rq or self._internal(f"{self.name}_rq", self.rq_partitions)

    def dlq_topic(self) -> CompositeTopic:
        return self.dlq or self._internal(f"{self.name}_dlq", self.dlq_partitions)

    def queue_config(self) -> RetryQueueConfig:
        """The RQ/DLQ settings of this sink (shard) for
        :class:`runtime.kafka.retry_queue.RetryQueue`."""
        return RetryQueueConfig(
            rq=self.rq_topic(),
            dlq=self.dlq_topic(),
            partitions=tuple(self.internal_partitions()),
            policy=self.policy,
            max_unsettled=self.max_unsettled,
            linger_ms=self.linger_ms,
            fetch_max_wait_ms=self.fetch_max_wait_ms,
            load_timeout_s=self.load_timeout_s,
            close_timeout_s=self.close_timeout_s,
            seed=self.seed,
        )


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


class KafkaSink(Sink):
    """The Kafka output sink. Use ``async with KafkaSink(config, sink_config) as sink:``."""

    def __init__(
        self,
        config: KafkaConfig,
        sink: KafkaSinkConfig,
        *,
        inject: FailureInjector | None = None,
        clock: Callable[[], float] = time.time,
        driver: Callable[[], bool] | None = None,
        takeover_grace_s: float = 10.0,
        meta: MetaOptions | None = None,
    ) -> None:
        """``driver``: several processes share this sink's RQ/DLQ, and this one may send the
        RQ's records while ``driver()`` is true (see :class:`runtime.kafka.retry_queue.RetryQueue`);
        None: this sink is the RQ/DLQ's only owner.

        ``meta``: the output is the composite topic that the metadata topic ``<name>_meta``
        describes (created from ``sink`` on a first start; :mod:`runtime.kafka.output_meta`), and
        this sink takes part in its switch barrier; its storage topics, produce pointer and
        RQ/DLQ topics come from there, and its RQ/DLQ writes follow shard-count changes (held
        during one, then to the new storage topics, which it reads too). None: the composite
        topic of ``sink`` and its RQ/DLQ alone."""
        self._config = config
        self._clock = clock
        self._driver = driver
        self._grace = takeover_grace_s
        self._meta_options = meta
        self._meta_log: MetaLog | None = None
        self.session: ProducerSession | None = None
        self._inject = inject
        self._injected = 0
        self._configure(sink)

    def _configure(self, sink: KafkaSinkConfig, gate: ProducerSession | None = None) -> None:
        self.sink_config = sink
        self.output = sink.output_topic()
        self.rq = sink.rq_topic()
        self.dlq = sink.dlq_topic()
        self._queue = RetryQueue(
            self._config,
            sink.queue_config(),
            self._send,
            also_topics=(self.output,),
            clock=self._clock,
            name=sink.name,
            driver=self._driver,
            takeover_grace_s=self._grace,
            gate=gate,
        )

    def __repr__(self) -> str:
        return f"KafkaSink({self.sink_config.name!r}, config={self._config!r})"

    @property
    def _core(self) -> RetryCore:
        """The retry core (tests look at its group state)."""
        return self._queue.core

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._meta_options is None:
            await self._queue.__aenter__()
            return self
        sink = self.sink_config
        meta_log = MetaLog(self._config, sink.name, load_timeout_s=sink.load_timeout_s)
        await meta_log.__aenter__()
        try:
            state, at = await open_meta(
                meta_log,
                partitions=sink.partitions,
                rq_partitions=sink.rq_partitions,
                dlq_partitions=sink.dlq_partitions,
            )
            # the session first: the queue's RQ/DLQ writes go through it (the shard barrier)
            session = ProducerSession(
                self._config,
                meta_log,
                state,
                at,
                options=self._meta_options,
                on_switch=self._switched,
                on_relayout=self._relayout,
            )
            await session.__aenter__()
            try:
                st = session.state  # (a relayout before here is in it)
                self._configure(
                    msgspec.structs.replace(sink, output=st.composite(), rq=st.rq(), dlq=st.dlq()),
                    gate=session,
                )
                await self._queue.__aenter__()
            except BaseException as exc:
                await session.__aexit__(type(exc), exc, exc.__traceback__)
                raise
        except BaseException:
            await meta_log.__aexit__(None, None, None)
            raise
        self._meta_log, self.session = meta_log, session
        return self

    def _relayout(self, state: OutputMeta) -> None:
        """A shard-count change of the RQ/DLQ committed (called by the session before any
        write goes to the new layout): write there, and read the new storage topics too."""
        sink = msgspec.structs.replace(self.sink_config, rq=state.rq(), dlq=state.dlq())
        self.sink_config, self.rq, self.dlq = sink, sink.rq_topic(), sink.dlq_topic()
        self._queue.relayout(self.rq, self.dlq, sink.internal_partitions())

    def _switched(self, state: OutputMeta) -> None:
        self.output = state.composite()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._queue.__aexit__(exc_type, exc, tb)
        finally:
            session, self.session = self.session, None
            meta_log, self._meta_log = self._meta_log, None
            try:
                if session is not None:
                    await session.__aexit__(exc_type, exc, tb)
            finally:
                if meta_log is not None:
                    await meta_log.__aexit__(None, None, None)

    async def abort(self) -> None:
        """Die abruptly (for tests of a task's death): stop processing at once, write nothing
        more to the RQ/DLQ, fail every pending batch. The context manager still has to exit."""
        if self.session is not None:
            self.session.kill()
        await self._queue.abort()

    # -- the Sink port ---------------------------------------------------------------------

    async def prepare(self, token: str) -> None:
        """Before a reader of ``token`` hands over anything: fold in every RQ/DLQ entry written
        so far (what the partition's previous owner parked keeps its keys blocked)."""
        await self._queue.barrier()

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        """Accept a batch (waits while ``max_unsettled`` records are not yet settled); the future
        resolves when every record is delivered or durably in the RQ/DLQ."""
        self._check_alive()
        records = [r for change in batch.records for r in output_records(change)]
        for rec in records:
            if not self.sink_config.owns(rec.key):
                raise ValueError(
                    f"record {rec.record_id} (key {rec.key}) belongs to another shard than "
                    f"{self.sink_config.shard_id} of {self.sink_config.shard_count}"
                )
        try:
            return await self._queue.submit(
                [(rec.record_id, rec.key, _out_encoder.encode(rec)) for rec in records]
            )
        except RetryQueueError as exc:
            raise KafkaSinkError(str(exc)) from exc

    def _check_alive(self) -> None:
        try:
            self._queue.check_alive()
        except RetryQueueError as exc:
            raise KafkaSinkError(f"{self!r}: {exc}") from exc

    # -- operator actions ------------------------------------------------------------------

    def dlq_records(self) -> list[DlqRecord]:
        return [
            DlqRecord(e.record_id, e.key, e.attempts, e.error, _maybe_decode(raw))
            for e, raw in self._queue.dlq_records()
        ]

    def replay_dlq(self, record_ids: Iterable[str] | None = None) -> list[str]:
        """Put DLQ records (all, or those named) back into the RQ; return their ids."""
        self._check_alive()
        return self._queue.replay_dlq(record_ids)

    def discard_dlq(self, record_ids: Iterable[str]) -> list[str]:
        self._check_alive()
        return self._queue.discard_dlq(record_ids)

    def holds(self, record_id: str) -> bool:
        return self._queue.holds(record_id)

    async def wait_idle(self, *, include_rq: bool = True) -> None:
        """Wait until nothing is unsettled and (``include_rq``) nothing is in flight or in the RQ:
        only DLQ records (and, for blocking keys, the records parked behind them) remain."""
        try:
            await self._queue.wait_idle(include_rq=include_rq)
        except RetryQueueError as exc:
            raise KafkaSinkError(str(exc)) from exc

    def statistics(self) -> KafkaSinkStats:
        q = self._queue.statistics()
        return KafkaSinkStats(
            records_accepted=q.records_accepted,
            records_settled=q.records_settled,
            records_delivered=q.records_delivered,
            delivery_failures=q.delivery_failures,
            injected_failures=self._injected,
            rq_writes=q.rq_writes,
            dlq_writes=q.dlq_writes,
            duplicates=q.duplicates,
            unsettled=q.unsettled,
            held=q.held,
            in_dlq=q.in_dlq,
            loaded_entries=q.loaded_entries,
            missing_payloads=q.missing_payloads,
        )

    # -- the delivery port -----------------------------------------------------------------

    async def _send(self, send: PendingSend) -> None:
        rid, key, payload = send.record_id, send.key, send.payload
        if self._inject is not None:
            error = self._inject(_out_decoder.decode(payload), send.attempts)
            if error is not None:
                self._injected += 1
                self._queue.failed(rid, error)
                return
        table, keys = split_key(key)
        h = key_hash(table, keys)
        session = self.session
        if session is None:
            idx, partition = self.output.route(h)
            topic = self.output.storage_topics[idx].name
        else:
            # the switch barrier: waits while a switch is pending; released when Kafka answers
            idx = await session.acquire()
            st = session.state.composite().storage_topics[idx]
            topic, partition = st.name, st.route(h)
        try:
            fut = await self._queue.producer.send(
                topic,
                payload,
                key=key.encode(),
                partition=partition,
                headers=[(ROW_KEY_HEADER, rid.encode())],
            )
        except KafkaError as exc:
            if session is not None:
                session.release(idx)
            log.warning("%r: producing %s failed: %r", self, rid, exc)
            self._queue.failed(rid, repr(exc))
            return

        def done(f: asyncio.Future[object]) -> None:
            if session is not None:
                session.release(idx)
            if f.cancelled():
                self._queue.failed(rid, "produce cancelled")
            elif (exc := f.exception()) is not None:
                log.warning("%r: delivery of %s failed: %r", self, rid, exc)
                self._queue.failed(rid, repr(exc))
            else:
                self._queue.delivered(rid)

        fut.add_done_callback(done)


def _maybe_decode(raw: bytes | None) -> OutputRecord | None:
    if raw is None:
        return None
    try:
        return _out_decoder.decode(raw)
    except msgspec.DecodeError:
        log.exception("a DLQ payload does not decode as an OutputRecord")
        return None


# --- operator helpers ----------------------------------------------------------------------


async def with_meta(config: KafkaConfig, sink: KafkaSinkConfig) -> tuple[KafkaSinkConfig, bool]:
    """``sink`` with the RQ/DLQ storage topics its metadata topic ``<name>_meta`` names (every one
    readers read: after a shard-count change, the old ones until they are fed), and whether the
    metadata topic exists; ``sink`` unchanged (and False) when it does not (looking creates
    no metadata topic: the dead-letter tools use this on outputs that never had one)."""
    if not await topic_exists(config, meta_topic(sink.name)):
        return sink, False
    async with MetaLog(config, sink.name, load_timeout_s=sink.load_timeout_s) as meta:
        state, _ = await meta.load()
    if not state.created:
        return sink, False
    return msgspec.structs.replace(
        sink, output=state.composite(), rq=state.rq(), dlq=state.dlq()
    ), True


async def list_dlq(config: KafkaConfig, sink: KafkaSinkConfig) -> list[DlqRecord]:
    """The records in the DLQ of ``sink`` (read from the RQ and DLQ topics; nothing is sent).
    Give it the storage topics of the metadata (:func:`with_meta`)."""
    return [
        DlqRecord(e.record_id, e.key, e.attempts, e.error, _maybe_decode(raw))
        for e, raw in await load_dlq(config, sink.queue_config())
    ]


async def replay_dlq(
    config: KafkaConfig,
    sink: KafkaSinkConfig,
    record_ids: Iterable[str] | None = None,
    *,
    timeout_s: float = 60.0,
    meta: MetaOptions | None = None,
) -> list[str]:
    """Send DLQ records (all, or those named) again, through a sink over the same topics, and
    wait until they are delivered (or dead-lettered again). Returns the ids replayed. The
    regular owner of the sink must not run meanwhile. ``meta``: the output has a metadata topic;
    the sink takes its topics from there and takes part in its barriers."""
    async with KafkaSink(config, sink, meta=meta) as s:
        chosen = s.replay_dlq(record_ids)
        async with asyncio.timeout(timeout_s):
            await s._queue.wait_replayed(chosen)
        return chosen
