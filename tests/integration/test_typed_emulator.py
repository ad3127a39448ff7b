"""The typed per-table changelog end to end on the Cloud Spanner emulator: a table with every
column type, a composite key, NULLs, an update, a delete and a column added mid-stream, read by
the real ``SpannerSource`` and written by the file sink in the typed layout (the default); the
output read back with pyarrow, and once with Spark's ``mergeSchema``, holds exactly the changes
committed, in their types.

Skips, with the reason printed, where the emulator binary is absent. Emulator 1.5.28 quirks
avoided here: an ARRAY with a NULL element crashes it (``Check failed: Null value``), and it sends
FLOAT64 NaN and infinities as JSON null (Spanner sends ``"NaN"`` / ``"Infinity"``; the unit tests
in tests/shells/test_typed.py cover those)."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import decimal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from protocol.records import ChangeRecord, DataChange
from runtime.files.sink import FileSink
from runtime.files.typed import read_table
from runtime.ports import SinkBatch
from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator, sync_client
from runtime.spanner.loadgen import LoadGenerator
from runtime.spanner.reader import SpannerSource, walk_stream
from tests.fixtures.spanner import until_past
from tests.fixtures.spark import spark
from tests.parts import require_part

__all__ = ["spark"]  # fixture, imported for pytest

pytestmark = pytest.mark.spanner

UTC = dt.UTC
D = decimal.Decimal
DDL = """CREATE TABLE Everything (
  K1 STRING(MAX) NOT NULL, K2 INT64 NOT NULL,
  I INT64, F FLOAT64, F32 FLOAT32, N NUMERIC, S STRING(MAX), J JSON, B BYTES(MAX), BO BOOL,
  D DATE, T TIMESTAMP, A_I ARRAY<INT64>, A_S ARRAY<STRING(MAX)>, A_F ARRAY<FLOAT64>,
  A_B ARRAY<BYTES(MAX)>, A_D ARRAY<DATE>, A_T ARRAY<TIMESTAMP>, A_N ARRAY<NUMERIC>,
  A_J ARRAY<JSON>, A_BO ARRAY<BOOL>
) PRIMARY KEY (K1, K2)"""
COLUMNS = ["K1", "K2", "I", "F", "F32", "N", "S", "J", "B", "BO", "D", "T"]
COLUMNS += ["A_I", "A_S", "A_F", "A_B", "A_D", "A_T", "A_N", "A_J", "A_BO"]
T1 = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
T2 = dt.datetime(2020, 1, 1, tzinfo=UTC)
# what the table reads as (NULL-free arrays: see the module docstring)
FULL: dict[str, Any] = {
    "K1": "a",
    "K2": 1,
    "I": 2**62,
    "F": 1.5,
    "F32": 2.5,
    "N": D("12345.123456789"),
    "S": "héllo",
    "J": '{"x":[1,2]}',
    "B": b"\x00\xffab",
    "BO": True,
    "D": dt.date(2024, 2, 29),
    "T": T1,
    "A_I": [1, 2, 3],
    "A_S": ["x", "y"],
    "A_F": [0.5, 1.0],
    "A_B": [b"\x01"],
    "A_D": [dt.date(2020, 1, 1)],
    "A_T": [T2],
    "A_N": [D("1.5")],
    "A_J": ['{"a":1}'],
    "A_BO": [True, False],
}
TYPES = {
    "K1": pa.string(),
    "K2": pa.int64(),
    "I": pa.int64(),
    "F": pa.float64(),
    "F32": pa.float32(),
    "N": pa.decimal128(38, 9),
    "S": pa.string(),
    "J": pa.string(),
    "B": pa.binary(),
    "BO": pa.bool_(),
    "D": pa.date32(),
    "T": pa.timestamp("us", tz="UTC"),
    "A_I": pa.list_(pa.int64()),
    "A_S": pa.list_(pa.string()),
    "A_F": pa.list_(pa.float64()),
    "A_B": pa.list_(pa.binary()),
    "A_D": pa.list_(pa.date32()),
    "A_T": pa.list_(pa.timestamp("us", tz="UTC")),
    "A_N": pa.list_(pa.decimal128(38, 9)),
    "A_J": pa.list_(pa.string()),
    "A_BO": pa.list_(pa.bool_()),
    "Extra": pa.string(),
}


def _client_value(name: str, value: Any) -> Any:
    """``FULL[name]`` as the Python client takes it (BYTES base64, JSON as JsonObject)."""
    from google.cloud import spanner_v1

    json_object: Any = spanner_v1.JsonObject
    if name == "B":
        return base64.b64encode(value)
    if name == "A_B":
        return [base64.b64encode(v) for v in value]
    if name == "J":
        return json_object({"x": [1, 2]})
    if name == "A_J":
        return [json_object({"a": 1})]
    return value


class Written:
    """What the fixture committed and where the file sink put it."""

    def __init__(self, out: Path, records: list[DataChange], alter_ts: int) -> None:
        self.out = out
        self.records = records
        self.alter_ts = alter_ts


async def _write_and_read(emulator: SpannerEmulator, out: Path) -> Written:
    from google.cloud import spanner_v1

    key_set: Any = spanner_v1.KeySet
    config = emulator.config
    with sync_client(config) as client:
        client.instance(config.instance).database(config.database).update_ddl([DDL]).result(120)
    start = int(time.time() * 1e6)
    loader = await LoadGenerator.connect(config, emulator.tables)
    db: Any = loader._db  # the load generator's async database: plain batches below

    async def commit(apply: Any) -> None:
        async with asyncio.timeout(60), db.batch() as batch:
            apply(batch)

    try:
        full = [_client_value(c, FULL[c]) for c in COLUMNS]
        await commit(lambda b: b.insert("Everything", COLUMNS, [full]))
        await commit(lambda b: b.insert("Everything", ["K1", "K2"], [["b", 2]]))  # NULLs
        await commit(
            lambda b: b.update("Everything", ["K1", "K2", "N", "S"], [["a", 1, D(2), None]])
        )
        await commit(lambda b: b.delete("Everything", key_set(keys=[["b", 2]])))
        with sync_client(config) as client:
            database = client.instance(config.instance).database(config.database)
            database.update_ddl(["ALTER TABLE Everything ADD COLUMN Extra STRING(MAX)"]).result(120)
        alter_ts = int(time.time() * 1e6)
        await commit(lambda b: b.insert("Everything", ["K1", "K2", "Extra"], [["c", 3, "new"]]))
    finally:
        await loader.close()
    end = int(time.time() * 1e6) + 1_000_000
    await until_past(end)  # a query over the past is answered complete
    batches: list[tuple[str, list[ChangeRecord]]] = []
    source = await SpannerSource.connect(config)
    try:
        await walk_stream(source, start, end, on_batch=lambda t, b: batches.append((t, list(b))))
    finally:
        await source.close()
    records = sorted(
        (r for _, batch in batches for r in batch if isinstance(r, DataChange)),
        key=lambda r: (r.commit_ts, r.record_sequence),
    )
    # two micro-batches: the changes before the ALTER, then the one after (a file with Extra)
    async with FileSink(out, max_age_s=0.05) as sink:
        for before in (True, False):
            futures = []
            for token, batch in batches:
                mine = tuple(
                    r
                    for r in batch
                    if isinstance(r, DataChange) and (r.commit_ts < alter_ts) == before
                )
                if mine:
                    futures.append(await sink.put(SinkBatch(token, mine, mine[-1].commit_ts)))
            for future in futures:
                await future
    return Written(out, records, alter_ts)


@pytest.fixture(scope="module")
def written() -> Iterator[Written]:
    try:
        emulator = SpannerEmulator(tables=("T0",))
    except EmulatorUnavailable as exc:
        print(f"SKIP typed changelog emulator tests: {exc}")
        require_part("the Cloud Spanner emulator", str(exc))
    emulator.start()
    with tempfile.TemporaryDirectory(prefix="shoal-typed-") as tmp:
        try:
            yield asyncio.run(_write_and_read(emulator, Path(tmp) / "data"))
        finally:
            emulator.stop()


def _expected() -> list[tuple[str, dict[str, Any]]]:
    """(mod type, the columns that differ from all-NULL) of each change, in commit order."""
    return [
        ("INSERT", {"K1": "a", "K2": 1, "I": FULL["I"]}),  # the first write: a row of FULL
        ("INSERT", {"K1": "b", "K2": 2}),
        ("UPDATE", {"K1": "a", "K2": 1, "N": D(2)}),
        ("DELETE", {"K1": "b", "K2": 2}),
        ("INSERT", {"K1": "c", "K2": 3, "Extra": "new"}),
    ]


def test_typed_output_equals_what_was_committed(written: Written) -> None:
    table = read_table(written.out, "Everything")
    schema = table.schema
    for name, arrow in TYPES.items():
        assert schema.field(name).type == arrow, name
    assert schema.field("_commit_ts").type == pa.timestamp("us", tz="UTC")
    assert schema.field("_old_N").type == pa.decimal128(38, 9)  # OLD_AND_NEW_VALUES stream
    rows = sorted(table.to_pylist(), key=lambda r: (r["_commit_ts"], r["_record_sequence"]))
    assert len(rows) == len(written.records) == 5
    for row, record in zip(rows, written.records, strict=True):
        assert row["_commit_ts"] == dt.datetime.fromtimestamp(0, UTC) + dt.timedelta(
            microseconds=record.commit_ts
        )
        assert row["_server_transaction_id"] == record.server_transaction_id
        assert row["_record_sequence"] == record.record_sequence
        assert row["_mod_index"] == 0
        assert row["_value_capture_type"] == "OLD_AND_NEW_VALUES"
        assert row["_is_system_transaction"] is False
        assert row["_number_of_records_in_transaction"] == 1
    first, null_row, update, delete, added = rows
    assert [r["_mod_type"] for r in rows] == [m for m, _ in _expected()]
    assert {k: first[k] for k in FULL} == FULL  # every type, every value
    assert first["Extra"] is None  # the older file has no Extra: merged in as null
    assert all(null_row[k] is None for k in FULL if k not in ("K1", "K2"))
    assert (null_row["K1"], null_row["K2"]) == ("b", 2)
    # an UPDATE holds the columns it wrote (others null), and their old values
    assert (update["K1"], update["K2"], update["N"], update["S"]) == ("a", 1, D(2), None)
    assert sorted(update["_columns"]) == ["N", "S"]
    assert (update["_old_N"], update["_old_S"]) == (FULL["N"], "héllo")
    assert update["I"] is None
    # a DELETE: the key, no new values, the old values of the row
    assert (delete["K1"], delete["K2"], delete["_columns"]) == ("b", 2, [])
    assert (added["K1"], added["K2"], added["Extra"]) == ("c", 3, "new")
    # the added column is in the later file only
    batches = sorted({r["batch"] for r in rows})
    assert len(batches) == 2
    assert {r["batch"] for r in rows if r["_commit_ts"].timestamp() * 1e6 >= written.alter_ts} == {
        added["batch"]
    }


@pytest.mark.spark
def test_spark_reads_the_typed_table_with_merge_schema(written: Written, spark: Any) -> None:
    from pyspark.sql import types as st

    df = spark.read.option("mergeSchema", "true").parquet(str(written.out / "Everything"))
    fields = {f.name: f.dataType for f in df.schema.fields}
    assert fields["K2"] == st.LongType()
    assert fields["F32"] == st.FloatType()
    assert fields["N"] == st.DecimalType(38, 9)
    assert fields["B"] == st.BinaryType()
    assert fields["D"] == st.DateType()
    assert fields["T"] == st.TimestampType()
    assert fields["A_T"] == st.ArrayType(st.TimestampType())
    assert fields["_commit_ts"] == st.TimestampType()
    assert fields["Extra"] == st.StringType()  # only in the later file: merged
    rows = df.orderBy("_commit_ts", "_record_sequence").collect()
    assert [r["_mod_type"] for r in rows] == [m for m, _ in _expected()]
    first = rows[0].asDict()
    assert {k: first[k] for k in ("K1", "K2", "I", "N", "B", "D", "A_I", "A_B")} == {
        k: FULL[k] for k in ("K1", "K2", "I", "N", "B", "D", "A_I", "A_B")
    }
    assert rows[-1]["Extra"] == "new"
    assert rows[0]["Extra"] is None
    # the latest state per key, as docs/reading-output.md builds it
    df.createOrReplaceTempView("everything")
    latest = spark.sql(
        """SELECT K1, K2, _mod_type FROM (
             SELECT *, row_number() OVER (PARTITION BY K1, K2
               ORDER BY _commit_ts DESC, _record_sequence DESC, _mod_index DESC) AS _row
             FROM everything) WHERE _row = 1 AND _mod_type != 'DELETE' ORDER BY K1"""
    ).collect()
    assert [(r["K1"], r["K2"]) for r in latest] == [("a", 1), ("c", 3)]
    # partial UPDATE rows (OLD_AND_NEW_VALUES): each column from the newest row that wrote it
    merged = spark.sql(
        """SELECT K1, K2,
             max_by(I, CASE WHEN array_contains(_columns, 'I') OR _mod_type = 'INSERT'
                       THEN struct(_commit_ts, _record_sequence, _mod_index) END) AS I,
             max_by(S, CASE WHEN array_contains(_columns, 'S') OR _mod_type = 'INSERT'
                       THEN struct(_commit_ts, _record_sequence, _mod_index) END) AS S,
             max_by(N, CASE WHEN array_contains(_columns, 'N') OR _mod_type = 'INSERT'
                       THEN struct(_commit_ts, _record_sequence, _mod_index) END) AS N,
             max_by(_mod_type, struct(_commit_ts, _record_sequence, _mod_index)) AS last_mod
           FROM everything GROUP BY K1, K2 HAVING last_mod != 'DELETE' ORDER BY K1"""
    ).collect()
    assert [(r["K1"], r["I"], r["S"], r["N"]) for r in merged] == [
        ("a", FULL["I"], None, D(2)),
        ("c", None, None, None),
    ]
