"""The Kafka output stays at least once (docs/design.md#exactly-once-output): every message
carries its row key in the header ``shoal-record-id``, so consumers de-duplicate on it."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from runtime.kafka import KafkaConfig
from runtime.kafka.sink import ROW_KEY_HEADER, KafkaSink, KafkaSinkConfig, decode_output
from tests.fixtures.kafka import connector, kafka_broker, kafka_config
from tests.fixtures.kafka_sink import put_all, workload
from tests.helpers import assert_catches_a_double, assert_no_row_twice

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name


@pytest.mark.asyncio
async def test_every_output_message_carries_its_row_key_header(
    kafka_config: KafkaConfig, connector: str
) -> None:
    cfg = KafkaSinkConfig(name=connector, partitions=2, rq_partitions=1, dlq_partitions=1)
    changes = workload(keys=5, per_key=2)
    async with KafkaSink(kafka_config, cfg) as sink:
        await put_all(sink, changes)
    consumer = AIOKafkaConsumer(
        **kafka_config.client_kwargs(),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
    )
    await consumer.start()
    seen: list[tuple[str, str]] = []
    try:
        tps = [TopicPartition(connector, p) for p in range(2)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        async with asyncio.timeout(20):
            while len(seen) < len(changes):
                for msgs in (await consumer.getmany(timeout_ms=200)).values():
                    for m in msgs:
                        headers = dict(m.headers)
                        seen.append(
                            (headers[ROW_KEY_HEADER].decode(), decode_output(m.value).record_id)
                        )
    finally:
        await consumer.stop()
    assert all(header == record_id for header, record_id in seen)
    row_keys = [h for h, _ in seen]
    assert len(row_keys) == len(changes)  # a run without failures delivers each record once
    assert_no_row_twice(row_keys, "row keys")
    assert_catches_a_double(assert_no_row_twice, row_keys)  # the check sees a doubled message
