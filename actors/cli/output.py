"""The ``output`` subcommand: scale the keyed Kafka output (``--sink kafka``) while it runs
(docs/operations.md, "Scaling the Kafka output"; rules: :mod:`protocol.output_meta`).

* ``output show [--json]``: storage topics (P, K, seal offsets), the produce pointer, a pending
  switch and whom it waits for, the producers' leases, the RQ/DLQ shard count and topics.
* ``output add-storage-topic N``: create storage topic ``<output>.<i>`` of N partitions (K by the
  routing rule; a warning when K falls to 1) and record it; the pointer does not move.
* ``output switch-produce``: prepare the switch to the next storage topic and wait until it is
  committed and the old storage topic sealed (the running producers do it; this command completes
  it too, e.g. when no producer runs).
* ``output shards N``: the RQ/DLQ shard count, changed at a barrier like a switch (running
  processes move their RQ/DLQ writes to the new layout together); new RQ/DLQ storage topics when N
  does not divide their partition counts, and the records held in the old ones are fed to the new
  ones. Interrupted, run it again: it resumes (waits for the pending change, or finishes the feed).
* ``output tail``: print the records in per-key order across storage topics, one JSON line each.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING, TextIO

import msgspec

from actors.cli.config import ConfigError, ShoalConfig, kafka_config
from protocol.output_meta import (
    MetaError,
    OutputMeta,
    SwitchCommitted,
    plan_add_storage_topic,
    plan_switch,
)

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

    from runtime.kafka import KafkaConfig
    from runtime.kafka.output_meta import MetaLog

ACTIONS = ("show", "add-storage-topic", "switch-produce", "shards", "tail")


def output_name(config: ShoalConfig) -> str:
    return config.kafka.output_topic or f"{config.run.connector}_output"


def _kafka(config: ShoalConfig) -> KafkaConfig:
    bootstrap = config.kafka.bootstrap_servers
    if bootstrap is None:
        raise ConfigError(
            "output needs the Kafka of the running connector: give --kafka-bootstrap-servers"
        )
    return kafka_config(config, bootstrap)


async def _load(meta: MetaLog) -> OutputMeta:
    state, _ = await meta.load()
    if not state.created:
        raise ConfigError(
            f"{meta.output!r} has no metadata topic {meta.topic!r} yet: start shoal with "
            "--sink kafka once (it creates the composite topic from --kafka-output-partitions)"
        )
    return state


def describe(state: OutputMeta, now: float, grace: float) -> dict[str, object]:
    out = state.composite()
    return {
        "name": out.name,
        "version": state.version,
        "produce_pointer": out.produce_pointer,
        "producing": out.producing.name,
        "storage_topics": [
            {
                "index": i,
                "name": st.name,
                "partitions": st.partitions,
                "k": st.k,
                "sealed_at": list(state.sealed[i]) if i in state.sealed else None,
            }
            for i, st in enumerate(out.storage_topics)
        ],
        "pending_switch": None
        if state.pending is None
        else {
            "target": state.pending.target,
            "acked": sorted(state.pending.acked),
            "waiting_for": state.waiting_for(now, grace),
        },
        "producers": {who: round(until - now, 1) for who, until in sorted(state.leases.items())},
        "shards": state.shards,
        "shards_pending": None
        if state.shards_pending is None
        else {
            "change": state.shards_pending.change,
            "shards": state.shards_pending.shards,
            "acked": sorted(state.shards_pending.acked),
            "waiting_for": state.shards_waiting_for(now, grace),
        },
        "unfed": state.unfed(),
        "rq": [[st.name, st.partitions] for st in state.rq().storage_topics],
        "dlq": [[st.name, st.partitions] for st in state.dlq().storage_topics],
        "ignored_entries": dict(state.ignored),
    }


def format_show(d: dict[str, object]) -> str:
    lines = [
        f"composite topic {d['name']!r}: version {d['version']}, producing to {d['producing']} "
        f"(pointer {d['produce_pointer']}), RQ/DLQ shards {d['shards']}"
    ]
    topics = d["storage_topics"]
    assert isinstance(topics, list)
    for st in topics:
        sealed = f"sealed at {st['sealed_at']}" if st["sealed_at"] is not None else ""
        mark = "*" if st["index"] == d["produce_pointer"] else " "
        lines.append(
            f" {mark} T{st['index']} {st['name']:<32} P={st['partitions']:<4} K={st['k']:<3} {sealed}"
        )
    pending = d["pending_switch"]
    if isinstance(pending, dict):
        lines.append(
            f"switch to T{pending['target']} pending: acked by {pending['acked'] or '-'}, "
            f"waiting for {pending['waiting_for'] or 'nobody (due)'}"
        )
    producers = d["producers"]
    assert isinstance(producers, dict)
    live = {k: v for k, v in producers.items() if v > 0}
    lines.append(
        f"producers with a lease: {', '.join(f'{k} ({v:g}s left)' for k, v in live.items()) or '-'}"
    )
    lines.append(f"RQ storage topics {d['rq']}, DLQ storage topics {d['dlq']}")
    return "\n".join(lines)


async def output(
    config: ShoalConfig,
    action: str,
    count: int | None,
    out: TextIO,
    *,
    as_json: bool = False,
    wait_s: float = 120.0,
    idle_exit_s: float | None = None,
) -> int:
    from runtime.kafka.output_meta import MetaLog, MetaOptions, change_shards
    from runtime.kafka.retry_queue import make_producer
    from runtime.kafka.topics import ensure_topic

    kafka = _kafka(config)
    name = output_name(config)
    grace = MetaOptions().grace_s
    if action in ("add-storage-topic", "shards") and count is None:
        raise ConfigError(f"output {action} needs a number (e.g. output {action} 12)")
    if action == "tail":
        return await _tail(kafka, name, out, idle_exit_s)
    async with MetaLog(kafka, name) as meta:
        state = await _load(meta)
        try:
            match action:
                case "show":
                    d = describe(state, time.time(), grace)
                    text = msgspec.json.encode(d).decode() if as_json else format_show(d)
                    out.write(text + "\n")
                case "add-storage-topic":
                    assert count is not None
                    plan = plan_add_storage_topic(state, count)
                    if plan.warning is not None:
                        sys.stderr.write(f"shoal: warning: {plan.warning}\n")
                    await ensure_topic(kafka, plan.storage.name, partitions=plan.storage.partitions)
                    await meta.append(plan.entry)
                    out.write(
                        f"added storage topic {plan.storage.name} (P={plan.storage.partitions}, "
                        f"K={plan.storage.k}); run 'output switch-produce' to produce to it\n"
                    )
                case "shards":
                    assert count is not None
                    try:
                        done = await change_shards(kafka, meta, count, grace_s=grace, wait_s=wait_s)
                    except TimeoutError:
                        state = await _load(meta)
                        raise ConfigError(
                            f"the shard-count change did not commit within {wait_s:g}s: waiting "
                            f"for {state.shards_waiting_for(time.time(), grace)} (it commits when "
                            "they ack or their leases run out; run the command again to go on)"
                        ) from None
                    fed = (
                        "nothing to feed"
                        if done.fed is None
                        else (
                            f"fed {len(done.fed.copies)} held record(s) from the old storage topics "
                            f"({done.fed.present} were there already)"
                        )
                    )
                    out.write(
                        f"RQ/DLQ shard count {done.shards}: RQ {done.rq}, DLQ {done.dlq}; {fed}\n"
                    )
                case "switch-produce":
                    prep = plan_switch(state, time.time())
                    await meta.append(prep)
                    out.write(f"switch to {state.composite().storage_topics[prep.target].name} ")
                    out.write("prepared; waiting for the producers' acknowledgements\n")
                    out.flush()
                    producer = make_producer(kafka)
                    await producer.start()
                    try:
                        async with asyncio.timeout(wait_s):
                            state = await _complete(kafka, meta, prep.target, grace, producer)
                    except TimeoutError:
                        state = await _load(meta)
                        raise ConfigError(
                            f"the switch did not complete within {wait_s:g}s: waiting for "
                            f"{state.waiting_for(time.time(), grace)} (it completes when they "
                            "ack or their leases run out; 'output show' tells)"
                        ) from None
                    finally:
                        await producer.stop()
                    out.write(
                        f"producing to {state.composite().producing.name}; "
                        f"{state.composite().storage_topics[prep.target - 1].name} sealed at "
                        f"{list(state.sealed[prep.target - 1])}\n"
                    )
                case _:
                    raise ConfigError(f"unknown output action {action!r}")
        except MetaError as exc:
            raise ConfigError(f"output {action}: {exc}") from exc
    return 0


async def _complete(
    kafka: KafkaConfig, meta: MetaLog, target: int, grace: float, producer: AIOKafkaProducer
) -> OutputMeta:
    """Wait until the switch to ``target`` is committed and sealed; commit or seal it from here
    when it is due and nobody did yet (no producer runs, or they died)."""
    from runtime.kafka.output_meta import seal as seal_fn

    while True:
        state = await _load(meta)
        out = state.composite()
        if out.produce_pointer >= target and (target - 1) in state.sealed:
            return state
        if state.pending is not None and state.switch_due(time.time(), grace):
            await meta.append(SwitchCommitted(state.pending.target))
            continue
        if out.produce_pointer >= target and (target - 1) not in state.sealed:
            await asyncio.sleep(1.0)  # a producer seals it; if none does, this does
            state = await _load(meta)
            if (target - 1) not in state.sealed:
                await seal_fn(kafka, meta, state, target - 1, producer)
            continue
        await asyncio.sleep(0.2)


async def _tail(kafka: KafkaConfig, name: str, out: TextIO, idle_exit_s: float | None) -> int:
    from runtime.kafka.composite_reader import read_composite

    reader = read_composite(kafka, name, idle_exit_s=idle_exit_s)
    try:
        async for m in reader:
            line = {
                "storage": m.storage_index,
                "topic": m.topic,
                "partition": m.partition,
                "offset": m.offset,
                "record_id": m.record_id,
                "value": m.value.decode() if m.value is not None else None,
            }
            out.write(msgspec.json.encode(line).decode() + "\n")
            out.flush()
    finally:
        await reader.aclose()
    return 0
