"""The Spark micro-batch bridge: change records into Spark, watermarks advance only after Spark
commits. ``SparkBridge`` is the ``Sink``; ``SparkConfig`` its settings; ``read_output`` reads the
default parquet output back. See ``bridge`` (the shell) and the paths it owns: ``batch`` (Spark
jobs, attempts, the default output's commits), ``keyed_path`` and ``stream_path`` (over the
Structured Streaming source ``streaming``); ``DeadLetterConfig`` turns on the retry and
dead-letter queues (``keyed_path``, ``keyed``, ``dead_letter``), and a ``foreach_batch`` may
raise ``RowsFailed`` to name failing keys."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.spark.bridge import SparkBridge
    from runtime.spark.config import BridgeError, BridgeStats, SparkConfig, TypedFrames
    from runtime.spark.dead_letter import DeadLetterConfig
    from runtime.spark.keyed import RowsFailed
    from runtime.spark.output import read_output, write_default
    from runtime.spark.rows import KEY_COLUMNS, row_key
    from runtime.spark.session import SparkStartError

# Imported when first used: Spark's Python workers import this package to reach the data
# sources (``runtime.spark.datasource``, ``runtime.spark.streaming``), and a fresh worker
# should not pay for the bridge and its Kafka clients (about half of its imports' time).
_EXPORTS = {
    "SparkBridge": "runtime.spark.bridge",
    "BridgeError": "runtime.spark.config",
    "BridgeStats": "runtime.spark.config",
    "SparkConfig": "runtime.spark.config",
    "TypedFrames": "runtime.spark.config",
    "DeadLetterConfig": "runtime.spark.dead_letter",
    "RowsFailed": "runtime.spark.keyed",
    "read_output": "runtime.spark.output",
    "write_default": "runtime.spark.output",
    "KEY_COLUMNS": "runtime.spark.rows",
    "row_key": "runtime.spark.rows",
    "SparkStartError": "runtime.spark.session",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "KEY_COLUMNS",
    "BridgeError",
    "BridgeStats",
    "DeadLetterConfig",
    "RowsFailed",
    "SparkBridge",
    "SparkConfig",
    "SparkStartError",
    "TypedFrames",
    "read_output",
    "row_key",
    "write_default",
]
