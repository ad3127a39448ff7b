"""The names of the topics and groups shoal uses for a connector, and :func:`ensure_topic`.

* ``<connector>_connector_sync``: the sync topic (one partition);
* ``<connector>_connector_sync_ckpt``: the consumer group whose committed offset is the latest
  checkpoint message's offset;
* ``<connector>_heartbeat``: the topic of the consumer group named after the connector, used only
  for Kafka's rebalance protocol.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Mapping

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError, for_code

from runtime.kafka.config import KafkaAdapterError, KafkaConfig
from runtime.kafka.sasl import diagnose as sasl_diagnose
from runtime.kafka.tls import diagnose as tls_diagnose
from runtime.kafka.tls import preflight

log = logging.getLogger(__name__)

_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_TOPIC_LEN = 249


def check_connector(connector: str) -> None:
    """Refuse a connector name that cannot name Kafka topics and groups."""
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


@contextlib.asynccontextmanager
async def _admin(config: KafkaConfig, doing: str) -> AsyncIterator[AIOKafkaAdminClient]:
    """A started admin client; a Kafka error in the block (``doing`` says what failed) becomes
    the TLS or SASL diagnosis when the connection failed on it, else a ``KafkaAdapterError``.
    A TLS client's listeners are checked first (:func:`runtime.kafka.tls.preflight`): a
    plaintext listener would hold the client's handshake for its whole request timeout."""
    await preflight(config)
    admin = AIOKafkaAdminClient(**config.client_kwargs())
    try:
        await admin.start()
        yield admin
    except KafkaError as exc:
        if isinstance(exc, KafkaConnectionError):
            refused = await tls_diagnose(config) or await sasl_diagnose(config)
            if refused is not None:
                # caused by the ssl or SASL error, so no caller takes it for a transient
                # connection error
                raise refused from refused.__cause__
        raise KafkaAdapterError(f"cannot {doing} on {config.bootstrap_servers}: {exc!r}") from exc
    finally:
        await admin.close()


async def topic_exists(config: KafkaConfig, topic: str) -> bool:
    """Whether ``topic`` exists (asking creates nothing)."""
    return topic in await list_topics(config)


async def list_topics(config: KafkaConfig) -> list[str]:
    """Every topic's name (a metadata request for all topics: it creates nothing, even on a
    Kafka that creates a topic a client asks about, ``auto.create.topics.enable``)."""
    async with _admin(config, "list the topics") as admin:
        return list(await admin.list_topics())


def connectors_of(topics: list[str]) -> list[str]:
    """The connectors whose sync topics are among ``topics``."""
    suffix = sync_topic("")
    return sorted(t.removesuffix(suffix) for t in topics if t.endswith(suffix) and t != suffix)


class TopicSettingsError(KafkaAdapterError):
    """An existing topic's settings cannot work for what shoal keeps in it (a sync topic of
    several partitions has no total order); retrying cannot help. The message names the topic."""


# (bootstrap servers, topic): existing topics whose replication factor was already warned about
_WARNED: set[tuple[str, str]] = set()


async def ensure_topic(
    config: KafkaConfig,
    topic: str,
    *,
    partitions: int = 1,
    topic_configs: Mapping[str, str] | None = None,
    exact_partitions: bool = False,
) -> bool:
    """Create ``topic`` (``config.replication_factor`` replicas) if it does not exist; return
    whether it was created. An existing topic is left as it is, but checked: a replication
    factor other than ``config.replication_factor`` is logged (a warning, once per process and
    topic: shoal does not change it), and with ``exact_partitions`` another partition count is
    :class:`TopicSettingsError`."""
    new = NewTopic(
        name=topic,
        num_partitions=partitions,
        replication_factor=config.replication_factor,
        topic_configs=dict(topic_configs or {}),
    )
    async with _admin(config, f"create topic {topic!r}") as admin:
        try:
            response = await admin.create_topics([new])
        except TopicAlreadyExistsError:
            exists = True
        else:
            exists = False
            for name, code, *rest in getattr(response, "topic_errors", ()):
                if code == TopicAlreadyExistsError.errno:
                    exists = True
                elif code != 0:
                    detail = rest[0] if rest and rest[0] else for_code(code).__name__
                    raise KafkaAdapterError(
                        f"creating topic {name!r} failed: {detail} (code {code})"
                    )
        if exists:
            await _check_existing(admin, config, topic, partitions if exact_partitions else None)
            return False
    log.info("created topic %s (%d partition(s))", topic, partitions)
    return True


async def _check_existing(
    admin: AIOKafkaAdminClient, config: KafkaConfig, topic: str, partitions: int | None
) -> None:
    """Compare an existing topic (it exists: describing it creates nothing) with the settings
    shoal would have created it with."""
    described = [d for d in await admin.describe_topics([topic]) if d.get("topic") == topic]
    if not described or described[0].get("error_code"):
        log.debug("topic %s exists but could not be described: %r", topic, described)
        return
    parts = described[0].get("partitions") or []
    if partitions is not None and len(parts) != partitions:
        raise TopicSettingsError(
            f"topic {topic!r} on {config.bootstrap_servers} has {len(parts)} partitions, "
            f"not {partitions}"
        )
    replicas = min((len(p.get("replicas") or ()) for p in parts), default=0)
    wanted = config.replication_factor
    if replicas and replicas != wanted and (config.bootstrap_servers, topic) not in _WARNED:
        _WARNED.add((config.bootstrap_servers, topic))
        log.warning(
            "topic %s has replication factor %d, not kafka.replication_factor %d "
            "(--kafka-replication-factor): shoal leaves an existing topic as it is; change it "
            "with your Kafka's tools (kafka-reassign-partitions.sh)%s",
            topic,
            replicas,
            wanted,
            ", or it does not survive the loss of a broker" if replicas < wanted else "",
        )
