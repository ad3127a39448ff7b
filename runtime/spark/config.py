"""The Spark bridge's settings and its public result types (no Spark import: the command line
and the dead-letter tools read them without starting Spark)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec

from runtime.spark.dead_letter import DeadLetterConfig

TypedFrames = Mapping[str, Any]
"""What a ``foreach_batch`` gets with ``SparkConfig.foreach_batch_frames = "typed"``: per table
with rows in the micro-batch (by name, sorted), its rows as a typed ``pyspark.sql.DataFrame``
(the typed layout's columns and types: docs/reading-output.md)."""

ForeachBatch = Callable[[Any, int], None] | Callable[[Any, int, str], None]
"""``foreach_batch(df, batch_id)``, or ``foreach_batch(df, batch_id, identity)`` to get the
deterministic batch identity too (docs/design.md#exactly-once-output)."""


class SparkConfig(msgspec.Struct, frozen=True):
    master: str = "local[2]"
    remote: str | None = None  # Spark Connect URL sc://host:port (instead of master)
    app_name: str = "shoal"
    # the connector writing the output: its own output state under <output_dir>/_shoal/<connector>
    # (docs/design.md#exactly-once-output, rule 5) and its batch identities
    connector: str = "shoal"
    conf: dict[str, str] = {}
    output_dir: str = "shoal-output"
    checkpoint_dir: str | None = None  # streaming: default <output_dir>/_checkpoint
    path: Literal["embedded", "streaming"] = "embedded"
    max_rows: int = 100_000
    max_age_s: float = 1.0
    max_inflight_batches: int = 4
    max_attempts: int = 3  # per micro-batch, the first run included
    retry_backoff_s: float = 0.5  # doubled per attempt
    start_timeout_s: float = 180.0
    # a lost session (the local JVM died, a Connect server restarted) is replaced this many
    # times in a row at most, with doubling backoff; then the process stops (runtime.spark.supervisor)
    restarts: int = 3
    restart_backoff_s: float = 2.0
    # a Spark job (a micro-batch, a dead-letter batch) running longer is cancelled and its
    # session replaced like a lost one (a cluster whose master and executors are gone never
    # finishes it); None: no limit
    job_timeout_s: float | None = 300.0
    stop_timeout_s: float = 120.0
    spool_dir: str | None = None  # streaming: default <output_dir>/_spool
    trigger_interval_s: float = 1.0  # streaming: the query's processing-time trigger
    ack_poll_s: float = 0.1  # streaming: how often Spark's checkpoint is read for commits
    # without atomic commits (no progress files): on start, learn each partition's tail from the
    # output (reads all of it); with them, each partition's tail comes from its progress file
    resume_dedupe: bool = True
    # embedded default output: commit each micro-batch atomically with its partitions'
    # positions (docs/design.md#exactly-once-output); needs the output on a file system this
    # process shares with Spark (always on local Spark; over Spark Connect, a shared one)
    atomic_commit: bool = True
    dead_letter: DeadLetterConfig | None = None  # RQ/DLQ for rows Spark keeps failing (opt-in)
    # the default output's layout: "typed" (one directory per table, the table's columns in
    # their types; runtime/spark/typed_output.py, written on either path without dead_letter
    # to a path this process writes or an s3://, gs://, file:// URI) or "generic" (one
    # schema, JSON text); None:
    # typed where it can be written, else generic
    output_layout: Literal["typed", "generic"] | None = None
    # the typed default output's table format: "parquet" (batch=<id> directories per table) or
    # "delta" (one Delta table per table, each micro-batch one idempotent Delta commit per table:
    # exactly once on object stores too; runtime/spark/typed_output.py)
    table_format: Literal["parquet", "delta"] = "parquet"
    # what a foreach_batch gets as its first argument: "generic" (one DataFrame, one row per
    # mod, keys and values as JSON text) or "typed" (a TypedFrames: table name -> that table's
    # typed DataFrame, the typed layout's columns and types); typed on the embedded path
    # without dead_letter
    foreach_batch_frames: Literal["generic", "typed"] = "generic"
    # check the output ledger's invariants after each of its events (protocol/ledger.py;
    # the CLI's --debug-validate)
    debug_validate: bool = False


class BridgeStats(msgspec.Struct, frozen=True):
    puts: int  # SinkBatches handed in
    rows_in: int  # rows (mods) handed in
    rows_deduplicated: int  # rows dropped as replays
    rows_committed: int  # rows Spark committed
    batches_committed: int  # micro-batches committed
    batches_failed: int  # micro-batches that failed every attempt
    attempts_failed: int  # failed attempts, retried or not
    puts_failed: int  # SinkBatches whose future failed
    puts_refused: int  # SinkBatches refused (bad input, closed bridge, past a failed batch)
    inflight: int  # micro-batches cut and not yet committed
    buffered_rows: int
    last_commit_latency_s: float  # oldest put of the last micro-batch → its commit
    last_batch_id: int
    fenced_refused: int = 0  # micro-batches refused: they held a batch a stopped reader fenced
    # with dead_letter:
    rows_parked: int = 0  # rows handed to the RQ (failing, or behind a key it holds)
    rows_retried: int = 0  # rows committed from the RQ
    isolation_runs: int = 0  # Spark batches run to isolate failing rows (halves, retries)
    rq_held: int = 0  # rows the RQ/DLQ holds now
    in_dlq: int = 0


class BridgeError(RuntimeError):
    """A batch the bridge could not commit (its reader re-reads it) or a bridge misuse."""
