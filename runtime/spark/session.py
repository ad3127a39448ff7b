"""Starting a Spark session the bridge can rely on: local (``master``) or Spark Connect
(``remote``), with the environment Spark needs on this machine, warmed before traffic, and a
clear ``SparkStartError`` instead of a hang when Java is missing or Spark does not come up."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["SparkStartError", "java_executable", "prepare_environment", "start_session", "warm"]


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
    """Build (or join) the session; blocking, so call it off the event loop."""
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
    builder: Any = SparkSession.builder.appName(app_name)
    builder = builder.remote(remote) if remote is not None else builder.master(master)
    settings = dict(DEFAULT_CONF)
    if remote is None:
        settings["spark.local.dir"] = local_dir
        settings["spark.driver.bindAddress"] = os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")
    settings.update(conf)
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        return builder.getOrCreate()
    except Exception as exc:
        where = remote if remote is not None else master
        raise SparkStartError(f"Spark failed to start ({where}): {exc}") from exc


def warm(spark: Any) -> None:
    """Run the first job now (the first one costs seconds) through the path batches take."""
    from runtime.spark.rows import to_arrow

    try:
        spark.createDataFrame(to_arrow([])).count()
    except Exception as exc:
        raise SparkStartError(f"Spark started but cannot run a job: {exc}") from exc
