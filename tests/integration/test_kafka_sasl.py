"""SASL against a broker that checks it: every Kafka client shoal builds (the producers,
consumers and admin clients of the sync log, the group, the topics and the Kafka output sink with
its retry queue) logs in with the configured mechanism, user name and password, and a wrong
password or no SASL at all is refused.

The embedded broker cannot authenticate itself (its SASL does not work; see
``runtime/kafka/broker.py``), so it sits behind :class:`tests.fixtures.sasl.SaslProxy`, a
Kafka-protocol proxy that does the server side of ``PLAIN`` and ``SCRAM-SHA-256/512`` (RFC 5802:
the client's proof is checked against the password, the server's signature is checked by the
client) and lets no other request through before a login; the broker advertises the proxy, so
every connection of a client, bootstrap and the rest, goes through it.
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

from actors.cli import config as options
from actors.cli.run import Pipeline
from runtime.kafka import KafkaConfig, KafkaSyncLog, SyncLogError
from runtime.kafka.config import SaslMechanism
from tests.fixtures.sasl import PASSWORD, USER, Login, SaslProxy, sasl_proxy

__all__ = ["sasl_proxy"]

pytestmark = [pytest.mark.kafka]

MECHANISM: SaslMechanism = "SCRAM-SHA-512"


class Built(msgspec.Struct, frozen=True):
    kind: str
    client_id: str
    security_protocol: str  # as the adapter asked for it
    mechanism: str | None  # as the client's connection layer holds them
    username: str | None
    password: str | None


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[Built]:
    """Every aiokafka producer, consumer and admin client constructed during the test, with the
    settings it was given (the clients are otherwise untouched: they log in through the proxy)."""
    seen: list[Built] = []

    def record(cls: type[Any], kind: str, attribute: str) -> None:
        original = cls.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            client = getattr(self, attribute)
            seen.append(
                Built(
                    kind=kind,
                    client_id=client._client_id,
                    security_protocol=kwargs.get("security_protocol", "PLAINTEXT"),
                    mechanism=client._sasl_mechanism,
                    username=client._sasl_plain_username,
                    password=client._sasl_plain_password,
                )
            )

        monkeypatch.setattr(cls, "__init__", init)

    record(AIOKafkaProducer, "producer", "client")
    record(AIOKafkaConsumer, "consumer", "_client")
    record(AIOKafkaAdminClient, "admin", "_client")
    return seen


def _sasl(
    bootstrap: str, mechanism: SaslMechanism = MECHANISM, password: str = PASSWORD
) -> KafkaConfig:
    return msgspec.structs.replace(
        KafkaConfig.embedded(bootstrap),
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=mechanism,
        sasl_username=USER,
        sasl_password=password,
    )


def _since(proxy: SaslProxy, before: int) -> list[Login]:
    return proxy.logins()[before:]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
async def test_a_client_with_the_password_logs_in_and_uses_the_log(
    sasl_proxy: SaslProxy, mechanism: SaslMechanism
) -> None:
    before = len(sasl_proxy.logins())
    async with KafkaSyncLog(
        _sasl(sasl_proxy.bootstrap, mechanism), f"sasl-{uuid.uuid4().hex[:8]}"
    ) as log:
        offset = await log.append(b"through SASL")
        async with asyncio.timeout(20):
            async for got in log.read(offset):
                assert got == (offset, b"through SASL")
                break
    logins = _since(sasl_proxy, before)
    assert logins, "no connection went through the proxy"
    assert all(x.ok and x.mechanism == mechanism and x.user == USER for x in logins), logins


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-512"])
async def test_a_wrong_password_is_refused_and_not_shown(
    sasl_proxy: SaslProxy, caplog: pytest.LogCaptureFixture, mechanism: SaslMechanism
) -> None:
    """The control of the test above: the proxy does check the password. The logs are taken at
    INFO: shoal keeps aiokafka's logger at WARNING or above (``runtime/logs.py``), and aiokafka's
    own DEBUG lines show a PLAIN login's token, password included."""
    caplog.set_level(logging.INFO)
    wrong = "not-the-password-SECRET"
    before = len(sasl_proxy.logins())
    with pytest.raises(SyncLogError) as failed:
        async with KafkaSyncLog(
            _sasl(sasl_proxy.bootstrap, mechanism, wrong), f"sasl-{uuid.uuid4().hex[:8]}"
        ):
            pass
    logins = _since(sasl_proxy, before)
    assert logins, "no connection went through the proxy"
    assert not any(x.ok for x in logins), logins
    assert all(x.reason == f"wrong password for {USER!r}" for x in logins), logins
    assert "SaslAuthenticationFailed" in caplog.text, caplog.text[-2000:]
    for secret in (wrong, PASSWORD):
        assert secret not in str(failed.value)
        assert secret not in caplog.text


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_client_without_sasl_is_refused(sasl_proxy: SaslProxy) -> None:
    before = len(sasl_proxy.logins())
    with pytest.raises(SyncLogError):
        async with KafkaSyncLog(
            KafkaConfig.embedded(sasl_proxy.bootstrap), f"sasl-{uuid.uuid4().hex[:8]}"
        ):
            pass
    logins = _since(sasl_proxy, before)
    assert logins, "no connection went through the proxy"
    assert all(not x.ok and "before a login" in x.reason for x in logins), logins


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_every_client_of_a_run_logs_in(
    tmp_path: Path, sasl_proxy: SaslProxy, built: list[Built]
) -> None:
    """A whole run (``Pipeline``, ``--sink kafka``, two tasks) through the proxy: every client
    it builds is given the SASL settings and logs in with them; no connection is refused."""
    before = len(sasl_proxy.logins())
    config = options.load(
        {
            "run__output_dir": str(tmp_path),
            "run__connector": f"sasl-{uuid.uuid4().hex[:8]}",
            "run__sink": "kafka",
            "run__tasks": "2",
            "run__duration": "6",
            "run__progress": "off",
            "kafka__bootstrap_servers": sasl_proxy.bootstrap,
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
    logins = _since(sasl_proxy, before)
    refused = [x for x in logins if not x.ok]
    assert not refused, f"connections the proxy refused: {refused}"
    assert all(x.mechanism == MECHANISM and x.user == USER for x in logins), logins
    unseen = {b.client_id for b in built} - {x.client_id for x in logins}
    assert not unseen, f"clients that never logged in: {unseen}; logins: {logins}"
    assert PASSWORD not in out.getvalue()
