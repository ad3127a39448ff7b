"""``python -m actors.runtime dlq list|replay`` against the embedded broker, through the real entry
point (subprocesses): a Kafka output sink dead-letters a key's record; ``dlq list`` shows it,
``dlq replay`` delivers it and the records parked behind it, in order, and the DLQ is empty
after. (The Spark bridge's DLQ through the same subcommand: tests/integration/test_spark_dead_letter.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from protocol.output_meta import meta_topic
from protocol.retry import RetryPolicy
from runtime.kafka import KafkaConfig
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.sink import KafkaSink, KafkaSinkConfig
from runtime.kafka.topics import topic_exists
from tests.fixtures.kafka import connector, kafka_broker, kafka_config
from tests.fixtures.kafka_sink import (
    expected_ids,
    failing,
    key_of,
    put_all,
    read_output,
    workload,
)
from tests.fixtures.output_runs import shoal
from tests.helpers import assert_catches_a_double, exactly

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name

FAST = RetryPolicy(max_attempts=2, base_backoff=0.02, max_backoff=0.05)


def all_ids(changes: list[Any]) -> list[str]:
    return [rid for ids in expected_ids(changes).values() for rid in ids]


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_dlq_list_and_replay_of_the_kafka_sink(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, connector: str
) -> None:
    name = f"{connector}_output"  # the CLI's default output topic; partitions as its defaults
    cfg = KafkaSinkConfig(name=name, partitions=4, policy=FAST)
    changes = workload(keys=6, per_key=3)
    want = expected_ids(changes)
    async with KafkaSink(kafka_config, cfg, inject=failing({2})) as sink:
        await put_all(sink, changes, batch=6)
        async with asyncio.timeout(20):
            await sink.wait_idle()
        (dead,) = sink.dlq_records()
    assert dead.record_id == want[2][0]

    where = ["--kafka-bootstrap-servers", kafka_broker.bootstrap, "--connector", connector]
    listed = await shoal("dlq", "list", "--sink", "kafka", *where)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [
        f"1 record(s) in the DLQ of {name!r}",
        f'{dead.record_id}  key=T:{{"id": "2"}}  attempts=2  error=injected failure for key 2',
    ]
    # an output without a metadata topic keeps having none: looking creates nothing
    assert not await topic_exists(kafka_config, meta_topic(name))

    # The default sink is spark: without its dead-letter queue the command says what to give.
    wrong = await shoal("dlq", "list", *where)
    assert wrong.returncode == 2
    assert "--spark-dead-letter" in wrong.stderr
    assert "--sink kafka" in wrong.stderr

    replayed = await shoal("dlq", "replay", "--sink", "kafka", *where)
    assert replayed.returncode == 0, replayed.stderr
    assert f"replayed 1 record(s) from the DLQ of {name!r}" in replayed.stdout
    got = await read_output(kafka_config, name, 4, want=len(changes))
    ids = [r.record_id for _, r in got]
    exactly(all_ids(changes))(ids)
    assert_catches_a_double(exactly(all_ids(changes)), ids)
    assert [r.record_id for _, r in got if key_of(r) == 2] == want[2]  # in order, after replay

    empty = await shoal("dlq", "list", "--sink", "kafka", *where)
    assert empty.returncode == 0, empty.stderr
    assert empty.stdout.splitlines() == [f"0 record(s) in the DLQ of {name!r}"]


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_dlq_replay_via_the_leader_while_the_sink_runs(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, connector: str
) -> None:
    """``dlq replay --via-leader`` while the (shared, driving) sink keeps running: the running
    sink delivers the replayed record, then the one parked behind it; nothing twice."""
    name = f"{connector}_output"
    cfg = KafkaSinkConfig(name=name, partitions=4, policy=FAST)
    changes = workload(keys=6, per_key=3)
    want = expected_ids(changes)
    healed = asyncio.Event()

    def inject(rec: Any, attempts: int) -> str | None:
        return None if healed.is_set() else failing({2})(rec, attempts)

    where = ["--kafka-bootstrap-servers", kafka_broker.bootstrap, "--connector", connector]
    async with KafkaSink(
        kafka_config, cfg, inject=inject, driver=lambda: True, takeover_grace_s=0.0
    ) as sink:
        await sink.prepare("p")
        await put_all(sink, changes, batch=6)
        async with asyncio.timeout(20):
            while len(sink.dlq_records()) != 1:
                await asyncio.sleep(0.05)
        healed.set()
        replayed = await shoal("dlq", "replay", "--via-leader", "--sink", "kafka", *where)
        assert replayed.returncode == 0, replayed.stderr
        assert f"replayed 1 record(s) from the DLQ of {name!r} via the leader" in replayed.stdout
    got = await read_output(kafka_config, name, 4, want=len(changes))
    ids = [r.record_id for _, r in got]
    exactly(all_ids(changes))(ids)
    assert_catches_a_double(exactly(all_ids(changes)), ids)
    assert [r.record_id for _, r in got if key_of(r) == 2] == want[2]


def test_spark_dead_letter_options_build_the_bridge_settings() -> None:
    from actors.cli import config as options
    from actors.cli.sinks import spark_config
    from actors.runtime import build_parser

    def load(*argv: str) -> options.ShoalConfig:
        return options.load(build_parser("run").parse_args(list(argv)), environ={})

    kafka = KafkaConfig(bootstrap_servers="127.0.0.1:9092")
    assert spark_config(load("--connector", "orders"), kafka).dead_letter is None
    on = spark_config(
        load(
            "--connector", "orders", "--spark-dead-letter", "--spark-dead-letter-max-attempts", "7"
        ),
        kafka,
    )
    assert on.dead_letter is not None
    assert on.dead_letter.name == "orders_spark"
    assert on.dead_letter.policy.max_attempts == 7
    assert on.dead_letter.kafka == kafka
    assert on.output_dir == str(Path("shoal-output").resolve() / "data")
    named = spark_config(load("--spark-dead-letter", "--spark-dead-letter-topic", "x.y"), kafka)
    assert named.dead_letter is not None
    assert named.dead_letter.name == "x.y"
    with pytest.raises(options.ConfigError, match="embedded path only"):
        load("--spark-dead-letter", "--spark-path", "streaming")
    with pytest.raises(options.ConfigError, match="dead_letter_topic"):
        load("--spark-dead-letter-topic", "a b")
