"""``status`` stays readable with real Spanner partition tokens (200+ characters, long shared
prefixes): the table shows each as its first characters and a short hash, distinct and the same
from one run to the next; ``--wide`` and ``--json`` show whole tokens. The tokens are put on a
real sync topic (the embedded broker) in an epoch message, as a leader writes it.

The first partition's watermark is fresh, the second's ten minutes old: with
``--health-failing-s 60`` only the second is marked ``STALLED`` and its owner named."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from protocol import messages
from runtime.kafka import KafkaConfig, KafkaSyncLog
from runtime.kafka.broker import EmbeddedBroker
from tests.fixtures.kafka import kafka_broker
from tests.helpers import REPO

__all__ = ["kafka_broker"]

pytestmark = [pytest.mark.kafka]

PREFIX = "AUrvX1Qf" * 25  # 200 characters every token shares, as Spanner's often do
TOKENS = (PREFIX + "child-one-0001", PREFIX + "child-two-0002")


async def _publish(bootstrap: str, connector: str) -> None:
    now = time.time_ns() // 1000
    watermarks = (now, now - 600_000_000)
    state = messages.TaskState(
        task_id="task-a",
        state_timestamp=now,
        data=tuple(
            messages.Partition(token=t, start_ts=now - 900_000_000, watermark=w)
            for t, w in zip(TOKENS, watermarks, strict=True)
        ),
        full=True,
    )
    epoch = messages.EpochMessage(
        task_id="task-a",
        message_timestamp=now,
        epoch=1,
        sync_epoch=uuid.uuid4().hex,
        members=("task-a",),
        connector_state=(state,),
    )
    async with KafkaSyncLog(KafkaConfig.embedded(bootstrap), connector) as log:
        await log.append(messages.encode(epoch))


def _status(broker: EmbeddedBroker, connector: str, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-m", "actors.runtime", "status", "--connector", connector,
         "--kafka-bootstrap-servers", broker.bootstrap, *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.timeout(120)
def test_status_shortens_long_tokens_and_shows_them_whole_on_request(
    kafka_broker: EmbeddedBroker,
) -> None:
    connector = f"tokens-{uuid.uuid4().hex[:8]}"
    asyncio.run(_publish(kafka_broker.bootstrap, connector))

    table = _status(kafka_broker, connector, "--health-failing-s", "60")
    rows = [line for line in table.splitlines() if line.startswith(PREFIX[:10])]
    assert len(rows) == 2, table
    assert [row.endswith("STALLED") for row in rows] == [False, True], table
    assert "NOT MAKING PROGRESS: partitions not advanced for over 60s" in table
    assert "owned by task-a (1)" in table
    assert all(len(line) <= 100 for line in table.splitlines()), table
    assert not any(t in table for t in TOKENS), "a whole 214-character token in the table"
    shown = [row.split()[0] for row in rows]
    assert len(set(shown)) == 2, f"two tokens with one prefix look alike: {shown}"
    assert all(PREFIX.startswith(s.split("~")[0]) for s in shown), shown
    assert [r.split()[0] for r in _status(kafka_broker, connector).splitlines()
            if r.startswith(PREFIX[:10])] == shown, "the short form is not stable"  # fmt: skip

    wide = _status(kafka_broker, connector, "--wide")
    assert all(t in wide for t in TOKENS), wide
    data = json.loads(_status(kafka_broker, connector, "--json"))
    assert set(data["tasks"]["task-a"]["partitions"]) == set(TOKENS)
