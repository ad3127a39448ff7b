"""The Kafka output sink (``runtime.kafka.sink``) against the embedded broker: failing keys do not
hold up the others, per-key commit order, every record delivered or dead-lettered exactly once,
a killed sink's RQ resumed by a new one, DLQ list and replay."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys

import msgspec
import pytest

from protocol.records import DataChange, Mod
from protocol.retry import RetryPolicy
from protocol.routing import key_hash, router, shard_of_partition
from runtime.kafka import KafkaConfig
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.sink import (
    KafkaSink,
    KafkaSinkConfig,
    OutputRecord,
    decode_output,
    list_dlq,
    output_records,
    replay_dlq,
)
from runtime.ports import Sink, SinkBatch
from tests.fixtures.kafka import connector, kafka_broker, kafka_config
from tests.fixtures.kafka_sink import (
    change,
    expected_ids,
    failing,
    key_of,
    kname,
    put_all,
    read_output,
    workload,
)
from tests.helpers import REPO, assert_catches_a_double, assert_no_row_twice

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name

FAST = RetryPolicy(max_attempts=4, base_backoff=0.02, max_backoff=0.1, jitter=0.2)


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_failing_keys_do_not_stop_others_and_order_is_kept(
    kafka_config: KafkaConfig, connector: str
) -> None:
    cfg = KafkaSinkConfig(
        name=connector, partitions=4, rq_partitions=2, dlq_partitions=2, policy=FAST
    )
    broken = {3}
    changes = workload(keys=40, per_key=10)
    want = expected_ids(changes)
    inject_broken = failing(broken)

    def inject(rec: OutputRecord, attempts: int) -> str | None:
        if key_of(rec) == 17 and attempts < 2:  # flaky: delivered on the third try
            return "flaky"
        return inject_broken(rec, attempts)

    async with KafkaSink(kafka_config, cfg, inject=inject) as sink:
        await put_all(sink, changes)
        async with asyncio.timeout(20):
            await sink.wait_idle()
        stats = sink.statistics()
        assert stats.in_dlq == 1
        (dead,) = sink.dlq_records()
        assert dead.record_id == want[3][0]
        assert dead.attempts == 4
        assert dead.error == "injected failure for key 3"
        assert dead.record is not None
        assert key_of(dead.record) == 3
        # key 3 is blocked: its later records are parked in the RQ in order
        assert stats.held == 10

        got = await read_output(kafka_config, connector, 4, want=390)
        ids = [r.record_id for _, r in got]
        assert len(ids) == 390
        assert_no_row_twice(ids, "records")
        assert_catches_a_double(assert_no_row_twice, ids)  # the check sees a doubled record
        for k in range(40):
            mine = [(p, r) for p, r in got if key_of(r) == k]
            if k == 3:
                assert mine == []
                continue
            assert [r.record_id for _, r in mine] == want[k], f"key {k} out of order"
            # routed by the design-003 router (one storage topic, K=1)
            parts = {p for p, _ in mine}
            assert parts == {router(key_hash("T", json.dumps({"id": str(k)})), 4, 1)}

        listed = await list_dlq(kafka_config, cfg)
        assert [d.record_id for d in listed] == [dead.record_id]

        # the key heals; replaying the DLQ delivers key 3 in order
        broken.clear()
        assert sink.replay_dlq() == [dead.record_id]
        async with asyncio.timeout(20):
            await sink.wait_idle()
        assert sink.statistics().held == 0
        got = await read_output(kafka_config, connector, 4, want=400)
        ids = [r.record_id for _, r in got]
        assert len(ids) == 400
        assert_no_row_twice(ids, "records")
        assert_catches_a_double(assert_no_row_twice, ids)
        assert [r.record_id for _, r in got if key_of(r) == 3] == want[3]
    assert await list_dlq(kafka_config, cfg) == []


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_release_mode_lets_a_dead_lettered_key_flow(
    kafka_config: KafkaConfig, connector: str
) -> None:
    policy = RetryPolicy(max_attempts=2, base_backoff=0.01, max_backoff=0.02, dlq_blocks=False)
    cfg = KafkaSinkConfig(
        name=connector, partitions=2, rq_partitions=2, dlq_partitions=1, policy=policy
    )
    changes = workload(keys=5, per_key=4)
    want = expected_ids(changes)
    first = want[2][0]

    def inject(rec: OutputRecord, attempts: int) -> str | None:
        return "poison" if rec.record_id == first else None

    async with KafkaSink(kafka_config, cfg, inject=inject) as sink:
        await put_all(sink, changes, batch=3)
        async with asyncio.timeout(20):
            await sink.wait_idle()
        assert [d.record_id for d in sink.dlq_records()] == [first]
        assert sink.statistics().held == 1
    got = await read_output(kafka_config, connector, 2, want=19)
    assert [r.record_id for _, r in got if key_of(r) == 2] == want[2][1:]
    assert len(got) == 19
    # the helper (a CLI subcommand) replays it with no sink running
    assert await replay_dlq(kafka_config, cfg, timeout_s=20) == [first]
    assert await list_dlq(kafka_config, cfg) == []
    got = await read_output(kafka_config, connector, 2, want=20)
    assert len(got) == 20
    assert [r.record_id for _, r in got if key_of(r) == 2][-1] == first


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_a_killed_sink_loses_nothing_from_its_rq(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """A sink aborted with keys parked in its RQ: a new sink resumes them from the RQ topic and
    delivers every record, each key in commit order. This checks loss and order only: the keyed
    Kafka output is at least once across a sink's death (docs/operations.md says why), so the
    output is read by each record's first delivery."""
    slow = RetryPolicy(max_attempts=50, base_backoff=0.3, max_backoff=0.5, jitter=0.1)
    cfg = KafkaSinkConfig(
        name=connector, partitions=3, rq_partitions=3, dlq_partitions=3, policy=slow
    )
    changes = workload(keys=12, per_key=6)
    want = expected_ids(changes)
    async with KafkaSink(kafka_config, cfg, inject=failing({1, 5})) as first:
        await put_all(first, changes, batch=10)  # settled: delivered, or durably in the RQ
        assert first.statistics().unsettled == 0
        for k in (1, 5):
            g = first._core.group_state(kname(k))
            assert len(g.rq) == 6, g
        await first.abort()

    async with KafkaSink(kafka_config, cfg) as second:
        assert second.statistics().held == 12  # resumed from the RQ topic
        async with asyncio.timeout(20):
            await second.wait_idle()
        assert second.statistics().held == 0
    got = await read_output(kafka_config, connector, 3, want=72)
    firsts: dict[str, int] = {}
    for i, (_, r) in enumerate(got):
        firsts.setdefault(r.record_id, i)
    for k, ids in want.items():
        assert sorted(ids, key=lambda rid: firsts[rid]) == ids, f"key {k} out of order"
    assert set(firsts) == {rid for ids in want.values() for rid in ids}, "records lost"


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_redelivered_records_held_in_the_rq_settle_at_once(
    kafka_config: KafkaConfig, connector: str
) -> None:
    slow = RetryPolicy(max_attempts=50, base_backoff=5.0, max_backoff=5.0)
    cfg = KafkaSinkConfig(
        name=connector, partitions=1, rq_partitions=1, dlq_partitions=1, policy=slow
    )
    changes = workload(keys=2, per_key=3)
    async with KafkaSink(kafka_config, cfg, inject=failing({0})) as sink:
        await put_all(sink, changes)
        await sink.abort()
    async with KafkaSink(kafka_config, cfg, inject=failing({0})) as sink:
        # upstream re-delivers from its watermark: the RQ copies count, nothing is parked twice
        before = sink.statistics()
        await put_all(sink, [c for c in changes if key_of(output_records(c)[0]) == 0])
        after = sink.statistics()
        assert after.held == before.held == 3
        assert after.rq_writes == before.rq_writes


