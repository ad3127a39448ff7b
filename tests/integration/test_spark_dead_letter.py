"""The Spark bridge's retry queue and dead-letter queue (``SparkConfig.dead_letter``) against local
Spark and the embedded broker: rows of failing keys are isolated (bisecting by key, or named by
``RowsFailed``) and parked, other keys keep flowing, each key's rows commit in order, every row
ends in the output or the DLQ exactly once; a bridge that dies with rows in its RQ leaves them to
the next one; the ``dlq`` subcommand lists and replays the Spark DLQ."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.cli import admin
from actors.cli import config as options
from actors.runtime import build_parser
from protocol.records import ColumnType, DataChange, Mod
from protocol.retry import RetryPolicy
from runtime.kafka import KafkaConfig
from runtime.kafka.broker import EmbeddedBroker
from runtime.ports import SinkBatch
from runtime.spark import SparkBridge, SparkConfig, read_output
from runtime.spark.dead_letter import DeadLetterConfig, list_dlq
from runtime.spark.keyed import RowsFailed, SparkRecord, decode_record, spark_records
from runtime.spark.output import write_default
from tests.fixtures.kafka import connector, kafka_broker, kafka_config
from tests.fixtures.spark import spark
from tests.helpers import REPO, assert_catches_a_double, assert_no_row_twice, exactly

pytestmark = [pytest.mark.spark, pytest.mark.kafka, pytest.mark.slow]
__all__ = ["connector", "kafka_broker", "kafka_config", "spark"]  # fixtures used by name

COLS = (ColumnType("id", '{"code":"INT64"}', True, 1),)
TOKEN = "tok"


def change(key: int, n: int) -> DataChange:
    """Row ``key`` of table ``T`` at version ``n``; commit order is ``n`` then ``key``."""
    return DataChange(
        commit_ts=1_000_000 + n * 1000 + key,
        record_sequence=f"{n:08d}",
        server_transaction_id=f"tx-{key}-{n}",
        is_last_record_in_transaction_in_partition=True,
        table="T",
        column_types=COLS,
        mods=(
            Mod(keys=json.dumps({"id": str(key)}), new_values=f'{{"n":"{n}"}}', old_values="{}"),
        ),
        mod_type="UPDATE",
    )


def workload(keys: int, per_key: int) -> list[DataChange]:
    return [change(k, n) for n in range(per_key) for k in range(keys)]


def key_of(keys_json: str) -> int:
    return int(json.loads(keys_json)["id"])


def expected_ids(changes: list[DataChange]) -> dict[int, list[str]]:
    by_key: dict[int, list[str]] = {}
    for r in spark_records(TOKEN, changes):
        by_key.setdefault(key_of(r.keys), []).append(r.record_id)
    return by_key


class Writer:
    """A ``foreach_batch`` over the default parquet sink that fails the rows of chosen keys
    (before writing anything) and logs every committed row id in commit order."""

    def __init__(self, out: Path, fail: Callable[[set[int]], set[int]], *, name_keys: bool) -> None:
        self.out = out
        self.fail = fail  # keys of a batch -> the keys that fail now
        self.name_keys = name_keys  # raise RowsFailed naming them (else a plain error: bisect)
        self.committed: list[tuple[int, str]] = []  # (key, record id), in commit order
        self.calls = 0
        self.run = 0  # bump for a new bridge: batch ids start again at 0
        self._lock = threading.Lock()

    def __call__(self, df: Any, batch_id: int) -> None:
        rows = df.select(
            "keys", "commit_ts", "server_transaction_id", "record_sequence", "mod_index"
        ).collect()
        with self._lock:
            self.calls += 1
            bad = self.fail({key_of(r["keys"]) for r in rows})
        if bad:
            if self.name_keys:
                raise RowsFailed({f'T:{{"id": "{k}"}}' for k in bad}, "injected")
            raise RuntimeError(f"injected failure for keys {sorted(bad)}")
        write_default(df, str(self.out), f"run{self.run}-{batch_id:010d}")
        with self._lock:
            self.committed += [
                (
                    key_of(r["keys"]),
                    f"{r['commit_ts']}/{r['server_transaction_id']}/{r['record_sequence']}/"
                    f"{r['mod_index']}",
                )
                for r in rows
            ]


def _config(out: Path, kafka: KafkaConfig, name: str, policy: RetryPolicy) -> SparkConfig:
    return SparkConfig(
        output_dir=str(out),
        max_rows=100_000,
        max_age_s=0.3,
        max_attempts=1,
        dead_letter=DeadLetterConfig(kafka=kafka, name=name, policy=policy),  # as the CLI's
    )


async def feed(bridge: SparkBridge, changes: list[DataChange], batch: int, pause: float) -> None:
    """Put ``changes`` in batches (pausing so they spread over several micro-batches) and wait
    until every batch's future resolved: each row committed or durably parked."""
    futures = []
    for i in range(0, len(changes), batch):
        part = tuple(changes[i : i + batch])
        futures.append(await bridge.put(SinkBatch(TOKEN, part, part[-1].commit_ts)))
        await asyncio.sleep(pause)
    async with asyncio.timeout(90):
        await asyncio.gather(*futures)


