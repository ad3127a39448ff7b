"""Topics that already exist are checked against the options at start, on the embedded broker
(which keeps its topics across the runs of a test, as any persistent Kafka does): a sync topic
of several partitions is refused (exit 2, one line naming the topic and ``--connector``) before
anything is read; a replication factor other than ``kafka.replication_factor`` is one warning
line naming the topic and the option (once per process), and the run goes on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from runtime.kafka import KafkaConfig, KafkaSyncLog
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.topics import heartbeat_topic, sync_topic
from tests.fixtures.kafka import kafka_broker
from tests.helpers import REPO

__all__ = ["kafka_broker"]

pytestmark = [pytest.mark.kafka]


def _run(
    broker: EmbeddedBroker, connector: str, tmp: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "actors.runtime", "--connector", connector,
         "--kafka-bootstrap-servers", broker.bootstrap, "--kafka-session-timeout-ms", "3000",
         "--kafka-heartbeat-interval-ms", "1000", "--sink", "files", "--sim-roots", "2",
         "--progress", "off", "--duration", "8", "--output-dir", str(tmp), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


async def _create(bootstrap: str, topic: str, partitions: int, *, replicas: int = 1) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, replicas)])
    finally:
        await admin.close()


async def _sync_topic(bootstrap: str, connector: str) -> None:
    async with KafkaSyncLog(KafkaConfig.embedded(bootstrap), connector):
        pass


def _warnings(stderr: str, topic: str) -> list[str]:
    return [line for line in stderr.splitlines() if "WARNING" in line and f" {topic} " in line]


@pytest.mark.timeout(120)
def test_a_sync_topic_of_several_partitions_is_refused(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    connector = f"parts-{uuid.uuid4().hex[:8]}"
    asyncio.run(_create(kafka_broker.bootstrap, sync_topic(connector), 3))
    result = _run(kafka_broker, connector, tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, result.stderr
    assert f"topic {sync_topic(connector)!r}" in lines[0]
    assert "has 3 partitions, not 1" in lines[0]
    assert "--connector" in lines[0]
    assert "shoal run summary" not in result.stdout  # refused before any task ran


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_replication_factor_other_than_the_option_is_one_warning(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    """The sync topic exists with 1 replica (as ``status`` used to create it); a start with
    ``--kafka-replication-factor 3`` (two tasks) warns once about it and creates the heartbeat
    topic with 3. Then, for a connector whose heartbeat topic exists with 3 replicas, a start with
    the factor 1 warns about the heartbeat topic only.

    The second start is a connector of its own: the embedded broker (Tansu) accepts 3 replicas
    on its single node, which a real Kafka refuses, and then does not let a second generation of
    the group form on that topic (the rejoin waits out its rebalance); a real Kafka never gets
    there."""
    connector = f"rf-{uuid.uuid4().hex[:8]}"
    asyncio.run(_sync_topic(kafka_broker.bootstrap, connector))
    three = _run(
        kafka_broker, connector, tmp_path / "a", "--kafka-replication-factor", "3", "--tasks", "2"
    )
    assert three.returncode == 0, three.stdout + three.stderr
    warned = _warnings(three.stderr, sync_topic(connector))
    assert len(warned) == 1, three.stderr
    assert "replication factor 1, not kafka.replication_factor 3" in warned[0]
    assert "--kafka-replication-factor" in warned[0]
    assert not _warnings(three.stderr, heartbeat_topic(connector))  # created with 3 here

    other = f"rf-{uuid.uuid4().hex[:8]}"
    asyncio.run(_sync_topic(kafka_broker.bootstrap, other))
    asyncio.run(_create(kafka_broker.bootstrap, heartbeat_topic(other), 1, replicas=3))
    one = _run(kafka_broker, other, tmp_path / "b")
    assert one.returncode == 0, one.stdout + one.stderr
    assert not _warnings(one.stderr, sync_topic(other))
    hb = _warnings(one.stderr, heartbeat_topic(other))
    assert len(hb) == 1, one.stderr
    assert "replication factor 3, not kafka.replication_factor 1" in hb[0]
