"""A reader of a composite output topic in per-key order (docs/operations.md, "Scaling the Kafka
output"; the rules: :mod:`protocol.output_meta`).

The rule, for one shard ``s`` of ``S`` (``S = 1``: the whole topic): start with storage topic
``T_0``; read each of its partitions in the shard's range (:func:`protocol.routing.
partitions_for_shard`) from the beginning up to its first seal marker (a message with the header
``shoal-seal``; it is not a record), then go on to ``T_1``, and so on; the storage topic the
produce pointer names has no seal: read it on. Because the switch barrier lets no producer write
to ``T_{i+1}`` before every record sent to ``T_i`` was acknowledged, and seals ``T_i`` only after
that, every record of a key in ``T_i`` comes before every record of the key in ``T_{i+1}``; within
a storage topic a key lives in one partition. (When K fell to 1 at a storage topic, keys change
shards there: a per-shard reader keeps per-key order only if every shard's reader finished
``T_i`` before any reads ``T_{i+1}``; one reader of the whole topic always does.)

The output is at least once: a record may appear twice (a crash between its delivery and its
batch's commit); consumers de-duplicate on the ``shoal-record-id`` header.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import msgspec
from aiokafka.structs import TopicPartition

from protocol.routing import partitions_for_shard
from runtime.kafka.config import KafkaAdapterError, KafkaConfig
from runtime.kafka.output_meta import SEAL_HEADER, MetaLog

__all__ = ["CompositeMessage", "read_composite"]


class CompositeMessage(msgspec.Struct, frozen=True):
    storage_index: int
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    record_id: str | None  # the shoal-record-id header


async def read_composite(
    config: KafkaConfig,
    output: str,
    *,
    shard: int = 0,
    shards: int = 1,
    idle_exit_s: float | None = None,
    poll_ms: int = 200,
) -> AsyncGenerator[CompositeMessage, None]:
    """Every message of composite topic ``output`` (shard ``shard`` of ``shards``) in the order
    above; follows the topic for ever, or ends once the storage topic being read gave nothing for
    ``idle_exit_s`` seconds. Close it (``aclose``) when done early."""
    async with MetaLog(config, output) as meta:
        state, _ = await meta.load()
        if not state.created:
            raise KafkaAdapterError(
                f"{output!r} has no composite-topic metadata ({meta.topic}): is it a shoal "
                "output that ran with the metadata topic?"
            )
        consumer = meta.consumer()
        await consumer.start()
        try:
            index = 0
            while True:
                st = state.composite().storage_topics[index]
                parts = partitions_for_shard(shard, st.partitions, shards)
                tps = [TopicPartition(st.name, p) for p in parts]
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                unsealed = set(tps)
                quiet_since = time.monotonic()
                while unsealed:
                    batches = await consumer.getmany(*unsealed, timeout_ms=poll_ms)
                    got = False
                    for tp, msgs in batches.items():
                        for m in msgs:
                            headers = dict(m.headers or ())
                            if SEAL_HEADER in headers:
                                unsealed.discard(tp)  # the switch point of this partition
                                break
                            got = True
                            rid = headers.get("shoal-record-id")
                            yield CompositeMessage(
                                index,
                                tp.topic,
                                tp.partition,
                                m.offset,
                                m.key,
                                m.value,
                                rid.decode() if rid is not None else None,
                            )
                    if got:
                        quiet_since = time.monotonic()
                    elif idle_exit_s is not None and time.monotonic() - quiet_since > idle_exit_s:
                        return
                index += 1
                while index >= len(state.composite().storage_topics):
                    # sealed, so the next storage topic is in the log already (the seal follows
                    # the commit): read it again
                    state, _ = await meta.load()
                    if index >= len(state.composite().storage_topics):
                        await asyncio.sleep(poll_ms / 1000)
        finally:
            await consumer.stop()
