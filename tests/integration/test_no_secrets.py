"""No secret anywhere: runs with known secret values (the SASL password, the TLS client key's
password, a Spanner service-account key file's contents, a secret Spark setting) and searches
everything an operator or a log collector sees for them: logs at every level (debug included, as
text and as JSON lines), the ``/metrics``, ``/healthz`` and ``/readyz`` pages, the progress
display and summary, ``status`` (table and ``--json``), ``config`` and the error messages of
failing starts (a SASL login the broker refuses, a bad service-account key).

The TLS runs go through stunnel in front of the embedded broker (``tests/fixtures/tls.py``) with
a client certificate whose key is encrypted with the password: the password is really used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.tls import KEY_PASSWORD, TlsProxy, tls_files, tls_proxy
from tests.helpers import REPO, wait_until

__all__ = ["tls_files", "tls_proxy"]

pytestmark = [pytest.mark.kafka]

SASL_PASSWORD = "sasl-pw-Q9v-SECRET"
SPANNER_KEY_SECRET = "MIIEvQIBADANBg-SPANNER-SECRET"
SPARK_SECRET = "s3a-secret-Zt5-SECRET"
SECRETS = (KEY_PASSWORD, SASL_PASSWORD, SPANNER_KEY_SECRET, SPARK_SECRET)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _tls(proxy: TlsProxy) -> list[str]:
    files = proxy.files
    return [
        *("--kafka-bootstrap-servers", proxy.bootstrap, "--kafka-security-protocol", "SSL"),
        *("--kafka-ssl-cafile", str(files.ca), "--kafka-ssl-certfile", str(files.client_cert)),
        *("--kafka-ssl-keyfile", str(files.client_key)),
        *("--kafka-session-timeout-ms", "3000", "--kafka-heartbeat-interval-ms", "1000"),
    ]


def _secret_env() -> dict[str, str]:
    """Every secret option set (the way the docs advise: environment variables)."""
    return {
        "SHOAL_KAFKA_SSL_KEYFILE_PASSWORD": KEY_PASSWORD,
    }


def assert_clean(what: str, text: str) -> None:
    found = [s for s in SECRETS if s in text]
    assert not found, f"{what} shows secret(s) {found}:\n{text[-3000:]}"


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


def _cli(
    args: list[str], env: dict[str, str], timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.runtime", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("json_logs", [False, True], ids=["text", "json"])
def test_a_tls_run_and_status_show_no_secret(
    tmp_path: Path, tls_proxy: TlsProxy, json_logs: bool
) -> None:
    connector = f"secrets-{os.getpid()}-{time.monotonic_ns() % 10**7}"
    port_file = tmp_path / "run.out"
    log_args = ["--log-level", "debug", *(["--log-json"] if json_logs else [])]
    with port_file.open("w") as out_file, (tmp_path / "run.err").open("w") as err_file:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "actors.runtime", *_tls(tls_proxy), *log_args,
                "--connector", connector, "--sink", "files", "--sim-roots", "2",
                "--duration", "10", "--metrics-port", "0", "--progress", "on",
                "--progress-interval", "0.5", "--output-dir", str(tmp_path / "out"),
                "--summary-json", str(tmp_path / "summary.json"),
            ],
            cwd=REPO, env=_env(**_secret_env()), stdout=out_file, stderr=err_file,
        )  # fmt: skip
    try:
        wait_until(lambda: "/metrics" in port_file.read_text(), 60, "the metrics URL")
        url = next(
            w for w in port_file.read_text().split() if w.startswith("http://")
        ).removesuffix("/metrics")
        wait_until(lambda: _get(f"{url}/readyz").strip() == "ready", 60, "the run to be ready")
        pages = {p: _get(f"{url}/{p}") for p in ("metrics", "healthz", "readyz")}
        status = _cli(["status", *_tls(tls_proxy), *log_args, "--connector", connector],
                      _env(**_secret_env()))  # fmt: skip
        status_json = _cli(
            ["status", "--json", *_tls(tls_proxy), *log_args, "--connector", connector],
            _env(**_secret_env()),
        )
        assert proc.wait(120) == 0, (tmp_path / "run.err").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "shoal_owned_partitions" in pages["metrics"]
    assert status.returncode == 0, status.stderr
    assert status_json.returncode == 0, status_json.stderr
    assert json.loads(status_json.stdout)["tasks"]
    err = (tmp_path / "run.err").read_text()
    assert "DEBUG" in err, "debug logs were on"
    if json_logs:
        assert all(json.loads(line) for line in err.splitlines() if line.startswith("{"))
    for page, text in pages.items():
        assert_clean(f"/{page}", text)
    assert_clean("the run's output", port_file.read_text())
    assert_clean("the run's logs", err)
    assert_clean("the summary", (tmp_path / "summary.json").read_text())
    for name, result in (("status", status), ("status --json", status_json)):
        assert_clean(f"{name} output", result.stdout)
        assert_clean(f"{name} logs", result.stderr)


def _spanner_key(tmp_path: Path) -> Path:
    """A service-account key file whose private key is (a stand-in for) a secret."""
    path = tmp_path / "key.json"
    path.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": "p",
                "private_key_id": "k1",
                "private_key": f"-----BEGIN PRIVATE KEY-----\n{SPANNER_KEY_SECRET}\n"
                "-----END PRIVATE KEY-----\n",
                "client_email": "shoal@p.iam.gserviceaccount.com",
                "client_id": "1",
                "token_uri": "https://oauth2.googleapis.com/token",
            }
        )
    )
    return path


def test_config_shows_no_secret(tmp_path: Path) -> None:
    key = _spanner_key(tmp_path)
    toml = tmp_path / "shoal.toml"
    toml.write_text(f'[spark.conf]\n"spark.hadoop.fs.s3a.secret.key" = "{SPARK_SECRET}"\n')
    result = _cli(
        [
            "config", "--config", str(toml), "--kafka-bootstrap-servers", "localhost:9093",
            "--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-mechanism", "PLAIN",
            "--kafka-sasl-username", "u", "--spanner-credentials-file", str(key),
            "--log-level", "debug",
        ],
        _env(SHOAL_KAFKA_SASL_PASSWORD=SASL_PASSWORD, **_secret_env()),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["kafka"]["sasl_password"] == "***"
    assert shown["kafka"]["ssl_keyfile_password"] == "***"
    assert shown["spark"]["conf"]["spark.hadoop.fs.s3a.secret.key"] == "***"
    assert_clean("config", result.stdout + result.stderr)
    help_text = _cli(["--help"], _env(SHOAL_KAFKA_SASL_PASSWORD=SASL_PASSWORD)).stdout
    assert_clean("--help", help_text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("json_logs", [False, True], ids=["text", "json"])
def test_failing_starts_show_no_secret(
    tmp_path: Path, tls_proxy: TlsProxy, json_logs: bool
) -> None:
    """A SASL login the broker refuses (behind TLS), and a Spanner source with a bad key file:
    both fail; neither the error nor the debug logs show the password or the key."""
    log_args = ["--log-level", "debug", *(["--log-json"] if json_logs else [])]
    sasl = _cli(
        [
            *_tls(tls_proxy), *log_args, "--kafka-security-protocol", "SASL_SSL",
            "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-username", "u",
            "--connect-timeout", "2", "--output-dir", str(tmp_path / "sasl"), "--sink", "files",
        ],
        _env(SHOAL_KAFKA_SASL_PASSWORD=SASL_PASSWORD, **_secret_env()),
    )  # fmt: skip
    assert sasl.returncode == 1, sasl.stderr
    assert "shoal: error:" in sasl.stderr
    assert "DEBUG" in sasl.stderr or '"level": "DEBUG"' in sasl.stderr
    assert_clean("a refused SASL login", sasl.stdout + sasl.stderr)

    key = _spanner_key(tmp_path)
    spanner = _cli(
        [
            *log_args, "--source", "spanner", "--spanner-project", "p", "--spanner-instance",
            "i", "--spanner-database", "d", "--spanner-change-stream", "s",
            "--spanner-credentials-file", str(key), "--sink", "files", "--output-dir",
            str(tmp_path / "spanner"), "--connect-timeout", "2",
        ],
        _env(),
    )  # fmt: skip
    assert spanner.returncode == 1, spanner.stdout + spanner.stderr
    assert "shoal: error:" in spanner.stderr
    assert_clean("a bad Spanner key", spanner.stdout + spanner.stderr)
