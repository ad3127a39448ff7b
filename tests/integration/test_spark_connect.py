"""The Spark bridge's embedded path against a remote Spark through Spark Connect: a real
``SparkConnectServer`` process on 127.0.0.1 (one per module), the bridge built with
``SparkConfig(remote="sc://...")`` and no session of its own. The default parquet sink's output
equals exactly the records handed in, readers' watermarks never pass what is on disk, a user
``foreach_batch`` gets Connect DataFrames, a restart does not write twice; and an unreachable
server or a setting the server refuses is a quick ``SparkStartError``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from bench.output import read_changes
from protocol.commit import STAGING_DIR
from protocol.records import DataChange
from runtime.ports import SinkBatch
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spark import KEY_COLUMNS, SparkBridge, SparkConfig, SparkStartError, read_output
from runtime.spark.output import write_default
from runtime.spark.session import start_session
from tests.fixtures.spark import Cluster, Row, expected_rows, output_rows, wait_for
from tests.fixtures.spark_connect import ConnectServer, connect_mode, connect_server, free_port
from tests.helpers import assert_catches_a_double, exactly

pytestmark = [pytest.mark.spark, pytest.mark.slow]
__all__ = ["connect_mode", "connect_server"]  # module-scoped fixtures


def _config(server: ConnectServer, out: Path, **kwargs: Any) -> SparkConfig:
    return SparkConfig(
        remote=server.url,
        output_dir=str(out),
        max_rows=20_000,
        max_age_s=0.5,
        **{"output_layout": "generic", **kwargs},
    )


def _records(seed: int, roots: int = 2, seconds: float = 2.0) -> dict[str, list[DataChange]]:
    """Per root token, its data records over ``seconds`` of a simulated stream."""
    model = StreamModel(StreamParams(seed=seed, roots=roots, records_per_s=60, split_p=0.0))
    start = model.params.start_ts
    out: dict[str, list[DataChange]] = {}
    for child in model.root_record().children:
        stream = model.records(child.token, start, start + int(seconds * 1e6))
        out[child.token] = [r for r in stream if isinstance(r, DataChange)]
    assert all(len(records) > 20 for records in out.values())
    return out


def _identity(change: DataChange, mod_index: int, token: str) -> tuple[str, str, int, str]:
    return (change.server_transaction_id, change.record_sequence, mod_index, token)


def _keys(rows: list[Row]) -> list[Row]:
    return [row[:4] for row in rows]


async def _put_in_parts(
    bridge: SparkBridge, records: dict[str, list[DataChange]], parts: int = 3
) -> list[tuple[SinkBatch, asyncio.Future[None]]]:
    puts = []
    for token, changes in records.items():
        size = -(-len(changes) // parts)
        for i in range(0, len(changes), size):
            part = tuple(changes[i : i + size])
            batch = SinkBatch(token, part, part[-1].commit_ts)
            puts.append((batch, await bridge.put(batch)))
    return puts


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("connect_mode")
async def test_three_tasks_over_connect_output_equals_the_stream(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    breaches: list[str] = []
    checks = 0

    async def watch(cluster: Cluster) -> None:
        """Every published (committed) watermark is covered by the output already on disk."""
        nonlocal checks
        reference = StreamModel(cluster.params)
        start = cluster.params.start_ts
        while True:
            committed = cluster.committed()
            try:
                table = await asyncio.to_thread(read_output, str(out))
                on_disk = set(_keys(output_rows(table)))
            except (KeyError, OSError, ValueError):  # caught Spark mid-write: look again
                await asyncio.sleep(0.05)
                continue
            for token, watermark in committed.items():
                if watermark <= start:
                    continue
                before = [
                    r
                    for r in reference.records(token, start, watermark - 1)
                    if isinstance(r, DataChange)
                ]
                missing = set(_keys(expected_rows(iter(before)))) - on_disk
                if missing:
                    breaches.append(f"{token} watermark {watermark}: {len(missing)} rows missing")
            checks += 1
            await asyncio.sleep(0.3)

    async with SparkBridge(_config(connect_server, out)) as bridge:
        assert type(bridge.spark).__module__.startswith("pyspark.sql.connect")
        cluster = Cluster(bridge, seed=21, seconds=8.0)
        async with AsyncExitStack() as stack:
            await cluster.start(stack)
            watcher = asyncio.create_task(watch(cluster))
            try:
                total = len(cluster.expected())
                await wait_for(lambda: bridge.stats().rows_committed >= total, 60, "all rows")
                await asyncio.sleep(0.5)  # a last look after the final watermarks
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        stats = bridge.stats()
    assert not breaches, breaches[:3]
    assert checks >= 3
    assert stats.batches_failed == 0
    assert stats.attempts_failed == 0
    assert stats.batches_committed >= 2
    rows = output_rows(read_output(str(out), dedupe=False))
    exactly(cluster.expected())(rows)
    assert_catches_a_double(exactly(cluster.expected()), rows)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("connect_mode")
async def test_futures_resolve_only_after_the_rows_are_on_disk(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    records = _records(seed=22)
    seen: list[bool] = []

    def on_disk(batch: SinkBatch, _: asyncio.Future[None]) -> None:
        rows = set(_keys(output_rows(read_output(str(out)))))
        seen.append(set(_keys(expected_rows(iter(batch.records)))) <= rows)

    async with SparkBridge(_config(connect_server, out)) as bridge:
        puts = await _put_in_parts(bridge, records)
        for batch, future in puts:
            future.add_done_callback(functools.partial(on_disk, batch))
        await asyncio.wait_for(asyncio.gather(*(f for _, f in puts)), 60)
        # the bridge remembers each micro-batch's watermarks; the newest ones are the puts'
        newest: dict[str, int] = {}
        for marks in bridge.watermarks.values():
            for token, mark in marks.items():
                newest[token] = max(newest.get(token, mark), mark)
        assert newest == {token: changes[-1].commit_ts for token, changes in records.items()}
    assert seen == [True] * len(puts)
    expected = expected_rows(r for changes in records.values() for r in changes)
    written = list(output_rows(read_output(str(out), dedupe=False)))
    exactly(expected)(written)
    assert_catches_a_double(exactly(expected), written)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("connect_mode")
async def test_foreach_batch_gets_connect_dataframes(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    records = _records(seed=23)
    calls: list[tuple[int, int, str]] = []

    def foreach(df: Any, batch_id: int) -> None:
        calls.append((batch_id, df.count(), type(df).__module__))
        write_default(df, str(out), f"user-{batch_id:010d}")

    async with SparkBridge(_config(connect_server, out), foreach_batch=foreach) as bridge:
        puts = await _put_in_parts(bridge, records)
        await asyncio.wait_for(asyncio.gather(*(f for _, f in puts)), 60)
        stats = bridge.stats()
    expected = expected_rows(r for changes in records.values() for r in changes)
    assert sum(n for _, n, _ in calls) == len(expected) == stats.rows_committed
    assert all(module.startswith("pyspark.sql.connect") for _, _, module in calls)
    assert [b for b, _, _ in calls] == sorted({b for b, _, _ in calls})
    written = list(output_rows(read_output(str(out), dedupe=False)))
    exactly(expected)(written)
    assert_catches_a_double(exactly(expected), written)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("connect_mode")
async def test_restart_over_connect_does_not_write_twice(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    """The second bridge learns, through Connect, what the first one wrote but never acked."""
    out = tmp_path / "out"
    token, records = next(iter(_records(seed=24, roots=1).items()))
    first, replay = records[:30], records[20:]
    for part in (first, replay):
        async with SparkBridge(_config(connect_server, out)) as bridge:
            future = await bridge.put(SinkBatch(token, tuple(part), part[-1].commit_ts))
            await asyncio.wait_for(future, 60)
    assert bridge.stats().rows_deduplicated == sum(len(r.mods) for r in records[20:30])
    written = list(output_rows(read_output(str(out), dedupe=False)))
    exactly(expected_rows(iter(records)))(written)
    assert_catches_a_double(exactly(expected_rows(iter(records))), written)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("connect_mode")
async def test_default_config_on_a_fresh_output_dir_writes_through_our_server(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    """An output directory that does not exist yet: the bridge starts, its session is a Spark
    Connect session of the server this module started (its application name, its server-side
    temp directory), and the rows put through it are exactly what is read back from disk."""
    out = tmp_path / "new"
    assert not out.exists()
    token, records = next(iter(_records(seed=25, roots=1).items()))
    async with SparkBridge(_config(connect_server, out)) as bridge:
        spark = bridge.spark
        assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
        assert spark.conf.get("spark.app.name") == "shoal-connect-test"
        assert spark.conf.get("spark.local.dir") == str(connect_server.log.parent / "local")
        future = await bridge.put(SinkBatch(token, tuple(records), records[-1].commit_ts))
        await asyncio.wait_for(future, 60)
        stats = bridge.stats()
    expected = expected_rows(iter(records))
    assert stats.rows_committed == len(expected)
    assert stats.batches_failed == 0
    written = list(output_rows(read_output(str(out), dedupe=False)))
    exactly(expected)(written)
    assert_catches_a_double(exactly(expected), written)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("connect_mode")
async def test_typed_default_over_connect_holds_each_change_once(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    """The default layout over Connect is the typed changelog, written by the server's
    executors (one Spark job per micro-batch, through shoal's data source, registered over the
    Connect session) and committed atomically by this process: every change of the stream is
    in its table's directory once, a restarted bridge that is handed the unacked tail again
    writes nothing twice, and Spark reads the tables back through the Connect session."""
    out = tmp_path / "out"
    records = _records(seed=26)
    token, changes = next(iter(records.items()))
    config = _config(connect_server, out, output_layout=None)
    async with SparkBridge(config) as bridge:
        assert bridge.layout == "typed"
        puts = await _put_in_parts(bridge, records)
        await asyncio.wait_for(asyncio.gather(*(f for _, f in puts)), 60)
    replay = changes[len(changes) // 2 :]
    async with SparkBridge(config) as bridge:
        future = await bridge.put(SinkBatch(token, tuple(replay), replay[-1].commit_ts))
        await asyncio.wait_for(future, 60)
        assert bridge.stats().rows_deduplicated == sum(len(r.mods) for r in replay)
        spark_counts = {
            t: bridge.spark.read.parquet(str(out / t)).count()
            for t in sorted({c.table for cs in records.values() for c in cs})
        }
    expected: Counter[tuple[object, ...]] = Counter(
        (c.commit_ts, c.table, c.mod_type, json.loads(m.keys)["Id"], *_identity(c, i, t))
        for t, cs in records.items()
        for c in cs
        for i, m in enumerate(c.mods)
    )
    changes_written = [tuple(c) for c in read_changes(out)]
    exactly(expected.elements())(changes_written)
    assert_catches_a_double(exactly(expected.elements()), changes_written)
    assert not any(p.is_file() for p in (out / STAGING_DIR).rglob("*"))
    by_table = Counter(row[1] for row in expected.elements())
    assert spark_counts == dict(by_table)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("connect_mode")
async def test_foreach_batch_over_connect_takes_an_empty_micro_batch(
    connect_server: ConnectServer, tmp_path: Path
) -> None:
    """A heartbeat (a watermark, no records) is a micro-batch too: the user's function gets it
    as an empty Connect DataFrame with the output's columns, and its watermark is remembered
    with that micro-batch."""
    calls: list[tuple[int, int, str, list[str]]] = []

    def foreach(df: Any, batch_id: int) -> None:
        calls.append((batch_id, df.count(), type(df).__module__, list(df.columns)))

    config = _config(connect_server, tmp_path / "out", max_attempts=1)
    async with SparkBridge(config, foreach_batch=foreach) as bridge:
        future = await bridge.put(SinkBatch("p", (), 1))  # a heartbeat: watermark, no records
        await asyncio.wait_for(future, 30)
        stats = bridge.stats()
        heartbeat = [b for b, marks in bridge.watermarks.items() if marks.get("p") == 1]
    assert len(heartbeat) == 1, bridge.watermarks
    (call,) = [c for c in calls if c[0] == heartbeat[0]]
    assert call[1] == 0
    assert call[2].startswith("pyspark.sql.connect")
    assert set(KEY_COLUMNS) <= set(call[3]), call[3]
    assert stats.batches_failed == 0
    assert stats.rows_committed == 0


@pytest.mark.usefixtures("connect_mode")
def test_setting_the_server_refuses_is_a_clear_error(connect_server: ConnectServer) -> None:
    with pytest.raises(SparkStartError, match=r"refused the setting spark\.executor\.memory"):
        start_session(
            master="local[2]",
            remote=connect_server.url,
            app_name="x",
            conf={"spark.executor.memory": "2g"},
            local_dir="unused",
        )


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_nothing_listening_is_a_quick_start_error(tmp_path: Path) -> None:
    """No Java needed: the client side alone notices there is no server. The message is the
    bridge's own probe's (the client's retry policy, minutes long, never ran); the bound is
    only "not minutes", generous for a loaded machine importing pyspark."""
    url = f"sc://127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(SparkStartError, match="no Spark Connect server at") as caught:
        async with SparkBridge(SparkConfig(remote=url, output_dir=str(tmp_path / "out"))):
            pass
    assert isinstance(caught.value.__cause__, ConnectionRefusedError), caught.value.__cause__
    assert time.monotonic() - began < 60


def test_bad_connect_url_is_a_start_error() -> None:
    with pytest.raises(SparkStartError, match="bad Spark Connect URL"):
        start_session(
            master="local[2]", remote="http://127.0.0.1:1", app_name="x", conf={}, local_dir="x"
        )
