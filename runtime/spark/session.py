"""Starting a Spark session the bridge can rely on: local (``master``) or Spark Connect
(``remote``), with the environment Spark needs on this machine, warmed before traffic, and a
clear ``SparkStartError`` instead of a hang when Java is missing or Spark does not come up.

Spark Connect (``remote="sc://host:port"``) differs from a local session in what the client may
decide: the server's JVM, its ``spark.local.dir``, UI and other static settings were fixed when
the server started, so only runtime SQL settings (``spark.sql.*``) of ``DEFAULT_CONF`` are sent,
and a user ``conf`` the server refuses is an error naming the key. The client would retry an
unreachable server for about ten minutes; instead the server's port is probed first and the
settings are sent under a short retry policy, so a wrong URL fails in seconds. Paths (the
output directory, a checkpoint) are paths on the server's side. A process holds one kind of
session: pyspark marks the process as Connect (``SPARK_CONNECT_MODE_ENABLED``) once a Connect
session exists, and its functions then build Connect columns."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime import compat

__all__ = [
    "SparkStartError",
    "connect_endpoint",
    "java_executable",
    "prepare_environment",
    "start_session",
    "warm",
]


class SparkStartError(RuntimeError):
    """Spark could not be started (Java missing, bad master URL, Spark failed or timed out)."""


# Settings the bridge needs (the user's ``conf`` overrides them).
DEFAULT_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.sources.partitionOverwriteMode": "dynamic",
    "spark.sql.parquet.compression.codec": "snappy",
    "spark.ui.showConsoleProgress": "false",
}

# Spark Connect: how long the server's port may take to accept a connection, and the retry
# policy while the session's settings are sent (about 3 s of retries for a server that accepts
# connections but does not answer as Spark Connect).
CONNECT_PROBE_TIMEOUT_S = 10.0
CONNECT_START_RETRIES = 4
CONNECT_START_MAX_BACKOFF_MS = 2000


def java_executable() -> str | None:
    """The ``java`` Spark would run: ``$JAVA_HOME/bin/java``, else ``java`` on the PATH."""
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = Path(home) / "bin" / "java"
        if candidate.exists():
            return str(candidate)
    return shutil.which("java")


def prepare_environment(master: str, remote: str | None) -> None:
    """Spark's Python workers must run this interpreter (the system ``python3`` lacks shoal's
    packages and fails with a misleading "worker failed to connect back") and find shoal; a
    local master binds to loopback. Values the user set are kept. Only the first session of a
    process starts the JVM, which keeps the environment of that moment."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # Python processes the JVM starts (workers, the streaming source's driver-side reader)
    # import shoal's modules: put the directory holding the ``runtime`` package on their path.
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, root])
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if remote is None and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def start_session(
    *, master: str, remote: str | None, app_name: str, conf: Mapping[str, str], local_dir: str
) -> Any:
    """Build (or join) the session; blocking, so call it off the event loop. With ``remote``,
    a new Spark Connect session (``app_name`` and ``local_dir`` are the server's business)."""
    if remote is None and java_executable() is None:
        raise SparkStartError(
            "Java was not found (JAVA_HOME unset and no java on PATH); local Spark needs a JDK "
            "17+, or point the bridge at a Spark Connect server with remote=sc://host:port"
        )
    prepare_environment(master, remote)
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pragma: no cover - pyspark is a dependency
        raise SparkStartError(f"pyspark is not importable: {exc}") from exc
    if remote is not None:
        return _start_connect(remote, conf)
    builder: Any = SparkSession.builder.appName(app_name).master(master)
    settings = dict(DEFAULT_CONF)
    settings["spark.local.dir"] = local_dir
    if master.startswith("local") or "SPARK_LOCAL_IP" in os.environ:
        # a cluster's executors connect back to the driver: bind to loopback only when Spark is
        # local or the environment asks for it (a standalone cluster on loopback)
        settings["spark.driver.bindAddress"] = os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")
    settings.update(conf)
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        return builder.getOrCreate()
    except Exception as exc:
        raise SparkStartError(f"Spark failed to start ({master}): {exc}") from exc


