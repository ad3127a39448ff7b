"""The command line writing Delta tables into an object store (``--table-format delta
--output-dir s3://...``, the file sink), against moto's S3 server on loopback: a bounded run
killed with SIGKILL in the middle and run again ends by itself with every row of its window in
the Delta tables exactly once (a micro-batch committed before the kill is not committed again:
its Delta commit carries an application transaction, and the new run resumes from the progress
kept in the store), a completeness mark at the end in the store, and no credential in anything
it printed. Expected rows come from the stream model; the tables are read back with delta-rs,
and a row there twice counts."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from deltalake import DeltaTable

from bench.procs import tree
from tests.fixtures.s3 import S3Server, s3_server
from tests.helpers import REPO, assert_catches_a_double
from tests.integration.test_cli_bounds import SIM, _exactly, _expected, _rfc3339, _window

__all__ = ["s3_server"]

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _env(s3: S3Server) -> dict[str, str]:
    env = {k: v for k, v in s3.child_env().items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _cli(args: list[str], s3: S3Server, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "actors.runtime", *args],
            cwd=REPO,
            env=_env(s3),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _kill_all(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run and everything it started (its embedded broker has a session of its
    own), as a machine failure would."""
    below = list(tree(proc.pid))
    proc.send_signal(signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):  # it ended with its parent
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _rows(s3: S3Server, uri: str) -> collections.Counter[str]:
    options = {
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": s3.env.get("AWS_REGION", "us-east-1"),
        "AWS_ACCESS_KEY_ID": s3.secrets[0],
        "AWS_SECRET_ACCESS_KEY": s3.secrets[1],
    }
    counts: collections.Counter[str] = collections.Counter()
    for table in ("Singers", "Albums", "Songs"):
        data = DeltaTable(f"{uri}/{table}", storage_options=options).to_pyarrow_table(
            columns=["_commit_ts", "_server_transaction_id", "_record_sequence", "_mod_index"]
        )
        ts = data.column("_commit_ts").cast("int64").to_pylist()
        for i, micros in enumerate(ts):
            txn = data.column("_server_transaction_id")[i].as_py()
            seq = data.column("_record_sequence")[i].as_py()
            mod = data.column("_mod_index")[i].as_py()
            counts[f"{micros}/{txn}/{seq}/{mod}"] += 1
    return counts


def _committed_batches(s3: S3Server, prefix: str) -> int:
    client = boto3.client("s3", endpoint_url=s3.endpoint, **_credentials(s3))
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return sum(1 for o in listed.get("Contents", []) if o["Key"].endswith(".json"))


def _credentials(s3: S3Server) -> dict[str, str]:
    return {
        "aws_access_key_id": s3.secrets[0],
        "aws_secret_access_key": s3.secrets[1],
        "region_name": s3.env.get("AWS_REGION", "us-east-1"),
    }


@pytest.mark.timeout(300)
def test_delta_on_s3_exactly_once_across_a_sigkill(tmp_path: Path, s3_server: S3Server) -> None:
    s3 = s3_server
    start, end = _window(ago_s=60, length_s=30)
    output = s3.uri("cli")
    args = [
        *SIM,
        "--sink",
        "files",
        "--table-format",
        "delta",
        "--progress",
        "off",
        "--output-dir",
        output,
        "--start-at",
        _rfc3339(start),
        "--end-at",
        _rfc3339(end),
        "--sim-start-ts",
        str(start),
    ]
    first = _cli(args, s3, tmp_path / "first.log")
    deadline = time.monotonic() + 120
    # killed once a few micro-batches are in the Delta logs, the rest not yet read
    while _committed_batches(s3, "cli/data/Albums/_delta_log/") < 2:
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline, "no Delta commit within 120 s"
        time.sleep(0.2)
    _kill_all(first)
    killed_at = _rows(s3, f"{output}/data")
    assert killed_at, "the killed run committed something"
    second = _cli(args, s3, tmp_path / "second.log")
    assert second.wait(timeout=200) == 0, (tmp_path / "second.log").read_text()
    counts = _rows(s3, f"{output}/data")
    expected = _expected(start, end)
    _exactly(expected)(list(counts.elements()))  # rows lost or written twice fail
    assert_catches_a_double(_exactly(expected), list(counts.elements()))
    assert len(counts) > len(killed_at)  # the second run wrote the rest
    client = boto3.client("s3", endpoint_url=s3.endpoint, **_credentials(s3))
    body = client.get_object(Bucket=s3.bucket, Key="cli/data/_shoal/shoal/completeness.json")
    assert json.loads(body["Body"].read())["low_watermark_us"] >= end
    for log in ("first.log", "second.log"):
        text = (tmp_path / log).read_text()
        for secret in s3.secrets:
            assert secret not in text, f"a credential in {log}"
