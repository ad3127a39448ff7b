"""Kafka adapters: the coordination ports of :mod:`runtime.ports` on Kafka, the embedded broker,
the Kafka output sink and the durable retry/dead-letter queue (see ``docs/design.md``, "Sync
topic and CIM" and "Retry and dead-letter queues").

* :mod:`runtime.kafka.config` – :class:`KafkaConfig`: connection settings shared by every client
  (bootstrap servers, SASL/SSL, group timeouts), validated up front; its ``repr`` never shows a
  secret.
* :mod:`runtime.kafka.topics` – the names of a connector's topics and groups, and
  :func:`ensure_topic`.
* :mod:`runtime.kafka.synclog` – :class:`KafkaSyncLog`, the sync topic as a
  :class:`runtime.ports.SyncLog`, and :func:`replay_until_marker`.
* :mod:`runtime.kafka.membership` – :class:`KafkaMembership`, the heartbeat-topic consumer group
  (used only for its rebalance protocol) as a :class:`runtime.ports.Membership`.
* :mod:`runtime.kafka.broker` – the embedded Kafka-compatible broker launcher.
* :mod:`runtime.kafka.sink` – the Kafka output sink (keyed, per-record delivery).
* :mod:`runtime.kafka.retry_queue` – the durable RQ/DLQ shell both sinks share.

This package re-exports the public names of the first four, so ``from runtime.kafka import
KafkaConfig, KafkaSyncLog, KafkaMembership`` works; import the other modules by name.

Everything here works the same on the embedded broker and on a real Kafka; only the timeouts
differ (real Kafka needs ``session_timeout_ms >= 6000`` by default).
"""

from runtime.kafka.config import KafkaAdapterError, KafkaConfig, SaslMechanism, SecurityProtocol
from runtime.kafka.membership import KafkaMembership, MembershipError, MembershipStats
from runtime.kafka.synclog import (
    KafkaSyncLog,
    ReplayResult,
    SyncLogError,
    SyncLogStats,
    replay_until_marker,
)
from runtime.kafka.topics import checkpoint_group, ensure_topic, heartbeat_topic, sync_topic

__all__ = [
    "KafkaAdapterError",
    "KafkaConfig",
    "KafkaMembership",
    "KafkaSyncLog",
    "MembershipError",
    "MembershipStats",
    "ReplayResult",
    "SaslMechanism",
    "SecurityProtocol",
    "SyncLogError",
    "SyncLogStats",
    "checkpoint_group",
    "ensure_topic",
    "heartbeat_topic",
    "replay_until_marker",
    "sync_topic",
]
