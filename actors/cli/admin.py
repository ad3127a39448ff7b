"""The ``status``, ``quarantine`` and ``dlq`` subcommands: read-only views of a running
connector, the partitions its quarantine rule parked (and their release), and the dead-letter
queue of the Kafka output sink or of the Spark bridge (``--spark-dead-letter``).

``quarantine list`` shows the quarantined partitions the sync topic records (owner, watermark,
error, record); ``quarantine release TOKEN`` appends a ``release`` message naming the partition
and its quarantine (``protocol/messages.py``, ``ReleaseMessage``): the owner applies it, reading
the partition again from exactly its watermark (a task changes only its own state).

``status`` replays the connector's sync topic (from its latest checkpoint) into a CIM, exactly
as a joining task does, and prints the epoch, the leader, every task with its partitions, and
every partition with its owner, status, watermark and lag (now minus watermark). It appends one
marker message to the sync topic (that is how it knows it has read everything) and writes
nothing else.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import os
import time
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from actors.cli.config import ConfigError, ShoalConfig, kafka_config
from protocol import messages
from protocol.cim import Cim
from protocol.completeness import held_by, low_watermark
from protocol.messages import Partition

if TYPE_CHECKING:
    from runtime.kafka import KafkaConfig
    from runtime.kafka.sink import KafkaSinkConfig
    from runtime.spark.config import SparkConfig
    from runtime.spark.dead_letter import DeadLetterConfig


def _need_kafka(config: ShoalConfig, command: str) -> str:
    bootstrap = config.kafka.bootstrap_servers
    if bootstrap is None:
        raise ConfigError(
            f"{command} needs a Kafka to read: give --kafka-bootstrap-servers "
            "(the embedded broker keeps nothing once its process ends)"
        )
    return bootstrap


def _when(micros: int) -> str:
    if micros <= 0:
        return "-"
    when = _dt.datetime.fromtimestamp(micros / 1e6, tz=_dt.UTC)
    return when.strftime("%H:%M:%S.%f")[:-3]


def _rfc3339(micros: int) -> str:
    """A commit time in microseconds as RFC 3339 (UTC, microsecond precision)."""
    moment = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC) + _dt.timedelta(microseconds=micros)
    return moment.isoformat().replace("+00:00", "Z")


def _lag(now: int, watermark: int) -> str:
    if watermark <= 0:
        return "-"
    return f"{max(0, now - watermark) / 1e6:.1f}s"


async def replay_cim(
    config: ShoalConfig, *, timeout_s: float = 60.0, command: str = "status"
) -> Cim:
    from runtime.kafka import KafkaSyncLog, replay_until_marker

    kafka = kafka_config(config, _need_kafka(config, command))
    cim = Cim()
    bad = 0

    def apply(offset: int, payload: bytes) -> None:
        nonlocal bad
        try:
            cim.apply(offset, messages.decode(payload))
        except messages.SyncDecodeError:
            bad += 1

    # create=False: a mistyped --connector must not leave a sync topic (with a later real
    # start's replication factor ignored) behind; it is reported as no such connector
    async with KafkaSyncLog(kafka, config.run.connector, create=False) as log:
        start = await log.checkpoint_offset()
        await replay_until_marker(
            log,
            start or 0,
            task_id=f"status-{os.getpid()}",
            on_message=apply,
            timeout_s=timeout_s,
        )
    cim.ignored["undecodable"] += bad
    return cim


TOKEN_WIDTH = 28  # the partition column of the status table


def short_token(token: str, width: int = TOKEN_WIDTH) -> str:
    """``token`` as the status table shows it: whole when it fits in ``width``, else its first
    characters, ``~`` and 8 hex digits of its SHA-256, so two tokens with the same beginning (real
    Spanner tokens are 200+ characters and share long prefixes) stay apart, and the same token
    always looks the same. ``status --wide`` and ``--json`` show whole tokens."""
    if len(token) <= width:
        return token
    digest = hashlib.sha256(token.encode()).hexdigest()[:8]
    return f"{token[: width - 9]}~{digest}"


def format_status(
    connector: str,
    cim: Cim,
    now: int,
    *,
    wide: bool = False,
    stalled_after_s: float = float("inf"),
) -> str:
    """The status table. An owned partition whose committed watermark is older than
    ``stalled_after_s`` (``health.failing_s``) is marked ``STALLED`` and a closing line says
    what that usually means: its owner's sink fails every batch or its source every query."""
    lines = [
        f"connector {connector!r}: epoch {cim.epoch}, leader {cim.leader or '-'}, "
        f"{len(cim.members)} member(s), sync offset {cim.offset}"
    ]
    if cim.epoch < 0:
        lines.append("  no epoch yet: no task has joined (or the sync topic is new)")
    complete = low_watermark(cim)
    if complete is not None:
        lines.append(  # every change committed by then is in the output
            f"complete up to {_rfc3339(complete)} ({max(0, now - complete) / 1e6:.1f}s behind)"
        )
    held = held_by(cim)
    if held:
        lines.append(
            f"HELD BACK by {len(held)} quarantined partition(s) (their reader kept failing; "
            "`quarantine list` shows why, `quarantine release TOKEN` reads them again): "
            + ", ".join(held if wide else [short_token(t) for t in held])
        )
    if cim.snapshot.plan is not None:
        done, total = cim.snapshot.progress()
        lines.append(
            f"snapshot at {_rfc3339(cim.snapshot.read_ts)}: {done}/{total} partitions done"
            + ("" if done < total else " (complete)")
        )
    lines.append("")
    lines.append(
        f"{'task':<24} {'member':>6} {'owned':>6} {'finished':>8} {'offers':>6} {'max lag':>8}"
    )
    for task_id in sorted(set(cim.tasks) | set(cim.members)):
        view = cim.tasks.get(task_id)
        parts = view.partitions if view is not None else {}
        owned = [p for p in parts.values() if p.status == "owned"]
        finished = sum(1 for p in parts.values() if p.status == "finished")
        offers = len(view.share) if view is not None else 0
        lag = max((now - max(p.watermark, p.start_ts) for p in owned), default=0)
        leader = "*" if task_id == cim.leader else ""
        lines.append(
            f"{task_id + leader:<24} {'yes' if task_id in cim.members else 'no':>6} "
            f"{len(owned):>6} {finished:>8} {offers:>6} {lag / 1e6 if owned else 0:>7.1f}s"
        )
    lines.append("")
    tokens = [t for view in cim.tasks.values() for t in (*view.partitions, *view.share)]
    width = max((len(t) for t in tokens), default=TOKEN_WIDTH) if wide else TOKEN_WIDTH
    width = max(width, len("partition"))

    def shown_token(token: str) -> str:
        return token if wide else short_token(token)

    lines.append(f"{'partition':<{width}} {'owner':<24} {'status':<9} {'watermark':>12} {'lag':>8}")
    stalled: dict[str, int] = {}
    for task_id, view in sorted(cim.tasks.items()):
        for token, p in sorted(view.partitions.items()):
            shown = _lag(now, p.watermark) if p.status == "owned" else "-"
            if p.quarantine is not None:
                shown += " QUARANTINED"
            late = p.status == "owned" and p.watermark > 0
            if late and (now - p.watermark) / 1e6 > stalled_after_s:
                stalled[task_id] = stalled.get(task_id, 0) + 1
                shown += " STALLED"
            lines.append(
                f"{shown_token(token):<{width}} {task_id:<24} {p.status:<9} "
                f"{_when(p.watermark):>12} {shown:>8}"
            )
        for token, offer in sorted(view.share.items()):
            target = offer.target or "(parked)"
            lines.append(
                f"{shown_token(token):<{width}} {task_id + ' -> ' + target:<24} "
                f"{'offer:' + offer.kind:<9} {_when(offer.partition.watermark):>12} {'-':>8}"
            )
    if stalled:
        owners = ", ".join(f"{task} ({n})" for task, n in sorted(stalled.items()))
        lines += [
            "",
            f"NOT MAKING PROGRESS: partitions not advanced for over {stalled_after_s:.0f}s "
            f"(health.failing_s) owned by {owners}:",
            "  the owner's sink fails every batch or its source every query (its /healthz and",
            "  progress display say which), or it is stuck (docs/operations.md, Metrics and health)",
        ]
    return "\n".join(lines)