def abandon_start(remote: str | None) -> None:
    """Blocking: give up a session start that ran past its time. A local JVM being started is
    killed: the starting thread's call into it then fails and the thread ends, instead of
    keeping the process alive while Spark retries by itself (a ``spark://`` master that never
    answers: a minute and more); then pyspark's handles of it are dropped, so that a next start
    launches a new JVM. A Spark Connect start is the client's: it ends by its own retry limit."""
    if remote is None:
        compat.kill_launched_jvm()
        compat.forget_local_session()


def connect_endpoint(remote: str) -> tuple[str, int]:
    """The (host, port) of a Spark Connect URL (``sc://host:port/;param=value``), checked as
    the client checks it."""
    try:
        from pyspark.sql.connect.client import DefaultChannelBuilder
    except ImportError as exc:
        raise SparkStartError(
            f"the Spark Connect client is not installed ({exc}); install pyspark[connect]"
        ) from exc
    try:
        channel = DefaultChannelBuilder(remote)
    except Exception as exc:
        raise SparkStartError(f"bad Spark Connect URL {remote!r}: {_first_line(exc)}") from exc
    host, _, port = channel.endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _start_connect(remote: str, conf: Mapping[str, str]) -> Any:
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.client.retries import DefaultPolicy

    host, port = connect_endpoint(remote)
    try:
        socket.create_connection((host, port), timeout=CONNECT_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise SparkStartError(
            f"no Spark Connect server at {remote} ({host}:{port}: {exc}); start one "
            "(pyspark's sbin/start-connect-server.sh) or fix the URL"
        ) from exc
    try:
        # No options on the builder: the client would send them at once, under its default
        # retry policy (minutes), and silently drop those the server refuses.
        session: Any = SparkSession.builder.remote(remote).create()
    except Exception as exc:
        raise SparkStartError(f"Spark Connect session failed ({remote}): {exc}") from exc
    client = session.client
    policies = client.get_retry_policies()
    client.set_retry_policies(
        [DefaultPolicy(max_retries=CONNECT_START_RETRIES, max_backoff=CONNECT_START_MAX_BACKOFF_MS)]
    )
    settings = {k: v for k, v in DEFAULT_CONF.items() if k.startswith("spark.sql.")}
    settings.update(conf)
    try:
        for key, value in settings.items():
            try:
                session.conf.set(key, value)
            except Exception as exc:
                if _is_rpc_error(exc):
                    raise SparkStartError(
                        f"the Spark Connect server at {remote} does not answer: {_first_line(exc)}"
                    ) from exc
                raise SparkStartError(
                    f"the Spark Connect server at {remote} refused the setting {key}={value!r}: "
                    f"{_first_line(exc)} (static and JVM settings, e.g. spark.ui.*, "
                    "spark.local.dir, spark.driver.*, spark.executor.*, belong to the server's "
                    "own start)"
                ) from exc
    except BaseException:
        session.stop()
        raise
    client.set_retry_policies(policies)
    return session


def _is_rpc_error(exc: BaseException) -> bool:
    """The server did not answer (as opposed to answering with an error)."""
    import grpc

    if isinstance(exc, grpc.RpcError):
        return True
    status = getattr(exc, "getGrpcStatusCode", None)
    return callable(status) and status() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def warm(spark: Any) -> None:
    """Run the first job now (the first one costs seconds) through the path batches take (one
    made-up row: Spark Connect cannot build a DataFrame from an empty table without a schema)."""
    from runtime.spark.rows import warm_table

    try:
        spark.createDataFrame(warm_table()).count()
    except Exception as exc:
        raise SparkStartError(f"Spark started but cannot run a job: {exc}") from exc
