"""Every option of ``python -m actors.runtime``, and how they are read.

One frozen msgspec Struct per section; each field carries its default and a description
(``msgspec.Meta(description=...)``). Everything else is derived from these Structs: the
command-line flags, the environment variable names, the TOML keys, ``--help`` and the reference in
``docs/configuration.md`` (:func:`reference_markdown`; a test keeps that file current).

Precedence, highest first: flags > environment variables ``SHOAL_*`` > the TOML file
(``--config PATH`` or ``SHOAL_CONFIG``) > defaults.

Naming, for a top-level option ``tasks`` and an option ``bootstrap_servers`` of section ``kafka``:

==============  ==========================  ===============================  =====================
option          flag                        environment                      TOML
==============  ==========================  ===============================  =====================
tasks           ``--tasks``                 ``SHOAL_TASKS``                  ``tasks = 3``
kafka           ``--kafka-bootstrap-        ``SHOAL_KAFKA_BOOTSTRAP_         ``[kafka]``
bootstrap       servers``                   SERVERS``                        ``bootstrap_servers``
==============  ==========================  ===============================  =====================

A bad value, an unknown key or variable, or an unreadable file raises :class:`ConfigError`, whose
message names the option and where it came from; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import fnmatch
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from protocol.filters import RecordFilter
from protocol.task import ANSWER_TIMEOUT, TaskConfig

if TYPE_CHECKING:
    from runtime.kafka import KafkaConfig

__all__ = [
    "ConfigError",
    "HealthOptions",
    "KafkaOptions",
    "Option",
    "RunOptions",
    "ShoalConfig",
    "SimOptions",
    "SpannerOptions",
    "SparkOptions",
    "TaskOptions",
    "add_arguments",
    "load",
    "options",
    "reference_markdown",
    "secret_setting",
]


class ConfigError(ValueError):
    """A bad option, variable or file; the message names it and where it came from."""


def _d(text: str) -> Meta:
    return Meta(description=text)


class RunOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    connector: Annotated[
        str,
        Meta(
            pattern=r"^[A-Za-z0-9._-]+$",
            description="Connector name: names the sync topic, the heartbeat topic and the group. "
            "Every process with the same name and Kafka cooperates.",
        ),
    ] = "shoal"
    tasks: Annotated[
        Annotated[int, Meta(ge=1, le=64)] | None,
        _d(
            "Tasks run in this process (ignored with task_id); unset: 3 on the embedded "
            "broker, 1 on a real Kafka (one task per process; start more processes)."
        ),
    ] = None
    task_id: Annotated[
        str | None,
        _d(
            "Run exactly one task with this id (production: one task per process). "
            "Default: task-0..task-N-1 on the embedded broker, <host>-<pid>[-i] on a real Kafka."
        ),
    ] = None
    source: Annotated[
        Literal["sim", "emulator", "spanner"],
        _d(
            "Change stream: sim (seeded simulator), emulator (starts the Cloud Spanner emulator "
            "with a write load), spanner (the [spanner] database)."
        ),
    ] = "sim"
    sink: Annotated[
        Literal["spark", "files", "kafka"],
        _d(
            "Where records go: spark (local or remote Spark writing parquet), files (parquet "
            "files written by pyarrow, no Java needed), kafka (the design-003 output topic)."
        ),
    ] = "spark"
    output_dir: Annotated[
        str,
        _d(
            "Where the output goes (under <output_dir>/data) and run files: a directory, or an "
            "object store's URI (s3://bucket/prefix, gs://bucket/prefix, file:///path; "
            "credentials from the standard environment and credential chains; "
            "docs/operations.md)."
        ),
    ] = "shoal-output"
    output_layout: Annotated[
        Literal["typed", "generic"],
        _d(
            "Layout of the parquet output (--sink files, and --sink spark's default output): "
            "typed (one directory per table, the table's columns in their Spanner types, "
            "old values as _old_<column>, metadata columns; docs/reading-output.md) or generic "
            "(every table in one schema, keys and values as JSON text). The Spark dead-letter "
            "queue writes generic."
        ),
    ] = "typed"
    table_format: Annotated[
        Literal["parquet", "delta"],
        _d(
            "Table format of the typed output: parquet (a directory of batch=<id> directories "
            "per table, each committed by a rename) or delta (one Delta Lake table per Spanner "
            "table, each micro-batch one idempotent Delta commit: exactly once on object "
            "stores too; docs/reading-output.md)."
        ),
    ] = "parquet"
    duration: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        Meta(description="Stop after this many seconds (then catch up, drain, exit 0)."),
    ] = None
    max_records: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Stop once this many records were delivered (then catch up)."),
    ] = None
    connect_timeout: Annotated[
        float,
        Meta(
            gt=0,
            description="Seconds start-up keeps retrying an unreachable Kafka (exponential "
            "backoff) before it gives up with an error (exit 1).",
        ),
    ] = 30.0
    drain_timeout: Annotated[
        float,
        Meta(
            gt=0,
            description="Seconds a shutdown may take to commit in-flight batches, publish the "
            "final state and leave the group; a second signal exits at once.",
        ),
    ] = 30.0
    progress: Annotated[
        Literal["auto", "on", "off"],
        _d("Live progress display: auto shows it when stdout is a terminal, on prints lines."),
    ] = "auto"
    progress_interval: Annotated[float, Meta(gt=0, description="Seconds between updates.")] = 1.0
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"], _d("Log level (logs go to stderr).")
    ] = "warning"
    log_json: Annotated[bool, _d("Logs as JSON lines (one object per record).")] = False
    metrics_port: Annotated[
        Annotated[int, Meta(ge=0, le=65535)] | None,
        Meta(
            description="Serve Prometheus /metrics, /healthz and /readyz on this port "
            "(0: any free port, printed at start); unset: no HTTP server.",
        ),
    ] = None
    metrics_host: Annotated[str, _d("Address the metrics server binds to.")] = "127.0.0.1"
    health_out_of_group_s: Annotated[
        float,
        Meta(
            gt=0,
            description="/healthz fails once a ready task has been out of the heartbeat group "
            "this many seconds (it cannot rejoin; restart the process).",
        ),
    ] = 120.0
    rq_takeover_grace_s: Annotated[
        float,
        Meta(
            ge=0,
            description="Retry queue shared by the processes (--sink kafka, or spark with the "
            "dead-letter queue): seconds a process that became the group leader waits before "
            "it retries the queue's records (the previous leader's retries in flight end).",
        ),
    ] = 10.0
    stuck_after_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Log (warning) and count (shoal_stuck_partitions) an owned partition "
            "whose committed watermark stood still this many seconds though nothing should keep "
            "it from being read.",
        ),
    ] = 60.0
    start_at: Annotated[
        str,
        _d(
            "Where a connector starts reading when it first starts: an RFC 3339 timestamp "
            "(2024-05-01T12:00:00Z) or now. A restart resumes from its watermarks; a different "
            "explicit start on a connector with state in its sync topic is refused. Not before "
            "the database's version retention (Spanner refuses it)."
        ),
    ] = "now"
    end_at: Annotated[
        str | None,
        _d(
            "Read up to this RFC 3339 timestamp (inclusive), then drain and exit 0 once every "
            "partition reached it; unset: no end."
        ),
    ] = None
    tables: Annotated[
        str | None,
        _d(
            "Keep only records of these tables: comma-separated glob patterns (Orders,Audit_*), "
            "case-insensitive; unset: every table. Filtered records still advance watermarks."
        ),
    ] = None
    exclude_tables: Annotated[
        str | None,
        _d("Drop records of these tables (glob patterns; wins over tables)."),
    ] = None
    mod_types: Annotated[
        str | None,
        _d(
            "Keep only these kinds of change: comma-separated INSERT, UPDATE, DELETE (and "
            "SNAPSHOT, the rows of a snapshot); unset: all."
        ),
    ] = None
    exclude_transaction_tags: Annotated[
        str | None,
        _d(
            "Drop the records of transactions whose transaction tag matches one of these "
            "comma-separated glob patterns (case-sensitive; an untagged transaction never "
            "matches): a pipeline's own writes, to avoid replication loops."
        ),
    ] = None
    exclude_system_transactions: Annotated[
        bool,
        _d(
            "Drop the records of system transactions (is_system_transaction: the deletes of a "
            "TTL row deletion policy)."
        ),
    ] = False
    exclude_columns: Annotated[
        str | None,
        _d(
            "Take these columns out of every record's new values, old values and column list: "
            "comma-separated Table.Column items, both parts glob patterns, case-insensitive "
            "(Users.Email,*.Ssn). Primary-key columns are never taken out."
        ),
    ] = None
    snapshot: Annotated[
        bool,
        _d(
            "When the connector first starts, read every watched table as of its start (T: "
            "start_at, else now) first, split into partitions the tasks share, then the change "
            "stream from after T; rows with _mod_type SNAPSHOT and _commit_ts T "
            "(docs/mirror.md). Spanner sources only."
        ),
    ] = False
    snapshot_chunk_rows: Annotated[
        int,
        Meta(
            ge=1,
            le=1_000_000,
            description="Rows per chunk of a snapshot partition (a chunk commits exactly once); "
            "fixed with T by the process that plans the snapshot.",
        ),
    ] = 10_000
    mirror: Annotated[
        bool,
        _d(
            "Also keep one current-state Delta table per Spanner table under "
            "<output_dir>/data/_mirror/<table>: the newest row per key, merged from each "
            "micro-batch (docs/mirror.md). With --sink files."
        ),
    ] = False
    summary_json: Annotated[
        str | None, _d("Also write the end-of-run summary as JSON to this file.")
    ] = None
    trace_dir: Annotated[
        str | None,
        _d(
            "Write every input of each task's protocol cores (its own and its readers'), and "
            "the commands they returned, to <dir>/<task id>.trace.jsonl (a Kafka sink's retry "
            "core: <dir>/retry-<output>.trace.jsonl), to replay the run offline "
            "(protocol.trace)."
        ),
    ] = None
    debug_validate: Annotated[
        bool,
        _d(
            "Check the invariants of every protocol core (the task's, its readers', its group "
            "membership's, a Kafka sink's retry queue's, the file sink's or Spark bridge's "
            "output ledger's) after every event (debugging; slower)."
        ),
    ] = False


class KafkaOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    bootstrap_servers: Annotated[
        str | None,
        _d("host:port[,host:port...] of a real Kafka; unset: start the embedded broker."),
    ] = None
    security_protocol: Annotated[
        Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"], _d("Kafka security protocol.")
    ] = "PLAINTEXT"
    sasl_mechanism: Annotated[
        Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None, _d("SASL mechanism.")
    ] = None
    sasl_username: Annotated[str | None, _d("SASL user name.")] = None
    sasl_password: Annotated[
        str | None, _d("SASL password (prefer the environment variable to a flag).")
    ] = None
    ssl_cafile: Annotated[str | None, _d("CA bundle to verify the brokers.")] = None
    ssl_certfile: Annotated[str | None, _d("Client certificate (with ssl_keyfile).")] = None
    ssl_keyfile: Annotated[str | None, _d("Client private key.")] = None
    ssl_keyfile_password: Annotated[str | None, _d("Password of the client private key.")] = None
    unreachable_limit_s: Annotated[
        float,
        Meta(
            ge=0,
            description="Stop the process (exit 1, naming Kafka) once none of its tasks has "
            "been a member of the group for this long: the broker unreachable, or the group not "
            "answering. Shorter outages heal (tasks stop reading, rejoin, resume). 0: never.",
        ),
    ] = 120.0
    session_timeout_ms: Annotated[
        Annotated[int, Meta(gt=0)] | None,
        Meta(
            description="Heartbeat-group session timeout; unset: 4000 on the embedded broker, "
            "10000 on a real Kafka (which refuses < 6000 by default).",
        ),
    ] = None
    heartbeat_interval_ms: Annotated[
        Annotated[int, Meta(gt=0)] | None,
        Meta(description="Group heartbeat interval; unset: 500 / 3000."),
    ] = None
    request_timeout_ms: Annotated[
        Annotated[int, Meta(gt=0)] | None,
        Meta(description="Kafka request timeout; unset: 10000 / 15000."),
    ] = None
    replication_factor: Annotated[
        int, Meta(ge=1, description="Replicas of the topics shoal creates (3 in production).")
    ] = 1
    client_id: Annotated[str, _d("Kafka client id prefix.")] = "shoal"
    output_topic: Annotated[
        str | None, _d("Output topic of --sink kafka (default: <connector>_output).")
    ] = None
    output_partitions: Annotated[
        int,
        Meta(
            ge=1,
            description="Partitions of the output topic at its first start (later: "
            "output add-storage-topic N).",
        ),
    ] = 4
    output_lease_s: Annotated[
        float,
        Meta(
            ge=1.0,
            description="Lease of each --sink kafka process in the output's switch barrier "
            "(renewed every third of it); a process that died holds a switch-produce this long.",
        ),
    ] = 15.0


class SpannerOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    project: Annotated[str | None, _d("Google Cloud project (--source spanner).")] = None
    instance: Annotated[str | None, _d("Spanner instance id.")] = None
    database: Annotated[str | None, _d("Spanner database id.")] = None
    change_stream: Annotated[str | None, _d("Change stream name.")] = None
    credentials_file: Annotated[
        str | None, _d("Service-account key file; unset: Application Default Credentials.")
    ] = None
    emulator_host: Annotated[
        str | None, _d("host:port of an already running emulator (plain-text, anonymous).")
    ] = None
    heartbeat_ms: Annotated[
        int, Meta(gt=0, description="heartbeat_milliseconds of the partition queries.")
    ] = 1000
    query_window_s: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        Meta(
            description="A partition query spans at most N s of commit time, then goes on with "
            "a new query; unset: 5 against the emulator (it keeps running cancelled queries "
            "until their end), none against Spanner."
        ),
    ] = None
    trail_s: Annotated[
        Annotated[float, Meta(ge=0)] | None,
        Meta(
            description="Read only commit time at least N s old, polling every N s (the "
            "emulator's live queries skip a commit that lands exactly on one of their internal "
            "100 ms scan steps; its queries over the past are complete); unset: 0.25 against "
            "the emulator, 0 (read live) against Spanner."
        ),
    ] = None
    emulator_path: Annotated[
        str | None,
        _d("emulator_main binary for --source emulator; unset: $SHOAL_SPANNER_EMULATOR, Debian."),
    ] = None
    emulator_churn_s: Annotated[
        Annotated[int, Meta(gt=0)] | None,
        Meta(description="Emulator partitions end every N..2N s (splits/moves/merges)."),
    ] = None
    load_rate: Annotated[
        float, Meta(gt=0, description="Commits per second written to the emulator.")
    ] = 50.0
    rpc_priority: Annotated[
        Literal["LOW", "MEDIUM", "HIGH"] | None,
        _d("RPC priority of the change-stream queries; unset: Spanner's default (HIGH)."),
    ] = None
    database_role: Annotated[
        str | None,
        _d(
            "Database role of the connection (fine-grained access control); it needs SELECT on "
            "the change stream and EXECUTE on its read function. Unset: the credentials' own."
        ),
    ] = None


class SparkOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    master: Annotated[str, _d("Spark master URL, e.g. local[2] or spark://host:7077.")] = "local[2]"
    remote: Annotated[
        str | None,
        _d("Spark Connect URL sc://host:port (instead of master); see docs/operations.md."),
    ] = None
    app_name: Annotated[
        str, _d("Spark application name (local Spark; a Connect server names its own).")
    ] = "shoal"
    path: Annotated[
        Literal["embedded", "streaming"],
        _d("embedded: createDataFrame per batch; streaming: Structured Streaming source."),
    ] = "embedded"
    checkpoint_dir: Annotated[
        str | None,
        _d(
            "Streaming checkpoint directory (default under output_dir; a local or shared "
            "directory, needed with an object-store output_dir: the spool goes beside it, "
            "<checkpoint_dir>-spool)."
        ),
    ] = None
    max_rows: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Rows per Spark micro-batch (bridge default)."),
    ] = None
    max_age_s: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        Meta(
            description="Seconds a micro-batch may wait to fill (while two are in flight it "
            "waits for the sink instead, and grows; it is cut at once when every reader in it "
            "waits only for its commit)."
        ),
    ] = None
    max_inflight_batches: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Micro-batches in flight before backpressure."),
    ] = None
    dead_letter: Annotated[
        bool,
        _d(
            "Retry and dead-letter queues for rows Spark keeps failing: the failing rows are "
            "isolated (the micro-batch is bisected by key) and parked in the Kafka topics "
            "<dead_letter_topic>_rq / _dlq, retried with backoff, per-key order kept; "
            "see the dlq command. Embedded path only."
        ),
    ] = False
    dead_letter_topic: Annotated[
        Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]+$")] | None,
        _d("Topic prefix of the Spark retry/dead-letter queues (default: <connector>_spark)."),
    ] = None
    dead_letter_max_attempts: Annotated[
        int, Meta(ge=1, description="Failures of a row before it goes to the dead-letter queue.")
    ] = 5
    restarts: Annotated[
        int,
        Meta(
            ge=0,
            description="Times in a row a lost Spark session (the local JVM died, a Spark "
            "Connect server restarted) is replaced by a new one before the process stops with "
            "exit 1 naming Spark; 0: stop at once. Embedded path.",
        ),
    ] = 3
    start_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Seconds Spark may take to start (the session, or a cluster's "
            "executors registering) and to run its first job before the process stops with "
            "exit 1 naming Spark; a replacement session gets the same.",
        ),
    ] = 180.0
    job_timeout_s: Annotated[
        float,
        Meta(
            ge=0,
            description="Seconds a Spark job (one micro-batch) may run before it is cancelled "
            "and its session counts as lost (restarted, see restarts): what bounds a cluster "
            "that lost its master and executors; 0: no limit. Embedded path.",
        ),
    ] = 300.0
    conf: Annotated[
        dict[str, str],
        _d(
            "Extra Spark settings (TOML table [spark.conf]); local Spark gets them in a "
            "private file, never on a command line."
        ),
    ] = {}
    secret_conf: Annotated[
        str | None,
        _d(
            "More [spark.conf] settings whose values are secrets, beyond those named like one "
            "(docs/operations.md, Logs): comma-separated names or glob patterns "
            "(spark.hadoop.fs.myfs.*.auth), case-insensitive; shown as *** and masked in logs."
        ),
    ] = None


class SimOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seed: Annotated[int, _d("Seed of the simulated stream (same seed: same records).")] = 1
    roots: Annotated[int, Meta(ge=1, description="Root partitions.")] = 8
    records_per_s: Annotated[
        float, Meta(gt=0, description="Records per second per partition (stream time).")
    ] = 200.0
    round_s: Annotated[
        float, Meta(gt=0, description="Stream seconds between partition split/move/merge.")
    ] = 5.0
    split_p: Annotated[float, Meta(ge=0, le=1, description="Split chance per round.")] = 0.05
    move_p: Annotated[float, Meta(ge=0, le=1, description="Move chance per round.")] = 0.03
    merge_p: Annotated[float, Meta(ge=0, le=1, description="Merge chance per round.")] = 0.05
    speedup: Annotated[float, Meta(gt=0, description="Stream time runs this much faster.")] = 1.0
    start_ts: Annotated[
        int | None,
        _d(
            "Stream start, Unix microseconds; unset: now. Processes that share a simulated "
            "stream must share this (and seed)."
        ),
    ] = None


class TaskOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cap: Annotated[
        int, Meta(ge=0, description="Partitions one task reads at once (0: no cap).")
    ] = 100
    answer_timeout_ms: Annotated[
        int,
        Meta(
            gt=0,
            description="Leader's wait for every member's answer to a rebalance before it plans "
            "the epoch anyway (a dead task's partitions wait that long for a new owner). Keep it "
            "above how late the broker answers followers' joins: shorter waits met unsafe "
            "histories in the fault simulator (docs/design.md#epochs).",
        ),
    ] = ANSWER_TIMEOUT // 1000
    publish_interval_ms: Annotated[
        int, Meta(gt=0, description="Coalescing of watermark-only sync messages.")
    ] = 250
    negotiate_interval_ms: Annotated[
        int, Meta(gt=0, description="How often balancing offers are considered.")
    ] = 200
    checkpoint_interval_s: Annotated[
        float, Meta(gt=0, description="Leader's full-state checkpoints to the sync topic.")
    ] = 10.0
    stall_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="A partition query that sends nothing, not even a heartbeat, for this "
            "long is restarted from its committed position (doubling per stall in a row, up to "
            "8x). Keep it well above the query's heartbeat interval.",
        ),
    ] = 30.0
    quarantine_after: Annotated[
        int,
        Meta(
            ge=0,
            description="A partition whose reader fails this many times in a row without its "
            "committed position moving, while another partition of the task advances, is "
            "quarantined: parked at its watermark, read by nobody until `quarantine release` "
            "(docs/operations.md). 0: off (a poison partition is retried for ever); at least 2.",
        ),
    ] = 5

    def task_config(self, task_id: str) -> TaskConfig:
        """The task core's settings for ``task_id`` (the core counts in microseconds)."""
        return TaskConfig(
            task_id=task_id,
            cap=self.cap,
            answer_timeout=self.answer_timeout_ms * 1000,
            publish_interval=self.publish_interval_ms * 1000,
            negotiate_interval=self.negotiate_interval_ms * 1000,
            checkpoint_interval=round(self.checkpoint_interval_s * 1e6),
            stall_timeout=round(self.stall_timeout_s * 1e6),
            quarantine_after=self.quarantine_after,
        )


class HealthOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    failing_s: Annotated[
        float,
        Meta(
            gt=0,
            description="/healthz fails (and status and the progress display say why) once the "
            "sink has failed every batch, or the source every query, for this many seconds; "
            "/readyz fails as soon as either fails every attempt since its last success.",
        ),
    ] = 300.0


class ShoalConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run: RunOptions = msgspec.field(default_factory=RunOptions)
    kafka: KafkaOptions = msgspec.field(default_factory=KafkaOptions)
    spanner: SpannerOptions = msgspec.field(default_factory=SpannerOptions)
    spark: SparkOptions = msgspec.field(default_factory=SparkOptions)
    sim: SimOptions = msgspec.field(default_factory=SimOptions)
    task: TaskOptions = msgspec.field(default_factory=TaskOptions)
    health: HealthOptions = msgspec.field(default_factory=HealthOptions)


SECTIONS: Final[dict[str, type[msgspec.Struct]]] = {
    "run": RunOptions,
    "kafka": KafkaOptions,
    "spanner": SpannerOptions,
    "spark": SparkOptions,
    "sim": SimOptions,
    "task": TaskOptions,
    "health": HealthOptions,
}
SECTION_TITLES: Final = {
    "run": "Run",
    "kafka": "Kafka (coordination topics and group)",
    "spanner": "Spanner (--source spanner / emulator)",
    "spark": "Spark (--sink spark)",
    "sim": "Simulated change stream (--source sim)",
    "task": "Task protocol tuning",
    "health": "Health (/healthz, /readyz)",
}
CONFIG_ENV: Final = "SHOAL_CONFIG"
# SHOAL_* variables that are not options but are read elsewhere.
# not options: the config file, the emulator binary, the tests' required-parts switch (.ci/run)
_FOREIGN_ENV: Final = frozenset({CONFIG_ENV, "SHOAL_SPANNER_EMULATOR", "SHOAL_REQUIRE_PARTS"})
_SECRET_FIELDS: Final = frozenset({"sasl_password", "ssl_keyfile_password"})