OPTIONS_TIMEOUT_S = 30.0  # status and config give up asking the stream's options after this


async def change_stream_options(config: ShoalConfig) -> dict[str, Any] | None:
    """With ``--source spanner`` and the database named: the change stream's own options
    (``protocol/stream_options.py``), read once, as ``{"change_stream", "options"}`` (options
    None: the database has no such stream) or ``{"change_stream", "error"}``; None otherwise
    (the simulator and the emulator source have no stream to ask before a run)."""
    s = config.spanner
    if config.run.source != "spanner" or not (
        s.project and s.instance and s.database and s.change_stream
    ):
        return None
    from runtime.spanner.config import SpannerConfig
    from runtime.spanner.reader import SpannerSource

    spanner = SpannerConfig(
        project=s.project,
        instance=s.instance,
        database=s.database,
        change_stream=s.change_stream,
        credentials_file=s.credentials_file,
        emulator_host=s.emulator_host,
        database_role=s.database_role,
    )
    try:
        async with asyncio.timeout(OPTIONS_TIMEOUT_S):  # an unreachable database: say so
            async with await SpannerSource.connect(spanner) as source:
                await source.detect_dialect(s.database)
                options = await source.stream_options()
    except Exception as exc:  # shown, not swallowed: status and config still print the rest
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return {"change_stream": s.change_stream, "error": text}
    return {
        "change_stream": s.change_stream,
        "options": None if options is None else msgspec.to_builtins(options),
    }


