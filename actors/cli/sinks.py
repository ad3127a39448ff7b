"""Sink glue of the command-line runtime (the file sink itself is ``runtime.files.sink``).

``CountingSink`` wraps the shared sink for one task and counts records handed over and
committed, so the progress display and the metrics can show them per task.

``spark_config`` turns the options into the Spark bridge's ``SparkConfig`` (with its retry and
dead-letter queues when ``spark.dead_letter`` is on); the run and the ``dlq`` command share it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from runtime.ports import Sink, SinkBatch, SinkWrapper

if TYPE_CHECKING:
    from actors.cli.config import ShoalConfig
    from runtime.kafka import KafkaConfig
    from runtime.spark import SparkConfig


class TaskSinkStats(msgspec.Struct, frozen=True):
    records_read: int  # data change records handed to the sink
    records_delivered: int  # ... whose batch committed
    batches_failed: int
    inflight_batches: int


class CountingSink(SinkWrapper):
    """The shared sink as one task sees it, with counts."""

    def __init__(self, inner: Sink) -> None:
        super().__init__(inner)
        self.records_read = 0
        self.records_delivered = 0
        self.batches_failed = 0
        self.inflight = 0
        self.delivered_by_token: dict[str, int] = {}

    def statistics(self) -> TaskSinkStats:
        return TaskSinkStats(
            self.records_read, self.records_delivered, self.batches_failed, self.inflight
        )

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        future = await self.inner.put(batch)
        n = len(batch.records)
        self.records_read += n
        self.inflight += 1

        def done(f: asyncio.Future[None]) -> None:
            self.inflight -= 1
            if f.cancelled() or f.exception() is not None:
                self.batches_failed += 1
            else:
                self.records_delivered += n

        future.add_done_callback(done)
        return future


def spark_config(config: ShoalConfig, kafka: KafkaConfig | None) -> SparkConfig:
    """The Spark bridge's settings for ``config``: output under ``<output_dir>/data``; with
    ``spark.dead_letter`` the RQ/DLQ topics ``<dead_letter_topic>_rq``/``_dlq`` on ``kafka``.
    Importing the bridge may fail (no pyspark): the caller reports it."""
    from protocol.retry import RetryPolicy
    from runtime.spark import SparkConfig
    from runtime.spark.dead_letter import DeadLetterConfig

    sc = config.spark
    kwargs: dict[str, Any] = {
        "master": sc.master,
        "remote": sc.remote,
        "app_name": sc.app_name,
        "connector": config.run.connector,
        "conf": dict(sc.conf),
        "output_dir": _absolute(config.run.output_dir, "data"),
        "checkpoint_dir": sc.checkpoint_dir and _absolute(sc.checkpoint_dir),
        # the streaming path's spool: under the output, or beside the checkpoint when the
        # output is an object store (the spool is read as files)
        "spool_dir": f"{_absolute(sc.checkpoint_dir)}-spool"
        if sc.path == "streaming" and sc.checkpoint_dir and ":/" in config.run.output_dir
        else None,
        "path": sc.path,
        # the RQ/DLQ writes through Spark itself: the generic layout
        "output_layout": "generic" if sc.dead_letter else config.run.output_layout,
        "table_format": config.run.table_format,
        "restarts": sc.restarts,
        "job_timeout_s": sc.job_timeout_s or None,
        "start_timeout_s": sc.start_timeout_s,
        "debug_validate": config.run.debug_validate,
    }
    optional = {
        "max_rows": sc.max_rows,
        "max_age_s": sc.max_age_s,
        "max_inflight_batches": sc.max_inflight_batches,
    }
    kwargs.update({name: value for name, value in optional.items() if value is not None})
    if sc.dead_letter:
        if kafka is None:
            raise ValueError("spark.dead_letter needs a Kafka for its topics")
        kwargs["dead_letter"] = DeadLetterConfig(
            kafka=kafka,
            name=sc.dead_letter_topic or f"{config.run.connector}_spark",
            policy=RetryPolicy(max_attempts=sc.dead_letter_max_attempts),
            takeover_grace_s=config.run.rq_takeover_grace_s,
        )
    return SparkConfig(**kwargs)


def _absolute(path: str, child: str = "") -> str:
    """``path`` (joined with ``child``) made absolute, so that Spark resolves it the same
    wherever it runs (over Spark Connect a relative path would be relative to the server's
    working directory); a URL (``s3a://``, ``hdfs://``, ``file:/``) is kept as a URL."""
    if ":/" in path:
        return f"{path.rstrip('/')}/{child}" if child else path
    return str(Path(path, child).resolve())
