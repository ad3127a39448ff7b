"""Kafka over TLS for real: tasks run with ``--kafka-security-protocol SSL`` and a CA file
through a TLS-terminating proxy (stunnel) in front of the embedded broker, which advertises the
proxy's address, and share the stream's partitions; an untrusted certificate or a wrong host name
stops the start at once (exit 1) with one line naming the option to fix.

Everything runs as ``python -m actors.runtime`` subprocesses, as an operator would."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from actors.cli.progress import RunSummary
from runtime.kafka import KafkaConfig, KafkaSyncLog
from tests.fixtures.tls import TlsProxy, tls_files, tls_proxy
from tests.helpers import REPO

__all__ = ["tls_files", "tls_proxy"]

pytestmark = [pytest.mark.kafka]

SIM = ["--sim-seed", "3", "--sim-roots", "4", "--sim-records-per-s", "40", "--sink", "files"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _connector() -> str:
    return f"tls-{os.getpid()}-{time.monotonic_ns() % 10**7}"


def ssl_args(
    proxy: TlsProxy, *, bootstrap: str | None = None, cafile: Path | None = None
) -> list[str]:
    return [
        *("--kafka-bootstrap-servers", bootstrap or proxy.bootstrap),
        *("--kafka-security-protocol", "SSL"),
        *("--kafka-ssl-cafile", str(cafile or proxy.files.ca)),
        *("--kafka-session-timeout-ms", "3000", "--kafka-heartbeat-interval-ms", "1000"),
    ]


def _cli(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.runtime", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


async def _create_sync_topic(proxy: TlsProxy, connector: str) -> None:
    config = KafkaConfig(
        bootstrap_servers=proxy.bootstrap, security_protocol="SSL", ssl_cafile=str(proxy.files.ca)
    )
    async with KafkaSyncLog(config, connector):
        pass


def _accepted(proxy: TlsProxy) -> int:
    return proxy.log.read_text().count("accepted connection")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tasks_share_partitions_through_tls(tmp_path: Path, tls_proxy: TlsProxy) -> None:
    """Two tasks over SSL, verified against the test CA, share the stream's partitions: both
    own some and deliver records, epochs are agreed, and the run drains cleanly. The proxy's log
    shows the connections went through it (the broker advertised only the proxy)."""
    before = _accepted(tls_proxy)
    summary_path = tmp_path / "summary.json"
    result = _cli(
        [
            *ssl_args(tls_proxy),
            *("--connector", _connector(), "--tasks", "2", *SIM),
            *("--duration", "12", "--progress", "off", "--output-dir", str(tmp_path / "out")),
            *("--summary-json", str(summary_path)),
        ],
        timeout=150,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = msgspec.json.decode(summary_path.read_bytes(), type=RunSummary)
    assert summary.drained
    assert len(summary.tasks) == 2
    assert all(t.records_delivered > 0 for t in summary.tasks), summary.tasks
    assert summary.epoch >= 0  # generations (and so epochs) start at 0 here
    owners = {p.owner for p in summary.partitions if p.status != "finished"}
    assert len(owners) == 2, f"the partitions were not shared: {summary.partitions}"
    # every client of both tasks (sync log, group, admin) connected through the proxy
    assert _accepted(tls_proxy) - before >= 4


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.timeout(90)
def test_untrusted_certificate_fails_at_start_naming_the_cafile(
    tmp_path: Path, tls_proxy: TlsProxy
) -> None:
    """A CA bundle that did not sign the brokers' certificate: exit 1 with one line naming
    --kafka-ssl-cafile, without retrying (an untrusted certificate stays untrusted)."""
    result = _cli(
        [
            *ssl_args(tls_proxy, cafile=tls_proxy.files.other_ca),
            *("--connector", _connector(), *SIM, "--connect-timeout", "60"),
            *("--output-dir", str(tmp_path)),
        ],
        timeout=80,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    line = _one_error_line(result)
    assert "--kafka-ssl-cafile" in line
    assert "certificate verify failed" in line or "unable to get local issuer" in line, line
    assert "retrying in" not in result.stderr, "an untrusted certificate was retried"


@pytest.mark.timeout(90)
def test_wrong_host_name_fails_at_start_naming_the_servers(
    tmp_path: Path, tls_proxy: TlsProxy
) -> None:
    """The right CA but a host name the certificate does not hold (127.0.0.1; it names only
    localhost): exit 1 with one line naming --kafka-bootstrap-servers and the host."""
    result = _cli(
        [
            *ssl_args(tls_proxy, bootstrap=tls_proxy.ip_bootstrap),
            *("--connector", _connector(), *SIM, "--connect-timeout", "60"),
            *("--output-dir", str(tmp_path)),
        ],
        timeout=80,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    line = _one_error_line(result)
    assert "--kafka-bootstrap-servers" in line
    assert "'127.0.0.1'" in line
    assert "retrying in" not in result.stderr


@pytest.mark.timeout(90)
def test_status_over_tls_and_its_errors(tls_proxy: TlsProxy) -> None:
    """``status`` reads through the same TLS settings (it finds no such connector, then, once
    the connector's sync topic exists, shows it); with an untrusted CA it fails the same clear
    way."""
    connector = _connector()
    missing = _cli(["status", *ssl_args(tls_proxy), "--connector", connector], timeout=60)
    assert missing.returncode == 1, missing.stderr
    assert f"no such connector {connector!r}" in _one_error_line(missing)
    asyncio.run(_create_sync_topic(tls_proxy, connector))
    ok = _cli(["status", *ssl_args(tls_proxy), "--connector", connector], timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert f"connector {connector!r}" in ok.stdout
    bad = _cli(
        [
            "status",
            *ssl_args(tls_proxy, cafile=tls_proxy.files.other_ca),
            *("--connector", connector),
        ],
        timeout=60,
    )
    assert bad.returncode == 1, bad.stderr
    assert "--kafka-ssl-cafile" in _one_error_line(bad)