def format_stream_options(found: dict[str, Any]) -> str:
    """The one line ``status`` prints for :func:`change_stream_options`."""
    from protocol.stream_options import StreamOptions

    name = found["change_stream"]
    if "error" in found:
        return f"change stream {name}: options not read ({found['error']})"
    if found["options"] is None:
        return f"change stream {name}: no such change stream in the database"
    options = msgspec.convert(found["options"], StreamOptions)
    return f"change stream {name}: {options.describe()}"


async def status(
    config: ShoalConfig, out: TextIO, *, as_json: bool = False, wide: bool = False
) -> int:
    from actors.task import wall_micros

    cim = await replay_cim(config)
    stream = await change_stream_options(config)
    if as_json:
        data = {
            "connector": config.run.connector,
            "change_stream_options": stream,
            "epoch": cim.epoch,
            "leader": cim.leader,
            "members": list(cim.members),
            "offset": cim.offset,
            "low_watermark_us": low_watermark(cim),
            "held_by": list(held_by(cim)),
            "snapshot": None
            if cim.snapshot.plan is None
            else {
                "read_ts_us": cim.snapshot.read_ts,
                "done": cim.snapshot.progress()[0],
                "total": cim.snapshot.progress()[1],
            },
            "tasks": {
                task_id: {
                    "partitions": {t: msgspec.to_builtins(p) for t, p in view.partitions.items()},
                    "share": {t: msgspec.to_builtins(s) for t, s in view.share.items()},
                }
                for task_id, view in cim.tasks.items()
            },
        }
        out.write(msgspec.json.encode(data).decode() + "\n")
    else:
        text = format_status(
            config.run.connector,
            cim,
            wall_micros(),
            wide=wide,
            stalled_after_s=config.health.failing_s,
        )
        if stream is not None:
            text = format_stream_options(stream) + "\n" + text
        out.write(text + "\n")
    return 0


def quarantined(cim: Cim) -> list[tuple[str, Partition]]:
    """The quarantined partitions ``cim`` records, as (holder, partition), by token: owned, or
    in an offer on their way to a new owner (the quarantine travels with them)."""
    found: dict[str, tuple[str, Partition]] = {}
    for task_id, view in sorted(cim.tasks.items()):
        candidates = [*view.partitions.values(), *(s.partition for s in view.share.values())]
        for part in candidates:
            if part.quarantine is not None and part.status != "incoming":
                found.setdefault(part.token, (task_id, part))
    return [found[t] for t in sorted(found)]


