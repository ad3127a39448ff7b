"""Against the real Cloud Spanner emulator (skipped, with the reason, where its binary is
absent): the change stream's own options, read once from the information schema
(``protocol/stream_options.py``). A GoogleSQL and a PostgreSQL-dialect stream show their
options (defaults for what the DDL did not set); ``config`` and ``status`` print them; a first
start older than the stream's retention is refused with one line naming both (exit 2), and a
start inside it is not (control)."""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from protocol.stream_options import StreamOptions
from runtime.kafka import KafkaConfig, KafkaSyncLog
from runtime.kafka.broker import EmbeddedBroker
from runtime.spanner.config import SpannerConfig
from runtime.spanner.emulator import SpannerEmulator, sync_client
from runtime.spanner.reader import SpannerSource
from tests.fixtures.kafka import kafka_broker
from tests.fixtures.spanner import _start_emulator
from tests.helpers import REPO

__all__ = ["kafka_broker"]

pytestmark = [pytest.mark.spanner]

SHORT = "ShortLived"  # retention_period 24h (the emulator's least), NEW_ROW, TTL deletes excluded


@pytest.fixture(scope="module")
def emulator() -> Iterator[SpannerEmulator]:
    emulator = _start_emulator()
    try:
        with sync_client(emulator.config) as client:
            db: Any = client.instance(emulator.config.instance).database(emulator.config.database)
            db.update_ddl(
                [
                    f"CREATE CHANGE STREAM {SHORT} FOR Singers OPTIONS (retention_period = '24h', "
                    "value_capture_type = 'NEW_ROW', exclude_ttl_deletes = true)"
                ]
            ).result(60)
        yield emulator
    finally:
        emulator.stop()


async def _options(config: SpannerConfig) -> StreamOptions | None:
    async with await SpannerSource.connect(config) as source:
        await source.detect_dialect(config.database)
        return await source.stream_options()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_options_of_googlesql_and_postgresql_streams(emulator: SpannerEmulator) -> None:
    config = emulator.config
    assert await _options(config) == StreamOptions(value_capture_type="OLD_AND_NEW_VALUES")
    short = await _options(msgspec.structs.replace(config, change_stream=SHORT))
    assert short is not None
    assert (short.retention_period, short.value_capture_type) == ("24h", "NEW_ROW")
    assert short.retention_us == 24 * 3_600_000_000
    # what this emulator states of exclude_ttl_deletes (it lists only some options): no claim
    missing = msgspec.structs.replace(config, change_stream="NoSuchStream")
    assert await _options(missing) is None
    pg = await asyncio.to_thread(emulator.create_postgresql_database, "shoal-pg-options")
    assert await _options(pg) == StreamOptions(value_capture_type="OLD_AND_NEW_VALUES")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "actors.runtime", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def _spanner_flags(emulator: SpannerEmulator, stream: str) -> list[str]:
    cfg = emulator.config
    return [
        "--source", "spanner", "--spanner-emulator-host", emulator.host,
        "--spanner-project", cfg.project, "--spanner-instance", cfg.instance,
        "--spanner-database", cfg.database, "--spanner-change-stream", stream,
    ]  # fmt: skip


@pytest.mark.timeout(120)
def test_config_shows_the_streams_options(emulator: SpannerEmulator) -> None:
    result = _cli("config", *_spanner_flags(emulator, SHORT))
    assert result.returncode == 0, result.stderr[-3000:]
    shown = msgspec.json.decode(result.stdout)["change_stream_options"]
    assert shown["change_stream"] == SHORT
    assert (shown["options"]["retention_period"], shown["options"]["value_capture_type"]) == (
        "24h",
        "NEW_ROW",
    )


@pytest.mark.kafka
@pytest.mark.timeout(150)
def test_status_shows_the_streams_options(
    emulator: SpannerEmulator, kafka_broker: EmbeddedBroker
) -> None:
    connector = f"opts-{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        async with KafkaSyncLog(KafkaConfig.embedded(kafka_broker.bootstrap), connector):
            pass

    asyncio.run(create())
    flags = ["--connector", connector, "--kafka-bootstrap-servers", kafka_broker.bootstrap]
    result = _cli("status", *flags, *_spanner_flags(emulator, SHORT))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == (
        f"change stream {SHORT}: retention_period 24h, value_capture_type NEW_ROW, "
        "partition_mode IMMUTABLE_KEY_RANGE, excludes "
        + result.stdout.splitlines()[0].split("excludes ", 1)[1]
    )
    as_json = _cli("status", "--json", *flags, *_spanner_flags(emulator, SHORT))
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    data = msgspec.json.decode(as_json.stdout)
    assert data["change_stream_options"]["options"]["retention_period"] == "24h"
    # control: without a Spanner source there is no stream to show
    plain = _cli("status", *flags)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "change stream" not in plain.stdout


def _ago(hours: float) -> str:
    moment = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=hours)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.kafka
@pytest.mark.timeout(240)
def test_a_start_older_than_the_streams_retention_is_refused(
    tmp_path: Any, emulator: SpannerEmulator
) -> None:
    start = _ago(30)
    result = _cli(
        *_spanner_flags(emulator, SHORT),
        "--sink", "files", "--progress", "off", "--start-at", start, "--duration", "20",
        "--output-dir", str(tmp_path / "out"),
        timeout=200,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("shoal: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(
        f"shoal: error: start_at {start} (--start-at) is older than change stream {SHORT}'s "
        "retention_period 24h: the oldest start it keeps records for is "
    ), errors[0]
    # control: a start inside the retention (now: the emulator refuses any start before the
    # database was created) is read, and the run ends by its duration, exit 0
    inside = _cli(
        *_spanner_flags(emulator, SHORT),
        "--sink", "files", "--progress", "off", "--start-at", _ago(0), "--duration", "8",
        "--output-dir", str(tmp_path / "out2"),
        timeout=200,
    )  # fmt: skip
    assert inside.returncode == 0, inside.stdout + inside.stderr[-3000:]
    assert f"change stream {SHORT}: retention_period 24h" in inside.stdout + inside.stderr
