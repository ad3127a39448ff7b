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
from runtime.kafka.tls import diagnose

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
    the TLS diagnosis when the connection failed on it, else a ``KafkaAdapterError``."""
    admin = AIOKafkaAdminClient(**config.client_kwargs())
    try:
        await admin.start()
        yield admin
    except KafkaError as exc:
        tls = await diagnose(config) if isinstance(exc, KafkaConnectionError) else None
        if tls is not None:
            # caused by the ssl error, so no caller takes it for a transient connection error
            raise tls from tls.__cause__
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


async def ensure_topic(
    config: KafkaConfig,
    topic: str,
    *,
    partitions: int = 1,
    topic_configs: Mapping[str, str] | None = None,
) -> bool:
    """Create ``topic`` (``config.replication_factor`` replicas) if it does not exist; return
    whether it was created. An existing topic is left as it is."""
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
            return False
    for name, code, *rest in getattr(response, "topic_errors", ()):
        if code == TopicAlreadyExistsError.errno:
            return False
        if code != 0:
            detail = rest[0] if rest and rest[0] else for_code(code).__name__
            raise KafkaAdapterError(f"creating topic {name!r} failed: {detail} (code {code})")
    log.info("created topic %s (%d partition(s))", topic, partitions)
    return True
