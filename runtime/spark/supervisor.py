"""Keeping the bridge's Spark session alive (docs/operations.md, "When the parts around shoal
fail").

A Spark job can fail for its own reasons (bad data, a full disk: the bridge retries the batch and
then fails it back to its readers) or because the session under it is gone: the local JVM was
killed (every call then fails at once with ``ConnectionRefusedError``), or a Spark Connect server
restarted (it no longer knows the session). Retrying a batch on a dead session only repeats the
failure, so after every failed job the bridge asks :meth:`SessionSupervisor.recover`:

* the session is alive: the failure is the job's own (``recover`` returns ``False``);
* it is gone and the bridge started it: a new one is started (a new JVM, or a new Connect
  session), warmed through the path batches take, up to ``SparkConfig.restarts`` times with
  doubling backoff; the bridge then runs the batch again. Nothing acked is lost and nothing is
  written twice: what was not committed was never acked, and the default output's atomic
  commit (``runtime.files.commit``) keeps a batch that was half written when the JVM died out of sight;
* it is gone and cannot come back (restarts used up or off, a session the caller owns, a start
  that hangs past ``start_timeout_s``): :class:`SparkLost`, an
  :class:`~runtime.ports.Unrecoverable` that stops the process with a message naming Spark and
  the cause.

A context Spark stopped by itself (a standalone application the cluster ended) counts as lost
too. So does a session whose job hangs: a Spark job (a micro-batch, a dead-letter half) that runs
past ``SparkConfig.job_timeout_s`` is cancelled and fails with :class:`SparkJobTimeout`, and a
session that cannot finish a job is replaced like a dead one. This is what bounds the loss of a
standalone cluster's master: running applications keep their executors (Spark waits for the
master to come back), but once an executor is lost too, no new one can be granted and every job
waits for ever. The timed-out job is cancelled, the new session cannot register with the missing
master (Spark gives up after its registration retries, or the start runs past
``start_timeout_s``), and the process stops naming Spark: at most ``job_timeout_s`` plus the
restarts' starts after the cluster stopped running jobs.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from runtime import compat
from runtime.ports import Unrecoverable
from runtime.spark.config import SparkConfig
from runtime.spark.session import SparkStartError, abandon_start, start_session, warm

__all__ = [
    "SessionSupervisor",
    "SparkJobTimeout",
    "SparkLost",
    "cancel_jobs",
    "connect_session_lost",
]

log = logging.getLogger("shoal.spark")

# Spark Connect errors that mean the server no longer has our session (it restarted), or is
# not there at all; anything else is the job's own failure.
# (Measured with pyspark 4.3: after a server restart the next call fails with NO_ACTIVE_SESSION,
# caused by the server's INVALID_HANDLE.SESSION_CHANGED.)
_CONNECT_LOST = (
    "SESSION_NOT_FOUND",
    "SESSION_CLOSED",
    "INVALID_HANDLE",
    "SESSION_CHANGED",
    "NO_ACTIVE_SESSION",
)


class SparkLost(Unrecoverable):
    """Spark's session is gone and could not be replaced: the process must stop."""


class SparkJobTimeout(RuntimeError):
    """A Spark job ran past ``SparkConfig.job_timeout_s`` and was cancelled: the session cannot
    finish jobs (a cluster without executors, a hung JVM) and is replaced like a dead one."""


def cancel_jobs(spark: Any) -> None:
    """Blocking: cancel every running job of ``spark`` (a Spark Connect session: its
    operations). Only one job of the bridge runs at a time, so these are the bridge's own."""
    if getattr(spark, "_sc", None) is None and hasattr(spark, "interruptAll"):  # Connect
        spark.interruptAll()
    else:
        spark.sparkContext.cancelAllJobs()


