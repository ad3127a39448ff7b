"""The sync topic as a :class:`runtime.ports.SyncLog`, and the replay helper.

* :class:`KafkaSyncLog` – the sync topic ``<connector>_connector_sync``: one partition, appended
  with ``acks=all`` and read without a consumer group (assign + seek); the latest checkpoint offset
  is the committed offset of the consumer group ``<connector>_connector_sync_ckpt``.
* :func:`replay_until_marker` – the robust "I have read everything" on any Kafka: append a unique
  marker and read until it comes back (``end_offsets`` is wrong on the embedded broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from types import TracebackType
from typing import Self

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError, OffsetOutOfRangeError
from aiokafka.structs import TopicPartition

from protocol import fragments
from protocol.messages import MarkerMessage, encode
from runtime.kafka.config import KafkaAdapterError, KafkaConfig
from runtime.kafka.topics import (
    TopicSettingsError,
    check_connector,
    checkpoint_group,
    connectors_of,
    ensure_topic,
    list_topics,
    sync_topic,
)
from runtime.ports import SyncLog, Unrecoverable

log = logging.getLogger(__name__)


class SyncLogError(KafkaAdapterError):
    """The sync topic could not be created, appended to or read."""


class NoSuchConnector(SyncLogError, Unrecoverable):
    """A reader that must not create anything (``create=False``, e.g. ``status``) found no sync
    topic for its connector: a mistyped name, or a connector that never ran on this Kafka."""


class SyncTopicUnusable(SyncLogError):
    """The connector's sync topic exists with more than one partition: it has no total order,
    so the tasks' states could be read out of order. Refused at start; a bad setup, not a
    failure to retry (the CLI exits 2). The message names the topic and what to do."""


class SyncTopicLost(SyncLogError, Unrecoverable):
    """The sync topic went back under a running process. The topic was deleted and created
    again, or the broker restarted without durable storage (the embedded broker keeps topics in
    memory): the connector's state is gone, and going on would silently start over from "now".
    The process stops (docs/operations.md, "When the parts around shoal fail").

    Two checks see it, and neither can fire on a healthy log, because each compares only with
    offsets that were in the log *before* the evidence was asked for:

    * an append is acknowledged at or below the highest offset this process had read, or had
      had an append acknowledged at, *before that append was sent* (a healthy log puts a new
      message after everything already in it; a reader seeing the message before its own
      acknowledgement arrives is fine, as the floor is taken before the send);
    * a reader's fetch answers with a high watermark at or below an offset that reader has
      already read, for longer than ``went_back_after_s`` (a healthy log's high watermark never
      goes back; on a real Kafka a new partition leader may briefly answer with an older one,
      hence the grace).
    """


class SyncLogStats(msgspec.Struct, frozen=True):
    appends: int
    append_failures: int
    appended_bytes: int
    readers_open: int
    checkpoints_recorded: int
    fragmented: int = 0  # messages over max_message_bytes, appended in fragments
    fragments_dropped: int = 0  # incomplete or orphaned fragmented messages readers skipped


class KafkaSyncLog(SyncLog):
    """The sync topic ``<connector>_connector_sync`` (one partition) as a ``SyncLog``.

    Use ``async with KafkaSyncLog(config, connector) as log:`` (or :meth:`start`/:meth:`close`).
    :meth:`start` creates the topic if missing (``retention_ms``, ``cleanup.policy=delete``) and
    refuses a topic with more than one partition (the log must be totally ordered). With
    ``create=False`` (a reader such as ``status``) a missing topic is :class:`NoSuchConnector`
    and nothing is created.

    ``append`` may write a message twice if it times out after the broker stored it (no
    idempotent producer: the embedded broker cannot do it); readers must tolerate duplicates,
    which the incremental protocol does.
    """

    def __init__(
        self,
        config: KafkaConfig,
        connector: str,
        *,
        retention_ms: int = 7 * 24 * 3600 * 1000,
        send_timeout_s: float | None = None,
        fetch_max_wait_ms: int = 30,
        compression_type: str | None = None,
        max_message_bytes: int = 512 * 1024,
        went_back_after_s: float = 10.0,
        create: bool = True,
    ) -> None:
        check_connector(connector)
        if not 1024 <= max_message_bytes <= 64 << 20:
            raise ValueError(
                f"max_message_bytes must be in [1 KiB, 64 MiB], got {max_message_bytes}"
            )
        if retention_ms <= 0:
            raise ValueError(f"retention_ms must be positive, got {retention_ms}")
        if not 0 < fetch_max_wait_ms <= 10_000:
            raise ValueError(f"fetch_max_wait_ms must be in (0, 10000], got {fetch_max_wait_ms}")
        if went_back_after_s < 0:
            raise ValueError(f"went_back_after_s must be >= 0, got {went_back_after_s}")
        self._config = config
        self._create = create
        self._went_back_after_s = went_back_after_s
        self._ids = random.Random(os.urandom(16))  # fragment ids (protocol/fragments.py)
        self.connector = connector
        self.topic = sync_topic(connector)
        self.checkpoint_group = checkpoint_group(connector)
        self._tp = TopicPartition(self.topic, 0)
        self._retention_ms = retention_ms
        self._send_timeout = (
            send_timeout_s if send_timeout_s is not None else config.request_timeout_ms / 1000
        )
        if self._send_timeout <= 0:
            raise ValueError(f"send_timeout_s must be positive, got {send_timeout_s}")
        self._fetch_max_wait_ms = fetch_max_wait_ms
        self._compression_type = compression_type
        self.max_message_bytes = max_message_bytes
        self._producer: AIOKafkaProducer | None = None
        self._ckpt: AIOKafkaConsumer | None = None
        self._closed = False
        self._appends = 0
        self._append_failures = 0
        self._appended_bytes = 0
        self._readers_open = 0
        self._checkpoints = 0
        self._fragmented = 0  # messages appended in fragments
        self._fragments_dropped = 0  # incomplete or orphaned fragments readers gave up on
        # The highest offset this process has read, or had an append acknowledged at: every
        # offset up to it was in the log then, so a later send must land above it.
        self._floor = -1
        self.fatal: SyncTopicLost | None = None  # the topic went back: this process must stop

    def __repr__(self) -> str:
        return f"KafkaSyncLog(topic={self.topic!r}, config={self._config!r})"

    def statistics(self) -> SyncLogStats:
        return SyncLogStats(
            appends=self._appends,
            append_failures=self._append_failures,
            appended_bytes=self._appended_bytes,
            readers_open=self._readers_open,
            checkpoints_recorded=self._checkpoints,
            fragmented=self._fragmented,
            fragments_dropped=self._fragments_dropped,
        )

    async def start(self) -> None:
        """Create the topic if needed and connect the producer and the checkpoint client."""
        if self._producer is not None:
            raise SyncLogError(f"{self!r} is already started")
        if self._closed:
            raise SyncLogError(f"{self!r} is closed")
        kwargs = self._config.client_kwargs()
        if not self._create:
            await self._check_exists()
        try:
            await ensure_topic(
                self._config,
                self.topic,
                partitions=1,
                topic_configs={
                    "retention.ms": str(self._retention_ms),
                    "cleanup.policy": "delete",
                },
                exact_partitions=True,
            )
        except TopicSettingsError as exc:
            raise self._unusable(str(exc)) from exc
        except KafkaAdapterError as exc:
            raise SyncLogError(str(exc)) from exc
        try:
            # Batches expire after the producer's request timeout: make that the send timeout so
            # a failed append does not linger (and close() does not wait for it).
            producer_kwargs = {**kwargs, "request_timeout_ms": int(self._send_timeout * 1000)}
            producer = AIOKafkaProducer(
                **producer_kwargs,
                acks="all",
                enable_idempotence=False,
                linger_ms=0,
                compression_type=self._compression_type,
            )
            self._producer = producer
            await producer.start()
            self._check_partitions(await producer.partitions_for(self.topic))
            ckpt = AIOKafkaConsumer(
                **kwargs,
                group_id=self.checkpoint_group,
                enable_auto_commit=False,
                auto_offset_reset="none",
            )
            self._ckpt = ckpt
            await ckpt.start()
            ckpt.assign([self._tp])
        except KafkaError as exc:
            await self._stop_clients()
            raise SyncLogError(
                f"cannot start the sync log {self.topic!r} on {self._config.bootstrap_servers}: "
                f"{exc!r}"
            ) from exc
        except BaseException:
            await self._stop_clients()
            raise

    async def _check_exists(self) -> None:
        """Raise :class:`NoSuchConnector` naming the connectors this Kafka has, if the sync
        topic is missing (asking creates nothing)."""
        try:
            topics = await list_topics(self._config)
        except KafkaAdapterError as exc:
            raise SyncLogError(str(exc)) from exc
        if self.topic in topics:
            return
        known = connectors_of(topics)
        raise NoSuchConnector(
            f"no such connector {self.connector!r} on {self._config.bootstrap_servers}: its "
            f"sync topic {self.topic!r} does not exist (nothing was created); connectors "
            f"there: {', '.join(repr(c) for c in known) if known else 'none'}"
        )

    def _check_partitions(self, partitions: set[int]) -> None:
        if partitions != {0}:
            raise self._unusable(f"sync topic {self.topic!r} has partitions {sorted(partitions)}")

    def _unusable(self, found: str) -> SyncTopicUnusable:
        return SyncTopicUnusable(
            f"{found}: the sync topic of connector {self.connector!r} (connector, --connector) "
            "needs exactly one partition (the sync log is totally ordered); nothing was "
            "read: delete the topic if it holds no state of this connector, or use another "
            "connector name"
        )

    async def close(self) -> None:
        """Disconnect the producer and the checkpoint client. Each reader has its own
        connection and ends only when it is closed (``contextlib.aclosing``)."""
        self._closed = True
        await self._stop_clients()

    async def _stop_clients(self) -> None:
        producer, ckpt = self._producer, self._ckpt
        self._producer = self._ckpt = None
        try:
            if producer is not None:
                await producer.stop()
        finally:
            if ckpt is not None:
                await ckpt.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _started_producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise SyncLogError(f"{self!r} is not started (use 'async with' or start())")
        return self._producer

    async def append(self, payload: bytes) -> int:
        """Append ``payload`` (acks=all); return its offset. Raises :class:`SyncLogError` if the
        broker did not acknowledge it within ``send_timeout_s``.

        A payload over ``max_message_bytes`` is appended as fragments (:mod:`protocol.fragments`)
        that :meth:`read` puts back together; the offset returned is then the first fragment's
        (where a reader must start to read the message whole)."""
        if len(payload) <= self.max_message_bytes:
            offset = await self._send(payload)
        else:
            pieces = fragments.cut(payload, self.max_message_bytes)
            fid, first = fragments.new_id(self._ids), -1
            for index, piece in enumerate(pieces):
                fragment = fragments.Fragment(fid, index, len(pieces), first, piece)
                at = await self._send(fragments.encode_fragment(fragment))
                if index == 0:
                    first = at
            offset = first
            self._fragmented += 1
        self._appends += 1
        self._appended_bytes += len(payload)
        return offset

    async def _send(self, payload: bytes) -> int:
        producer = self._started_producer()
        floor = self._floor  # before the send: a reader may see this message before its ack
        try:
            # The producer fails the batch after send_timeout; this outer bound is a backstop.
            async with asyncio.timeout(self._send_timeout + 1.0):
                metadata = await producer.send_and_wait(self.topic, payload, partition=0)
        except TimeoutError as exc:
            self._append_failures += 1
            raise SyncLogError(
                f"append to {self.topic!r} not acknowledged within {self._send_timeout:.1f} s "
                "(broker unreachable or overloaded); it may still be written"
            ) from exc
        except KafkaError as exc:
            self._append_failures += 1
            raise SyncLogError(f"append to {self.topic!r} failed: {exc!r}") from exc
        offset: int = metadata.offset
        if offset <= floor:
            raise self._went_back(
                f"an append landed at offset {offset}, though offset {floor} was already in it "
                "before the append was sent"
            )
        self._floor = max(self._floor, offset)
        return offset

    def _went_back(self, evidence: str) -> SyncTopicLost:
        """Remember (``fatal``) and return the error that stops this process."""
        self.fatal = self.fatal or SyncTopicLost(
            f"Kafka: the sync topic {self.topic!r} on {self._config.bootstrap_servers} went "
            f"back ({evidence}): it was deleted, or the broker restarted without its data (the "
            "embedded broker keeps topics in memory), and the connector's state with it; "
            "refusing to start over from now. Restart shoal (a new connector starts at "
            "--start-at)"
        )
        return self.fatal

    def read(self, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """Every message from offset ``start`` on, as ``(offset, payload)``, waiting for new ones
        forever (no consumer group: assign + seek). A message with a null value reads as ``b""``.

        Close the iterator when done (``async with contextlib.aclosing(log.read(0)) as it``).
        Raises :class:`SyncLogError` if ``start`` is no longer in the log (retention) or, on a
        real Kafka, beyond its end (the embedded broker just waits there).
        """
        if start < 0:
            raise ValueError(f"start offset must be >= 0, got {start}")
        self._started_producer()
        return self._read(start)

    async def _read(self, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        consumer = AIOKafkaConsumer(
            **self._config.client_kwargs(),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="none",
            fetch_max_wait_ms=self._fetch_max_wait_ms,
            isolation_level="read_uncommitted",
        )
        self._readers_open += 1
        try:
            try:
                await consumer.start()
            except KafkaError as exc:
                raise SyncLogError(
                    f"cannot read {self.topic!r} from {self._config.bootstrap_servers}: {exc!r}"
                ) from exc
            consumer.assign([self._tp])
            consumer.seek(self._tp, start)
            whole = fragments.Reassembler(start)
            last = -1  # the highest offset this reader has read
            short_since: float | None = None  # since when fetches answer below ``last``
            while True:
                try:
                    batches = await consumer.getmany(self._tp, timeout_ms=1000)
                except OffsetOutOfRangeError as exc:
                    raise SyncLogError(
                        f"offset {start} is not in {self.topic!r} (deleted by retention, or "
                        "beyond the end): start from a checkpoint"
                    ) from exc
                except KafkaError as exc:
                    raise SyncLogError(f"reading {self.topic!r} failed: {exc!r}") from exc
                # Each fetch is sent after the records before it were taken, so on a healthy
                # log its high watermark is above every offset this reader has read.
                high = consumer.highwater(self._tp)
                if high is not None and high <= last:
                    now = time.monotonic()
                    short_since = now if short_since is None else short_since
                    if now - short_since >= self._went_back_after_s:
                        raise self._went_back(
                            f"its high watermark is {high} after a fetch, though this process "
                            f"read offset {last} there"
                        )
                else:
                    short_since = None
                for record in batches.get(self._tp, ()):
                    last = max(last, record.offset)
                    self._floor = max(self._floor, record.offset)
                    value = record.value
                    step = whole.feed(record.offset, value if value is not None else b"")
                    for reason in whole.dropped:
                        self._fragments_dropped += 1
                        log.warning("%s: sync message dropped: %s", self.topic, reason)
                    whole.dropped.clear()
                    if isinstance(step, fragments.Complete):
                        yield step.offset, step.payload
                    elif isinstance(step, fragments.Rewind):
                        consumer.seek(self._tp, step.offset)
                        break  # the rest of this fetch is read again after the rewind
        finally:
            self._readers_open -= 1
            await consumer.stop()

    async def checkpoint_offset(self) -> int | None:
        """The offset last given to :meth:`record_checkpoint` (by any task), or ``None``."""
        ckpt = self._started_ckpt()
        try:
            async with asyncio.timeout(self._config.request_timeout_ms / 1000):
                committed: int | None = await ckpt.committed(self._tp)
        except (TimeoutError, KafkaError) as exc:
            raise SyncLogError(
                f"cannot read the committed offset of group {self.checkpoint_group!r}: {exc!r}"
            ) from exc
        return committed

    async def record_checkpoint(self, offset: int) -> None:
        """Remember ``offset`` (the checkpoint message's own offset) as the committed offset of
        the group ``<connector>_connector_sync_ckpt``. Last writer wins."""
        if offset < 0:
            raise ValueError(f"checkpoint offset must be >= 0, got {offset}")
        ckpt = self._started_ckpt()
        try:
            async with asyncio.timeout(self._config.request_timeout_ms / 1000):
                await ckpt.commit({self._tp: offset})
        except (TimeoutError, KafkaError) as exc:
            raise SyncLogError(
                f"cannot commit checkpoint offset {offset} for group "
                f"{self.checkpoint_group!r}: {exc!r}"
            ) from exc
        self._checkpoints += 1

    def _started_ckpt(self) -> AIOKafkaConsumer:
        if self._ckpt is None:
            raise SyncLogError(f"{self!r} is not started (use 'async with' or start())")
        return self._ckpt


class ReplayResult(msgspec.Struct, frozen=True):
    marker: str  # the unique marker string this replay produced
    marker_offset: int  # where the marker was appended
    next_offset: int  # continue reading here (marker_offset + 1)
    messages: int  # how many messages before the marker were handed to ``on_message``


async def replay_until_marker(
    log: SyncLog,
    start: int,
    *,
    task_id: str,
    on_message: Callable[[int, bytes], None],
    timeout_s: float | None = 60.0,
    epoch: int = -1,
) -> ReplayResult:
    """Read ``log`` from ``start`` until a freshly appended marker comes back.

    Appends a :class:`protocol.messages.MarkerMessage` with a unique marker, then hands every
    message before it, in order, to ``on_message(offset, payload)`` (other tasks' markers
    included: decoding is the caller's job). When it returns, the caller has seen everything that
    was in the log when the marker was appended; continue with ``log.read(result.next_offset)``.
    Works on any Kafka (``end_offsets`` is wrong on the embedded broker) and on in-memory logs.
    """
    if start < 0:
        raise ValueError(f"start offset must be >= 0, got {start}")
    marker = f"{task_id}:{uuid.uuid4().hex}"
    payload = encode(
        MarkerMessage(
            task_id=task_id,
            message_timestamp=time.time_ns(),
            epoch=epoch,
            marker=marker,
        )
    )
    count = 0
    async with contextlib.AsyncExitStack() as stack:
        if timeout_s is not None:
            await stack.enter_async_context(asyncio.timeout(timeout_s))
        marker_offset = await log.append(payload)
        if marker_offset < start:
            raise ValueError(
                f"replay start {start} is beyond the end of the log (marker at {marker_offset})"
            )
        reader = log.read(start)
        stack.push_async_callback(reader.aclose)
        async for offset, message in reader:
            if message == payload:
                return ReplayResult(
                    marker=marker, marker_offset=offset, next_offset=offset + 1, messages=count
                )
            if offset >= marker_offset:
                raise SyncLogError(
                    f"the marker appended at offset {marker_offset} was not read back there "
                    f"(read offset {offset} instead)"
                )
            on_message(offset, message)
            count += 1
    raise SyncLogError("the sync log reader ended before the marker was read back")
