"""The SASL settings reach every Kafka client shoal builds, as documented: mechanism, user name
and password, on the producers, consumers and admin clients of the sync log, the group, the
topics and the Kafka output sink with its retry queue.

The embedded broker cannot authenticate (this build's SASL does not work; see
``runtime/kafka/broker.py``), so two things are checked:

* the real handshake: with ``SASL_PLAINTEXT`` a client does start a SASL handshake with the
  configured mechanism, which the broker refuses (``UnsupportedSaslMechanismError``), and the
  start fails;
* a whole run (``Pipeline``, ``--sink kafka``): every aiokafka client the adapters construct is
  recorded with the security settings it was given and the SASL settings its connection client
  holds, then connected in plaintext, the only way this broker can serve it, so the run's every
  client gets built (a client built only after an earlier one connected would otherwise never
  be seen).
"""

from __future__ import annotations

import asyncio
import io
import logging
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from actors.cli.run import Pipeline
from runtime import config as options
from runtime.kafka import KafkaConfig, KafkaSyncLog, SyncLogError
from runtime.kafka.broker import EmbeddedBroker
from tests.fixtures.kafka import kafka_broker

__all__ = ["kafka_broker"]

pytestmark = [pytest.mark.kafka]

USER = "shoal-user"
PASSWORD = "sasl-pw-Xy7-SECRET"
MECHANISM = "SCRAM-SHA-512"


class Built(msgspec.Struct, frozen=True):
    kind: str
    client_id: str
    security_protocol: str  # as the adapter asked for it
    mechanism: str | None  # as the client's connection layer holds them
    username: str | None
    password: str | None


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[Built]:
    """Every aiokafka producer, consumer and admin client constructed during the test."""
    seen: list[Built] = []

    def record(cls: type[Any], kind: str, attribute: str) -> None:
        original = cls.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            asked = kwargs.get("security_protocol", "PLAINTEXT")
            original(self, *args, **kwargs)
            client = getattr(self, attribute)
            seen.append(
                Built(
                    kind=kind,
                    client_id=str(kwargs.get("client_id")),
                    security_protocol=asked,
                    mechanism=client._sasl_mechanism,
                    username=client._sasl_plain_username,
                    password=client._sasl_plain_password,
                )
            )
            # The broker cannot authenticate: connect this client in plaintext.
            client._security_protocol = "PLAINTEXT"

        monkeypatch.setattr(cls, "__init__", init)

    record(AIOKafkaProducer, "producer", "client")
    record(AIOKafkaConsumer, "consumer", "_client")
    record(AIOKafkaAdminClient, "admin", "_client")
    return seen


def _sasl(bootstrap: str) -> KafkaConfig:
    return msgspec.structs.replace(
        KafkaConfig.embedded(bootstrap),
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=MECHANISM,
        sasl_username=USER,
        sasl_password=PASSWORD,
    )


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_sasl_client_starts_the_handshake_with_its_mechanism(
    kafka_broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(SyncLogError) as failed:
        async with KafkaSyncLog(_sasl(kafka_broker.bootstrap), f"sasl-{uuid.uuid4().hex[:8]}"):
            pass
    assert "UnsupportedSaslMechanismError" in caplog.text  # the broker refused the mechanism
    assert PASSWORD not in str(failed.value)
    assert PASSWORD not in caplog.text


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_every_client_of_a_run_gets_the_sasl_settings(
    tmp_path: Path, kafka_broker: EmbeddedBroker, built: list[Built]
) -> None:
    config = options.load(
        {
            "run__output_dir": str(tmp_path),
            "run__connector": f"sasl-{uuid.uuid4().hex[:8]}",
            "run__sink": "kafka",
            "run__tasks": "2",
            "run__duration": "6",
            "run__progress": "off",
            "kafka__bootstrap_servers": kafka_broker.bootstrap,
            "kafka__security_protocol": "SASL_PLAINTEXT",
            "kafka__sasl_mechanism": MECHANISM,
            "kafka__sasl_username": USER,
            "kafka__session_timeout_ms": "3000",
            "kafka__heartbeat_interval_ms": "1000",
        },
        environ={"SHOAL_KAFKA_SASL_PASSWORD": PASSWORD},
    )
    out = io.StringIO()
    summary = await Pipeline(config, stop=asyncio.Event(), out=out).run()
    assert summary.drained, out.getvalue()
    assert summary.records_delivered > 0, "the run worked, so every client was exercised"
    kinds = {b.kind for b in built}
    assert kinds == {"producer", "consumer", "admin"}, built
    assert len(built) >= 6, built
    wrong = [
        b
        for b in built
        if (b.security_protocol, b.mechanism, b.username, b.password)
        != ("SASL_PLAINTEXT", MECHANISM, USER, PASSWORD)
    ]
    assert not wrong, f"clients built without the SASL settings: {wrong}"
    assert PASSWORD not in out.getvalue()