class Option(msgspec.Struct, frozen=True):
    """One option as the flags, the environment and the docs see it."""

    section: str  # "run" for top-level options
    name: str
    kind: str  # human-readable type
    default: Any
    description: str
    choices: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return self.name if self.section == "run" else f"{self.section}.{self.name}"

    @property
    def flag(self) -> str:
        dashed = self.name.replace("_", "-")
        return f"--{dashed}" if self.section == "run" else f"--{self.section}-{dashed}"

    @property
    def env(self) -> str:
        base = self.name.upper() if self.section == "run" else f"{self.section}_{self.name}".upper()
        return f"SHOAL_{base}"

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.name}"

    @property
    def toml(self) -> str:
        return self.name if self.section == "run" else f"[{self.section}] {self.name}"

    @property
    def secret(self) -> bool:
        return self.name in _SECRET_FIELDS


def _describe(t: msgspec.inspect.Type) -> tuple[str, str, tuple[str, ...]]:
    """(kind, description, choices) of a field type."""
    description = ""
    if isinstance(t, msgspec.inspect.Metadata):
        description = str((t.extra_json_schema or {}).get("description", ""))
        t = t.type
    optional = False
    if isinstance(t, msgspec.inspect.UnionType):
        rest = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
        optional = len(rest) < len(t.types)
        t = rest[0] if len(rest) == 1 else t
    choices: tuple[str, ...] = ()
    match t:
        case msgspec.inspect.LiteralType():
            choices = tuple(str(v) for v in t.values)
            kind = "|".join(choices)
        case msgspec.inspect.BoolType():
            kind = "bool"
        case msgspec.inspect.IntType():
            kind = "int"
        case msgspec.inspect.FloatType():
            kind = "float"
        case msgspec.inspect.StrType():
            kind = "str"
        case msgspec.inspect.DictType():
            kind = "table"
        case _:
            kind = type(t).__name__
    return (f"{kind} (optional)" if optional else kind), description, choices


