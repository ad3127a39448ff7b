"""The sync topic adapter (``runtime.kafka.KafkaSyncLog``), the replay helper and ``KafkaConfig``,
against the embedded broker (no Kafka mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from protocol.messages import MarkerMessage, StateMessage, decode, encode
from runtime.kafka import (
    KafkaAdapterError,
    KafkaConfig,
    KafkaSyncLog,
    SyncLogError,
    ensure_topic,
    replay_until_marker,
    sync_topic,
)
from runtime.kafka.broker import EmbeddedBroker
from runtime.net import free_port
from tests.fixtures.kafka import connector, kafka_broker, kafka_config

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name


async def _take(log: KafkaSyncLog, start: int, count: int) -> list[tuple[int, bytes]]:
    got: list[tuple[int, bytes]] = []
    async with asyncio.timeout(10), contextlib.aclosing(log.read(start)) as reader:
        async for item in reader:
            got.append(item)
            if len(got) == count:
                break
    return got


# -- KafkaConfig (no broker) ---------------------------------------------------------------------


def test_config_repr_hides_secrets() -> None:
    config = KafkaConfig(
        bootstrap_servers="k1:9093,k2:9093",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="shoal",
        sasl_password="hunter2-secret",
    )
    for text in (repr(config), str(config), f"{config}", f"{[config]}"):
        assert "hunter2-secret" not in text
        assert "***" in text
        assert "k1:9093" in text
    kwargs = config.client_kwargs()
    assert kwargs["sasl_plain_password"] == "hunter2-secret"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kwargs["bootstrap_servers"] == "k1:9093,k2:9093"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bootstrap_servers": ""}, "bootstrap_servers"),
        ({"bootstrap_servers": "nohostport"}, "host:port"),
        ({"bootstrap_servers": "h:99999"}, "host:port"),
        ({"bootstrap_servers": "h:1", "session_timeout_ms": 0}, "session_timeout_ms"),
        (
            {"bootstrap_servers": "h:1", "session_timeout_ms": 3000, "heartbeat_interval_ms": 3000},
            "below",
        ),
        ({"bootstrap_servers": "h:1", "security_protocol": "SASL_SSL"}, "sasl_mechanism"),
        (
            {
                "bootstrap_servers": "h:1",
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "PLAIN",
            },
            "sasl_username",
        ),
        ({"bootstrap_servers": "h:1", "sasl_username": "u"}, "SASL settings"),
        ({"bootstrap_servers": "h:1", "ssl_cafile": "/ca.pem"}, "SSL files"),
        (
            {"bootstrap_servers": "h:1", "security_protocol": "SSL", "ssl_certfile": "/c.pem"},
            "go together",
        ),
        ({"bootstrap_servers": "h:1", "replication_factor": 0}, "replication_factor"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KafkaConfig(**kwargs)  # type: ignore[arg-type]


def test_config_missing_ssl_file_is_named(tmp_path: object) -> None:
    config = KafkaConfig(
        bootstrap_servers="h:1", security_protocol="SSL", ssl_cafile="/nonexistent/ca.pem"
    )
    with pytest.raises(KafkaAdapterError, match=r"ssl_cafile '/nonexistent/ca\.pem'"):
        config.client_kwargs()


def test_bad_connector_name() -> None:
    config = KafkaConfig.embedded("127.0.0.1:1")
    with pytest.raises(ValueError, match="connector name"):
        KafkaSyncLog(config, "bad name/with slash")


# -- the sync log --------------------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_append_then_read_in_order(kafka_config: KafkaConfig, connector: str) -> None:
    async with KafkaSyncLog(kafka_config, connector) as log:
        assert log.topic == sync_topic(connector) == f"{connector}_connector_sync"
        payloads = [f"message-{i}".encode() for i in range(50)]
        offsets = [await log.append(p) for p in payloads]
        assert offsets == list(range(offsets[0], offsets[0] + 50))
        got = await _take(log, offsets[0], 50)
        assert got == list(zip(offsets, payloads, strict=True))
        # From an offset in the middle.
        assert await _take(log, offsets[20], 30) == got[20:]
        stats = log.statistics()
        assert stats.appends == 50
        assert stats.readers_open == 0


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_reader_waits_for_new_messages(kafka_config: KafkaConfig, connector: str) -> None:
    async with (
        KafkaSyncLog(kafka_config, connector) as writer,
        KafkaSyncLog(kafka_config, connector) as reader_log,
    ):
        first = await writer.append(b"first")
        latencies: list[float] = []
        async with contextlib.aclosing(reader_log.read(first)) as reader:
            assert await anext(reader) == (first, b"first")
            for i in range(5):
                sent = time.monotonic()
                offset = await writer.append(f"late-{i}".encode())
                async with asyncio.timeout(5):
                    assert await anext(reader) == (offset, f"late-{i}".encode())
                latencies.append(time.monotonic() - sent)
        # fetch_max_wait_ms=30: delivery well under a second once the reader is waiting (the
        # median, so one scheduling hiccup of a loaded machine does not fail it; a reader that
        # long-polls 0.5 s or more per fetch would fail every one)
        assert sorted(latencies)[len(latencies) // 2] < 1.0, latencies


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_payloads_are_opaque_bytes(kafka_config: KafkaConfig, connector: str) -> None:
    """Garbage is delivered as it is: decoding (and skipping) is the caller's job."""
    garbage = [b"\xff\xfe\x00not json", b"", b"{}", b"x" * 100_000]
    async with KafkaSyncLog(kafka_config, connector) as log:
        offsets = [await log.append(p) for p in garbage]
        assert await _take(log, offsets[0], len(garbage)) == list(
            zip(offsets, garbage, strict=True)
        )


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_a_message_over_the_record_limit_is_read_whole(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """A 3 MB sync message (a 30,000-partition checkpoint is about that) is appended as fragments
    while another task appends small messages between them; a reader from its first offset, or
    from inside it, gets it whole, once, at its last fragment's offset."""
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB
    async with (
        KafkaSyncLog(kafka_config, connector) as writer,
        KafkaSyncLog(kafka_config, connector) as other,
    ):
        small_done = asyncio.Event()

        async def chatter() -> list[int]:
            offsets = []
            for i in range(40):
                offsets.append(await other.append(f"small-{i}".encode()))
                if i == 5:
                    small_done.set()
            return offsets

        chat = asyncio.ensure_future(chatter())
        await small_done.wait()
        first = await writer.append(big)  # the default limit: 512 KiB per record
        smalls = await chat
        assert writer.statistics().fragmented == 1
        assert writer.statistics().appended_bytes == len(big)
        everything = await _take(writer, 0, 41)
        payloads = [payload for _, payload in everything]
        assert payloads.count(big) == 1
        assert [p for p in payloads if p != big] == [f"small-{i}".encode() for i in range(40)]
        at_big = next(at for at, payload in everything if payload == big)
        assert at_big > first  # read at its last fragment
        assert any(first < at < at_big for at in smalls)  # the other task wrote in between
        assert [at for at, p in everything if p != big] == smalls  # the others where they are
        # From inside the message (a reader starting after its first fragment): rewound.
        inside = await _take(writer, first + 2, sum(1 for at in smalls if at > first + 2) + 1)
        assert [p for _, p in inside].count(big) == 1
        assert writer.statistics().fragments_dropped == 0


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_replay_until_marker(kafka_config: KafkaConfig, connector: str) -> None:
    async with (
        KafkaSyncLog(kafka_config, connector) as log,
        KafkaSyncLog(kafka_config, connector) as other,
    ):
        written = [encode(StateMessage(task_id="t-other", message_timestamp=i)) for i in range(200)]
        written.append(b"garbage in the log")
        first = await other.append(written[0])
        for payload in written[1:]:
            await other.append(payload)
        seen: list[tuple[int, bytes]] = []
        result = await replay_until_marker(
            log, first, task_id="t-me", on_message=lambda o, p: seen.append((o, p))
        )
        assert [p for _, p in seen] == written
        assert [o for o, _ in seen] == list(range(first, first + len(written)))
        assert result.messages == len(written)
        assert result.marker_offset == first + len(written)
        assert result.next_offset == result.marker_offset + 1
        assert result.marker.startswith("t-me:")
        # The marker itself is a MarkerMessage in the log, for every other reader to skip.
        (offset, payload), *_ = await _take(other, result.marker_offset, 1)
        marker = decode(payload)
        assert isinstance(marker, MarkerMessage)
        assert (marker.marker, marker.task_id) == (result.marker, "t-me")
        # A second replay from the first marker on sees that marker (another task's, say)
        # and nothing else.
        again: list[tuple[int, bytes]] = []
        second = await replay_until_marker(
            log,
            result.marker_offset,
            task_id="t-me",
            on_message=lambda o, p: again.append((o, p)),
        )
        assert again == [(offset, payload)]
        assert second.marker != result.marker
        assert second.marker_offset == result.next_offset


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_replay_start_beyond_the_end_is_refused(
    kafka_config: KafkaConfig, connector: str
) -> None:
    async with KafkaSyncLog(kafka_config, connector) as log:
        with pytest.raises(ValueError, match="beyond the end"):
            await replay_until_marker(log, 10_000, task_id="t", on_message=lambda o, p: None)


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_checkpoint_offset_round_trip(kafka_config: KafkaConfig, connector: str) -> None:
    async with KafkaSyncLog(kafka_config, connector) as log:
        assert log.checkpoint_group == f"{connector}_connector_sync_ckpt"
        assert await log.checkpoint_offset() is None
        await log.record_checkpoint(5)
        assert await log.checkpoint_offset() == 5
        await log.record_checkpoint(0)
        assert await log.checkpoint_offset() == 0
        await log.record_checkpoint(12)
        assert log.statistics().checkpoints_recorded == 3
    # Another task (another client) sees it.
    async with KafkaSyncLog(kafka_config, connector) as other:
        assert await other.checkpoint_offset() == 12
        with pytest.raises(ValueError, match="checkpoint offset"):
            await other.record_checkpoint(-1)


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_multi_partition_sync_topic_is_refused(
    kafka_config: KafkaConfig, connector: str
) -> None:
    assert await ensure_topic(kafka_config, sync_topic(connector), partitions=2)
    assert not await ensure_topic(kafka_config, sync_topic(connector), partitions=2)
    log = KafkaSyncLog(kafka_config, connector)
    with pytest.raises(SyncLogError, match="exactly one"):
        await log.start()
    await log.close()


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_not_started_is_a_clear_error(kafka_config: KafkaConfig, connector: str) -> None:
    log = KafkaSyncLog(kafka_config, connector)
    with pytest.raises(SyncLogError, match="not started"):
        await log.append(b"x")
    with pytest.raises(SyncLogError, match="not started"):
        log.read(0)


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_append_to_a_dead_broker_fails_in_bounded_time(connector: str) -> None:
    broker = EmbeddedBroker()
    await broker.astart()
    try:
        config = KafkaConfig.embedded(broker.bootstrap)
        async with KafkaSyncLog(config, connector, send_timeout_s=1.0) as log:
            await log.append(b"ok")
            broker.kill()
            started = time.monotonic()
            with pytest.raises(SyncLogError, match="append"):
                await log.append(b"lost")
            # about send_timeout_s (1 s), not for ever: generous for a loaded machine
            assert time.monotonic() - started < 30.0
            assert log.statistics().append_failures == 1
    finally:
        await broker.astop()


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_unreachable_kafka_is_a_clear_error(connector: str) -> None:
    config = KafkaConfig.embedded(f"127.0.0.1:{free_port()}")  # nothing listens there
    log = KafkaSyncLog(config, connector)
    started = time.monotonic()
    with pytest.raises(SyncLogError, match=r"cannot create topic .* on 127\.0\.0\.1:"):
        await log.start()
    assert time.monotonic() - started < 30  # not for ever: generous for a loaded machine
    await log.close()


def test_config_from_env() -> None:
    config = KafkaConfig.from_env(
        {
            "SHOAL_KAFKA_BOOTSTRAP_SERVERS": "k1:9092",
            "SHOAL_KAFKA_SESSION_TIMEOUT_MS": "6000",
            "SHOAL_KAFKA_HEARTBEAT_INTERVAL_MS": "2000",
            "SHOAL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "SHOAL_KAFKA_SASL_MECHANISM": "PLAIN",
            "SHOAL_KAFKA_SASL_USERNAME": "u",
            "SHOAL_KAFKA_SASL_PASSWORD": "p4ss",
            "OTHER": "ignored",
        }
    )
    assert config.session_timeout_ms == 6000
    assert config.sasl_password == "p4ss"
    assert "p4ss" not in repr(config)
    with pytest.raises(ValueError, match="unknown Kafka setting"):
        KafkaConfig.from_env({"SHOAL_KAFKA_BOOTSTRAP_SERVER": "typo:1"})
    with pytest.raises(ValueError, match="session_timeout_ms"):
        KafkaConfig.from_mapping({"bootstrap_servers": "k:1", "session_timeout_ms": "soon"})