# -- sharding (RQ/DLQ are shard consistent with the output topic) ---------------------


@pytest.mark.parametrize(
    ("partitions", "rq", "dlq", "shards"),
    [(4, 8, 4, 2), (4, 8, 4, 4), (6, 12, 6, 3), (12, 24, 12, 6), (2, 10, 2, 2)],
)
def test_rq_and_dlq_partitions_stay_in_the_keys_shard(
    partitions: int, rq: int, dlq: int, shards: int
) -> None:
    cfg = KafkaSinkConfig(name="o", partitions=partitions, rq_partitions=rq, dlq_partitions=dlq)
    out, rqt, dlqt = cfg.output_topic(), cfg.rq_topic(), cfg.dlq_topic()
    assert rqt.storage_topics[0].k == rq // partitions
    for k in range(500):
        h = key_hash("T", json.dumps({"id": str(k)}))
        owners = {
            shard_of_partition(t.route(h)[1], t.producing.partitions, shards)
            for t in (out, rqt, dlqt)
        }
        assert len(owners) == 1
        sid = owners.pop()
        for other in range(shards):
            shard = KafkaSinkConfig(
                name="o",
                partitions=partitions,
                rq_partitions=rq,
                dlq_partitions=dlq,
                shard_id=other,
                shard_count=shards,
            )
            assert shard.owns(kname(k)) == (other == sid)


