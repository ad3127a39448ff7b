"""A standalone Spark cluster on loopback, started from the installed pyspark: one master and
``workers`` workers (``bin/spark-class org.apache.spark.deploy.master.Master`` and
``...deploy.worker.Worker spark://...``), each on free ports, each worker with a small number of
cores and little memory. For the benchmark and the tests that run the command line against a
real ``spark://`` master (docs/operations.md, "A real Spark cluster"); production clusters are
started by their operators.

``StandaloneCluster`` is a context manager: entering starts the daemons and waits until the
master's JSON UI (``statistics()``) shows every worker alive; leaving stops them (SIGTERM to
each daemon's own process group, which holds the executors a worker started, then SIGKILL
after ``stop_timeout_s``). Every daemon's output goes to ``<work_dir>/<name>.log``; a daemon
that dies while starting fails with its log's tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import msgspec

from runtime.net import free_port
from runtime.spark.session import SparkStartError, java_executable

__all__ = ["ClusterStatus", "StandaloneCluster", "spark_home"]

HOST = "127.0.0.1"


def spark_home() -> Path:
    """The installed pyspark's directory: it holds ``bin/spark-class`` and the jars."""
    try:
        import pyspark
    except ImportError as exc:
        raise SparkStartError(f"pyspark is not importable: {exc}") from exc
    return Path(pyspark.__file__).resolve().parent


class ClusterStatus(msgspec.Struct, frozen=True):
    """What the master's JSON UI says."""

    status: str  # the master's state: ALIVE once it leads
    alive_workers: int
    cores: int  # over the alive workers
    active_apps: int


class StandaloneCluster:
    """A master and ``workers`` workers on loopback; see the module docstring."""

    def __init__(
        self,
        work_dir: str | os.PathLike[str],
        *,
        workers: int = 2,
        worker_cores: int = 1,
        worker_memory: str = "768m",
        daemon_memory: str = "256m",
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        if workers < 1 or worker_cores < 1:
            raise ValueError("workers and worker_cores must be >= 1")
        self.work_dir = Path(work_dir)
        self.workers = workers
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        self.daemon_memory = daemon_memory
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.port = free_port()
        self.ui_port = free_port()
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    @property
    def master_url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"http://{HOST}:{self.ui_port}"

    def __repr__(self) -> str:
        return f"StandaloneCluster({self.master_url}, {self.workers} workers)"

    def env(self) -> dict[str, str]:
        """The environment of the daemons, and the one a driver on this machine needs: Spark's
        home, loopback only, this interpreter for Python workers."""
        env = dict(os.environ)
        env["SPARK_HOME"] = str(spark_home())
        env["SPARK_LOCAL_IP"] = HOST
        env["SPARK_DAEMON_MEMORY"] = self.daemon_memory
        env["PYSPARK_PYTHON"] = env.get("PYSPARK_PYTHON", sys.executable)
        env.setdefault("SPARK_CONF_DIR", str(self.work_dir / "conf"))  # no site settings
        return env

    def __enter__(self) -> Self:
        if java_executable() is None:
            raise SparkStartError("Java was not found (JAVA_HOME unset and no java on PATH)")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "conf").mkdir(exist_ok=True)
        spark_class = str(spark_home() / "bin" / "spark-class")
        try:
            self._start(
                "master",
                [
                    spark_class,
                    "org.apache.spark.deploy.master.Master",
                    *("--host", HOST, "--port", str(self.port)),
                    *("--webui-port", str(self.ui_port)),
                ],
            )
            self._wait(lambda s: s.status == "ALIVE", "the master to lead")
            for i in range(self.workers):
                work = self.work_dir / f"worker-{i}"
                work.mkdir(exist_ok=True)
                self._start(
                    f"worker-{i}",
                    [
                        spark_class,
                        "org.apache.spark.deploy.worker.Worker",
                        *("--host", HOST, "--port", str(free_port())),
                        *("--webui-port", str(free_port())),
                        *("--cores", str(self.worker_cores), "--memory", self.worker_memory),
                        *("--work-dir", str(work)),
                        self.master_url,
                    ],
                )
            self._wait(lambda s: s.alive_workers >= self.workers, f"{self.workers} workers")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _start(self, name: str, args: list[str]) -> None:
        with (self.work_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                args,
                env=self.env(),
                cwd=self.work_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopping it stops its executors too
            )
        self._procs.append((name, proc))

    def pids(self) -> dict[str, int]:
        """The process id of each daemon (``master``, ``worker-<i>``) while it runs."""
        return {name: proc.pid for name, proc in self._procs if proc.poll() is None}

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.work_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def statistics(self) -> ClusterStatus:
        """The master's view (its JSON UI); raises ``OSError`` while it does not answer."""
        with urllib.request.urlopen(f"{self.ui_url}/json/", timeout=5) as response:
            data: dict[str, Any] = json.loads(response.read())
        alive = [w for w in data.get("workers", []) if w.get("state") == "ALIVE"]
        return ClusterStatus(
            status=str(data.get("status", "")),
            alive_workers=len(alive),
            cores=sum(int(w.get("cores", 0)) for w in alive),
            active_apps=len(data.get("activeapps", [])),
        )

    def _wait(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        last: str = "no answer yet"
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise SparkStartError(
                        f"Spark {name} exited with {proc.returncode} while waiting for {what}: "
                        f"{self.log_tail(name)}"
                    )
            try:
                status = self.statistics()
            except (OSError, ValueError) as exc:  # not listening yet, or a half-written answer
                last = f"{type(exc).__name__}: {exc}"
            else:
                if ready(status):
                    return
                last = repr(status)
            time.sleep(0.5)
        raise SparkStartError(
            f"{self!r}: no {what} within {self.start_timeout_s:.0f}s (last: {last}); "
            f"master log: {self.log_tail('master')}"
        )

    def kill(self, *, master: bool = False, workers: bool = False) -> None:
        """SIGKILL the master and/or every worker, each with its process group (a worker's
        executors with it): a cluster losing its parts, for the tests of what a driver does
        then. ``stop`` still reaps them."""
        for name, proc in self._procs:
            if (master and name == "master") or (workers and name.startswith("worker-")):
                _signal_group(proc, signal.SIGKILL)

    def stop(self) -> None:
        """Stop every daemon this cluster started (workers first), each with its group."""
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for _, proc in reversed(self._procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            # executors the worker started live in its group and may outlive it by a moment
            _signal_group(proc, signal.SIGKILL)
        self._procs.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone: nothing left to stop
        os.killpg(proc.pid, sig)