def options() -> list[Option]:
    """Every option, in declaration order."""
    out: list[Option] = []
    for section, cls in SECTIONS.items():
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        for field in info.fields:
            kind, description, choices = _describe(field.type)
            default = (
                field.default_factory()
                if field.default is msgspec.NODEFAULT
                and field.default_factory is not msgspec.NODEFAULT
                else field.default
            )
            out.append(Option(section, field.name, kind, default, description, choices))
    return out


def _by_dest() -> dict[str, Option]:
    return {o.dest: o for o in options()}


# -- flags --------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option (``--config`` too). Flags default to ``None`` (= not given)."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML file of options (also ${CONFIG_ENV}); flags and SHOAL_* variables win.",
    )
    for section, title in SECTION_TITLES.items():
        group = parser.add_argument_group(title)
        for option in options():
            if option.section != section or option.kind == "table":
                continue
            shown = (
                "unset"
                if option.default is None
                else ("***" if option.secret else _show(option.default))
            )
            text = f"{option.description} [default: {shown}; env {option.env}]"
            if option.kind == "bool":
                group.add_argument(
                    option.flag,
                    dest=option.dest,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=text,
                )
            else:
                metavar = (
                    option.name.upper()
                    if not option.choices
                    else "{" + ",".join(option.choices) + "}"
                )
                group.add_argument(
                    option.flag, dest=option.dest, default=None, metavar=metavar, help=text
                )


