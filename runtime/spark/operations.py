"""Operator actions on the Spark bridge's output, run from the command line
(``python -m actors.runtime dlq ...``): list the rows in its dead-letter queue, and write them to
Spark again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from runtime.spark.bridge import SparkBridge
from runtime.spark.config import SparkConfig
from runtime.spark.dead_letter import SparkDlqRecord, list_dlq

__all__ = ["SparkDlqRecord", "list_dlq", "replay_dlq"]


async def replay_dlq(
    config: SparkConfig,
    record_ids: Iterable[str] | None = None,
    *,
    spark: Any = None,
    timeout_s: float = 120.0,
) -> list[str]:
    """Write DLQ rows (all, or those named) to Spark again through a bridge over the same topics
    (``config.dead_letter``), and wait until each is committed (or dead-lettered again). The
    regular owner must not run meanwhile. ``spark``: a session to use (else one is started)."""
    if config.dead_letter is None:
        raise ValueError("replay_dlq needs SparkConfig.dead_letter")
    async with SparkBridge(config, spark=spark) as bridge:
        chosen = bridge.replay_dlq(record_ids)
        async with asyncio.timeout(timeout_s):
            await bridge.wait_replayed(chosen)
        return chosen