def test_sink_config_checks_the_seed_rules() -> None:
    with pytest.raises(ValueError, match="must divide the rq_partitions"):
        KafkaSinkConfig(name="o", partitions=4, rq_partitions=6, shard_count=4)
    with pytest.raises(ValueError, match="must divide the output base"):
        KafkaSinkConfig(name="o", partitions=6, rq_partitions=12, dlq_partitions=12, shard_count=4)
    with pytest.raises(ValueError, match="out of range"):
        KafkaSinkConfig(name="o", shard_id=2, shard_count=2)


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_each_shard_resumes_only_its_own_rq(
    kafka_config: KafkaConfig, connector: str
) -> None:
    slow = RetryPolicy(max_attempts=50, base_backoff=5.0, max_backoff=5.0)
    shards = [
        KafkaSinkConfig(
            name=connector,
            partitions=4,
            rq_partitions=4,
            dlq_partitions=4,
            policy=slow,
            shard_id=s,
            shard_count=2,
        )
        for s in range(2)
    ]
    changes = workload(keys=12, per_key=2)
    mine = {s: [c for c in changes if shards[s].owns(output_records(c)[0].key)] for s in range(2)}
    assert mine[0]
    assert mine[1]
    async with KafkaSink(kafka_config, shards[0], inject=failing(set(range(12)))) as s0:
        with pytest.raises(ValueError, match="another shard"):
            await s0.put(SinkBatch("tok", tuple(mine[1][:1]), watermark=0))
        await put_all(s0, mine[0])
        held = s0.statistics().held
        assert held == len(mine[0])
        await s0.abort()
    async with KafkaSink(kafka_config, shards[1]) as s1:
        assert s1.statistics().held == 0
    async with KafkaSink(kafka_config, shards[0]) as s0:
        assert s0.statistics().held == held


def test_kafka_sink_meets_the_sink_port_with_its_prepare_hook() -> None:
    """mypy checks the ``Sink`` port (the class statement and the annotated assignment); a Kafka
    sink has a shared retry queue, so it must override the port's do-nothing ``prepare``, or
    readers would skip the retry queue's catch-up."""
    sink: Sink = KafkaSink(
        KafkaConfig(bootstrap_servers="localhost:9092"), KafkaSinkConfig(name="o")
    )
    assert type(sink).prepare is not Sink.prepare, "readers would skip the retry queue's catch-up"
    assert inspect.iscoroutinefunction(sink.prepare)
    assert list(inspect.signature(sink.prepare).parameters) == ["token"]
    assert inspect.iscoroutinefunction(sink.put)
    assert list(inspect.signature(sink.put).parameters) == ["batch"]


def test_output_records_one_per_mod() -> None:
    c = change(1, 2)
    two = DataChange(
        **{f: getattr(c, f) for f in c.__struct_fields__ if f != "mods"},
        mods=(c.mods[0], Mod(keys='{"id": "9"}', new_values="{}", old_values="{}")),
    )
    recs = output_records(two)
    assert [r.record_id for r in recs] == [f"{c.commit_ts}/tx-1-2/00000002/{i}" for i in (0, 1)]
    assert [r.key for r in recs] == [kname(1), kname(9)]
    assert decode_output(msgspec.json.encode(recs[0])) == recs[0]