# -- loading ------------------------------------------------------------------------------------


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {exc}") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc


def _suggest(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load(
    argv_values: Mapping[str, Any] | argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> ShoalConfig:
    """The effective configuration: flags (``argparse`` values by ``dest``) > ``environ``
    ``SHOAL_*`` > the TOML file (``config_path``, else ``$SHOAL_CONFIG``) > defaults."""
    env = os.environ if environ is None else environ
    if isinstance(argv_values, argparse.Namespace):
        flags = vars(argv_values)
    else:
        flags = dict(argv_values or {})
    if config_path is None:
        config_path = flags.get("config") or env.get(CONFIG_ENV) or None
    by_dest = _by_dest()
    by_key = {(o.section, o.name): o for o in options()}
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    origin: dict[tuple[str, str], str] = {}

    if config_path:
        data = _read_toml(Path(config_path))
        where = f"config file {config_path!r}"
        for key, value in data.items():
            if key in SECTIONS and key != "run":
                if not isinstance(value, dict):
                    raise ConfigError(f"{where}: [{key}] must be a table, got {value!r}")
                known = [n for (s, n) in by_key if s == key]
                for name, item in value.items():
                    if (key, name) not in by_key:
                        raise ConfigError(
                            f"{where}: unknown key {name!r} in [{key}]{_suggest(name, known)}"
                        )
                    values[key][name] = item
                    origin[(key, name)] = f"{where}, [{key}] {name}"
            elif ("run", key) in by_key:
                values["run"][key] = value
                origin[("run", key)] = f"{where}, key {key}"
            else:
                known = [n for (s, n) in by_key if s == "run"] + [s for s in SECTIONS if s != "run"]
                raise ConfigError(f"{where}: unknown key {key!r}{_suggest(key, known)}")

    env_names = {o.env: o for o in options() if o.kind != "table"}
    for name, value in env.items():
        if not name.startswith("SHOAL_") or name in _FOREIGN_ENV:
            continue
        option = env_names.get(name)
        if option is None:
            raise ConfigError(
                f"unknown environment variable {name}{_suggest(name, list(env_names))}"
            )
        values[option.section][option.name] = _env_value(option, value)
        origin[(option.section, option.name)] = f"environment variable {name}"

    for dest, value in flags.items():
        option = by_dest.get(dest)
        if option is None or value is None:
            continue
        values[option.section][option.name] = (
            _env_value(option, value) if isinstance(value, str) else value
        )
        origin[(option.section, option.name)] = f"flag {option.flag}"

    try:
        config = msgspec.convert(values, ShoalConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), origin, by_key)) from exc
    check(config)
    return config


