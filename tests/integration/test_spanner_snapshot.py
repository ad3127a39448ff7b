"""The snapshot adapter (``runtime.spanner.snapshot``) on the Cloud Spanner emulator: a table with
every column type, NULLs and a composite key, 5,600 rows, split into partitions at a read
timestamp T; the partitions' rows add up to the table exactly once, a partition read in another
process from its serialised form gives the same chunks, every row's keys / new_values / column
types are exactly what the change stream gave for the same row, and a T too old for the database
gives the clear retention error.

Skips, with the reason printed, where the emulator binary is absent. Emulator 1.5.28 quirks kept
out of the comparison (see the module docstring of ``runtime.spanner.snapshot``): its change
records drop TIMESTAMP fractions, so the compared rows hold whole-second timestamps, and a NULL
array element crashes it, so arrays hold none."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import decimal
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from protocol.records import DataChange
from runtime.ports import Unrecoverable
from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator, sync_client
from runtime.spanner.reader import SpannerSource, walk_stream
from runtime.spanner.snapshot import (
    DEFAULT_RETENTION_S,
    SnapshotChunk,
    SnapshotPartition,
    SnapshotSessionLost,
    SnapshotTooOld,
    check_retention,
    classify_read_error,
    parse_retention_period,
    plan_snapshot,
    read_partition,
    release_snapshot,
)
from tests.parts import require_part

pytestmark = pytest.mark.spanner

UTC = dt.UTC
D = decimal.Decimal
ROWS = 5_600
DDL = """CREATE TABLE Everything (
  K1 STRING(MAX) NOT NULL, K2 INT64 NOT NULL,
  I INT64, F FLOAT64, F32 FLOAT32, N NUMERIC, S STRING(MAX), J JSON, B BYTES(MAX), BO BOOL,
  D DATE, T TIMESTAMP, A_I ARRAY<INT64>, A_S ARRAY<STRING(MAX)>, A_F ARRAY<FLOAT64>,
  A_B ARRAY<BYTES(MAX)>, A_D ARRAY<DATE>, A_T ARRAY<TIMESTAMP>, A_N ARRAY<NUMERIC>,
  A_J ARRAY<JSON>, A_BO ARRAY<BOOL>
) PRIMARY KEY (K1, K2)"""
COLUMNS = ["K1", "K2", "I", "F", "F32", "N", "S", "J", "B", "BO", "D", "T"]
COLUMNS += ["A_I", "A_S", "A_F", "A_B", "A_D", "A_T", "A_N", "A_J", "A_BO"]
FLOATS = [1.0, 0.1, 1e16, 1e-7, -0.0, 1e300, 5e-324, 123456789.0, 3.14159, -2.5]


def _row(i: int) -> list[Any]:
    """Row ``i`` as the client takes it; every fifth row is NULL outside its key."""
    from google.cloud import spanner_v1

    json_object: Any = spanner_v1.JsonObject
    key = [f"k{i % 7}-é", i * 3 - ROWS]  # a composite key, negative INT64s too
    if i % 5 == 0:
        return [*key] + [None] * (len(COLUMNS) - 2)
    when = dt.datetime(2020, 1, 1, tzinfo=UTC) + dt.timedelta(seconds=i * 7919)
    return [
        *key,
        (i * 2**40) * (-1 if i % 2 else 1),
        FLOATS[i % len(FLOATS)] * (i + 1),
        i * 0.1,
        D(f"{i}.{i % 1000:03d}"),  # trailing zeros (e.g. 10.010) as the client writes them
        f'q"\\\n\u0001/<>&\u2028😀 {i}',
        json_object({"z": [1.5, None, "x"], "a": {"y": i, "é": True}}),
        base64.b64encode(i.to_bytes(4, "big")),
        i % 3 == 0,
        dt.date(1, 1, 1) + dt.timedelta(days=i * 131),
        when,
        [i, -i, 2**63 - 1],
        ["", f"s{i}"],
        [0.5, float(i)],
        [base64.b64encode(b"\x00\xff")] if i % 2 else [],
        [dt.date(2024, 2, 29)],
        [when, when + dt.timedelta(days=1)],
        [D("-0.000000001"), D(i)],
        [json_object([1, 2]), json_object({"b": 1, "a": "é"})],
        [True, False],
    ]


class World:
    def __init__(self, emulator: SpannerEmulator, database: Any, t: int, stream: list[Any]):
        self.emulator = emulator
        self.database = database
        self.t = t
        self.stream = stream  # the change stream's INSERT records of Everything


def _read_stream(emulator: SpannerEmulator, start: int, end: int) -> list[DataChange]:
    async def go() -> list[DataChange]:
        source = await SpannerSource.connect(emulator.config)
        try:
            walked = await walk_stream(source, start, end)
        finally:
            await source.close()
        return [r for r in walked.data if isinstance(r, DataChange) and r.table == "Everything"]

    return asyncio.run(go())


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    try:
        emulator = SpannerEmulator(tables=("T0",))
    except EmulatorUnavailable as exc:
        print(f"SKIP spanner snapshot emulator tests: {exc}")
        require_part("the Cloud Spanner emulator", str(exc))
    emulator.start()
    try:
        config = emulator.config
        with sync_client(config) as client:
            database = client.instance(config.instance).database(config.database)
            database.update_ddl([DDL]).result(120)
            start = int(time.time() * 1e6)
            for lo in range(0, ROWS, 700):
                with database.batch() as batch:
                    batch.insert("Everything", COLUMNS, [_row(i) for i in range(lo, lo + 700)])
            t = int(time.time() * 1e6)
            stream = _read_stream(emulator, start, t + 1_000_000)
            yield World(emulator, database, t, stream)
    finally:
        emulator.stop()


@pytest.fixture(scope="module")
def plan(world: World) -> list[SnapshotPartition]:
    return plan_snapshot(world.database, ["Everything", "T0"], world.t)


def _read_all(world: World, plan: list[SnapshotPartition], chunk_rows: int) -> list[SnapshotChunk]:
    return [c for item in plan for c in read_partition(world.database, item, chunk_rows)]


def _fullest(world: World, plan: list[SnapshotPartition]) -> SnapshotPartition:
    """The Everything partition with the most rows (the emulator may give empty ones)."""
    rows = {
        p.id: sum(c.rows for c in read_partition(world.database, p, 10_000))
        for p in plan
        if p.table == "Everything"
    }
    return next(p for p in plan if p.id == max(rows, key=lambda i: rows[i]))


def test_partitions_add_up_to_the_table_exactly_once(
    world: World, plan: list[SnapshotPartition]
) -> None:
    everything = [p for p in plan if p.table == "Everything"]
    print(f"partitions: Everything {len(everything)}, T0 {len(plan) - len(everything)}")
    assert len(everything) >= 2  # really split
    assert [p.index for p in everything] == list(range(len(everything)))
    assert all(p.count == len(everything) and p.read_ts == world.t for p in everything)
    assert len({p.id for p in plan}) == len(plan)
    chunks = _read_all(world, plan, 500)
    per = {p.id: sum(c.rows for c in chunks if c.partition == p.id) for p in plan}
    print(f"rows per partition: {per}")
    keys = [m.keys for c in chunks if c.change.table == "Everything" for m in c.change.mods]
    assert len(keys) == ROWS
    assert len(set(keys)) == ROWS
    assert {json.loads(k)["K2"] for k in keys} == {str(i * 3 - ROWS) for i in range(ROWS)}
    # T0 is empty: each of its partitions still yields one (empty) last chunk
    t0 = [c for c in chunks if c.change.table == "T0"]
    assert t0
    assert all(c.last and c.rows == 0 for c in t0)


def test_chunks_have_stable_unique_identities(world: World, plan: list[SnapshotPartition]) -> None:
    item = _fullest(world, plan)
    first = list(read_partition(world.database, item, 300))
    again = list(read_partition(world.database, item, 300))
    assert first == again  # the same rows in the same order: the same chunks
    assert [c.chunk for c in first] == list(range(len(first)))
    assert [c.last for c in first] == [False] * (len(first) - 1) + [True]
    assert all(c.rows == 300 for c in first[:-1])
    assert 0 < first[-1].rows <= 300
    for c in first:
        assert c.partition == item.id
        assert c.change.commit_ts == world.t
        assert c.change.server_transaction_id == f"snapshot:{item.id}"
        assert c.change.record_sequence == str(c.chunk)
        assert c.change.mod_type == "SNAPSHOT"
        assert c.change.is_last_record_in_transaction_in_partition == c.last
    all_chunks = _read_all(world, plan, 300)
    identities = [c.change.identity for c in all_chunks]
    assert len(set(identities)) == len(identities)


def test_a_partition_read_in_another_process_gives_the_same_chunks(
    world: World, plan: list[SnapshotPartition]
) -> None:
    item = _fullest(world, plan)
    wire = msgspec.json.encode({"config": world.emulator.config, "item": item})
    assert msgspec.json.decode(msgspec.json.encode(item), type=SnapshotPartition) == item
    done = subprocess.run(
        [sys.executable, "-m", "tests.proc_snapshot_read", "400"],
        input=wire,
        capture_output=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    there = msgspec.json.decode(done.stdout, type=list[SnapshotChunk])
    here = list(read_partition(world.database, item, 400))
    assert there == here
    assert sum(c.rows for c in there) > 0


def test_rows_are_spelled_exactly_as_the_change_stream_spells_them(
    world: World, plan: list[SnapshotPartition]
) -> None:
    stream = {m.keys: (r, m) for r in world.stream for m in r.mods}
    assert len(stream) == ROWS
    chunks = [c for c in _read_all(world, plan, 1000) if c.change.table == "Everything"]
    compared = 0
    for chunk in chunks:
        for mod in chunk.change.mods:
            record, streamed = stream[mod.keys]
            assert mod.new_values == streamed.new_values, mod.keys
            assert chunk.change.column_types == record.column_types
            compared += 1
    assert compared == ROWS
    # a control: plain json.dumps (Python's float repr) spells some FLOAT32 ties differently
    # from the change stream, and the comparison above would have caught it
    plain = [
        m
        for c in chunks
        for m in c.change.mods
        if json.dumps(
            json.loads(m.new_values), separators=(",", ":"), sort_keys=True, ensure_ascii=False
        )
        != stream[m.keys][1].new_values
    ]
    assert plain


def test_snapshot_keeps_timestamp_fractions(world: World) -> None:
    """The emulator's change records drop a TIMESTAMP's fraction; the snapshot keeps what the
    database holds."""
    with world.database.batch() as batch:
        batch.insert(
            "Everything",
            ["K1", "K2", "T", "A_T"],
            [["frac", 1, dt.datetime(2021, 5, 6, 7, 8, 9, 123400, tzinfo=UTC), []]],
        )
    t = int(time.time() * 1e6)
    items = plan_snapshot(world.database, ["Everything"], t)
    rows = [
        m for i in items for c in read_partition(world.database, i, 10_000) for m in c.change.mods
    ]
    assert len(rows) == ROWS + 1
    frac = next(m for m in rows if json.loads(m.keys) == {"K1": "frac", "K2": "1"})
    assert json.loads(frac.new_values)["T"] == "2021-05-06T07:08:09.1234Z"


def test_retention_check(world: World) -> None:
    now = int(time.time() * 1e6)
    kept = check_retention(world.database, now, now)
    # the emulator lists no version_retention_period: Spanner's default, one hour
    assert kept.period_s == DEFAULT_RETENTION_S
    assert kept.readable_until == now + DEFAULT_RETENTION_S * 1_000_000
    check_retention(world.database, now - 50 * 60 * 1_000_000, now, needed_s=5 * 60)
    with pytest.raises(SnapshotTooOld, match="version_retention_period"):
        check_retention(world.database, now - 50 * 60 * 1_000_000, now, needed_s=15 * 60)
    with pytest.raises(SnapshotTooOld, match="version_retention_period"):
        check_retention(world.database, now - 2 * 3600 * 1_000_000, now)
    assert parse_retention_period("7d") == 7 * 86400
    assert parse_retention_period("90m") == 5400
    assert parse_retention_period("3600s") == 3600
    with pytest.raises(ValueError, match="version_retention_period"):
        parse_retention_period("1 week")


def test_a_read_at_a_too_old_t_gives_the_clear_error(world: World) -> None:
    old = int(time.time() * 1e6) - 3 * 3600 * 1_000_000
    # the emulator keeps schema versions: at T (before the database existed) there is no such
    # table, and planning says so
    with pytest.raises(Unrecoverable, match="does not exist at the snapshot's read timestamp"):
        plan_snapshot(world.database, ["Everything"], old)
    # it still partitions a read at such a T; the partition's read is what it refuses
    from google.cloud import spanner_v1

    key_set: Any = spanner_v1.KeySet
    batch = world.database.batch_snapshot(read_timestamp=dt.datetime.fromtimestamp(old / 1e6, UTC))
    token = next(iter(batch.generate_read_batches("T0", ["Id"], key_set(all_=True))))["partition"]
    state = batch.to_dict()
    item = SnapshotPartition(
        table="T0",
        index=0,
        count=1,
        read_ts=old,
        session=state["session_id"],
        transaction_id=state["transaction_id"],
        token=token,
        columns=("Id",),
        keys=("Id",),
        ordinals=(1,),
    )
    with pytest.raises(SnapshotTooOld, match="version_retention_period") as refused:
        list(read_partition(world.database, item, 10))
    assert "maximum timestamp staleness" in str(refused.value)


def test_a_released_snapshot_cannot_be_read(world: World) -> None:
    """Runs last: releasing ends the batch transaction of the module's snapshot too (on the
    emulator every batch snapshot gets session "0")."""
    items = plan_snapshot(world.database, ["Everything"], int(time.time() * 1e6))
    assert sum(c.rows for i in items for c in read_partition(world.database, i, 10_000)) > 0
    release_snapshot(world.database, items[0])
    with pytest.raises(SnapshotSessionLost, match="planned again"):
        for item in items:
            list(read_partition(world.database, item, 10_000))


def test_other_errors_are_not_called_too_old() -> None:
    from google.api_core import exceptions

    gexc: Any = exceptions
    assert classify_read_error(gexc.FailedPrecondition("Table not found: X"), 0) is None
    assert classify_read_error(gexc.DeadlineExceeded("too old"), 0) is None
    too_old = classify_read_error(
        gexc.FailedPrecondition(
            "Read-only transaction timestamp has exceeded the maximum timestamp staleness"
        ),
        0,
    )
    assert isinstance(too_old, SnapshotTooOld)


def test_float_spelling_rounds_ties_away_from_zero() -> None:
    """The emulator's change-stream spellings seen in the test above, and every text still reads
    back as the same double."""
    from runtime.spanner.snapshot import _float_text

    assert _float_text(128.100006103515625) == "128.10000610351563"  # repr: ...562
    assert _float_text(-515.20001220703125) == "-515.2000122070313"  # repr: ...312
    for x, text in [(1.0, "1.0"), (-0.0, "-0.0"), (1e16, "1e+16"), (5e-324, "5e-324")]:
        assert _float_text(x) == text
    import math
    import random
    import struct

    rng = random.Random(7)
    for _ in range(20_000):
        x = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(63)))[0]
        f32 = struct.unpack("<f", struct.pack("<f", rng.uniform(-1e6, 1e6)))[0]
        for v in (x, f32):
            if math.isfinite(v):  # NaN and infinities come as strings, never numbers
                assert float(_float_text(v)) == v