_CHILD = """
import asyncio, sys
from protocol.retry import RetryPolicy
from runtime.kafka import KafkaConfig
from runtime.kafka.sink import KafkaSink, KafkaSinkConfig
from tests.fixtures.kafka_sink import failing, put_all, workload

async def main() -> None:
    config = KafkaConfig.embedded(sys.argv[1])
    policy = RetryPolicy(max_attempts=50, base_backoff=0.2, max_backoff=0.3)
    cfg = KafkaSinkConfig(name=sys.argv[2], partitions=3, rq_partitions=3, dlq_partitions=3,
                          policy=policy)
    async with KafkaSink(config, cfg, inject=failing({1, 5})) as sink:
        await put_all(sink, workload(keys=12, per_key=6), batch=10)
        print("settled", sink.statistics().held, flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.kafka
@pytest.mark.asyncio
async def test_a_sigkilled_sink_process_loses_nothing_from_its_rq(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, connector: str
) -> None:
    """As above with the sink's process SIGKILLed: loss and per-key order only, since the keyed
    Kafka output is at least once across a death (records are read by their first delivery)."""
    repo = REPO
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD,
        kafka_broker.bootstrap,
        connector,
        stdout=asyncio.subprocess.PIPE,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
        assert line.split() == [b"settled", b"12"]
        await asyncio.sleep(0.5)  # retries under way when it dies
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    changes = workload(keys=12, per_key=6)
    want = expected_ids(changes)
    cfg = KafkaSinkConfig(name=connector, partitions=3, rq_partitions=3, dlq_partitions=3)
    async with KafkaSink(kafka_config, cfg) as sink:
        assert sink.statistics().held == 12
        async with asyncio.timeout(20):
            await sink.wait_idle()
        assert sink.statistics().held == 0
    got = await read_output(kafka_config, connector, 3, want=72)
    firsts: dict[str, int] = {}
    for i, (_, r) in enumerate(got):
        firsts.setdefault(r.record_id, i)
    assert set(firsts) == {rid for ids in want.values() for rid in ids}, "records lost"
    for k, ids in want.items():
        assert sorted(ids, key=lambda rid: firsts[rid]) == ids, f"key {k} out of order"


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_two_processes_share_the_rq_through_a_hand_off_and_a_death(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """Two sinks (two processes) over one output topic and one RQ/DLQ. A reads the partition
    first; key 1 keeps failing and is parked. The partition moves to B, which catches up with
    the RQ before it reads (prepare): key 1's next records wait behind A's. A drives the RQ
    and dies with key 1 still parked; B becomes the driver and delivers everything: each
    record once in the output, every key in commit order, no restart needed."""
    cfg = KafkaSinkConfig(
        name=connector,
        partitions=4,
        rq_partitions=2,
        dlq_partitions=2,
        policy=RetryPolicy(max_attempts=1000, base_backoff=0.02, max_backoff=0.1, jitter=0.0),
    )
    keys = 4
    changes = workload(keys, 6)
    first, second = changes[: keys * 3], changes[keys * 3 :]
    healed = asyncio.Event()

    def inject(rec: OutputRecord, attempts: int) -> str | None:
        if key_of(rec) == 1 and not healed.is_set():
            return "injected: key 1 is down"
        return None

    drivers = {"A": True, "B": False}
    a = KafkaSink(
        kafka_config, cfg, inject=inject, driver=lambda: drivers["A"], takeover_grace_s=0.2
    )
    b = KafkaSink(
        kafka_config, cfg, inject=inject, driver=lambda: drivers["B"], takeover_grace_s=0.2
    )
    async with b:
        await a.__aenter__()
        try:
            await a.prepare("p")
            await put_all(a, first)  # key 1's records are parked by A
            assert a._core.blocks(kname(1))
            # the partition moves to B
            await b.prepare("p")
            assert b._core.blocks(kname(1))
            await put_all(b, second)
            assert b._core.group_state(kname(1)).rq  # key 1's later records parked behind
            await a.abort()  # the driver dies with key 1 parked
        finally:
            await a.__aexit__(None, None, None)
        drivers["A"], drivers["B"] = False, True
        healed.set()
        async with asyncio.timeout(30):
            while b._core.held_count() or not b._queue.driving:
                await asyncio.sleep(0.05)
    want = expected_ids(changes)
    out = await read_output(kafka_config, connector, 4, sum(len(v) for v in want.values()))
    seen: dict[int, list[str]] = {}
    for _, rec in out:
        ids = seen.setdefault(key_of(rec), [])
        if rec.record_id not in ids:
            ids.append(rec.record_id)
    assert seen == want
    delivered = [r.record_id for _, r in out]
    assert_no_row_twice(delivered, "records")
    assert_catches_a_double(assert_no_row_twice, delivered)  # the check sees a doubled record