def assert_in_order(committed: list[tuple[int, str]], want: dict[int, list[str]]) -> None:
    ids = [rid for _, rid in committed]
    assert_no_row_twice(ids)
    assert_catches_a_double(assert_no_row_twice, ids)  # the check sees a doubled row
    for k, expected in want.items():
        got = [rid for key, rid in committed if key == k]
        assert got == expected[: len(got)], f"key {k} out of order"


def output_ids(out: Path) -> list[str]:
    table = read_output(str(out), dedupe=False)
    cols = [
        table.column(c).to_pylist()
        for c in ("commit_ts", "server_transaction_id", "record_sequence", "mod_index")
    ]
    return ["/".join(str(v) for v in row) for row in zip(*cols, strict=True)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_failing_keys_are_parked_while_others_flow_in_order_then_cli_replays(
    spark: Any,
    kafka_broker: EmbeddedBroker,
    kafka_config: KafkaConfig,
    connector: str,
    tmp_path: Path,
) -> None:
    out = tmp_path / "cli" / "data"  # where `dlq replay --output-dir tmp/cli` writes too
    broken, flaky = {3}, {7}
    flaky_failures: Counter[int] = Counter()

    def fail(keys: set[int]) -> set[int]:
        bad = keys & broken
        for k in keys & flaky:
            if flaky_failures[k] < 2:  # fails until it failed alone twice (from the RQ), then ok
                flaky_failures[k] += keys == {k}
                bad.add(k)
        return bad

    writer = Writer(out, fail, name_keys=False)  # a plain error: the bridge bisects
    policy = RetryPolicy(max_attempts=3, base_backoff=0.05, max_backoff=0.2, jitter=0.1)
    name = f"{connector}_spark"
    config = _config(out, kafka_config, name, policy)
    changes = workload(keys=12, per_key=5)
    want = expected_ids(changes)
    async with SparkBridge(config, foreach_batch=writer, spark=spark) as bridge:
        await feed(bridge, changes, batch=12, pause=0.35)
        async with asyncio.timeout(60):
            await bridge.wait_retries_idle()
        stats = bridge.stats()
        (dead,) = bridge.dlq_records()
    assert dead.record_id == want[3][0]
    assert dead.attempts == 3
    assert "injected failure for keys [3]" in dead.error
    assert dead.record is not None
    assert dead.record.key == 'T:{"id": "3"}'
    assert stats.rq_held == 5  # key 3 blocks: its later rows are parked behind, in order
    assert stats.in_dlq == 1
    assert stats.rows_parked == 10  # keys 3 and 7: the failing rows and those behind them
    assert stats.rows_retried >= 5  # key 7's rows, from the RQ
    assert stats.puts_failed == 0
    assert stats.batches_failed == 0
    assert_in_order(writer.committed, want)
    healthy = {rid for k, ids in want.items() if k != 3 for rid in ids}
    assert {rid for _, rid in writer.committed} == healthy
    exactly(healthy)(output_ids(out))
    assert_catches_a_double(exactly(healthy), output_ids(out))

    # `dlq list --sink spark` reads the topics (no Spark needed) ...
    common = [
        "--sink",
        "spark",
        "--spark-dead-letter",
        "--spark-dead-letter-topic",
        name,
        "--kafka-bootstrap-servers",
        kafka_broker.bootstrap,
        "--connector",
        connector,
        "--output-dir",
        str(tmp_path / "cli"),
    ]
    listed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "actors.runtime", "dlq", "list", *common],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert f"1 record(s) in the DLQ of {name!r}" in listed.stdout
    assert f"{dead.record_id}  key={dead.record.key}  attempts=3" in listed.stdout
    assert config.dead_letter is not None
    assert [d.record_id for d in await list_dlq(config.dead_letter)] == [dead.record_id]

    # ... and `dlq replay --sink spark` (in process, on this module's Spark session: a bridge
    # with the default parquet sink under --output-dir) writes key 3's five rows, in order.
    printed = io.StringIO()
    args = build_parser("dlq").parse_args(["replay", *common])
    cli_config = options.load(args, environ={})
    assert await admin.dlq(cli_config, "replay", [], printed, spark=spark) == 0
    assert f"replayed 1 record(s) from the DLQ of {name!r}" in printed.getvalue()
    assert await list_dlq(config.dead_letter) == []
    everything = {rid for ids in want.values() for rid in ids}
    exactly(everything)(output_ids(out))
    assert_catches_a_double(exactly(everything), output_ids(out))
    table = read_output(str(out), dedupe=False)
    replayed = sorted(
        (batch, rid)
        for batch, rid in zip(table.column("batch").to_pylist(), output_ids(out), strict=True)
        if not batch.startswith("run")  # the replay's own batches, numbered in commit order
    )
    assert [rid for _, rid in replayed] == want[3]


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_dead_bridge_leaves_its_rq_to_the_next_one(
    spark: Any, kafka_config: KafkaConfig, connector: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    broken = {1, 5}
    writer = Writer(out, lambda keys: keys & broken, name_keys=True)  # RowsFailed: no bisection
    slow = RetryPolicy(max_attempts=50, base_backoff=0.5, max_backoff=1.0, jitter=0.1)
    config = _config(out, kafka_config, f"{connector}_spark", slow)
    changes = workload(keys=10, per_key=4)
    want = expected_ids(changes)
    async with SparkBridge(config, foreach_batch=writer, spark=spark) as first:
        await feed(first, changes, batch=10, pause=0.35)  # settled: committed, or in the RQ
        assert first.stats().rq_held == 8
        assert first.stats().puts_failed == 0
        await first.abort()  # dies with 8 rows in its RQ (the RQ topic keeps them)
    assert not {k for k, _ in writer.committed} & broken

    broken.clear()
    writer.run += 1
    async with SparkBridge(config, foreach_batch=writer, spark=spark) as second:
        assert second.stats().rq_held == 8  # resumed from the RQ topic
        async with asyncio.timeout(60):
            await second.wait_retries_idle()
        assert second.stats().rq_held == 0
        assert second.stats().rows_retried == 8
    assert_in_order(writer.committed, want)
    everything = {rid for ids in want.values() for rid in ids}
    assert {rid for _, rid in writer.committed} == everything
    exactly(everything)(output_ids(out))
    assert_catches_a_double(exactly(everything), output_ids(out))


_CHILD = """
import asyncio, sys
from pathlib import Path
from protocol.retry import RetryPolicy
from runtime.kafka import KafkaConfig
from runtime.spark import SparkBridge
from tests.integration.test_spark_dead_letter import Writer, _config, feed, workload

async def main():
    out, kafka, name = Path(sys.argv[1]), KafkaConfig.embedded(sys.argv[2]), sys.argv[3]
    writer = Writer(out, lambda keys: keys & {1, 5}, name_keys=True)
    slow = RetryPolicy(max_attempts=50, base_backoff=0.3, max_backoff=0.6, jitter=0.1)
    async with SparkBridge(_config(out, kafka, name, slow), foreach_batch=writer) as bridge:
        await feed(bridge, workload(keys=10, per_key=4), batch=10, pause=0.35)
        print("settled", bridge.stats().rq_held, len(writer.committed), flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_a_sigkilled_bridge_process_leaves_its_rq_to_the_next_one(
    spark: Any, kafka_broker: EmbeddedBroker, connector: str, tmp_path: Path
) -> None:
    """As above, but the first bridge is a process of its own (its own local Spark) killed with
    SIGKILL while it retries: nothing of it runs its exit, and the RQ topic alone carries the
    parked rows to the next bridge."""
    out, name = tmp_path / "out", f"{connector}_spark"
    env = {**_env(), "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD,
        str(out),
        kafka_broker.bootstrap,
        name,
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
        env=env,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(150):
            line = await proc.stdout.readline()
        assert line.split() == [b"settled", b"8", b"32"]  # keys 1 and 5 parked, 32 rows written
        await asyncio.sleep(1.0)  # retries under way when it dies
    finally:
        if proc.returncode is None:
            proc.kill()  # SIGKILL
        await proc.wait()

    changes = workload(keys=10, per_key=4)
    want = expected_ids(changes)
    writer = Writer(out, lambda keys: set(), name_keys=True)
    writer.run = 1
    policy = RetryPolicy(max_attempts=50, base_backoff=0.3, max_backoff=0.6, jitter=0.1)
    config = _config(out, KafkaConfig.embedded(kafka_broker.bootstrap), name, policy)
    async with SparkBridge(config, foreach_batch=writer, spark=spark) as second:
        assert second.stats().rq_held == 8  # resumed from the RQ topic
        async with asyncio.timeout(60):
            await second.wait_retries_idle()
        assert second.stats().rows_retried == 8
    assert {k for k, _ in writer.committed} == {1, 5}
    assert_in_order(writer.committed, want)
    everything = {rid for ids in want.values() for rid in ids}
    assert sorted(output_ids(out)) == sorted(everything)  # each row once, none missing


def test_records_round_trip_and_halves_keep_keys_together() -> None:
    from runtime.kafka.sink import decode_output
    from runtime.spark.keyed import encode_record, halves, records_table
    from runtime.spark.keyed_path import ordering_keys

    changes = workload(keys=5, per_key=3)
    records = spark_records(TOKEN, changes)
    assert ordering_keys([(TOKEN, changes)]) == {r.key for r in records}
    raw = encode_record(records[0])
    assert decode_record(raw) == records[0]
    assert decode_output(raw).record_id == records[0].record_id  # `dlq list` reads both sinks
    left, right = halves(records)
    assert {r.key for r in left}.isdisjoint({r.key for r in right})
    assert sorted(left + right, key=records.index) == records
    for half in (left, right):
        assert [r for r in records if r in half] == half  # order kept
    table = records_table(records)
    assert table.num_rows == len(records)
    assert table.column("record_sequence").to_pylist() == [r.record_sequence for r in records]
    with pytest.raises(ValueError, match="two keys"):
        halves([r for r in records if r.key == records[0].key])
    assert isinstance(records[0], SparkRecord)