async def quarantine(
    config: ShoalConfig, action: str, tokens: list[str], out: TextIO, *, as_json: bool = False
) -> int:
    """``quarantine list``: the quarantined partitions; ``quarantine release TOKEN ...``: ask
    their owners to read them again (a ``release`` message in the sync topic per partition)."""
    cim = await replay_cim(config, command="quarantine")
    parked = quarantined(cim)
    if action == "list":
        if as_json:
            rows = [
                {
                    "token": p.token,
                    "owner": holder,
                    "watermark_us": p.watermark,
                    **msgspec.to_builtins(p.quarantine),
                }
                for holder, p in parked
            ]
            out.write(msgspec.json.encode(rows).decode() + "\n")
            return 0
        out.write(f"{len(parked)} quarantined partition(s) of connector {config.run.connector!r}\n")
        for holder, p in parked:
            q = p.quarantine
            assert q is not None
            out.write(
                f"{p.token}  owner={holder}  watermark={p.watermark} ({_rfc3339(p.watermark)})  "
                f"failures={q.failures}  since={_when(q.since)}  record={q.record or '-'}  "
                f"error={q.error}\n"
            )
        return 0
    if not tokens:
        raise ConfigError("quarantine release needs the token of each partition to release")
    by_token = {p.token: p for _, p in parked}
    unknown = [t for t in tokens if t not in by_token]
    if unknown:
        raise ConfigError(
            f"quarantine release: not quarantined: {', '.join(unknown)} "
            f"(quarantine list shows the {len(by_token)} that are)"
        )
    from runtime.kafka import KafkaSyncLog

    kafka = kafka_config(config, _need_kafka(config, "quarantine"))
    async with KafkaSyncLog(kafka, config.run.connector, create=False) as log:
        for token in tokens:
            q = by_token[token].quarantine
            assert q is not None
            message = messages.ReleaseMessage(
                task_id=f"quarantine-{os.getpid()}",
                message_timestamp=time.time_ns() // 1000,
                token=token,
                since=q.since,
            )
            offset = await log.append(messages.encode(message))
            out.write(
                f"released {token} (quarantined since {_when(q.since)}, watermark "
                f"{by_token[token].watermark}): release message at offset {offset}; its owner "
                "reads it from the watermark\n"
            )
    return 0


async def dlq(
    config: ShoalConfig,
    action: str,
    ids: list[str],
    out: TextIO,
    *,
    spark: Any = None,
    via_leader: bool = False,
) -> int:
    """``dlq list|replay``: the dead-letter queue of the sink ``--sink`` names (the same options
    as the run): the Kafka output sink's, or the Spark bridge's (``--spark-dead-letter``).
    Replay delivers through a sink over the same topics (for Spark: a bridge, on ``spark`` if
    given, else a session it starts), so the shoal processes must be stopped meanwhile; with
    ``via_leader`` it hands the records to the running processes' leader instead."""
    kafka = kafka_config(config, _need_kafka(config, "dlq"))
    if config.run.sink == "files":
        raise ConfigError(
            "dlq: --sink files has no dead-letter queue "
            "(--sink kafka, or --sink spark with --spark-dead-letter, have one)"
        )
    if action == "replay" and via_leader:
        return await _replay_via_leader(config, kafka, ids, out)
    if config.run.sink == "kafka":
        return await _kafka_dlq(config, kafka, action, ids, out)
    return await _spark_dlq(config, kafka, action, ids, out, spark)


async def _kafka_sink_config(
    config: ShoalConfig, kafka: KafkaConfig
) -> tuple[KafkaSinkConfig, bool]:
    """The Kafka sink's settings with the RQ/DLQ storage topics its metadata topic names (all
    that readers read: after ``output shards N``, the new ones and the old ones until they are
    fed), and whether the output has that metadata topic."""
    from runtime.kafka.sink import KafkaSinkConfig, with_meta

    name = config.kafka.output_topic or f"{config.run.connector}_output"
    return await with_meta(
        kafka, KafkaSinkConfig(name=name, partitions=config.kafka.output_partitions)
    )