def _env_value(option: Option, value: str) -> Any:
    """Strings from the environment and flags: empty means unset for optional options."""
    if value == "" and option.kind.endswith("(optional)"):
        return None
    return value


def _explain(
    message: str, origin: Mapping[tuple[str, str], str], by_key: Mapping[tuple[str, str], Option]
) -> str:
    text, _, path = message.rpartition(" - at `")
    parts = path.rstrip("`").removeprefix("$.").split(".") if path else []
    if len(parts) >= 2 and (parts[0], parts[1]) in by_key:
        option = by_key[(parts[0], parts[1])]
        where = origin.get((parts[0], parts[1]), "the defaults")
        return f"invalid value for {option.key} (from {where}): {text or message}"
    return f"invalid configuration: {message}"


def task_count(config: ShoalConfig) -> int:
    """How many tasks this process runs."""
    if config.run.task_id is not None:
        return 1
    if config.run.tasks is not None:
        return config.run.tasks
    return 3 if config.kafka.bootstrap_servers is None else 1


def check(config: ShoalConfig) -> None:
    """Rules that span options."""
    run, kafka, spanner = config.run, config.kafka, config.spanner
    if run.task_id is not None and not run.task_id.strip():
        raise ConfigError("task_id must not be empty")
    if run.source == "spanner":
        missing = [
            f"spanner.{name}"
            for name in ("project", "instance", "database", "change_stream")
            if getattr(spanner, name) is None
        ]
        if missing:
            raise ConfigError(f"--source spanner needs {', '.join(missing)}")
    if spanner.change_stream is not None and not spanner.change_stream.replace("_", "").isalnum():
        raise ConfigError(
            f"spanner.change_stream must be an identifier, got {spanner.change_stream!r}"
        )
    start, end = start_micros(run), end_micros(run)
    if start is not None and end is not None and end < start:
        raise ConfigError(f"end_at {run.end_at} is before start_at {run.start_at}")
    try:
        record_filter(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if config.spark.dead_letter and config.spark.path != "embedded":
        raise ConfigError("spark.dead_letter works on the embedded path only (spark.path)")
    if config.task.quarantine_after == 1:
        raise ConfigError(
            f"{_flag('task', 'quarantine_after')} 1: the rule compares a failure with the one "
            "before it (did another partition advance between them?); give 0 (off) or at least 2"
        )
    if (
        run.sink == "spark"
        and config.spark.path == "streaming"
        and is_url(run.output_dir)
        and not config.spark.checkpoint_dir
    ):
        raise ConfigError(
            "spark.path streaming with an object-store output_dir (--output-dir) needs "
            "spark.checkpoint_dir (--spark-checkpoint-dir): a directory for Spark's checkpoint "
            "and the spool"
        )
    _check_output(config)
    _check_snapshot(config)
    if kafka.bootstrap_servers is None:
        _check_embedded_kafka(kafka)
    else:
        try:
            settings = kafka_config(config, kafka.bootstrap_servers)
        except ValueError as exc:
            raise ConfigError(f"kafka: {exc}") from exc
        from runtime.kafka.config import KafkaSettingError

        try:  # the TLS files: readable, certificates and a key the password opens
            settings.ssl_context()
        except KafkaSettingError as exc:
            raise ConfigError(str(exc)) from exc


def is_url(output_dir: str) -> bool:
    """Whether ``run.output_dir`` names an object store (or a ``file://`` URI), not a path."""
    return "://" in output_dir


def _check_output(config: ShoalConfig) -> None:
    """The output's location and format agree with the sink (nothing is reached here)."""
    run = config.run
    if run.table_format == "delta":
        if run.sink == "kafka":
            raise ConfigError("table_format delta (--table-format) is for --sink files or spark")
        if run.output_layout != "typed":
            raise ConfigError(
                "table_format delta (--table-format) needs output_layout typed "
                "(--output-layout): a Delta table per Spanner table"
            )
        if run.sink == "spark" and config.spark.dead_letter:
            raise ConfigError(
                "table_format delta (--table-format) with --sink spark is written without "
                "spark.dead_letter, which writes the generic layout"
            )
        if run.sink == "spark" and is_url(run.output_dir):
            scheme = run.output_dir.split("://", 1)[0].lower()
            if scheme not in ("s3", "gs", "gcs", "file"):
                raise ConfigError(
                    f"table_format delta (--table-format) with --sink spark: output_dir "
                    f"(--output-dir) {scheme}:// is Spark's own URL; give s3://, gs:// or "
                    "file:// (written through shoal's store layer)"
                )
    if is_url(run.output_dir):
        from runtime.lake.store import StoreError, open_store

        try:
            open_store(run.output_dir)  # the URI's form only: the store is reached at start
        except StoreError as exc:
            raise ConfigError(str(exc)) from exc


def _check_snapshot(config: ShoalConfig) -> None:
    """``snapshot`` and ``mirror`` agree with the source, the sink and the filters."""
    run = config.run
    if run.snapshot and run.source == "sim":
        raise ConfigError(
            "snapshot (--snapshot) reads a Spanner database: use --source spanner or emulator"
        )
    if (
        run.snapshot
        and record_filter(config).mod_types
        and "SNAPSHOT" not in (record_filter(config).mod_types)
    ):
        raise ConfigError(
            f"snapshot (--snapshot) with mod_types {run.mod_types} (--mod-types) would drop "
            "every snapshot row: add SNAPSHOT to mod_types, or leave it unset"
        )
    if run.mirror and run.sink != "files":
        raise ConfigError("mirror (--mirror) is written by --sink files for now")
    if run.mirror and run.output_layout != "typed":
        raise ConfigError("mirror (--mirror) needs output_layout typed (--output-layout)")


# The settings of a real Kafka's authentication and TLS: the embedded broker takes none of them.
_KAFKA_SECURITY: Final = (
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_keyfile_password",
)


def _check_embedded_kafka(kafka: KafkaOptions) -> None:
    """Without ``kafka.bootstrap_servers`` shoal starts its embedded broker, which speaks
    plaintext only: an authentication or TLS setting then means a forgotten
    ``--kafka-bootstrap-servers``, not something to ignore (the values are not shown: some are
    secrets)."""
    given = [name for name in _KAFKA_SECURITY if getattr(kafka, name) is not None]
    if kafka.security_protocol != "PLAINTEXT":
        given.insert(0, "security_protocol")
    if given:
        names = ", ".join(f"kafka.{name} ({_flag('kafka', name)})" for name in given)
        raise ConfigError(
            f"{names} given without kafka.bootstrap_servers (--kafka-bootstrap-servers): the "
            "embedded broker started then takes no SASL or TLS settings; give the Kafka "
            "they are for, or leave them unset"
        )


def _flag(section: str, name: str) -> str:
    return Option(section, name, "", None, "").flag


_RFC3339 = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?([Zz]|[+-]\d{2}:\d{2})"
)


