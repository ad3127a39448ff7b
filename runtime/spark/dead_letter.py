"""Settings and operator helpers of the Spark bridge's retry queue and dead-letter queue.

The bridge (``SparkConfig.dead_letter``) keeps failing rows in two Kafka topics, ``<name>_rq``
and ``<name>_dlq``, in the format of :mod:`runtime.kafka.retry_queue` (the Kafka output sink's), each
entry carrying its row as :class:`runtime.spark.keyed.SparkRecord` JSON. :func:`list_dlq` reads
them without Spark; replaying needs a bridge (it writes the rows to Spark):
``SparkBridge.replay_dlq`` on a running one, or :func:`runtime.spark.operations.replay_dlq`
with the regular owner stopped.
"""

from __future__ import annotations

import msgspec

from protocol.retry import RetryPolicy
from runtime.kafka.config import KafkaConfig
from runtime.kafka.retry_queue import RetryQueueConfig, internal_topic, load_dlq
from runtime.spark.keyed import SparkRecord, decode_record

__all__ = ["DeadLetterConfig", "SparkDlqRecord", "list_dlq"]


class DeadLetterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the Spark bridge parks rows Spark keeps failing, and how it retries them."""

    kafka: KafkaConfig
    name: str  # topic prefix: <name>_rq and <name>_dlq
    rq_partitions: int = 4
    dlq_partitions: int = 4
    policy: RetryPolicy = msgspec.field(default_factory=RetryPolicy)
    max_unsettled: int = 200_000  # rows handed to the RQ and not yet durably parked
    load_timeout_s: float = 60.0
    close_timeout_s: float = 10.0
    seed: int = 0
    # with several processes over these topics: how long a new driver of the RQ waits before
    # it sends (the previous driver's sends in flight end first)
    takeover_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("dead_letter needs a topic name")
        if self.rq_partitions < 1 or self.dlq_partitions < 1 or self.max_unsettled < 1:
            raise ValueError("rq_partitions, dlq_partitions and max_unsettled must be positive")

    def queue_config(self) -> RetryQueueConfig:
        return RetryQueueConfig(
            rq=internal_topic(f"{self.name}_rq", self.rq_partitions),
            dlq=internal_topic(f"{self.name}_dlq", self.dlq_partitions),
            policy=self.policy,
            max_unsettled=self.max_unsettled,
            load_timeout_s=self.load_timeout_s,
            close_timeout_s=self.close_timeout_s,
            seed=self.seed,
        )


class SparkDlqRecord(msgspec.Struct, frozen=True):
    record_id: str
    key: str
    attempts: int
    error: str
    record: SparkRecord | None  # None if the payload could not be found or decoded


def _decode(raw: bytes | None) -> SparkRecord | None:
    if raw is None:
        return None
    try:
        return decode_record(raw)
    except msgspec.DecodeError:
        return None


async def list_dlq(dead_letter: DeadLetterConfig) -> list[SparkDlqRecord]:
    """The rows in the bridge's DLQ, read from the RQ and DLQ topics (no Spark needed)."""
    return [
        SparkDlqRecord(e.record_id, e.key, e.attempts, e.error, _decode(raw))
        for e, raw in await load_dlq(dead_letter.kafka, dead_letter.queue_config())
    ]
