"""Kafka adapters for the coordination ports of ``runtime.ports`` (design 000).

* :class:`KafkaConfig` – connection settings shared by every client (bootstrap servers, SASL/SSL,
  group timeouts), validated up front; its ``repr`` never shows a secret.
* :class:`KafkaSyncLog` – the sync topic ``<connector>_connector_sync`` as a
  :class:`runtime.ports.SyncLog`: one partition, appended with ``acks=all`` and read without a
  consumer group (assign + seek); the latest checkpoint offset is the committed offset of the
  consumer group ``<connector>_connector_sync_ckpt``.
* :func:`replay_until_marker` – the robust "I have read everything" on any Kafka: append a unique
  marker and read until it comes back (``end_offsets`` is wrong on the embedded broker).
* :class:`KafkaMembership` – membership of the consumer group named after the connector on the
  heartbeat topic ``<connector>_heartbeat``, as a :class:`runtime.ports.Membership`. The group is
  used only for Kafka's rebalance protocol: a custom assignor, which runs on the group leader only,
  reads every member's task id from its subscription and tells every member the generation's
  leader and member list. No partition is ever assigned.

Everything here works the same on the embedded broker (:mod:`runtime.kafka.broker`) and on a real Kafka;
only the timeouts differ (real Kafka needs ``session_timeout_ms >= 6000`` by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Self

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from aiokafka.errors import (
    KafkaError,
    OffsetOutOfRangeError,
    TopicAlreadyExistsError,
    for_code,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.group import LeaveGroupRequest
from aiokafka.structs import TopicPartition

from protocol import fragments
from protocol.messages import MarkerMessage, encode
from runtime.ports import GroupAssignment, GroupEvent, GroupLost, SyncLog

log = logging.getLogger(__name__)

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_TOPIC_LEN = 249
_UNKNOWN_MEMBER_ID: Final = ""  # aiokafka's JoinGroupRequest.UNKNOWN_MEMBER_ID


class KafkaAdapterError(RuntimeError):
    """A Kafka adapter could not do what was asked; the message says what and why."""


class SyncLogError(KafkaAdapterError):
    """The sync topic could not be created, appended to or read."""


class MembershipError(KafkaAdapterError):
    """The heartbeat-topic group membership failed for good (not a normal loss of membership)."""


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------


class KafkaConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach Kafka. ``session_timeout_ms``/``heartbeat_interval_ms`` are the heartbeat-topic
    group's; the embedded broker is fine with 3000/1000 (:meth:`embedded`), a real Kafka refuses
    sessions under its ``group.min.session.timeout.ms`` (6000 by default)."""

    bootstrap_servers: str
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_keyfile_password: str | None = None
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    request_timeout_ms: int = 15_000
    replication_factor: int = 1  # for the topics shoal creates; use 3 on a production cluster
    client_id: str = "shoal"

    @classmethod
    def embedded(cls, bootstrap_servers: str) -> KafkaConfig:
        """Settings for the embedded broker: plaintext, fast group timeouts (3000/1000 ms)."""
        return cls(
            bootstrap_servers=bootstrap_servers,
            session_timeout_ms=3_000,
            heartbeat_interval_ms=1_000,
            request_timeout_ms=10_000,
        )

    def __post_init__(self) -> None:
        servers = [s.strip() for s in self.bootstrap_servers.split(",")]
        if not servers or any(not s for s in servers):
            raise ValueError(
                f"bootstrap_servers must be 'host:port[,host:port...]', got {self.bootstrap_servers!r}"
            )
        for server in servers:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"bootstrap server {server!r} is not 'host:port'")
        for name in (
            "session_timeout_ms",
            "heartbeat_interval_ms",
            "request_timeout_ms",
            "replication_factor",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below "
                f"session_timeout_ms ({self.session_timeout_ms}); a third of it is usual"
            )
        sasl = self.security_protocol.startswith("SASL_")
        if sasl:
            if self.sasl_mechanism is None:
                raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism")
            if not self.sasl_username or self.sasl_password is None:
                raise ValueError(
                    f"SASL mechanism {self.sasl_mechanism} needs sasl_username and sasl_password"
                )
        elif self.sasl_mechanism is not None or self.sasl_username or self.sasl_password:
            raise ValueError(
                f"SASL settings are given but security_protocol is {self.security_protocol}; "
                "use SASL_PLAINTEXT or SASL_SSL"
            )
        uses_ssl = self.security_protocol in ("SSL", "SASL_SSL")
        ssl_files = (self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile)
        if not uses_ssl and any(f is not None for f in ssl_files):
            raise ValueError(
                f"SSL files are given but security_protocol is {self.security_protocol}; "
                "use SSL or SASL_SSL"
            )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together (client certificate)")

    def __repr__(self) -> str:
        shown = []
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if field in ("sasl_password", "ssl_keyfile_password") and value is not None:
                value = "***"
            if value != getattr(_DEFAULTS, field, None) or field == "bootstrap_servers":
                shown.append(f"{field}={value!r}")
        return f"KafkaConfig({', '.join(shown)})"

    __str__ = __repr__

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context, or ``None`` without SSL. Missing files are reported by name."""
        if self.security_protocol not in ("SSL", "SASL_SSL"):
            return None
        for label, path in (
            ("ssl_cafile", self.ssl_cafile),
            ("ssl_certfile", self.ssl_certfile),
            ("ssl_keyfile", self.ssl_keyfile),
        ):
            if path is not None and not Path(path).is_file():
                raise KafkaAdapterError(f"{label} {path!r} does not exist or is not a file")
        context: ssl.SSLContext = create_ssl_context(
            cafile=self.ssl_cafile,
            certfile=self.ssl_certfile,
            keyfile=self.ssl_keyfile,
            password=self.ssl_keyfile_password,
        )
        return context

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments common to aiokafka's producer, consumer and admin client."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
        }
        context = self.ssl_context()
        if context is not None:
            kwargs["ssl_context"] = context
        if self.sasl_mechanism is not None:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password
        return kwargs

    def with_client_id(self, client_id: str) -> KafkaConfig:
        return msgspec.structs.replace(self, client_id=client_id)

    @classmethod
    def from_mapping(cls, values: Mapping[str, str]) -> KafkaConfig:
        """Build from strings (a config file section, environment variables); field names as
        in this class. Unknown names are refused, so a typo does not go unnoticed."""
        unknown = sorted(set(values) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(
                f"unknown Kafka setting(s) {unknown}; known: {sorted(cls.__struct_fields__)}"
            )
        try:
            return msgspec.convert(dict(values), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid Kafka settings: {exc}") from exc

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, prefix: str = "SHOAL_KAFKA_"
    ) -> KafkaConfig:
        """Build from ``SHOAL_KAFKA_<FIELD>`` variables, e.g. ``SHOAL_KAFKA_BOOTSTRAP_SERVERS``,
        ``SHOAL_KAFKA_SASL_PASSWORD``, ``SHOAL_KAFKA_SESSION_TIMEOUT_MS``."""
        env = os.environ if environ is None else environ
        return cls.from_mapping(
            {
                key[len(prefix) :].lower(): value
                for key, value in env.items()
                if key.startswith(prefix)
            }
        )


_DEFAULTS: Final = KafkaConfig(bootstrap_servers="localhost:9092")


def _check_connector(connector: str) -> None:
    longest = f"{connector}_connector_sync_ckpt"
    if not connector or not _TOPIC_CHARS.match(connector):
        raise ValueError(
            f"connector name {connector!r} must be non-empty ASCII letters, digits, '.', '_' or '-' "
            "(it names Kafka topics and groups)"
        )
    if len(longest) > _MAX_TOPIC_LEN:
        raise ValueError(f"connector name {connector!r} is too long for a Kafka topic name")


def sync_topic(connector: str) -> str:
    return f"{connector}_connector_sync"


def checkpoint_group(connector: str) -> str:
    return f"{connector}_connector_sync_ckpt"


def heartbeat_topic(connector: str) -> str:
    return f"{connector}_heartbeat"


async def ensure_topic(
    config: KafkaConfig,
    topic: str,
    *,
    partitions: int = 1,
    topic_configs: Mapping[str, str] | None = None,
) -> bool:
    """Create ``topic`` (``config.replication_factor`` replicas) if it does not exist; return
    whether it was created. An existing topic is left as it is."""
    admin = AIOKafkaAdminClient(**config.client_kwargs())
    try:
        await admin.start()
        new = NewTopic(
            name=topic,
            num_partitions=partitions,
            replication_factor=config.replication_factor,
            topic_configs=dict(topic_configs or {}),
        )
        try:
            response = await admin.create_topics([new])
        except TopicAlreadyExistsError:
            return False
    except KafkaError as exc:
        raise KafkaAdapterError(
            f"cannot create topic {topic!r} on {config.bootstrap_servers}: {exc!r}"
        ) from exc
    finally:
        await admin.close()
    for name, code, *rest in getattr(response, "topic_errors", ()):
        if code == TopicAlreadyExistsError.errno:
            return False
        if code != 0:
            detail = rest[0] if rest and rest[0] else for_code(code).__name__
            raise KafkaAdapterError(f"creating topic {name!r} failed: {detail} (code {code})")
    log.info("created topic %s (%d partition(s))", topic, partitions)
    return True


# ------------------------------------------------------------------------------------------------
# The sync topic
# ------------------------------------------------------------------------------------------------


class SyncLogStats(msgspec.Struct, frozen=True):
    appends: int
    append_failures: int
    appended_bytes: int
    readers_open: int
    checkpoints_recorded: int
    fragmented: int = 0  # messages over max_message_bytes, appended in fragments
    fragments_dropped: int = 0  # incomplete or orphaned fragmented messages readers skipped


class KafkaSyncLog:
    """The sync topic ``<connector>_connector_sync`` (one partition) as a ``SyncLog``.

    Use ``async with KafkaSyncLog(config, connector) as log:`` (or :meth:`start`/:meth:`close`).
    :meth:`start` creates the topic if missing (``retention_ms``, ``cleanup.policy=delete``) and
    refuses a topic with more than one partition (the log must be totally ordered).

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
    ) -> None:
        _check_connector(connector)
        if not 1024 <= max_message_bytes <= 64 << 20:
            raise ValueError(
                f"max_message_bytes must be in [1 KiB, 64 MiB], got {max_message_bytes}"
            )
        if retention_ms <= 0:
            raise ValueError(f"retention_ms must be positive, got {retention_ms}")
        if not 0 < fetch_max_wait_ms <= 10_000:
            raise ValueError(f"fetch_max_wait_ms must be in (0, 10000], got {fetch_max_wait_ms}")
        self._config = config
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
        try:
            await ensure_topic(
                self._config,
                self.topic,
                partitions=1,
                topic_configs={
                    "retention.ms": str(self._retention_ms),
                    "cleanup.policy": "delete",
                },
            )
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

    def _check_partitions(self, partitions: set[int]) -> None:
        if partitions != {0}:
            raise SyncLogError(
                f"sync topic {self.topic!r} has partitions {sorted(partitions)}; it must "
                "have exactly one (the sync log is totally ordered): delete and recreate it"
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
            fid, first = fragments.new_id(), -1
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
        return offset

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
                for record in batches.get(self._tp, ()):
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
        aclose = getattr(reader, "aclose", None)
        if aclose is not None:
            stack.push_async_callback(aclose)
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


# ------------------------------------------------------------------------------------------------
# Group membership on the heartbeat topic
# ------------------------------------------------------------------------------------------------

_ASSIGNOR_NAME: Final = "shoal-tasks-v1"


class _MemberInfo(msgspec.Struct, frozen=True):
    """What a member puts in its subscription's ``user_data``."""

    task_id: str
    v: int = 1
    floor: int = -1  # the newest epoch this member knows of (received, or read in the sync log)


class _GroupInfo(msgspec.Struct, frozen=True):
    """What the leader puts in every member's assignment ``user_data``."""

    leader: str
    members: tuple[str, ...]
    v: int = 1
    epoch: int = -1  # the generation's epoch (-1 from a leader that predates it: the generation)


_member_info_decoder: Final = msgspec.json.Decoder(_MemberInfo)
_group_info_decoder: Final = msgspec.json.Decoder(_GroupInfo)


class _TaskAssignor(AbstractPartitionAssignor):  # type: ignore[misc]
    """Assigns no partition; carries task ids (and the newest epoch each member knows) up in the
    subscriptions, and the leader, the member list and the generation's epoch down.

    The epoch is the generation unless some member knows an epoch at least as new: Kafka's
    generations start over when the group is gone (the embedded broker restarted, or a real
    Kafka deleted the empty group's metadata) while the sync topic keeps the old epochs, and an
    epoch that is not newer than the sync topic's is ignored there as stale.

    aiokafka calls ``metadata``/``on_assignment`` on every member and ``assign`` on the group
    leader only, on this very instance (the ABC declares them classmethods; instances work).
    """

    name = _ASSIGNOR_NAME
    version = 0

    def __init__(
        self, task_id: str, floor: Callable[[], int], generation: Callable[[], int]
    ) -> None:
        self._task_id = task_id
        self._floor = floor
        self._generation = generation
        self.received: _GroupInfo | None = None  # the last assignment's info, if it decoded
        self.bad_subscriptions = 0

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        user_data = msgspec.json.encode(_MemberInfo(task_id=self._task_id, floor=self._floor()))
        return ConsumerProtocolMemberMetadata(self.version, sorted(topics), user_data)

    def assign(
        self, cluster: Any, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        task_ids: dict[str, str] = {}
        floor = self._floor()
        for member_id, metadata in members.items():
            try:
                member_info = _member_info_decoder.decode(metadata.user_data)
                task_ids[member_id] = member_info.task_id
                floor = max(floor, member_info.floor)
            except msgspec.DecodeError as exc:
                self.bad_subscriptions += 1
                log.warning(
                    "group member %s sent no shoal task id (%s); using its member id instead",
                    member_id,
                    exc,
                )
                task_ids[member_id] = member_id
        unique = sorted(set(task_ids.values()))
        if len(unique) != len(task_ids):
            log.error(
                "two group members claim the same task id (%s): task ids must be unique",
                sorted(task_ids.values()),
            )
        # aiokafka sets the coordinator's generation from the JoinGroup response before it asks
        # the leader to assign.
        generation = self._generation()
        epoch = max(generation, floor + 1)
        if epoch != generation:
            log.warning(
                "group generation %d is not newer than epoch %d a member knows (the group "
                "started over): this generation is epoch %d",
                generation,
                floor,
                epoch,
            )
        info = msgspec.json.encode(
            _GroupInfo(leader=self._task_id, members=tuple(unique), epoch=epoch)
        )
        log.info("group leader %s assigns epoch %d members %s", self._task_id, epoch, unique)
        return {
            member_id: ConsumerProtocolMemberAssignment(self.version, [], info)
            for member_id in members
        }

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        try:
            self.received = _group_info_decoder.decode(assignment.user_data)
        except msgspec.DecodeError as exc:
            self.received = None
            log.warning("undecodable group assignment from the leader: %s", exc)


class MembershipStats(msgspec.Struct, frozen=True):
    generation: int  # -1 while not a member
    leader: str
    members: tuple[str, ...]
    assignments: int  # GroupAssignment events emitted
    losses: int  # GroupLost events emitted
    heartbeats_ok: int
    heartbeats_failed: int
    poll_errors: int
    events_dropped: int  # oldest events dropped because nobody read them
    stale_epochs: int  # assignments refused because their epoch was not newer than one known


_END: Final = object()


class KafkaMembership:
    """Membership of the consumer group ``connector`` on the topic ``<connector>_heartbeat``.

    ``await start()`` (or ``async with``) creates the topic if missing, joins in the background
    and returns at once; :meth:`events` then yields a :class:`GroupAssignment` after each
    completed rebalance and a :class:`GroupLost` when the membership is lost:

    * the coordinator rejected a heartbeat or join (unknown member id, illegal generation —
      the session expired or this member was fenced);
    * no heartbeat succeeded for a whole session timeout (broker unreachable), or, while a
      rebalance is in progress, for the session plus the rebalance timeout.

    After a loss the member keeps trying to rejoin; success is a new :class:`GroupAssignment`.

    :meth:`lease_valid_until` is the monotonic time of the last successful heartbeat (its send
    time) or completed join, plus the session timeout, minus ``lease_margin_ms`` (default: a
    sixth of the session, at most 1 s: it must cover how long the task takes to notice the
    lease is past and stop its readers); ``-inf`` while not a member. A task stops its readers
    once it is past. aiokafka sends no heartbeat while its JoinGroup is in flight, so a slow
    rebalance (one waiting for a member that does not rejoin) can let the lease lapse although
    this member is kept; :attr:`rebalance_in_progress` tells that case apart, and the next
    assignment renews the lease. Measured on the embedded broker (3000/1000 ms): the lease
    keeps >= ~0.5 s of headroom through ordinary joins, leaves and kills.

    :meth:`close` leaves the group at once (others rebalance in ~2 s on the embedded broker
    instead of waiting a session timeout); if this member's rebalance is in flight it first lets
    it finish (at most the rebalance timeout + 1 s). ``rebalance_timeout_ms`` defaults to the
    session timeout.

    A :class:`GroupAssignment`'s ``generation`` is the *epoch* of the generation, which never goes
    back, unlike Kafka's generations (they start at 0 on the embedded broker, restart when it
    restarts, and on a real Kafka when an empty group's metadata is deleted). Each member tells
    the leader the newest epoch it knows — the newest it was assigned, and ``epoch_floor()`` (a
    task gives its CIM's epoch, read from the sync topic) — and the leader assigns
    ``max(generation, newest known + 1)``. A member that is assigned an epoch not newer than
    what it knows (the leader had not read as far: a race at the first join) refuses it and
    rejoins, telling the next leader. While the group keeps its generations the epoch *is* the
    generation.
    """

    def __init__(
        self,
        config: KafkaConfig,
        connector: str,
        task_id: str,
        *,
        lease_margin_ms: int | None = None,
        rebalance_timeout_ms: int | None = None,
        event_buffer: int = 64,
        clock: Callable[[], float] = time.monotonic,
        epoch_floor: Callable[[], int] | None = None,
    ) -> None:
        _check_connector(connector)
        if not task_id:
            raise ValueError("task_id must not be empty")
        session = config.session_timeout_ms
        margin = lease_margin_ms if lease_margin_ms is not None else min(session // 6, 1_000)
        if not 0 <= margin < session:
            raise ValueError(f"lease_margin_ms must be in [0, {session}), got {margin}")
        if event_buffer < 1:
            raise ValueError(f"event_buffer must be >= 1, got {event_buffer}")
        self._config = config
        self.connector = connector
        self.task_id = task_id
        self.group_id = connector
        self.topic = heartbeat_topic(connector)
        self._session_s = session / 1000
        self._rebalance_timeout_ms = rebalance_timeout_ms or session
        self._margin_s = margin / 1000
        self._clock = clock
        self._epoch_floor = epoch_floor
        self._epoch_seen = -1  # the newest epoch this member was assigned
        self._assignor = _TaskAssignor(task_id, self._known_epoch, self._coordinator_generation)
        self._events: asyncio.Queue[GroupEvent | object] = asyncio.Queue(event_buffer)
        self._consumer: AIOKafkaConsumer | None = None
        self._runner: asyncio.Task[None] | None = None
        self._closed = False
        self._events_taken = False
        # Membership state.
        self._current: GroupAssignment | None = None  # None: not a member
        self._last_ok = -math.inf  # monotonic time of the last proof of membership
        self._joining = False
        self._settled = asyncio.Event()  # set while no rebalance of this member is in flight
        # Counters.
        self._assignments = 0
        self._losses = 0
        self._heartbeats_ok = 0
        self._heartbeats_failed = 0
        self._poll_errors = 0
        self._events_dropped = 0
        self._stale_epochs = 0

    def __repr__(self) -> str:
        return (
            f"KafkaMembership(group={self.group_id!r}, task_id={self.task_id!r}, "
            f"generation={self.generation})"
        )

    # -- public view ---------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._current.generation if self._current is not None else -1

    @property
    def rebalance_in_progress(self) -> bool:
        """A rebalance started (this member is rejoining) and has not completed yet."""
        return self._joining

    @property
    def current(self) -> GroupAssignment | None:
        """The latest assignment while a member, else ``None``."""
        return self._current

    def set_epoch_floor(self, epoch_floor: Callable[[], int]) -> None:
        """Where the newest epoch this task has read in the sync topic comes from (see the class
        docstring); may be set after :meth:`start`."""
        self._epoch_floor = epoch_floor

    def _known_epoch(self) -> int:
        floor = self._epoch_floor() if self._epoch_floor is not None else -1
        return max(self._epoch_seen, floor)

    def _coordinator_generation(self) -> int:
        consumer = self._consumer
        if consumer is None or consumer._coordinator is None:
            return -1
        generation: int = consumer._coordinator.generation
        return generation

    def lease_valid_until(self) -> float:
        if self._current is None:
            return -math.inf
        return self._last_ok + self._session_s - self._margin_s

    def statistics(self) -> MembershipStats:
        current = self._current
        return MembershipStats(
            generation=self.generation,
            leader=current.leader if current is not None else "",
            members=current.members if current is not None else (),
            assignments=self._assignments,
            losses=self._losses,
            heartbeats_ok=self._heartbeats_ok,
            heartbeats_failed=self._heartbeats_failed,
            poll_errors=self._poll_errors,
            events_dropped=self._events_dropped,
            stale_epochs=self._stale_epochs,
        )

    def events(self) -> AsyncIterator[GroupEvent]:
        """Rebalances and losses in order; ends after :meth:`close`. One reader only."""
        if self._events_taken:
            raise MembershipError("events() may be iterated by one reader only")
        self._events_taken = True
        return self._iterate_events()

    async def _iterate_events(self) -> AsyncIterator[GroupEvent]:
        while True:
            item = await self._events.get()
            if item is _END:
                runner = self._runner
                if runner is not None and runner.done() and not runner.cancelled():
                    error = runner.exception()
                    if error is not None:
                        raise MembershipError(f"{self!r} failed: {error!r}") from error
                return
            assert isinstance(item, GroupAssignment | GroupLost)
            yield item

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the heartbeat topic if missing and start joining the group (in the
        background: watch :meth:`events`)."""
        if self._consumer is not None or self._closed:
            raise MembershipError(f"{self!r} was already started")
        try:
            await ensure_topic(self._config, self.topic, partitions=1)
        except KafkaAdapterError as exc:
            raise MembershipError(f"{self!r} cannot start: {exc}") from exc
        consumer = AIOKafkaConsumer(
            **self._config.with_client_id(f"shoal-{self.task_id}").client_kwargs(),
            group_id=self.group_id,
            session_timeout_ms=self._config.session_timeout_ms,
            heartbeat_interval_ms=self._config.heartbeat_interval_ms,
            rebalance_timeout_ms=self._rebalance_timeout_ms,
            partition_assignment_strategy=(self._assignor,),
            enable_auto_commit=False,
            auto_offset_reset="latest",
        )
        self._consumer = consumer
        try:
            await consumer.start()  # no subscription yet: does not join
            self._observe_heartbeats(consumer)
            consumer.subscribe([self.topic], listener=_Listener(self))
        except BaseException as exc:
            self._consumer = None
            await consumer.stop()
            if isinstance(exc, KafkaError):
                raise MembershipError(f"{self!r} cannot connect: {exc!r}") from exc
            raise
        self._runner = asyncio.create_task(self._run(consumer), name=f"membership-{self.task_id}")

    async def close(self) -> None:
        """Leave the group (a prompt rebalance for the others) and end :meth:`events`."""
        if self._closed:
            return
        self._closed = True
        runner, consumer = self._runner, self._consumer
        self._runner = None
        try:
            if runner is not None:
                runner.cancel()
                await asyncio.wait([runner])  # a cancellation of close() itself propagates
                if not runner.cancelled() and runner.exception() is not None:
                    log.error("%r had failed before close: %r", self, runner.exception())
        finally:
            if consumer is not None:
                await self._leave(consumer)
            self._current = None
            self._put(_END)

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

    async def _leave(self, consumer: AIOKafkaConsumer) -> None:
        coordinator = consumer._coordinator
        if self._joining:
            # Leaving while our JoinGroup/SyncGroup is in flight can make the embedded broker
            # elect the departed member leader of the next generation, which then never
            # completes (seen with Tansu 0.6.0-510f3e2). Let the rebalance finish first. It can
            # take a whole rebalance timeout to begin (the broker waits that long for a member
            # that left) and as long again to finish: on a loaded machine one finished just
            # after a single timeout, the member had left, and the next group stalled.
            wait_s = 2 * self._rebalance_timeout_ms / 1000 + 1.0
            try:
                async with asyncio.timeout(wait_s):
                    await self._settled.wait()
            except TimeoutError:
                log.warning(
                    "%r: leaving although its rebalance did not finish in %.1f s", self, wait_s
                )
        # aiokafka sends LeaveGroup only in a generation > 0. The embedded broker starts at 0,
        # and a member closed while its JoinGroup is in flight has a member id but generation
        # -1: leave explicitly then, or the others wait a whole session timeout for us.
        if (
            coordinator is not None
            and coordinator.generation <= 0
            and coordinator.member_id != _UNKNOWN_MEMBER_ID
        ):
            try:
                async with asyncio.timeout(self._config.request_timeout_ms / 1000):
                    await coordinator._send_req(
                        LeaveGroupRequest(self.group_id, coordinator.member_id)
                    )
            except (TimeoutError, KafkaError) as exc:
                log.warning(
                    "%r: LeaveGroup (generation %d) failed: %r", self, coordinator.generation, exc
                )
        await consumer.stop()

    # -- the background work -------------------------------------------------------------------

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._poll(consumer))
                group.create_task(self._watch(consumer))
        finally:
            if not self._closed:
                # The runner died on its own: say so to the events reader.
                self._put(_END)

    async def _poll(self, consumer: AIOKafkaConsumer) -> None:
        """Keep polling: aiokafka leaves the group if ``getmany`` is not called for
        ``max_poll_interval_ms``, and its coordination errors surface here."""
        backoff = self._config.heartbeat_interval_ms / 1000
        while True:
            try:
                await consumer.getmany(timeout_ms=1000)
            except KafkaError as exc:
                self._poll_errors += 1
                log.warning("%r: group coordination error (will retry): %r", self, exc)
                await asyncio.sleep(backoff)

    async def _watch(self, consumer: AIOKafkaConsumer) -> None:
        """Declare the membership lost once no heartbeat has succeeded for too long."""
        period = min(self._config.heartbeat_interval_ms / 1000 / 4, 0.25)
        while True:
            await asyncio.sleep(period)
            if self._current is None:
                continue
            coordinator = consumer._coordinator
            if coordinator is not None and coordinator.member_id == _UNKNOWN_MEMBER_ID:
                self._lose(
                    "the coordinator no longer knows this member (session expired or fenced)"
                )
                continue
            allowed = self._session_s
            if self._joining:
                allowed += self._rebalance_timeout_ms / 1000
            silent = self._clock() - self._last_ok
            if silent > allowed:
                self._lose(
                    f"no successful heartbeat for {silent:.1f} s (session timeout "
                    f"{self._session_s:.1f} s): the group coordinator is unreachable"
                )
                if coordinator is not None:
                    coordinator.request_rejoin()

    def _observe_heartbeats(self, consumer: AIOKafkaConsumer) -> None:
        """Hook aiokafka's heartbeat (``GroupCoordinator._do_heartbeat``, aiokafka 0.14) to learn
        when one succeeds: there is no public callback for it."""
        coordinator = consumer._coordinator
        original = getattr(coordinator, "_do_heartbeat", None)
        if original is None:
            raise MembershipError(
                "this aiokafka has no GroupCoordinator._do_heartbeat to observe heartbeats "
                "through: the membership adapter is written for aiokafka 0.14"
            )

        async def observed_heartbeat() -> bool:
            sent = self._clock()
            ok: bool = await original()
            if ok:
                self._heartbeats_ok += 1
                self._last_ok = max(self._last_ok, sent)
            else:
                self._heartbeats_failed += 1
                if coordinator.member_id == _UNKNOWN_MEMBER_ID:
                    self._lose("heartbeat rejected: unknown member id or illegal generation")
            return ok

        coordinator._do_heartbeat = observed_heartbeat

    # -- state changes (called from the listener, the heartbeat hook and the watchdog) ---------

    def _rebalance_started(self) -> None:
        self._joining = True
        self._settled.clear()

    def _rebalance_done(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        coordinator = consumer._coordinator
        self._joining = False
        self._settled.set()
        info = self._assignor.received
        if info is None:
            self._poll_errors += 1
            log.error("%r: rebalance done without a usable assignment; rejoining", self)
            coordinator.request_rejoin()
            return
        if self.task_id not in info.members:
            log.error(
                "%r: the leader's member list %s does not include this task", self, info.members
            )
        epoch = info.epoch if info.epoch >= 0 else coordinator.generation
        known = self._known_epoch()
        if epoch <= known:
            # The leader did not know how far the epochs went (this member had not told it yet,
            # or the group started over): rejoin, and the next leader learns it from us.
            self._stale_epochs += 1
            log.warning(
                "%r: assigned epoch %d (generation %d), not newer than epoch %d known here; "
                "rejoining",
                self,
                epoch,
                coordinator.generation,
                known,
            )
            self._lose(f"assigned a stale epoch {epoch} (epoch {known} is known here)")
            coordinator.request_rejoin()
            return
        self._epoch_seen = epoch
        event = GroupAssignment(generation=epoch, leader=info.leader, members=info.members)
        self._last_ok = self._clock()
        self._current = event
        self._assignments += 1
        log.info(
            "%r: generation %d, leader %s, members %s",
            self,
            event.generation,
            event.leader,
            event.members,
        )
        self._put(event)

    def _lose(self, reason: str) -> None:
        if self._current is None:
            return
        log.warning("%r: group membership lost: %s", self, reason)
        self._current = None
        self._losses += 1
        self._put(GroupLost(reason=reason))

    def _put(self, item: GroupEvent | object) -> None:
        """Queue an event; when nobody reads them, the oldest is dropped (and counted): the
        newest says more about the group than a stale one."""
        if self._events.full():
            dropped = self._events.get_nowait()
            self._events_dropped += 1
            log.error("%r: nobody reads group events; dropped the oldest: %r", self, dropped)
        self._events.put_nowait(item)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, membership: KafkaMembership) -> None:
        self._membership = membership

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._membership._rebalance_started()

    def on_partitions_assigned(self, assigned: Any) -> None:
        self._membership._rebalance_done()
