"""Kafka authentication and TLS mistakes stop a start at once and name the option to fix; none is
retried as an unreachable broker (they all used to end as "Kafka ... unreachable after N
attempt(s)", after up to ``--connect-timeout`` of retries).

* A SASL mechanism the broker refuses: the real embedded broker, which refuses every mechanism
  (``UnsupportedSaslMechanismError``) — exit 1 naming ``kafka.sasl_mechanism``.
* A SASL login the broker refuses: the embedded broker cannot produce one (it authenticates
  nobody), so a tiny fake listener (``tests.fixtures.fake_sasl_broker``) answers aiokafka's
  real connection set-up and refuses the login with ``SASL_AUTHENTICATION_FAILED`` as a real
  broker does — exit 1 naming ``kafka.sasl_username`` and the password's variable, the password
  not shown. The classification itself is also checked on aiokafka's own exception types.
* SSL against the embedded broker's plaintext listener: exit 1 within seconds naming
  ``kafka.security_protocol`` (it took 41 s).
* A CA file that is no certificate or does not exist, a client key whose password is wrong or
  missing: exit 2 before anything connects, naming the option (files made by the TLS fixture).

The CLI runs as ``python -m actors.runtime`` subprocesses, or through ``main`` where nothing is
started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)

from actors.runtime import main
from runtime.kafka import KafkaConfig
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.sasl import refusal
from tests.fixtures.fake_sasl_broker import REFUSAL, FakeSaslBroker, fake_sasl_broker
from tests.fixtures.kafka import kafka_broker
from tests.fixtures.tls import KEY_PASSWORD, TlsFiles, tls_files
from tests.helpers import REPO

__all__ = ["fake_sasl_broker", "kafka_broker", "tls_files"]

PASSWORD = "sasl-pw-Qq9-SECRET"


def _cli(
    args: list[str], password: str | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    if password is not None:
        env["SHOAL_KAFKA_SASL_PASSWORD"] = password
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "actors.runtime", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return result, time.monotonic() - began


def _run_args(bootstrap: str, tmp: Path) -> list[str]:
    return [
        *("--kafka-bootstrap-servers", bootstrap, "--connector", f"refused-{uuid.uuid4().hex[:8]}"),
        *("--sink", "files", "--progress", "off", "--duration", "5"),
        *("--connect-timeout", "60", "--output-dir", str(tmp)),
    ]


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, result.stderr
    assert "retrying in" not in result.stderr, "a refusal was retried as unreachable"
    assert "unreachable" not in lines[0]
    return lines[0]


def _sasl(mechanism: str = "PLAIN") -> list[str]:
    return [
        *("--kafka-security-protocol", "SASL_PLAINTEXT", "--kafka-sasl-mechanism", mechanism),
        *("--kafka-sasl-username", "alice"),
    ]


# -- SASL ---------------------------------------------------------------------------------------


def test_the_sasl_classification_on_aiokafkas_errors() -> None:
    config = KafkaConfig(
        bootstrap_servers="k:9092",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="alice",
        sasl_password=PASSWORD,
    )
    login = refusal(SaslAuthenticationFailed(REFUSAL), config, "k:9092")
    assert login is not None
    assert f"refused the SASL login of user 'alice' with SCRAM-SHA-512 ({REFUSAL})" in str(login)
    assert "kafka.sasl_username (--kafka-sasl-username)" in str(login)
    assert "SHOAL_KAFKA_SASL_PASSWORD" in str(login)
    mechanism = refusal(UnsupportedSaslMechanismError("enabled: ['PLAIN']"), config, "k:9092")
    assert mechanism is not None
    assert "does not accept SASL mechanism SCRAM-SHA-512 (enabled: ['PLAIN'])" in str(mechanism)
    assert "kafka.sasl_mechanism (--kafka-sasl-mechanism)" in str(mechanism)
    assert all(PASSWORD not in str(e) for e in (login, mechanism))
    # not refusals: a connection error, or no SASL configured
    assert refusal(KafkaConnectionError("Unable to bootstrap"), config, "k:9092") is None
    plain = KafkaConfig(bootstrap_servers="k:9092")
    assert refusal(SaslAuthenticationFailed(REFUSAL), plain, "k:9092") is None


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_refused_sasl_mechanism_stops_the_start_at_once(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    result, took = _cli(
        [*_run_args(kafka_broker.bootstrap, tmp_path), *_sasl("SCRAM-SHA-256")], PASSWORD
    )
    assert result.returncode == 1, result.stdout + result.stderr
    line = _error_line(result)
    assert "does not accept SASL mechanism SCRAM-SHA-256" in line, line
    assert "kafka.sasl_mechanism (--kafka-sasl-mechanism)" in line
    assert PASSWORD not in result.stdout + result.stderr
    assert took < 30, f"{took:.1f}s: the refusal was waited out (--connect-timeout 60)"


@pytest.mark.timeout(120)
def test_a_refused_sasl_login_stops_the_start_at_once(
    tmp_path: Path, fake_sasl_broker: FakeSaslBroker
) -> None:
    result, took = _cli([*_run_args(fake_sasl_broker.bootstrap, tmp_path), *_sasl()], PASSWORD)
    assert result.returncode == 1, result.stdout + result.stderr
    line = _error_line(result)
    assert "refused the SASL login of user 'alice' with PLAIN" in line, line
    assert REFUSAL in line
    assert "kafka.sasl_username (--kafka-sasl-username)" in line
    assert "kafka.sasl_password (SHOAL_KAFKA_SASL_PASSWORD)" in line
    assert PASSWORD not in result.stdout + result.stderr
    assert took < 30, f"{took:.1f}s"
    # the client's own attempt and the diagnosis: no retry loop
    assert 1 <= fake_sasl_broker.logins_refused <= 3, fake_sasl_broker.logins_refused


# -- TLS ----------------------------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_ssl_against_a_plaintext_listener_fails_fast_naming_the_protocol(
    tmp_path: Path, kafka_broker: EmbeddedBroker, tls_files: TlsFiles
) -> None:
    result, took = _cli(
        [
            *_run_args(kafka_broker.bootstrap, tmp_path),
            *("--kafka-security-protocol", "SSL", "--kafka-ssl-cafile", str(tls_files.ca)),
        ]
    )
    assert result.returncode == 1, result.stdout + result.stderr
    line = _error_line(result)
    assert f"Kafka at {kafka_broker.bootstrap} speaks plaintext, not TLS" in line, line
    assert "kafka.security_protocol SSL (--kafka-security-protocol)" in line
    # start-up (imports) and a 3 s handshake wait; it used to take 41 s
    assert took < 20, f"{took:.1f}s"


def _not_a_cert(tmp: Path) -> Path:
    path = tmp / "not-a-cert.pem"
    path.write_text("this is no certificate\n")
    return path


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("ca-not-a-cert", "kafka.ssl_cafile '{file}' (--kafka-ssl-cafile) holds no CA certificate"),
        ("ca-missing", "kafka.ssl_cafile '{file}' (--kafka-ssl-cafile) does not exist"),
        (
            "wrong-key-password",
            "kafka.ssl_keyfile '{key}' (--kafka-ssl-keyfile) could not be decrypted with "
            "kafka.ssl_keyfile_password (--kafka-ssl-keyfile-password): wrong password",
        ),
        (
            "no-key-password",
            "kafka.ssl_keyfile '{key}' (--kafka-ssl-keyfile) is encrypted: give its password in "
            "kafka.ssl_keyfile_password",
        ),
    ],
)
def test_a_bad_tls_file_or_key_password_exits_2_at_start(
    tmp_path: Path,
    tls_files: TlsFiles,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    needle: str,
) -> None:
    """Found when the options are read, before any broker, Spark or connection (the address
    below has no listener: reaching it was never tried)."""
    ca = {
        "ca-not-a-cert": _not_a_cert(tmp_path),
        "ca-missing": tmp_path / "missing.pem",
    }.get(case, tls_files.ca)
    args = [
        *("--kafka-bootstrap-servers", "127.0.0.1:1", "--kafka-security-protocol", "SSL"),
        *("--kafka-ssl-cafile", str(ca), "--sink", "files", "--output-dir", str(tmp_path / "o")),
    ]
    for name in [k for k in os.environ if k.startswith("SHOAL_")]:
        monkeypatch.delenv(name)
    if case in ("wrong-key-password", "no-key-password"):
        args += ["--kafka-ssl-certfile", str(tls_files.client_cert)]
        args += ["--kafka-ssl-keyfile", str(tls_files.client_key)]
    if case == "wrong-key-password":
        monkeypatch.setenv("SHOAL_KAFKA_SSL_KEYFILE_PASSWORD", "not-" + KEY_PASSWORD)
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle.format(file=ca, key=tls_files.client_key) in lines[0], lines[0]
    assert KEY_PASSWORD not in err
    assert not (tmp_path / "o").exists(), "something started before the check"


def test_the_right_key_password_passes_the_check(tmp_path: Path, tls_files: TlsFiles) -> None:
    """Control: the same files with the right password make a TLS context."""
    config = KafkaConfig(
        bootstrap_servers="127.0.0.1:1",
        security_protocol="SSL",
        ssl_cafile=str(tls_files.ca),
        ssl_certfile=str(tls_files.client_cert),
        ssl_keyfile=str(tls_files.client_key),
        ssl_keyfile_password=KEY_PASSWORD,
    )
    assert config.ssl_context() is not None
