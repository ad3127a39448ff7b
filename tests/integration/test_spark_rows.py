"""The pure parts of the Spark bridge, without Spark: rows, keys, de-duplication, cutting."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from protocol.records import ColumnType, DataChange, Mod
from runtime.ports import SinkBatch
from runtime.spark import (
    KEY_COLUMNS,
    BridgeError,
    SparkBridge,
    SparkConfig,
    SparkStartError,
    read_output,
)
from runtime.spark.rows import COLUMNS, Batcher, row_key, to_arrow, to_columns
from runtime.spark.session import start_session
from tests.helpers import wait_for

COLS = (ColumnType("Id", '{"code":"INT64"}', True, 1),)


def change(ts: int, seq: str = "0", txn: str = "t", mods: int = 1, table: str = "T") -> DataChange:
    return DataChange(
        commit_ts=ts,
        record_sequence=seq,
        server_transaction_id=txn,
        is_last_record_in_transaction_in_partition=True,
        table=table,
        column_types=COLS,
        mods=tuple(Mod(f'{{"Id":{i}}}', f'{{"V":{i}}}', "{}") for i in range(mods)),
        mod_type="INSERT",
        transaction_tag="tag",
        number_of_records_in_transaction=2,
    )


def test_one_row_per_mod_with_every_column() -> None:
    cols = to_columns([("p1", [change(10, mods=2)]), ("p2", [change(11, table="U")])])
    assert list(cols) == [name for name, _ in COLUMNS]
    assert cols["mod_index"] == [0, 1, 0]
    assert cols["partition_token"] == ["p1", "p1", "p2"]
    assert cols["table"] == ["T", "T", "U"]
    assert cols["keys"] == ['{"Id":0}', '{"Id":1}', '{"Id":0}']
    assert cols["new_values"][1] == '{"V":1}'
    assert cols["old_values"] == ["{}"] * 3
    assert cols["transaction_tag"] == ["tag"] * 3
    assert cols["number_of_records_in_transaction"] == [2, 2, 2]


def test_arrow_table_has_spark_exact_types() -> None:
    table = to_arrow([("p", [change(10, mods=3)])])
    assert table.num_rows == 3
    assert str(table.schema.field("keys").type) == "string"  # not large_string
    assert str(table.schema.field("commit_ts").type) == "int64"
    assert to_arrow([]).num_rows == 0


def test_row_key_is_record_identity_plus_mod_index() -> None:
    c = change(10, seq="7", txn="x")
    assert row_key(c, 2) == (10, "x", "7", 2)
    assert row_key(c, 0)[:3] == c.identity
    assert KEY_COLUMNS == ("commit_ts", "server_transaction_id", "record_sequence", "mod_index")


def test_batcher_cuts_by_rows() -> None:
    b = Batcher(max_rows=4, max_age_s=1.0)
    b.add(SinkBatch("p", (change(1, mods=2),), 1), now=0.0)
    assert not b.due(0.0)
    b.add(SinkBatch("p", (change(2, mods=2),), 5), now=0.1)
    assert b.full()
    assert b.due(0.1)
    cut = b.cut()
    assert cut is not None
    assert (cut.batch_id, cut.rows, cut.watermarks, cut.first_put) == (0, 4, {"p": 5}, 0.0)
    assert b.cut() is None
    assert b.rows == 0


def test_batcher_cuts_by_age_including_empty_batches() -> None:
    b = Batcher(max_rows=100, max_age_s=1.0)
    assert b.deadline() is None
    b.add(SinkBatch("p", (), 7), now=5.0)  # a heartbeat moves the watermark only
    b.add(SinkBatch("q", (change(3),), 3), now=5.5)
    assert b.deadline() == 6.0
    assert not b.due(5.9)
    assert b.due(6.0)
    cut = b.cut()
    assert cut is not None
    assert cut.watermarks == {"p": 7, "q": 3}
    assert cut.rows == 1
    assert b.next_batch_id == 1


def test_batcher_holds_an_old_batch_back_while_two_are_in_flight() -> None:
    """Adaptive micro-batches: past its age a micro-batch is cut only while fewer than two are
    in flight (one being written, one waiting); a full one is cut regardless."""
    b = Batcher(max_rows=4, max_age_s=1.0)
    b.add(SinkBatch("p", (change(1),), 1), now=0.0)
    assert [b.due(1.0, inflight=n) for n in range(4)] == [True, True, False, False]
    assert not b.due(0.5, inflight=0)  # control: not old enough, whatever is in flight
    b.add(SinkBatch("p", (change(2, mods=3),), 2), now=1.5)  # the held batch keeps growing
    assert b.full()
    assert [b.due(1.5, inflight=n) for n in range(4)] == [True, True, True, True]


def test_batcher_cuts_at_once_when_every_reader_of_it_flushed() -> None:
    """Once every reader with a batch in the micro-batch waits only for its commit
    (Sink.flush), it is due now; while one still reads it waits for its age. A flush by a
    reader with nothing buffered changes nothing; the next micro-batch waits for its own age."""
    b = Batcher(max_rows=100, max_age_s=1.0)
    b.add(SinkBatch("p", (change(1),), 1), now=0.0)
    b.add(SinkBatch("q", (change(2),), 2), now=0.1)
    assert not b.flush("r", now=0.2)  # control: nothing of r is buffered
    assert not b.flush("p", now=0.2)  # q still reads: no small micro-batch of p alone
    assert b.deadline() == 1.0
    assert b.flush("q", now=0.3)
    assert b.deadline() == 0.3
    assert b.due(0.3)
    assert not b.due(0.3, inflight=2)  # held back like an old one while two are in flight
    b.add(SinkBatch("r", (change(3),), 3), now=0.35)  # joins before the cut: rides along
    assert b.due(0.35)
    cut = b.cut()
    assert cut is not None
    assert cut.rows == 3
    b.add(SinkBatch("p", (change(4),), 4), now=0.4)
    assert b.deadline() == 1.4
    assert not b.due(0.5)


def test_batcher_rejects_bad_limits() -> None:
    with pytest.raises(ValueError, match="max_rows"):
        Batcher(max_rows=0, max_age_s=1.0)


def test_clear_error_when_java_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SparkStartError, match="Java was not found"):
        start_session(
            master="local[2]", remote=None, app_name="x", conf={}, local_dir=str(tmp_path)
        )


@pytest.mark.asyncio
async def test_bridge_refuses_puts_before_start_and_bad_config() -> None:
    bridge = SparkBridge(SparkConfig())
    with pytest.raises(RuntimeError, match="not running"):
        await bridge.put(SinkBatch("p", (), 1))
    assert bridge.stats().puts_refused == 1
    with pytest.raises(ValueError, match="max_inflight_batches"):
        SparkBridge(SparkConfig(max_inflight_batches=0))


def test_read_output_of_nothing_is_empty(tmp_path: Path) -> None:
    table = read_output(str(tmp_path / "none"))
    assert table.num_rows == 0
    assert "batch" in table.column_names


class _FakeFrame:
    def __init__(self, table: Any) -> None:
        self.table = table

    def count(self) -> int:
        return int(self.table.num_rows)


class _FakeSpark:
    """Stands in for a session: the bridge's shell logic without a JVM."""

    def createDataFrame(self, table: object) -> _FakeFrame:
        return _FakeFrame(table)


