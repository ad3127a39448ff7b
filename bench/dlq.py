"""Benchmark: the Kafka output sink (docs/design.md#retry-and-dead-letter-queues) while 1% of keys fail for a while.

Two runs over the embedded broker in one process, same workload (records spread over many keys,
handed to the sink in batches like a change-stream reader does):

1. **baseline**: no failures;
2. **failing**: every delivery of 1% of the keys fails until the whole workload has been accepted
   (plus a margin); their records go to the RQ, retried with backoff, the oldest ones reach the
   DLQ and block their key. Then the keys heal, the DLQ is replayed and everything drains.

Each kind runs ``--repeat`` times, alternated; the best of each kind is kept.
Figures: ``healthy_ratio`` is the failing run's throughput of healthy-key records (records per
second until every batch is settled) over the baseline's; ``lost`` counts records of the
workload that are neither on the output topic nor in the DLQ at the end (read back from Kafka);
``order_violations`` counts records read back before an older record of the same key;
``duplicates`` records read back twice (at-least-once; 0 without crashes).

``--scale``: the output is a composite topic (its metadata topic, the producer session of the
switch barrier); half-way through each run, while records keep coming and others are parked in
the RQ, a storage topic of 3x the partitions is added and the produce pointer switched, and the
RQ/DLQ shard count goes to 3 (``output shards 3``: new RQ/DLQ storage topics of 9 and 3
partitions at a barrier, the held records fed to them, the old ones retired); the read-back goes
through the composite reader (each storage topic up to its seal, then the next). ``storage_topics``
reports how many storage topics the output had at the end, ``rq_fed`` the held records the feeds
copied, ``rq_shards`` the RQ/DLQ shard count at the end, and ``held_mismatch`` the records on
which the sink's own state and the RQ/DLQ storage topics the metadata names (the old ones retired
after the feed: what ``dlq list`` reads) disagree once the keys healed, before the DLQ replay.

``python -m bench dlq [--quick]``; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from protocol.output_meta import plan_add_storage_topic, plan_switch
from protocol.records import ColumnType, DataChange, Mod
from protocol.retry import RetryPolicy, from_log
from runtime.kafka import KafkaConfig
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.composite_reader import read_composite
from runtime.kafka.output_meta import MetaLog, MetaOptions, change_shards
from runtime.kafka.retry_queue import load_log, make_producer
from runtime.kafka.sink import (
    KafkaSink,
    KafkaSinkConfig,
    OutputRecord,
    decode_output,
    output_records,
    with_meta,
)
from runtime.kafka.topics import ensure_topic
from runtime.ports import SinkBatch

COLS = (
    ColumnType("id", '{"code":"INT64"}', True, 1),
    ColumnType("v", '{"code":"STRING"}', False, 2),
)
PARTITIONS = 8


def _workload(records: int, keys: int, seed: int) -> list[DataChange]:
    rng = random.Random(seed)
    out = []
    for n in range(records):
        k = rng.randrange(keys)
        out.append(
            DataChange(
                commit_ts=1_700_000_000_000_000 + n,
                record_sequence=f"{n:08d}",
                server_transaction_id=f"tx{n}",
                is_last_record_in_transaction_in_partition=True,
                table="Bench",
                column_types=COLS,
                mods=(
                    Mod(
                        keys=f'{{"id":"{k}"}}', new_values=f'{{"v":"{"x" * 200}"}}', old_values="{}"
                    ),
                ),
                mod_type="UPDATE",
            )
        )
    return out


def _key(rec: OutputRecord) -> int:
    return int(json.loads(rec.keys)["id"])


@dataclass
class RunResult:
    seconds: float
    healthy_records: int
    injected: int
    dlq_replayed: int
    lost: int
    order_violations: int
    duplicates: int
    storage_topics: int = 1
    rq_fed: int = 0
    rq_shards: int = 1
    held_mismatch: int = 0

    @property
    def healthy_per_s(self) -> float:
        return self.healthy_records / self.seconds


async def _read_back(
    config: KafkaConfig, topic: str, want: int, timeout_s: float
) -> list[OutputRecord]:
    consumer = AIOKafkaConsumer(
        **config.client_kwargs(),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=4 << 20,
    )
    await consumer.start()
    out: list[OutputRecord] = []
    seen: set[str] = set()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while time.monotonic() < deadline and (len(seen) < want or quiet < 2):
            batches = await consumer.getmany(timeout_ms=200, max_records=20_000)
            got = [decode_output(m.value) for msgs in batches.values() for m in msgs]
            quiet = quiet + 1 if not got else 0
            out.extend(got)
            seen.update(r.record_id for r in got)
    finally:
        await consumer.stop()
    return out


def _check(
    changes: list[DataChange], got: list[OutputRecord], dlq: set[str]
) -> tuple[int, int, int]:
    """(lost, order violations, duplicates) of ``got`` against the workload."""
    expected = [r for c in changes for r in output_records(c)]
    position = {r.record_id: i for i, r in enumerate(expected)}
    seen: set[str] = set()
    duplicates = 0
    violations = 0
    last: dict[int, int] = {}
    for r in got:
        if r.record_id in seen:
            duplicates += 1
            continue
        seen.add(r.record_id)
        k, pos = _key(r), position[r.record_id]
        if last.get(k, -1) > pos:
            violations += 1
        last[k] = max(last.get(k, -1), pos)
    lost = sum(1 for r in expected if r.record_id not in seen and r.record_id not in dlq)
    return lost, violations, duplicates


async def _run(
    config: KafkaConfig,
    changes: list[DataChange],
    failing: set[int],
    *,
    batch: int,
    label: str,
    shared: bool = False,
    scale: bool = False,
) -> RunResult:
    name = f"bench-dlq-{label}-{uuid.uuid4().hex[:8]}"
    policy = RetryPolicy(max_attempts=5, base_backoff=0.05, max_backoff=0.4, jitter=0.2)
    cfg = KafkaSinkConfig(
        name=name, partitions=PARTITIONS, rq_partitions=PARTITIONS, dlq_partitions=2, policy=policy
    )
    healed = asyncio.Event()

    def inject(rec: OutputRecord, attempts: int) -> str | None:
        if not healed.is_set() and _key(rec) in failing:
            return "bench: key unavailable"
        return None

    healthy = sum(1 for c in changes if _key(output_records(c)[0]) not in failing)
    driver = (lambda: True) if shared else None
    meta = MetaOptions(lease_ttl_s=3.0, margin_s=0.6, grace_s=0.5) if scale else None
    async with KafkaSink(
        config, cfg, inject=inject, driver=driver, takeover_grace_s=0.0, meta=meta
    ) as sink:
        if shared:
            await sink.prepare("bench")  # what a reader does first
        start = time.perf_counter()
        futures = []
        scaling: asyncio.Task[int] | None = None
        for i in range(0, len(changes), batch):
            # half-way (once a failing key is dead-lettered, so that records wait in the old
            # RQ/DLQ storage topics with no retry due: only the feed carries them over)
            due = i >= len(changes) // 2 and (not failing or sink.statistics().in_dlq > 0)
            if scale and scaling is None and due:
                scaling = asyncio.create_task(_scale(config, name))  # while records keep coming
            futures.append(
                await sink.put(SinkBatch("bench", tuple(changes[i : i + batch]), watermark=i))
            )
        await asyncio.gather(*futures)
        seconds = time.perf_counter() - start
        if scale and scaling is None:
            scaling = asyncio.create_task(_scale(config, name))
        fed = 0 if scaling is None else await scaling
        await asyncio.sleep(0.5)  # failing a while longer: retries and DLQ under way
        healed.set()
        async with asyncio.timeout(60):
            await sink.wait_idle()
        mismatch = 0
        if scale:  # what the RQ/DLQ hold, as 'dlq list' reads them (the storage topics the
            # metadata names: the old ones are retired after the feed), against the sink's own
            # state, before the replay: the DLQ records and the records parked behind them
            listed, _ = await with_meta(config, cfg)
            mine = {e.record_id for e in sink._core.durable_state()}
            mismatch = len(mine ^ await _held_in_topics(config, listed))
        replayed = sink.replay_dlq()
        async with asyncio.timeout(60):
            await sink.wait_idle()
        stats = sink.statistics()
        dlq = {d.record_id for d in sink.dlq_records()}
        storage_topics = len(sink.output.storage_topics)
        rq_shards = 1
        if scale:
            async with MetaLog(config, name) as meta_log:
                rq_shards = (await meta_log.load())[0].shards
    if scale:
        got = [
            decode_output(m.value)
            async for m in read_composite(config, name, idle_exit_s=2.0)
            if m.value is not None
        ]
    else:
        got = await _read_back(config, name, want=len(changes) - len(dlq), timeout_s=60)
    lost, violations, duplicates = _check(changes, got, dlq)
    print(
        f"{label:>9}: {len(changes)} records, {healthy} healthy, accepted in {seconds:.2f} s "
        f"({healthy / seconds:,.0f} healthy records/s); injected failures {stats.injected_failures}, "
        f"RQ writes {stats.rq_writes}, DLQ writes {stats.dlq_writes}, replayed {len(replayed)}; "
        f"read back {len(got)}: lost {lost}, order violations {violations}, duplicates {duplicates}"
        + (f"; RQ/DLQ fed {fed}, held mismatch {mismatch}" if scale else ""),
        file=sys.stderr,
    )
    return RunResult(
        seconds,
        healthy,
        stats.injected_failures,
        len(replayed),
        lost,
        violations,
        duplicates,
        storage_topics,
        fed,
        rq_shards,
        mismatch,
    )


async def _held_in_topics(config: KafkaConfig, sink: KafkaSinkConfig) -> set[str]:
    """The records the RQ/DLQ storage topics of ``sink`` hold (RQ or DLQ), folded from them."""
    producer = make_producer(config)
    await producer.start()
    try:
        q = sink.queue_config()
        loaded = await load_log(
            config, producer, q.read_partitions(), fetch_max_wait_ms=50, timeout_s=60
        )
    finally:
        await producer.stop()
    return {e.record_id for e in from_log(loaded.entries).durable_state()}


async def _scale(config: KafkaConfig, name: str) -> int:
    """``output add-storage-topic 3P``, ``output switch-produce`` (the sink's own session acks,
    commits and seals) and ``output shards 3``; returns how many held records the feed copied."""
    async with MetaLog(config, name) as meta:
        state, _ = await meta.load()
        plan = plan_add_storage_topic(state, 3 * state.composite().producing.partitions)
        await ensure_topic(config, plan.storage.name, partitions=plan.storage.partitions)
        await meta.append(plan.entry)
        state, _ = await meta.load()
        await meta.append(plan_switch(state, time.time()))
        done = await change_shards(config, meta, 3, grace_s=0.5, wait_s=60)
        return 0 if done.fed is None else len(done.fed.copies)


async def _main(args: argparse.Namespace) -> dict[str, object]:
    changes = _workload(args.records, args.keys, args.seed)
    rng = random.Random(args.seed + 1)
    failing = set(rng.sample(range(args.keys), max(1, args.keys // 100)))
    async with EmbeddedBroker() as broker:
        config = KafkaConfig.embedded(broker.bootstrap)
        await _run(
            config,
            changes[: args.records // 10],
            set(),
            batch=args.batch,
            label="warm-up",
            shared=args.shared,
            scale=args.scale,
        )
        bases: list[RunResult] = []
        fails: list[RunResult] = []
        for _ in range(args.repeat):  # alternated, so drift in the broker hits both alike
            bases.append(
                await _run(
                    config,
                    changes,
                    set(),
                    batch=args.batch,
                    label="baseline",
                    shared=args.shared,
                    scale=args.scale,
                )
            )
            fails.append(
                await _run(
                    config,
                    changes,
                    failing,
                    batch=args.batch,
                    label="failing",
                    shared=args.shared,
                    scale=args.scale,
                )
            )
    base = max(bases, key=lambda r: r.healthy_per_s)
    fail = max(fails, key=lambda r: r.healthy_per_s)
    runs = bases + fails
    return {
        "scenario": "dlq",
        "healthy_ratio": round(fail.healthy_per_s / base.healthy_per_s, 3),
        "lost": sum(r.lost for r in runs),
        "order_violations": sum(r.order_violations for r in runs),
        "duplicates": sum(r.duplicates for r in runs),
        "baseline_healthy_per_s": round(base.healthy_per_s),
        "failing_healthy_per_s": round(fail.healthy_per_s),
        "records": len(changes),
        "keys": args.keys,
        "failing_keys": len(failing),
        "injected_failures": fail.injected,
        "dlq_replayed": fail.dlq_replayed,
        "shared": args.shared,
        "scale": args.scale,
        "storage_topics": min(r.storage_topics for r in runs),
        "rq_shards": min(r.rq_shards for r in runs),
        "rq_fed": sum(r.rq_fed for r in runs),
        "rq_fed_failing_run": fail.rq_fed,
        "held_mismatch": sum(r.held_mismatch for r in runs),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench dlq", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer records; well under a minute")
    parser.add_argument("--records", type=int, default=None)
    parser.add_argument("--keys", type=int, default=None)
    parser.add_argument("--batch", type=int, default=500, help="records per SinkBatch")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument(
        "--shared",
        action="store_true",
        help="the RQ/DLQ as several processes share it (tailed all along, one driver)",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="half-way through each run: add a storage topic and switch the output to it, and "
        "change the RQ/DLQ shard count to 3 (new RQ/DLQ storage topics, held records fed)",
    )
    parser.add_argument("--repeat", type=int, default=None, help="runs of each kind (best kept)")
    args = parser.parse_args(argv)
    if args.records is None:
        args.records = 30_000 if args.quick else 200_000
    if args.keys is None:
        args.keys = 2_000 if args.quick else 10_000
    if args.repeat is None:
        args.repeat = 1 if args.quick else 2
    result = asyncio.run(_main(args))
    print(json.dumps(result))
    ok = result["lost"] == 0 and result["order_violations"] == 0 and result["held_mismatch"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