def _spark_settings(
    config: ShoalConfig, kafka: KafkaConfig
) -> tuple[SparkConfig, DeadLetterConfig]:
    from actors.cli.sinks import spark_config

    if not config.spark.dead_letter:
        raise ConfigError(
            "dlq: the Spark bridge's dead-letter queue is off: give --spark-dead-letter (and "
            "--spark-dead-letter-topic, as the run did), or --sink kafka for the Kafka sink's"
        )
    settings = spark_config(config, kafka)
    assert settings.dead_letter is not None
    return settings, settings.dead_letter


async def _kafka_dlq(
    config: ShoalConfig, kafka: KafkaConfig, action: str, ids: list[str], out: TextIO
) -> int:
    from runtime.kafka.output_meta import MetaOptions
    from runtime.kafka.sink import list_dlq, replay_dlq

    sink, has_meta = await _kafka_sink_config(config, kafka)
    name = sink.name
    if action == "list":
        records = await list_dlq(kafka, sink)
        _print_dlq(out, name, [(r.record_id, r.key, r.attempts, r.error) for r in records])
        return 0
    # with the metadata topic, the replaying sink takes part in its barriers (a lease, writes
    # held during a shard-count change), as a shoal process does
    meta = (
        MetaOptions(
            lease_ttl_s=config.kafka.output_lease_s, margin_s=config.kafka.output_lease_s / 5
        )
        if has_meta
        else None
    )
    replayed = await replay_dlq(kafka, sink, ids or None, meta=meta)
    out.write(f"replayed {len(replayed)} record(s) from the DLQ of {name!r}\n")
    return 0


async def _spark_dlq(
    config: ShoalConfig, kafka: KafkaConfig, action: str, ids: list[str], out: TextIO, spark: Any
) -> int:
    from runtime.spark import operations

    settings, letters = _spark_settings(config, kafka)
    name = letters.name
    if action == "list":
        records = await operations.list_dlq(letters)
        _print_dlq(out, name, [(r.record_id, r.key, r.attempts, r.error) for r in records])
        return 0
    replayed = await operations.replay_dlq(settings, ids or None, spark=spark)
    out.write(f"replayed {len(replayed)} record(s) from the DLQ of {name!r}\n")
    return 0


async def _replay_via_leader(
    config: ShoalConfig, kafka: KafkaConfig, ids: list[str], out: TextIO
) -> int:
    from runtime.kafka.output_meta import MetaOptions, meta_session
    from runtime.kafka.retry_queue import replay_via_driver

    if config.run.sink == "kafka":
        sink, has_meta = await _kafka_sink_config(config, kafka)
        name, queue = sink.name, sink.queue_config()
        if has_meta:  # its RQ writes take part in the shard-count barrier
            lease = config.kafka.output_lease_s
            async with meta_session(
                kafka, name, MetaOptions(lease_ttl_s=lease, margin_s=lease / 5)
            ) as session:
                st = session.state if session is not None else None
                if st is not None:
                    sink = msgspec.structs.replace(sink, rq=st.rq(), dlq=st.dlq())
                    queue = sink.queue_config()
                replayed = await replay_via_driver(kafka, queue, ids or None, gate=session)
            out.write(
                f"replayed {len(replayed)} record(s) from the DLQ of {name!r} via the leader\n"
            )
            return 0
    else:  # "spark" (dlq() refused "files")
        _, letters = _spark_settings(config, kafka)
        name, queue = letters.name, letters.queue_config()
    replayed = await replay_via_driver(kafka, queue, ids or None)
    out.write(f"replayed {len(replayed)} record(s) from the DLQ of {name!r} via the leader\n")
    return 0


def _print_dlq(out: TextIO, name: str, records: list[tuple[str, str, int, str]]) -> None:
    out.write(f"{len(records)} record(s) in the DLQ of {name!r}\n")
    for record_id, key, attempts, error in records:
        out.write(f"{record_id}  key={key}  attempts={attempts}  error={error}\n")