@pytest.mark.asyncio
@pytest.mark.timeout(20)
async def test_backpressure_bounds_what_is_in_flight(tmp_path: Path) -> None:
    release = threading.Event()
    seen: list[int] = []

    def slow(df: object, batch_id: int) -> None:
        seen.append(batch_id)
        release.wait(10)

    config = SparkConfig(
        output_dir=str(tmp_path), max_rows=2, max_age_s=0.05, max_inflight_batches=1
    )
    async with SparkBridge(config, foreach_batch=slow, spark=_FakeSpark()) as bridge:
        first = await bridge.put(SinkBatch("p", (change(1, mods=2),), 1))  # cut, in flight
        await wait_for(lambda: seen == [0], 5, "the first batch in foreach_batch")
        second = await bridge.put(SinkBatch("p", (change(2, mods=2),), 2))  # fills the buffer
        third = asyncio.ensure_future(bridge.put(SinkBatch("p", (change(3, mods=2),), 3)))
        await wait_for(
            lambda: bridge.stats().inflight == 1 and bridge.stats().buffered_rows == 2,
            5,
            "the buffer full and a batch in flight",
        )
        # the third put waits (here for 0.3 s: a put that did not wait would be done at once)
        done, _ = await asyncio.wait({third}, timeout=0.3)
        assert not done, "put must wait while the buffer is full and a batch in flight"
        assert bridge.stats().inflight == 1
        assert bridge.stats().buffered_rows == 2
        release.set()
        await asyncio.wait_for(asyncio.gather(first, second, await third), 5)
    assert seen == [0, 1, 2]
    stats = bridge.stats()
    assert (stats.rows_committed, stats.batches_committed, stats.inflight) == (6, 3, 0)


@pytest.mark.asyncio
@pytest.mark.timeout(20)
async def test_retry_then_permanent_failure_fails_the_put(tmp_path: Path) -> None:
    calls: list[int] = []

    def broken(df: object, batch_id: int) -> None:
        calls.append(batch_id)
        raise RuntimeError("injected")

    config = SparkConfig(
        output_dir=str(tmp_path),
        max_rows=1,
        max_age_s=0.05,
        max_attempts=3,
        retry_backoff_s=0.01,
        debug_validate=True,
    )
    async with SparkBridge(config, foreach_batch=broken, spark=_FakeSpark()) as bridge:
        future = await bridge.put(SinkBatch("p", (change(5),), 5))
        with pytest.raises(BridgeError, match="failed after 3 attempts"):
            await asyncio.wait_for(future, 5)
        # a later batch of the same partition, past the failed one, is refused until re-read
        later = await bridge.put(SinkBatch("p", (change(6),), 6))
        with pytest.raises(BridgeError, match="re-read"):
            await later
        # a heartbeat past the failed record too (committed, it would record p's position past
        # a record never written: protocol/ledger.py, rule 2); one at the gap is taken
        heartbeat = await bridge.put(SinkBatch("p", (), 6))
        with pytest.raises(BridgeError, match="re-read"):
            await heartbeat
        at_gap = await bridge.put(SinkBatch("p", (), 5))
        assert bridge.ledger.gap("p") == 5
        with pytest.raises(BridgeError, match="failed after 3 attempts"):
            await asyncio.wait_for(at_gap, 5)  # taken (and run: the fake Spark fails it)
    assert calls == [0, 0, 0]  # the heartbeat's run failed before the foreach_batch
    stats = bridge.stats()
    assert (stats.attempts_failed, stats.batches_failed, stats.rows_committed) == (6, 2, 0)
    assert stats.puts_refused == 2