def parse_time(text: str, option: str) -> int:
    """An RFC 3339 timestamp (with ``Z`` or an offset; up to nanoseconds, truncated to the
    microseconds Spanner's commit timestamps have) as Unix microseconds."""
    match = _RFC3339.fullmatch(text.strip())
    if match is None:
        raise ConfigError(
            f"{option}: {text!r} is not an RFC 3339 timestamp with a time zone "
            "(e.g. 2024-05-01T12:00:00Z or 2024-05-01T14:00:00.5+02:00)"
        )
    day, clock, fraction, zone = match.groups()
    try:
        moment = datetime.datetime.fromisoformat(
            f"{day}T{clock}{'+00:00' if zone in 'Zz' else zone}"
        )
    except ValueError as exc:
        raise ConfigError(f"{option}: {text!r}: {exc}") from exc
    micros = int((fraction or "0").ljust(6, "0")[:6])
    return (moment - _EPOCH) // datetime.timedelta(microseconds=1) + micros


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def start_micros(run: RunOptions) -> int | None:
    """``start_at`` as Unix microseconds; None for ``now`` (decided when the connector first
    starts)."""
    if run.start_at.strip().lower() == "now":
        return None
    return parse_time(run.start_at, "start_at")


def end_micros(run: RunOptions) -> int | None:
    """``end_at`` as Unix microseconds; None: no end."""
    return None if run.end_at is None else parse_time(run.end_at, "end_at")


def record_filter(config: ShoalConfig) -> RecordFilter:
    """The record filter of ``tables``, ``exclude_tables``, ``mod_types``,
    ``exclude_transaction_tags``, ``exclude_system_transactions`` and ``exclude_columns``."""
    run = config.run
    return RecordFilter.parse(
        run.tables,
        run.exclude_tables,
        run.mod_types,
        exclude_transaction_tags=run.exclude_transaction_tags,
        exclude_system_transactions=run.exclude_system_transactions,
        exclude_columns=run.exclude_columns,
    )


# The Cloud Spanner emulator keeps running a cancelled partition query's server loop until the
# query's end or the partition's (runtime/spanner/reader.py): a window bounds each leaked loop.
# 5 s, not 20: in two full chaos runs of one seed the emulator's load grew more slowly with it
# (docs/benchmarks.md, Chaos).
EMULATOR_QUERY_WINDOW_S = 5.0


def query_window(options: SpannerOptions, *, emulator: bool) -> float | None:
    """The partition query window to use: the configured one, else 5 s against the emulator
    and none (one query to the partition's end) against Spanner."""
    if options.query_window_s is not None:
        return options.query_window_s
    return EMULATOR_QUERY_WINDOW_S if emulator else None


# How far behind now a reader of the emulator stays (runtime/spanner/reader.py, "Trailing"):
# each poll is one query, so this is also the poll interval; the added delay is about 1.5x it.
EMULATOR_TRAIL_S = 0.25


def trail(options: SpannerOptions, *, emulator: bool) -> float | None:
    """How far behind now partition queries stay: the configured value (0: read live), else
    0.25 s against the emulator and none against Spanner."""
    if options.trail_s is not None:
        return options.trail_s or None
    return EMULATOR_TRAIL_S if emulator else None