def connect_session_lost(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a Spark Connect call, says the server is gone or no longer
    knows the session (as opposed to a job that failed)."""
    import grpc

    seen: BaseException | None = exc
    for _ in range(5):  # the error and what it was raised from or during
        if seen is None:
            return False
        status = getattr(seen, "getGrpcStatusCode", None) or getattr(seen, "code", None)
        if callable(status) and status() == grpc.StatusCode.UNAVAILABLE:
            return True
        details = getattr(seen, "details", None)
        text = f"{seen} {details() if callable(details) else ''}"
        if any(marker in text for marker in _CONNECT_LOST):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class SessionSupervisor:
    """Watches one bridge's session and replaces it when it is lost (see the module docstring).
    ``spark``: the current session; ``owned``: whether the bridge started it (a session the
    caller handed in is never replaced); ``warm_more(spark)``: further blocking warm-up of a
    new session (the bridge's first parquet write)."""

    def __init__(
        self,
        config: SparkConfig,
        spark: Any,
        *,
        owned: bool,
        local_dir: str | None,
        warm_more: Callable[[Any], None] | None = None,
    ) -> None:
        self.config = config
        self.spark = spark
        self.owned = owned
        self.local_dir = local_dir
        self.warm_more = warm_more
        self.restarts = 0  # sessions started after the first
        self.lost: SparkLost | None = None
        self._lost_in_a_row = 0  # sessions lost with no job succeeding in between
        self._where = config.remote or config.master

    def __repr__(self) -> str:
        return f"SessionSupervisor({self._where}, restarts={self.restarts})"

    def dead_because(self, exc: BaseException | None) -> str | None:
        """Blocking: why the current session is gone (after a job failed with ``exc``), or
        ``None`` while it is alive."""
        if isinstance(exc, SparkJobTimeout):
            return f"{exc}{self._no_executors()}"
        if self.config.remote is not None:
            if exc is not None and connect_session_lost(exc):
                first = str(exc).strip().splitlines()
                return f"the Spark Connect session was lost ({first[0] if first else exc!r})"
            return None
        proc = compat.spark_jvm_process(self.spark)
        if proc is not None and (code := proc.poll()) is not None:
            return f"its JVM (pid {proc.pid}) {_exit_text(code)}"
        try:
            stopped = compat.spark_context_stopped(self.spark)
        except Exception as err:  # the JVM does not answer: the job's error tells the rest
            log.warning("Spark (%s): cannot ask whether the context stopped: %r", self._where, err)
            return None
        return "its SparkContext was stopped" if stopped else None

    def _no_executors(self) -> str:
        """Blocking: a hint when a cluster session has no executors left to run jobs."""
        if self.config.remote is not None or self.config.master.startswith("local"):
            return ""
        try:
            executors = compat.spark_executor_count(self.spark)
        except Exception as err:  # the JVM does not answer: the timeout says enough
            log.warning("Spark (%s): cannot count the executors: %r", self._where, err)
            return ""
        if executors > 0:
            return ""
        return (
            f"; the application has no executors left (is the cluster manager at {self._where} up?)"
        )

    async def recover(self, exc: BaseException | None) -> bool:
        """After a job failed with ``exc``: ``False`` if the session is alive; ``True`` once a
        new session (``self.spark``) replaced a lost one; :class:`SparkLost` if it cannot be."""
        if self.lost is not None:
            raise self.lost
        cause = await asyncio.to_thread(self.dead_because, exc)
        if cause is None:
            return False
        log.error("Spark (%s): %s", self._where, cause)
        self._lost_in_a_row += 1
        if self._lost_in_a_row > max(1, self.config.restarts):
            raise self._give_up(
                f"{cause}; its sessions died {self._lost_in_a_row} times in a row without a "
                "job succeeding"
            )
        if not self.owned:
            raise self._give_up(
                f"{cause}; the session was handed to the bridge, which cannot start another"
            )
        if self.config.restarts < 1:
            raise self._give_up(f"{cause}; restarts are off (spark.restarts = 0)")
        last = ""
        delay = self.config.restart_backoff_s
        for attempt in range(1, self.config.restarts + 1):
            try:
                self.spark = await self._start()
            except TimeoutError:
                raise self._give_up(
                    f"{cause}; a new session did not start within "
                    f"{self.config.start_timeout_s:.0f}s (attempt {attempt})"
                ) from None
            except (SparkStartError, OSError, RuntimeError) as err:
                last = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
                log.warning(
                    "Spark (%s): restart %d/%d failed: %s",
                    self._where,
                    attempt,
                    self.config.restarts,
                    last,
                )
                if attempt < self.config.restarts:
                    await asyncio.sleep(delay)
                    delay *= 2
                continue
            self.restarts += 1
            log.warning("Spark (%s): a new session is up after %s", self._where, cause)
            return True
        raise self._give_up(f"{cause}; {self.config.restarts} restart(s) failed, the last: {last}")

    def job_succeeded(self) -> None:
        """A job succeeded on the current session: losses are counted in a row from here."""
        self._lost_in_a_row = 0

    def _give_up(self, why: str) -> SparkLost:
        self.lost = SparkLost(f"Spark ({self._where}): {why}")
        return self.lost

    async def _start(self) -> Any:
        cfg = self.config
        try:
            async with asyncio.timeout(cfg.start_timeout_s):
                return await asyncio.to_thread(self._start_blocking)
        except TimeoutError:
            await asyncio.to_thread(abandon_start, cfg.remote)
            raise

    def _start_blocking(self) -> Any:
        cfg = self.config
        if cfg.remote is None:
            compat.forget_local_session()
        spark = start_session(
            master=cfg.master,
            remote=cfg.remote,
            app_name=cfg.app_name,
            conf=cfg.conf,
            local_dir=self.local_dir or "",
        )
        warm(spark)
        if self.warm_more is not None:
            self.warm_more(spark)
        return spark

    def forget(self) -> None:
        """Blocking: drop a lost local session's handles instead of stopping it (its JVM is
        gone; ``stop()`` would only fail)."""
        if self.config.remote is None:
            compat.forget_local_session()
