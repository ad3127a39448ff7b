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
session exists, and its functions then build Connect columns.

No Spark setting travels on a command line. pyspark hands a builder's settings to the JVM it
launches as ``spark-submit --conf key=value`` arguments, which every user of the machine can
read (``ps``, ``/proc/<pid>/cmdline``), and ``[spark.conf]`` may hold secrets (an object store's
``spark.hadoop.fs.s3a.secret.key``). So a local session's settings, all of them (shoal's
defaults, the master, the application name and every ``conf`` entry: no rule guessing which
names hold secrets can then miss one), are written to a Java properties file readable by this
user only (mode 0600, in the session's ``local_dir``, which the bridge creates private) and
named to spark-submit by ``--properties-file`` in ``PYSPARK_SUBMIT_ARGS`` (with
``--load-spark-defaults``, so the site's ``spark-defaults.conf`` still applies beneath them);
the file is deleted as soon as the start returns or fails: by then spark-submit has read it.
This is chosen over setting secrets on the running session (``hadoopConfiguration().set``):
that reaches Hadoop settings only, not those Spark reads at its start (``spark.ssl.*``,
``spark.authenticate.secret``, ``spark.driver.memory``), and needs pyspark's private parts.
Spark reads the file as its own configuration, so executors get the settings from the driver
as they get any other (Spark puts only its start-up settings on an executor's command line,
never ``spark.authenticate.secret`` or an SSL password). When a JVM already runs (a session
was stopped, or the process was started by ``spark-submit``), nothing is launched and the
settings go to it through pyspark's gateway, off any command line. Spark trims the values it
reads from a properties file, so a value with surrounding white space is refused (it would
silently change). A Spark Connect session's settings are sent over its gRPC connection. The
JVM's own options (``spark.driver.extraJavaOptions``) and ``PYSPARK_SUBMIT_ARGS`` are command
lines by nature: no secret belongs there."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from runtime import compat

__all__ = [
    "SparkStartError",
    "connect_endpoint",
    "java_executable",
    "prepare_environment",
    "settings_file",
    "start_session",
    "submit_args",
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
    settings = {"spark.master": master, "spark.app.name": app_name, **DEFAULT_CONF}
    settings["spark.local.dir"] = local_dir
    if master.startswith("local") or "SPARK_LOCAL_IP" in os.environ:
        # a cluster's executors connect back to the driver: bind to loopback only when Spark is
        # local or the environment asks for it (a standalone cluster on loopback)
        settings["spark.driver.bindAddress"] = os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")
    settings.update(conf)
    try:
        if compat.spark_jvm_running() or GATEWAY_PORT_ENV in os.environ:
            # no JVM is launched: the settings reach the running one through the gateway
            builder: Any = SparkSession.builder
            return builder.config(map=settings).getOrCreate()
        with settings_file(settings, local_dir) as path, submit_args(path):
            # no setting on the builder: pyspark would put it on spark-submit's command line
            return SparkSession.builder.getOrCreate()
    except SparkStartError:
        raise
    except Exception as exc:
        raise SparkStartError(f"Spark failed to start ({master}): {exc}") from exc


# pyspark connects to a running JVM instead of launching one when this is set (a Python
# process that spark-submit started)
GATEWAY_PORT_ENV = "PYSPARK_GATEWAY_PORT"
SUBMIT_ARGS_ENV = "PYSPARK_SUBMIT_ARGS"


@contextlib.contextmanager
def settings_file(settings: Mapping[str, str], directory: str) -> Iterator[str]:
    """A Java properties file holding ``settings``, readable by this user only (mode 0600), in
    ``directory`` (the system's temporary directory if empty or missing); deleted on leaving.
    Raises :class:`SparkStartError` for a value with surrounding white space (Spark trims the
    values it reads from such a file)."""
    for key, value in settings.items():
        if value != value.strip():
            raise SparkStartError(
                f"the Spark setting {key} has white space around its value, which Spark drops "
                "when it reads its settings: remove it ([spark.conf])"
            )
    where = directory if directory and os.path.isdir(directory) else None
    fd, path = tempfile.mkstemp(prefix="shoal-spark-", suffix=".properties", dir=where)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.writelines(
                f"{_properties_escape(k)}={_properties_escape(v)}\n" for k, v in settings.items()
            )
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):  # already gone: nothing left to delete
            os.unlink(path)


_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/[]*,@+")


def _properties_escape(text: str) -> str:
    """``text`` as a key or value of a Java properties file: every character but a few plain
    ones written as a ``\\uXXXX`` escape (UTF-16 units), which ``Properties.load`` turns back
    into the character whatever it is (``=``, ``:``, ``#``, ``\\``, white space, newlines)."""
    out: list[str] = []
    for char in text:
        if char in _PLAIN:
            out.append(char)
            continue
        units = char.encode("utf-16-be")
        out.extend(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2))
    return "".join(out)


@contextlib.contextmanager
def submit_args(properties: str) -> Iterator[None]:
    """While inside: ``PYSPARK_SUBMIT_ARGS`` names ``properties`` as spark-submit's properties
    file (Spark's ``spark-defaults.conf`` loaded beneath it), before what the user set there.
    Raises :class:`SparkStartError` if the user's value names a properties file of its own (one
    of the two would be ignored)."""
    before = os.environ.get(SUBMIT_ARGS_ENV)
    try:
        user = shlex.split(before) if before is not None else ["pyspark-shell"]
    except ValueError as exc:
        raise SparkStartError(f"{SUBMIT_ARGS_ENV} cannot be parsed: {exc}") from exc
    if any(a == "--properties-file" or a.startswith("--properties-file=") for a in user):
        raise SparkStartError(
            f"{SUBMIT_ARGS_ENV} names a --properties-file: shoal passes Spark its settings in a "
            "properties file of its own; put the settings in [spark.conf] (or in Spark's "
            "spark-defaults.conf, which is still read) instead"
        )
    os.environ[SUBMIT_ARGS_ENV] = shlex.join(
        ["--properties-file", properties, "--load-spark-defaults", *user]
    )
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SUBMIT_ARGS_ENV, None)
        else:
            os.environ[SUBMIT_ARGS_ENV] = before


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
                    f"the Spark Connect server at {remote} refused the setting {key}: "
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