def kafka_config(config: ShoalConfig, bootstrap: str) -> KafkaConfig:
    """The :class:`runtime.kafka.KafkaConfig` for ``bootstrap`` (the embedded broker's timeouts
    unless ``kafka.bootstrap_servers`` names a real Kafka)."""
    from runtime.kafka import KafkaConfig

    k = config.kafka
    base = (
        KafkaConfig.embedded(bootstrap)
        if k.bootstrap_servers is None
        else KafkaConfig(bootstrap_servers=bootstrap)
    )
    return KafkaConfig(
        bootstrap_servers=bootstrap,
        security_protocol=k.security_protocol,
        sasl_mechanism=k.sasl_mechanism,
        sasl_username=k.sasl_username,
        sasl_password=k.sasl_password,
        ssl_cafile=k.ssl_cafile,
        ssl_certfile=k.ssl_certfile,
        ssl_keyfile=k.ssl_keyfile,
        ssl_keyfile_password=k.ssl_keyfile_password,
        session_timeout_ms=k.session_timeout_ms or base.session_timeout_ms,
        heartbeat_interval_ms=k.heartbeat_interval_ms or base.heartbeat_interval_ms,
        request_timeout_ms=k.request_timeout_ms or base.request_timeout_ms,
        replication_factor=k.replication_factor,
        client_id=k.client_id,
    )


# Words that make a part of a Spark setting's name (between dots) say it holds a secret.
_SECRET_WORDS: Final = ("secret", "passw", "token", "credential", "private")


def secret_setting(key: str, extra: str | None = None) -> bool:
    """Whether the Spark setting ``key`` holds a secret, by its name: a part of it between dots
    contains ``secret``, ``passw``, ``token``, ``credential`` or ``private``, or is ``sas``, or
    ends in ``key`` or ``keys`` (``fs.s3a.secret.key``, ``fs.s3a.access.key``,
    ``fs.azure.account.key.<account>.dfs.core.windows.net``, ``fs.azure.sas.<container>...``,
    ``spark.ssl.keyPassword``, ``spark.authenticate.secret``, ``<catalog>.token``,
    ``s3.secret-access-key``, ``accountKey``), or it matches one of the comma-separated names or
    glob patterns of ``extra`` (``spark.secret_conf``). Case-insensitive. Such settings are
    shown as ``***`` and masked in logs; every setting, secret or not, reaches local Spark in a
    private file (``runtime.spark.session``)."""
    name = key.lower()
    for part in name.split("."):
        if any(word in part for word in _SECRET_WORDS):
            return True
        if part == "sas" or part.endswith(("key", "keys")):
            return True
    patterns = [p.strip().lower() for p in (extra or "").split(",") if p.strip()]
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def redacted(config: ShoalConfig) -> dict[str, Any]:
    """The configuration as plain data with secrets replaced by ``***``."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    for section in data.values():
        for name in _SECRET_FIELDS:
            if section.get(name) is not None:
                section[name] = "***"
    conf = data["spark"]["conf"]
    for key in conf:
        if secret_setting(key, config.spark.secret_conf):
            conf[key] = "***"
    return data


def secret_values(config: ShoalConfig) -> tuple[str, ...]:
    """Every secret value of ``config`` (the secret options, secret-looking Spark settings), for
    the logs to mask wherever one would appear (:func:`runtime.logs.configure`)."""
    values = [
        getattr(section, name)
        for section in (config.run, config.kafka, config.spanner, config.spark)
        for name in _SECRET_FIELDS
        if getattr(section, name, None)
    ]
    values += [
        v for k, v in config.spark.conf.items() if v and secret_setting(k, config.spark.secret_conf)
    ]
    if is_url(config.run.output_dir):  # the object store's credentials, from the environment
        from runtime.lake.store import Store

        values += Store.secret_values()
    return tuple(values)


# -- the reference ------------------------------------------------------------------------------


def reference_markdown() -> str:
    """``docs/configuration.md``: every option with its flag, variable, TOML key and default."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m actors.runtime config --reference` from actors/cli/config.py;",
        "     tests/shells/test_config.py fails when this file is out of date. Do not edit by hand. -->",
        "",
        "Every option can be given as a flag, an environment variable or a key of a TOML file",
        "(`--config PATH` or `SHOAL_CONFIG`). Precedence, highest first: **flags > environment",
        "variables > TOML file > defaults**. Top-level options are plain TOML keys; the others",
        "live in the table named by their section (`[kafka]`, `[spanner]`, ...). A bad value, an",
        "unknown key or variable, or an unreadable file stops the program with one message that",
        "names the option and where it came from, and exit code 2.",
        "",
        "Example `shoal.toml` for one production task:",
        "",
        "```toml",
        'connector = "orders"',
        'task_id = "orders-a"',
        'source = "spanner"',
        'sink = "spark"',
        "metrics_port = 9464",
        "",
        "[kafka]",
        'bootstrap_servers = "kafka-1:9093,kafka-2:9093"',
        'security_protocol = "SASL_SSL"',
        'sasl_mechanism = "SCRAM-SHA-512"',
        'sasl_username = "shoal"',
        "# sasl_password: set SHOAL_KAFKA_SASL_PASSWORD instead of writing it here",
        "session_timeout_ms = 10000",
        "replication_factor = 3",
        "",
        "[spanner]",
        'project = "my-project"',
        'instance = "prod"',
        'database = "orders"',
        'change_stream = "OrdersStream"',
        "",
        "[spark]",
        'master = "spark://spark-master:7077"',
        "",
        "[spark.conf]",
        '"spark.executor.memory" = "4g"',
        "```",
        "",
    ]
    for section, title in SECTION_TITLES.items():
        lines += [f"## {title}", "", "| option | flag / environment | type | default | meaning |"]
        lines.append("|---|---|---|---|---|")
        for o in options():
            if o.section != section:
                continue
            flag = "—" if o.kind == "table" else f"`{o.flag}`<br>`{o.env}`"
            default = "*unset*" if o.default is None else f"`{_show(o.default)}`"
            kind = o.kind.replace("|", "\\|")
            lines.append(f"| `{o.toml}` | {flag} | {kind} | {default} | {o.description} |")
        lines.append("")
    return "\n".join(lines)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)
