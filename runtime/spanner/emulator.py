"""Launcher for the Cloud Spanner emulator (``emulator_main``), for tests and benchmarks.

Finds the binary (argument, else env ``SHOAL_SPANNER_EMULATOR``, else where the Debian package
``google-cloud-cli-spanner-emulator`` puts it), starts it on a free loopback port, waits until it
answers, creates an instance, a database with a few tables and a change stream through the admin
API, and stops it (SIGTERM, then SIGKILL) on ``stop()``. ``EmulatorUnavailable`` says clearly why
it cannot run (tests skip with that message).

Partition churn: ``partition_alive_s=N`` passes
``--override_change_stream_partition_token_alive_seconds=N``, so partitions end every N–2N s with
real splits, moves and merges.

Synchronous on purpose: it is a fixture helper; the admin calls take milliseconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import IO, Any

from runtime import compat
from runtime.spanner.config import SpannerConfig

__all__ = [
    "DEFAULT_EMULATOR_PATH",
    "DEFAULT_TABLES",
    "EMULATOR_ENV",
    "EmulatorUnavailable",
    "SpannerEmulator",
    "find_emulator",
    "pg_table_ddl",
    "table_ddl",
]

log = logging.getLogger(__name__)

EMULATOR_ENV = "SHOAL_SPANNER_EMULATOR"
DEFAULT_EMULATOR_PATH = "/usr/lib/google-cloud-sdk/bin/cloud_spanner_emulator/emulator_main"
DEFAULT_TABLES = ("Singers", "Albums", "Songs")


class EmulatorUnavailable(RuntimeError):
    """The emulator binary is absent or does not start; the message says which and where."""


def find_emulator(path: str | None = None) -> str:
    """The emulator binary: ``path``, else ``$SHOAL_SPANNER_EMULATOR``, else the Debian package
    location, else ``emulator_main`` on ``PATH``. Raises ``EmulatorUnavailable``."""
    candidates: list[tuple[str, str]] = []
    if path:
        candidates.append(("argument", path))
    elif os.environ.get(EMULATOR_ENV):
        candidates.append((f"${EMULATOR_ENV}", os.environ[EMULATOR_ENV]))
    else:
        candidates.append(("default", DEFAULT_EMULATOR_PATH))
        on_path = shutil.which("emulator_main")
        if on_path:
            candidates.append(("PATH", on_path))
    for _, candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    tried = ", ".join(f"{src}: {p}" for src, p in candidates)
    raise EmulatorUnavailable(
        f"Cloud Spanner emulator binary not found or not executable ({tried}); install the Debian "
        f"package google-cloud-cli-spanner-emulator or set {EMULATOR_ENV} to emulator_main"
    )


def pg_table_ddl(table: str) -> str:
    """:func:`table_ddl` in the PostgreSQL dialect, names quoted so they keep their case (the
    load generator's mutations name them as in GoogleSQL)."""
    return (
        f'CREATE TABLE "{table}" ("Id" bigint NOT NULL, "Name" varchar, "Value" bigint, '
        'PRIMARY KEY ("Id"))'
    )


def table_ddl(table: str) -> str:
    """The schema every generated table shares (the load generator writes these columns)."""
    return (
        f"CREATE TABLE {table} (Id INT64 NOT NULL, Name STRING(MAX), Value INT64) PRIMARY KEY (Id)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class SpannerEmulator:
    """One emulator process with one provisioned database. Use as a context manager or call
    ``start()`` / ``stop()``; ``config`` is valid after ``start()``."""

    def __init__(
        self,
        *,
        binary: str | None = None,
        partition_alive_s: int | None = None,
        project: str = "shoal-test",
        instance: str = "shoal-instance",
        database: str = "shoal-db",
        change_stream: str = "ShoalStream",
        tables: Sequence[str] = DEFAULT_TABLES,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = find_emulator(binary)
        self.partition_alive_s = partition_alive_s
        self.project = project
        self.instance = instance
        self.database = database
        self.change_stream = change_stream
        self.tables = tuple(tables)
        self.extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._host: str | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def host(self) -> str:
        if self._host is None:
            raise RuntimeError("emulator not started")
        return self._host

    @property
    def pid(self) -> int:
        """The emulator process's id (to watch its CPU, as ``bench emuleak`` does)."""
        if self._proc is None:
            raise RuntimeError("emulator not started")
        return self._proc.pid

    @property
    def config(self) -> SpannerConfig:
        return SpannerConfig(
            project=self.project,
            instance=self.instance,
            database=self.database,
            change_stream=self.change_stream,
            emulator_host=self.host,
        )

    def start(self, timeout_s: float = 30.0) -> SpannerConfig:
        """Start the process, wait for it, create instance, database, tables and stream."""
        if self._proc is not None:
            raise RuntimeError("emulator already started")
        for attempt in range(3):
            try:
                self._spawn(timeout_s)
                break
            except EmulatorUnavailable:
                self.stop()
                if attempt == 2:
                    raise
                log.warning("spanner emulator did not start (attempt %d), retrying", attempt + 1)
        try:
            self._provision(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.config

    def _spawn(self, timeout_s: float) -> None:
        port = _free_port()
        args = [self.binary, "--host_port", f"127.0.0.1:{port}"]
        if self.partition_alive_s is not None:
            args.append(
                f"--override_change_stream_partition_token_alive_seconds={self.partition_alive_s}"
            )
        args.extend(self.extra_args)
        self._log = tempfile.TemporaryFile(prefix="shoal-spanner-emulator-")  # noqa: SIM115
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise EmulatorUnavailable(
                    f"emulator exited with {self._proc.returncode} on port {port}: "
                    f"{self._log_tail()}"
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.monotonic() > deadline:
                raise EmulatorUnavailable(
                    f"emulator not accepting on port {port} after {timeout_s}s"
                )
            time.sleep(0.02)
        self._host = f"127.0.0.1:{port}"
        log.info("spanner emulator pid %d on %s", self._proc.pid, self._host)

    def _provision(self, timeout_s: float) -> None:
        with sync_client(self.config) as client:
            config_name = f"projects/{self.project}/instanceConfigs/emulator-config"
            instance = client.instance(self.instance, configuration_name=config_name, node_count=1)
            instance.create().result(timeout_s)
            ddl = [table_ddl(t) for t in self.tables]
            ddl.append(
                f"CREATE CHANGE STREAM {self.change_stream} FOR ALL "
                "OPTIONS (value_capture_type = 'OLD_AND_NEW_VALUES')"
            )
            db: Any = instance.database(self.database, ddl_statements=ddl)
            db.create().result(timeout_s)

    def create_postgresql_database(self, database: str, timeout_s: float = 60.0) -> SpannerConfig:
        """A PostgreSQL-dialect database beside the provisioned one, with the same tables
        (:func:`pg_table_ddl`) and change stream (name quoted: its case is kept); its config."""
        from google.cloud.spanner_admin_database_v1.types import DatabaseDialect

        with sync_client(self.config) as client:
            db: Any = client.instance(self.instance).database(
                database, database_dialect=DatabaseDialect.POSTGRESQL
            )
            db.create().result(timeout_s)
            ddl = [pg_table_ddl(t) for t in self.tables]
            ddl.append(
                f'CREATE CHANGE STREAM "{self.change_stream}" FOR ALL '
                "WITH (value_capture_type = 'OLD_AND_NEW_VALUES')"
            )
            db.update_ddl(ddl).result(timeout_s)
        return SpannerConfig(
            project=self.project,
            instance=self.instance,
            database=database,
            change_stream=self.change_stream,
            emulator_host=self.host,
        )

    def _log_tail(self, limit: int = 2000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return text[-limit:].strip() or "(no output)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, wait, SIGKILL if needed; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("spanner emulator pid %d ignored SIGTERM; killing", proc.pid)
                proc.kill()
                proc.wait(timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._host = None

    def __enter__(self) -> SpannerEmulator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def sync_client(config: SpannerConfig) -> Iterator[Any]:
    """A blocking ``google.cloud.spanner.Client`` whose gRPC channels are closed on exit."""
    compat.disable_grpc_fork_support()
    from google.cloud import spanner

    client = spanner.Client(**config.client_kwargs())
    try:
        yield client
    finally:
        close_sync_client(client)


def close_sync_client(client: Any, databases: Sequence[Any] = ()) -> None:
    """Close the gRPC channels a blocking client (and its databases) opened. The client has no
    ``close()`` of its own for them; unclosed channels warn at garbage collection."""
    for db in databases:
        db.close()
        transport = compat.database_transport(db)
        if transport is not None:
            transport.close()
    for transport in compat.admin_transports(client):
        transport.close()
    client.close()
