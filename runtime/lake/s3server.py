"""moto's S3-compatible server (``python -m moto.server``) on a free loopback port: the object
store the tests and ``python -m bench lake`` write to, as ``runtime/kafka/broker.py``'s embedded
broker and ``runtime/spanner/emulator.py`` are their Kafka and Spanner. Not for production.

:func:`running_s3_server` starts one in its own process with one bucket and random test
credentials (so a test can look for them in logs and output), and stops it after.
:class:`S3Unavailable`: moto's server or boto3 is not installed (``pip install 'moto[server]'
boto3``).
:meth:`S3Server.requests` reads back the requests the server answered (from its log), so a
test or a bench can count what a commit costs in requests."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["S3Request", "S3Server", "S3Unavailable", "running_s3_server"]

# werkzeug's request line, coloured by status: ... "GET /bucket/key?query HTTP/1.1" 200 -
_COLOUR = rb"(?:\x1b\[[0-9;]*m)*"
_REQUEST = re.compile(rb'"' + _COLOUR + rb"([A-Z]+) (\S+) HTTP/[0-9.]+" + _COLOUR + rb'" (\d{3})')
_LOG_GRACE_S = 0.2  # see S3Server.requests


class S3Unavailable(RuntimeError):
    """moto's server or boto3 is missing."""


@dataclass(frozen=True, slots=True)
class S3Request:
    """One request the server answered: ``key`` is the object key (or the listing's
    ``prefix``) without the bucket; ``listing`` for a bucket listing."""

    method: str
    key: str
    listing: bool
    status: int


def _parse_request(method: bytes, target: bytes, status: bytes) -> S3Request:
    path, _, query = target.decode(errors="replace").partition("?")
    parts = path.lstrip("/").split("/", 1)
    key = urllib.parse.unquote(parts[1]) if len(parts) > 1 else ""
    listing = False
    if not key and query:
        for item in query.split("&"):
            name, _, value = item.partition("=")
            if name == "prefix":
                key = urllib.parse.unquote(value)
            elif name == "list-type":
                listing = True
    return S3Request(method.decode(), key, listing, int(status))


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    env: dict[str, str] = field(repr=False)  # AWS_* for this server, with its test credentials
    log_path: Path

    @property
    def secrets(self) -> tuple[str, str]:
        """The test credentials (access key id, secret key): never to appear in output."""
        return self.env["AWS_ACCESS_KEY_ID"], self.env["AWS_SECRET_ACCESS_KEY"]

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def child_env(self, **extra: str) -> dict[str, str]:
        """The environment for a subprocess talking to this server."""
        return {**os.environ, **self.env, **extra}

    def storage_options(self) -> dict[str, str]:
        """delta-rs' storage options for this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": self.env["AWS_REGION"],
            "AWS_ACCESS_KEY_ID": self.env["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": self.env["AWS_SECRET_ACCESS_KEY"],
        }

    def log_offset(self) -> int:
        """Where the server's log ends now: :meth:`requests` ``since`` it counts what follows."""
        return self.log_path.stat().st_size

    def requests(self, since: int = 0) -> list[S3Request]:
        """The S3 requests the server answered after log offset ``since`` (its health checks,
        ``/moto-api/``, left out). moto's server logs a request after answering it, so this
        first sends a marker request of its own and waits (up to 10 s) for it in the log, and
        then a little more: the server answers on many threads, and a request answered just
        before the marker (a client's parallel reads) may be logged by its thread just after
        the marker's line."""
        marker = f"_shoal-log-marker-{uuid.uuid4().hex}"
        with contextlib.suppress(Exception):  # a 404 is the expected answer
            self.client().head_object(Bucket=self.bucket, Key=marker)
        deadline = time.monotonic() + 10
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                data = f.read()
            if marker.encode() in data or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        time.sleep(_LOG_GRACE_S)
        with open(self.log_path, "rb") as f:
            f.seek(since)
            data = f.read()
        return [
            request
            for m in _REQUEST.finditer(data)
            if not m.group(2).startswith(b"/moto-api")
            and (request := _parse_request(m.group(1), m.group(2), m.group(3))).key != marker
        ]

    def client(self) -> Any:
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.env["AWS_REGION"],
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/moto-api/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False


def _server_env(endpoint: str, home: Path) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": f"shoaltestkey{uuid.uuid4().hex[:12]}",
        "AWS_SECRET_ACCESS_KEY": f"shoal-test-secret-{uuid.uuid4().hex}",
        # no instance-metadata lookups, no user's ~/.aws
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(home / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials"),
    }


@contextlib.contextmanager
def running_s3_server(directory: Path, bucket: str) -> Iterator[S3Server]:
    """Start moto's server on a free loopback port (its log: ``directory/moto.log``), create
    ``bucket``; stop the server after. Raises :class:`S3Unavailable` without moto or boto3,
    RuntimeError if it does not answer (three ports tried, a minute each)."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as exc:
        raise S3Unavailable(f"it needs `moto[server]` and boto3 (pip): {exc}") from exc
    log_path = directory / "moto.log"
    for _ in range(3):
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 60
        while proc.poll() is None and not _answers(endpoint) and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None and _answers(endpoint):
            break
        proc.kill()
        proc.wait()
    else:
        raise RuntimeError(f"moto's server did not start; see {log_path}")
    server = S3Server(endpoint, bucket, _server_env(endpoint, directory), log_path)
    try:
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
