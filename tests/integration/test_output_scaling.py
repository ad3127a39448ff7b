"""Scaling the keyed Kafka output while it runs (docs/operations.md, "Scaling the Kafka output";
rules: protocol/output_meta.py), against the embedded broker with real processes.

Two producer processes write per-key sequence numbers to a composite output topic of 4
partitions; mid-stream ``output add-storage-topic 12`` and ``output switch-produce`` run through
the real entry point, and one producer is killed with SIGKILL right after the switch is prepared
(its replacement sends its keys again from the start: at least once). The reader of the composite
topic (:func:`runtime.kafka.composite_reader.read_composite`) must then see, per key, every
sequence number; after dropping repeats of a record id already seen, no key's sequence number
goes backwards (each record read is either a repeat or newer than every record of its key read
before). Both storage topics hold records and the first is sealed."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from runtime.kafka import KafkaConfig
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.composite_reader import read_composite
from runtime.kafka.sink import decode_output
from tests.fixtures import output_runs as runs
from tests.fixtures.kafka import connector, kafka_broker, kafka_config
from tests.fixtures.kafka_sink import key_of

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name

PER_KEY = 40


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_add_storage_topic_and_switch_with_a_kill_keep_per_key_order(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, connector: str
) -> None:
    name = f"{connector}_output"
    where = ["--kafka-bootstrap-servers", kafka_broker.bootstrap, "--connector", connector]
    a = await runs.start_producer(kafka_broker.bootstrap, name, 0, 9, PER_KEY)
    await runs.line(a, "started")
    b = await runs.start_producer(kafka_broker.bootstrap, name, 10, 19, PER_KEY)
    await runs.line(b, "put 5")

    added = await runs.shoal("output", "add-storage-topic", "12", *where)
    assert added.returncode == 0, added.stderr
    assert f"added storage topic {name}.1 (P=12, K=3)" in added.stdout

    switch = asyncio.create_task(runs.shoal("output", "switch-produce", "--wait", "60", *where))
    await asyncio.sleep(0.5)  # prepared: the producers hold and ack
    b.send_signal(signal.SIGKILL)
    await b.wait()
    done = await switch
    assert done.returncode == 0, done.stderr
    assert f"producing to {name}.1" in done.stdout

    b2 = await runs.start_producer(
        kafka_broker.bootstrap, name, 10, 19, PER_KEY
    )  # B's keys again, from the start
    await runs.line(a, "done", within_s=120)
    await runs.line(b2, "done", within_s=120)
    await a.wait()
    await b2.wait()

    shown = await runs.shoal("output", "show", "--json", *where)
    assert shown.returncode == 0, shown.stderr
    state = json.loads(shown.stdout)
    assert state["produce_pointer"] == 1
    assert state["storage_topics"][0]["sealed_at"] is not None
    assert state["pending_switch"] is None

    per_storage = [0, 0]
    last: dict[int, int] = {}
    seen: set[str] = set()
    backwards = repeats = 0
    reader = read_composite(kafka_config, name, idle_exit_s=3.0)
    async for m in reader:
        assert m.value is not None
        rec = decode_output(m.value)
        per_storage[m.storage_index] += 1
        if rec.record_id in seen:
            repeats += 1
            continue
        seen.add(rec.record_id)
        k, n = key_of(rec), int(json.loads(rec.new_values)["n"])
        if n <= last.get(k, -1):
            backwards += 1
        last[k] = max(last.get(k, -1), n)
    assert backwards == 0
    assert len(seen) == 20 * PER_KEY  # every record, each key's 0..PER_KEY-1
    assert last == dict.fromkeys(range(20), PER_KEY - 1)
    assert per_storage[0] > 0
    assert per_storage[1] > 0
    print(f"read {sum(per_storage)} ({per_storage}), repeats {repeats}")
