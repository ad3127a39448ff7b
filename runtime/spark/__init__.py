"""The Spark micro-batch bridge: change records into Spark, watermarks advance only after Spark
commits. ``SparkBridge`` is the ``Sink``; ``SparkConfig`` its settings; ``read_output`` reads the
default parquet output back. See ``bridge`` (embedded path) and ``streaming`` (Structured
Streaming source); ``DeadLetterConfig`` turns on the retry and dead-letter queues (``keyed``,
``dead_letter``), and a ``foreach_batch`` may raise ``RowsFailed`` to name failing keys."""

from runtime.spark.bridge import SparkBridge
from runtime.spark.config import BridgeError, BridgeStats, SparkConfig
from runtime.spark.dead_letter import DeadLetterConfig
from runtime.spark.keyed import RowsFailed
from runtime.spark.output import read_output, write_default
from runtime.spark.rows import KEY_COLUMNS, row_key
from runtime.spark.session import SparkStartError

__all__ = [
    "KEY_COLUMNS",
    "BridgeError",
    "BridgeStats",
    "DeadLetterConfig",
    "RowsFailed",
    "SparkBridge",
    "SparkConfig",
    "SparkStartError",
    "read_output",
    "row_key",
    "write_default",
]
