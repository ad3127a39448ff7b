"""PostgreSQL-dialect databases on the Cloud Spanner emulator: the source asks the database its
dialect, reads the change stream with ``spanner."read_json_<stream>"``, and the records — through
partition splits and merges (partitions end every 2–4 s) — are exactly the changes committed,
with the typed output in the same Arrow types as a GoogleSQL database's.

Skips, with the reason printed, where the emulator binary is absent. Emulator 1.5.28 quirks
avoided here (PostgreSQL dialect): an array with a NULL element of text, float8, float4, bytea,
bool or timestamptz crashes it (``Check failed: Null value``; bigint, numeric, date and jsonb
arrays survive, but it sends their NULL elements as the string ``"NULL"``); float8 NaN and
infinities arrive as JSON null; timestamptz values arrive truncated to whole seconds."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from protocol.records import ChildPartitions, DataChange
from runtime.files.typed import read_table
from runtime.spanner.emulator import SpannerEmulator, sync_client
from runtime.spanner.reader import (
    GOOGLE_SQL,
    POSTGRESQL,
    SpannerSource,
    UnsupportedDialect,
    walk_stream,
)
from runtime.typed import typed_tables
from tests.fixtures.spanner import churn_emulator, until_past
from tests.helpers import REPO

__all__ = ["churn_emulator"]  # fixture, imported for pytest

pytestmark = pytest.mark.spanner

UTC = dt.UTC
DB = "pgdb"
DDL = [
    """CREATE TABLE everything (
      k1 varchar NOT NULL, k2 bigint NOT NULL,
      i bigint, f8 float8, f4 float4, n numeric, s varchar, tx text, j jsonb, b bytea, bo bool,
      d date, ts timestamptz, a_i bigint[], a_s text[], a_f float8[], a_b bytea[], a_d date[],
      a_t timestamptz[], a_n numeric[], a_j jsonb[], a_bo bool[],
      PRIMARY KEY (k1, k2))""",
    "CREATE TABLE small (id bigint PRIMARY KEY, v text)",
    # unquoted: PostgreSQL stores it as pgstream; the test asks for PgStream
    "CREATE CHANGE STREAM PgStream FOR ALL WITH (value_capture_type = 'OLD_AND_NEW_VALUES')",
]
FULL_SQL = (
    "INSERT INTO everything (k1, k2, i, f8, f4, n, s, tx, j, b, bo, d, ts, a_i, a_s, a_f, a_b, "
    "a_d, a_t, a_n, a_j, a_bo) VALUES ('a', 1, 4611686018427387904, 1.5, 2.5, "
    "12345678901234567890.123456789, 'héllo', 'text', '{\"x\": [1, 2]}', '\\x00ff6162'::bytea, "
    "true, '2024-02-29', '2024-01-02T03:04:05Z', ARRAY[1, 2, 3]::bigint[], ARRAY['x', 'y'], "
    "ARRAY[0.5, 1.0]::float8[], ARRAY['\\x01'::bytea], ARRAY['2020-01-01'::date], "
    "ARRAY['2020-01-01T00:00:00Z'::timestamptz], ARRAY[1.5]::numeric[], "
    "ARRAY['{\"a\": 1}'::jsonb], ARRAY[true, false])"
)
# what the typed output holds for the row FULL_SQL wrote
FULL: dict[str, Any] = {
    "k1": "a",
    "k2": 1,
    "i": 2**62,
    "f8": 1.5,
    "f4": 2.5,
    "n": "12345678901234567890.123456789",  # numeric: its exact text (no decimal holds NaN)
    "s": "héllo",
    "tx": "text",
    "j": '{"x": [1, 2]}',
    "b": b"\x00\xffab",
    "bo": True,
    "d": dt.date(2024, 2, 29),
    "ts": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
    "a_i": [1, 2, 3],
    "a_s": ["x", "y"],
    "a_f": [0.5, 1.0],
    "a_b": [b"\x01"],
    "a_d": [dt.date(2020, 1, 1)],
    "a_t": [dt.datetime(2020, 1, 1, tzinfo=UTC)],
    "a_n": ["1.5"],
    "a_j": ['{"a": 1}'],
    "a_bo": [True, False],
}
TYPES = {
    "k1": pa.string(),
    "k2": pa.int64(),
    "i": pa.int64(),
    "f8": pa.float64(),
    "f4": pa.float32(),
    "n": pa.string(),
    "s": pa.string(),
    "tx": pa.string(),
    "j": pa.string(),
    "b": pa.binary(),
    "bo": pa.bool_(),
    "d": pa.date32(),
    "ts": pa.timestamp("us", tz="UTC"),
    "a_i": pa.list_(pa.int64()),
    "a_s": pa.list_(pa.string()),
    "a_f": pa.list_(pa.float64()),
    "a_b": pa.list_(pa.binary()),
    "a_d": pa.list_(pa.date32()),
    "a_t": pa.list_(pa.timestamp("us", tz="UTC")),
    "a_n": pa.list_(pa.string()),
    "a_j": pa.list_(pa.string()),
    "a_bo": pa.list_(pa.bool_()),
}
SMALL = 12  # single-row commits to the small table, spread over ~6 s of partition churn


class Committed:
    def __init__(self, start: int, end: int, small_ids: list[int]) -> None:
        self.start = start
        self.end = end
        self.small_ids = small_ids


def _commit_all(emulator: SpannerEmulator) -> Committed:
    from google.cloud.spanner_admin_database_v1.types import DatabaseDialect

    config = emulator.config
    with sync_client(config) as client:
        db: Any = client.instance(config.instance).database(
            DB, database_dialect=DatabaseDialect.POSTGRESQL
        )
        db.create().result(60)
        db.update_ddl(DDL).result(60)
        start = int(time.time() * 1e6)

        def run(*sql: str) -> None:
            db.run_in_transaction(lambda tx: [tx.execute_update(s) for s in sql])

        run(FULL_SQL)
        run("INSERT INTO everything (k1, k2) VALUES ('b', 2)")  # NULLs
        run("UPDATE everything SET n = 'NaN', s = NULL WHERE k1 = 'a' AND k2 = 1")
        run("DELETE FROM everything WHERE k1 = 'b' AND k2 = 2")
        for i in range(SMALL):
            run(f"INSERT INTO small (id, v) VALUES ({i}, 'v{i}')")
            time.sleep(0.5)
        run("UPDATE small SET v = 'w' WHERE id = 0", "DELETE FROM small WHERE id = 1")
        end = int(time.time() * 1e6)
    return Committed(start, end, list(range(SMALL)))


@pytest.fixture(scope="module")
def committed(churn_emulator: SpannerEmulator) -> Committed:
    return _commit_all(churn_emulator)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_postgresql_change_stream_reads_what_was_committed(
    churn_emulator: SpannerEmulator, committed: Committed
) -> None:
    config = churn_emulator.config
    async with await SpannerSource.connect(config) as source:
        assert await source.detect_dialect(config.database) == GOOGLE_SQL  # control
    pg_config = config.__class__(**{**_fields(config), "database": DB, "change_stream": "PgStream"})
    async with await SpannerSource.connect(pg_config) as source:
        assert await source.detect_dialect(DB) == POSTGRESQL
        assert 'spanner."read_json_pgstream"' in source._sql  # the stored (folded) name
        end = committed.end + 1_000_000
        await until_past(end)  # a query over the past is answered complete
        result = await walk_stream(source, committed.start, end)
    # partition churn happened while the commits went on: children with parents were read
    assert any(parents for _, parents in result.partitions.values()), result.partitions
    assert result.child_records > 1
    data = sorted(result.data, key=lambda r: (r.commit_ts, r.record_sequence))
    summary = [(r.table, r.mod_type, [m.keys for m in r.mods]) for r in data]
    assert summary == [
        ("everything", "INSERT", ['{"k1":"a","k2":"1"}']),
        ("everything", "INSERT", ['{"k1":"b","k2":"2"}']),
        ("everything", "UPDATE", ['{"k1":"a","k2":"1"}']),
        ("everything", "DELETE", ['{"k1":"b","k2":"2"}']),
        *[("small", "INSERT", [f'{{"id":"{i}"}}']) for i in committed.small_ids],
        ("small", "UPDATE", ['{"id":"0"}']),
        ("small", "DELETE", ['{"id":"1"}']),
    ], summary
    update = data[2]
    # (the emulator's PostgreSQL UPDATE sends every column as written, not only n and s)
    assert json.loads(update.mods[0].new_values) | {"n": "NaN", "s": None} == json.loads(
        update.mods[0].new_values
    )
    assert update.value_capture_type == "OLD_AND_NEW_VALUES"
    assert all(not isinstance(r, ChildPartitions) for r in data)

    tables = typed_tables([("t", [r for r in data if isinstance(r, DataChange)])])
    everything = tables["everything"]
    for name, arrow in TYPES.items():
        assert everything.schema.field(name).type == arrow, name
    rows = everything.to_pylist()
    first, nulls, changed, deleted = rows
    assert {k: first[k] for k in FULL} == FULL  # every type, every value
    assert all(nulls[k] is None for k in FULL if k not in ("k1", "k2"))
    assert (changed["n"], changed["s"], changed["_old_n"], changed["_old_s"]) == (
        "NaN",
        None,
        FULL["n"],
        "héllo",
    )
    assert (deleted["k1"], deleted["k2"], deleted["_mod_type"]) == ("b", 2, "DELETE")
    small = tables["small"].to_pylist()
    assert [(r["id"], r["v"]) for r in small[:SMALL]] == [(i, f"v{i}") for i in range(SMALL)]
    assert base64.b64encode(first["b"]) == b"AP9hYg=="


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_change_stream_the_postgresql_database_lacks_is_a_clear_error(
    churn_emulator: SpannerEmulator, committed: Committed
) -> None:
    config = churn_emulator.config
    pg_config = config.__class__(**{**_fields(config), "database": DB, "change_stream": "Nope"})
    async with await SpannerSource.connect(pg_config) as source:
        with pytest.raises(
            UnsupportedDialect,
            match=r"PostgreSQL-dialect database 'pgdb' has no change stream 'Nope' "
            r"\(it has \['pgstream'\]\)",
        ):
            await source.detect_dialect(DB)


def _fields(config: Any) -> dict[str, Any]:
    return {f: getattr(config, f) for f in config.__struct_fields__}


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_the_cli_writes_the_postgresql_changes_typed(
    churn_emulator: SpannerEmulator, committed: Committed, tmp_path: Path
) -> None:
    """``--source spanner`` on the PostgreSQL-dialect database, bounded by ``--start-at`` /
    ``--end-at``: the run exits 0 by itself and the typed output holds the committed changes."""
    out = tmp_path / "out"
    proc = _cli(
        churn_emulator,
        out,
        "--start-at",
        _rfc3339(committed.start),
        "--end-at",
        _rfc3339(committed.end),
    )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err + proc.stdout.decode()
    everything = read_table(out / "data", "everything")
    assert everything.schema.field("n").type == pa.string()
    rows = sorted(everything.to_pylist(), key=lambda r: (r["_commit_ts"], r["_record_sequence"]))
    assert [r["_mod_type"] for r in rows] == ["INSERT", "INSERT", "UPDATE", "DELETE"]
    assert {k: rows[0][k] for k in FULL} == FULL
    small = read_table(out / "data", "small").to_pylist()
    assert sorted((r["id"], r["_mod_type"]) for r in small) == sorted(
        [(i, "INSERT") for i in range(SMALL)] + [(0, "UPDATE"), (1, "DELETE")]
    )


def _rfc3339(micros: int) -> str:
    when = dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(microseconds=micros)
    return when.isoformat().replace("+00:00", "Z")


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_start_too_far_in_the_past_is_a_bad_option_in_postgresql_too(
    churn_emulator: SpannerEmulator, committed: Committed, tmp_path: Path
) -> None:
    proc = _cli(churn_emulator, tmp_path / "out", "--start-at", "2020-01-01T00:00:00Z")
    err = proc.stderr.decode()
    assert proc.returncode == 2, err + proc.stdout.decode()
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, err
    assert lines[0].startswith(  # from the stream's options, read in the PostgreSQL dialect
        "shoal: error: start_at 2020-01-01T00:00:00Z (--start-at) is older than change stream "
        "PgStream's retention_period 1d: the oldest start it keeps records for is "
    ), lines[0]
    assert "Traceback" not in err


def _cli(emulator: SpannerEmulator, out: Path, *extra: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI on the PostgreSQL-dialect database (one task, file sink, embedded broker)."""
    config = emulator.config
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "actors.runtime",
            "--source",
            "spanner",
            "--spanner-emulator-host",
            config.emulator_host or "",
            "--spanner-project",
            config.project,
            "--spanner-instance",
            config.instance,
            "--spanner-database",
            DB,
            "--spanner-change-stream",
            "PgStream",
            "--sink",
            "files",
            "--output-dir",
            str(out),
            "--progress",
            "off",
            "--tasks",
            "1",
            *extra,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=100,
        check=False,
    )
