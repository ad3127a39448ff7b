"""A shard-count change of the RQ/DLQ while two producers run, with records parked and
dead-lettered, and one producer SIGKILLed during the change (docs/operations.md, "Scaling the
Kafka output"; rules: protocol/output_meta.py and protocol/retry.py ``feed_plan``), against the
embedded broker through the real entry point.

Producer A (keys 0-9, it drives the shared RQ as the group leader's process does) and B (keys
10-19) write per-key sequence numbers; keys 3 and 13 fail, so their first record is dead-lettered
and their later records are parked in the RQ behind it. ``output shards 3`` runs (new RQ/DLQ
storage topics of 6 partitions); B stops before it and is SIGKILLed once the change is prepared,
so the change waits for its lease. The command then feeds the old storage topics' held records to the new ones and retires
them. B's replacement sends B's keys again from the start (at least once). ``dlq list`` and
``dlq replay --via-leader`` now read only the new storage topics (from the output's metadata):
the list shows both dead-lettered records, the replay delivers them and everything parked
behind. The output must hold every record, and per key, once repeats of a record id already seen
are dropped, no sequence number goes backwards."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import msgspec
import pytest

from protocol.output_meta import ShardsCommitted, feed_due, shards_plan
from protocol.retry import LogEntry, ParkInRetry, Released, SendToDlq, feed_plan, from_log
from protocol.routing import CompositeTopic, key_hash
from runtime.kafka import KafkaConfig
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.composite_reader import read_composite
from runtime.kafka.output_meta import MetaLog, open_meta
from runtime.kafka.retry_queue import (
    InternalMessage,
    feed,
    load_log,
    make_producer,
    split_key,
)
from runtime.kafka.sink import decode_output
from runtime.kafka.topics import ensure_topic
from tests.fixtures import output_runs as runs
from tests.fixtures.kafka import connector, kafka_broker, kafka_config
from tests.fixtures.kafka_sink import key_of, kname
from tests.helpers import assert_catches_a_double, assert_no_row_twice

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name

PER_KEY = 30
LOGS: int | None = None  # a file descriptor for the producers' logs (set by the test)


async def _producer(
    bootstrap: str, name: str, first: int, last: int, *opts: str
) -> asyncio.subprocess.Process:
    errors = asyncio.subprocess.DEVNULL if LOGS is None else LOGS
    return await runs.start_producer(bootstrap, name, first, last, PER_KEY, *opts, stderr=errors)


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_rq_dlq_shard_change_with_parked_records_and_a_kill(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, connector: str, tmp_path: Path
) -> None:
    global LOGS
    started = time.monotonic()
    procs: list[asyncio.subprocess.Process] = []
    log_file = (tmp_path / "producers.log").open("wb")
    LOGS = log_file.fileno()
    try:
        name = f"{connector}_output"
        where = ["--kafka-bootstrap-servers", kafka_broker.bootstrap, "--connector", connector]
        heal, hold = tmp_path / "heal", tmp_path / "hold"
        a = await _producer(
            kafka_broker.bootstrap,
            name,
            0,
            9,
            "driver=1",
            "fail=3,13",
            f"heal={heal}",
            f"hold={hold}",
        )
        procs.append(a)
        await runs.line(a, "started")
        b_opts = ("driver=0", "fail=3,13", f"heal={heal}")
        b = await _producer(kafka_broker.bootstrap, name, 10, 19, *b_opts)
        procs.append(b)
        await runs.line(b, "put 8")

        # B stops (it cannot ack any more) and dies during the change: the change waits until
        # B's lease ran out, then commits without it
        b.send_signal(signal.SIGSTOP)
        shards = asyncio.create_task(runs.shoal("output", "shards", "3", "--wait", "60", *where))
        async with MetaLog(kafka_config, name) as meta:
            async with asyncio.timeout(60):
                while (await meta.load())[0].shards_pending is None:
                    assert not shards.done(), shards.result()
                    await asyncio.sleep(0.05)
        b.send_signal(signal.SIGKILL)
        await b.wait()
        done = await shards
        assert done.returncode == 0, done.stderr
        assert f"RQ/DLQ shard count 3: RQ {name}_rq.1, DLQ {name}_dlq.1; fed " in done.stdout
        fed = int(done.stdout.split("; fed ")[1].split()[0])
        assert fed >= 2, done.stdout  # the two dead-lettered records at least, and parked ones

        shown = await runs.shoal("output", "show", "--json", *where)
        assert shown.returncode == 0, shown.stderr
        state = json.loads(shown.stdout)
        assert state["shards"] == 3
        assert state["rq"] == [[f"{name}_rq.1", 6]]  # the old storage topics are fed and retired
        assert state["dlq"] == [[f"{name}_dlq.1", 6]]
        assert state["unfed"] is False
        assert state["shards_pending"] is None

        b2 = await _producer(kafka_broker.bootstrap, name, 10, 19, *b_opts)  # B's keys again
        procs.append(b2)
        await runs.line(b2, "started")
        listed = await runs.shoal("dlq", "list", "--sink", "kafka", *where)
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert lines[0] == f"2 record(s) in the DLQ of {name!r}", listed.stdout
        assert sorted(line.split("  ")[1] for line in lines[1:]) == [
            'key=T:{"id": "13"}',
            'key=T:{"id": "3"}',
        ]

        heal.touch()
        replay = await runs.shoal("dlq", "replay", "--via-leader", "--sink", "kafka", *where)
        assert replay.returncode == 0, replay.stderr
        assert f"replayed 2 record(s) from the DLQ of {name!r} via the leader" in replay.stdout
        await runs.line(a, "done", within_s=120)
        await runs.line(b2, "done", within_s=120)
        await b2.wait()
        hold.touch()
        await runs.line(a, "idle", within_s=120)
        await a.wait()

        empty = await runs.shoal("dlq", "list", "--sink", "kafka", *where)
        assert empty.stdout.splitlines() == [f"0 record(s) in the DLQ of {name!r}"], empty.stdout

        last: dict[int, int] = {}
        seen: set[str] = set()
        backwards = repeats = 0
        async for m in read_composite(kafka_config, name, idle_exit_s=2.0):
            assert m.value is not None
            rec = decode_output(m.value)
            if rec.record_id in seen:
                repeats += 1
                continue
            seen.add(rec.record_id)
            k, n = key_of(rec), int(json.loads(rec.new_values)["n"])
            if n <= last.get(k, -1):
                backwards += 1
            last[k] = max(last.get(k, -1), n)
        assert backwards == 0
        assert len(seen) == 20 * PER_KEY  # nothing lost
        assert last == dict.fromkeys(range(20), PER_KEY - 1)
        print(f"fed {fed}, repeats {repeats}, {time.monotonic() - started:.1f} s")
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        log_file.close()
        LOGS = None


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_feed_interrupted_half_way_is_finished_by_running_the_command_again(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, connector: str
) -> None:
    """The command died after the commit and after copying 3 records: ``output shards 3`` run
    again feeds the rest, each record once, and retires the old storage topics; a feed run
    once more copies nothing. The new storage topics alone then hold exactly what all held, and
    ``dlq replay`` over them delivers the dead-lettered record and those parked behind it."""
    started = time.monotonic()
    name = f"{connector}_output"
    where = ["--kafka-bootstrap-servers", kafka_broker.bootstrap, "--connector", connector]
    old_rq, old_dlq = (
        CompositeTopic.create(f"{name}_rq", 4),
        CompositeTopic.create(f"{name}_dlq", 4),
    )
    entries: list[LogEntry] = []
    for n in range(12):  # 4 keys, 3 records each; the first of key 0 dead-lettered, 2 delivered
        key = kname(n % 4)
        entries.append(ParkInRetry(f"r{n}", key, n + 1, n + 1, 1, 0.0, "x"))
    entries += [
        SendToDlq("r0", kname(0), 1, 20, 3, "boom"),
        Released("r5", kname(1), 21),
        Released("r6", kname(2), 22),
    ]
    payloads = {e.record_id: e.record_id.encode() for e in entries}

    async def write(items: list[tuple[CompositeTopic, LogEntry]]) -> None:
        producer = make_producer(kafka_config)
        await producer.start()
        try:
            for topic, e in items:
                await ensure_topic(
                    kafka_config, topic.producing.name, partitions=topic.producing.partitions
                )
                table, keys = split_key(e.key)
                _, partition = topic.route(key_hash(table, keys))
                payload = payloads[e.record_id] if isinstance(e, ParkInRetry | SendToDlq) else None
                raw = msgspec.msgpack.encode(InternalMessage(entry=e, payload=payload))
                await producer.send_and_wait(topic.producing.name, raw, partition=partition)
        finally:
            await producer.stop()

    await write([(old_dlq if isinstance(e, SendToDlq) else old_rq, e) for e in entries])
    async with MetaLog(kafka_config, name) as meta:
        state, _ = await open_meta(meta, partitions=4, rq_partitions=4, dlq_partitions=4)
        prepare = shards_plan(state, 3)
        await meta.append(prepare)  # no producer runs: due at once
        await meta.append(ShardsCommitted(prepare.change))
        state, _ = await meta.load()
    assert feed_due(state) is not None
    new_rq, new_dlq = state.rq(), state.dlq()  # old and new storage topics, newest produced to
    plan = feed_plan([(e, False) for e in entries], payloads)
    held = {c.entry.record_id for c in plan.copies}
    assert held == {f"r{n}" for n in range(12)} - {"r5", "r6"}
    # the first feeder copied three records, then died
    await write(
        [(new_dlq if isinstance(c.entry, SendToDlq) else new_rq, c.entry) for c in plan.copies[:3]]
    )

    again = await runs.shoal("output", "shards", "3", *where)
    assert again.returncode == 0, again.stderr
    assert "fed 7 held record(s) from the old storage topics (3 were there already)" in again.stdout
    shown = json.loads((await runs.shoal("output", "show", "--json", *where)).stdout)
    assert (shown["rq"], shown["unfed"]) == ([[f"{name}_rq.1", 6]], False)
    listed = await runs.shoal("dlq", "list", "--sink", "kafka", *where)
    assert listed.stdout.splitlines()[0] == f"1 record(s) in the DLQ of {name!r}", listed.stdout
    assert listed.stdout.splitlines()[1].startswith("r0  key=")

    assert (await feed(kafka_config, new_rq, new_dlq)).copies == ()  # nothing twice
    producer = make_producer(kafka_config)
    await producer.start()
    try:
        only_new = [(t.producing.name, p) for t in (new_rq, new_dlq) for p in range(6)]
        loaded = await load_log(
            kafka_config, producer, only_new, fetch_max_wait_ms=50, timeout_s=30
        )
    finally:
        await producer.stop()
    copies = [(e.record_id, e.version) for e in loaded.entries]
    assert len(copies) == len(held)
    assert_no_row_twice(copies, "RQ copies")
    assert_catches_a_double(assert_no_row_twice, copies)  # the check sees a doubled copy
    assert {e.record_id for e in from_log(loaded.entries).durable_state()} == held
    assert loaded.payloads == {rid: rid.encode() for rid in held}

    # 'dlq replay' (no process runs) over the new storage topics, with a lease in the metadata:
    # the dead-lettered record, then the records parked behind it, in order
    replay = await runs.shoal("dlq", "replay", "--sink", "kafka", *where)
    assert replay.returncode == 0, replay.stderr
    assert f"replayed 1 record(s) from the DLQ of {name!r}" in replay.stdout
    key0 = [
        m.record_id
        async for m in read_composite(kafka_config, name, idle_exit_s=1.0)
        if m.key == kname(0).encode()
    ]
    assert key0 == ["r0", "r4", "r8"]
    print(f"{time.monotonic() - started:.1f} s")
