"""``status`` with a connector name that has no sync topic (a typo) says "no such connector" in
one line with exit code 1 and creates nothing: it used to create the topic, which a later real
start of that name then kept with replication factor 1. Against the embedded broker, through
the command line as an operator types it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest

from runtime.kafka import KafkaConfig, KafkaSyncLog
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.topics import list_topics
from tests.fixtures.kafka import kafka_broker
from tests.helpers import REPO

__all__ = ["kafka_broker"]

pytestmark = [pytest.mark.kafka]


def _status(broker: EmbeddedBroker, connector: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "actors.runtime", "status", "--connector", connector,
         "--kafka-bootstrap-servers", broker.bootstrap],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


async def _create(bootstrap: str, connector: str) -> None:
    async with KafkaSyncLog(KafkaConfig.embedded(bootstrap), connector):
        pass


@pytest.mark.timeout(120)
def test_status_of_a_mistyped_connector_creates_nothing(kafka_broker: EmbeddedBroker) -> None:
    config = KafkaConfig.embedded(kafka_broker.bootstrap)
    real = f"orders-{uuid.uuid4().hex[:8]}"
    asyncio.run(_create(kafka_broker.bootstrap, real))
    typo = real.replace("orders", "ordres")
    before = set(asyncio.run(list_topics(config)))

    result = _status(kafka_broker, typo)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"shoal: error: no such connector {typo!r} on "), lines
    assert f"{typo}_connector_sync" in lines[0]
    assert repr(real) in lines[0], "the connectors that exist are named"
    after = set(asyncio.run(list_topics(config)))
    assert after == before, f"status created {sorted(after - before)}"

    # control: the connector that exists is shown
    ok = _status(kafka_broker, real)
    assert ok.returncode == 0, ok.stderr
    assert f"connector {real!r}" in ok.stdout
