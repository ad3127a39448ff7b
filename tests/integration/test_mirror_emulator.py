"""``--snapshot --mirror`` through the command line on the Cloud Spanner emulator
(docs/mirror.md), beside tests/integration/test_snapshot_mirror.py and ``python -m bench
mirror`` (whose tables, load and comparison these tests use):

* every Spanner type and NULLs: two tables of every type (one with a composite key), rows NULL
  in every non-key column among them, snapshotted at T, then inserts, full and partial updates
  and deletes after T, with the change stream capturing ``NEW_VALUES`` and
  ``OLD_AND_NEW_VALUES``: the mirror equals a stale read of the database at the final
  completeness watermark, column by column (the control: the same comparison at T differs);
* a T the database no longer keeps: exit 1 and the message saying what to set, nothing written;
* tables that join the change stream after the connector started (docs/mirror.md, "A table
  added later"): one that existed before is not snapshotted (its mirror holds only what changed
  after it joined), one created after T is mirrored whole through its INSERTs.

(Out-of-order commits of two partitions' batches, with the blind control:
tests/integration/test_lake_mirror.py.) Skips, with the reason printed, where the emulator
binary or the embedded broker is absent."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from bench.mirror import Load, compare, fill, mirror_rows
from protocol.commit import completeness_path
from runtime.kafka.broker import EmbeddedBroker
from runtime.lake.mirror import mirror_store, read_mirror
from runtime.lake.store import open_store
from runtime.output_state import OutputState
from runtime.spanner.config import SpannerConfig
from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator, sync_client
from tests.fixtures.kafka import kafka_broker
from tests.fixtures.spanner import until_past
from tests.helpers import REPO, wait_for
from tests.parts import require_part

__all__ = ["kafka_broker"]  # fixture, imported for pytest

pytestmark = [pytest.mark.spanner, pytest.mark.kafka]

UTC = dt.UTC
ROWS = 600  # pre-filled, over both tables
CHUNK_ROWS = 64
TXNS = 80  # the load's transactions after T


def _now() -> int:
    return time.time_ns() // 1000


def _rfc3339(micros: int) -> str:
    when = dt.datetime.fromtimestamp(0, UTC) + dt.timedelta(microseconds=micros)
    return when.isoformat().replace("+00:00", "Z")


@pytest.fixture
def emulator() -> Iterator[SpannerEmulator]:
    try:
        emulator = SpannerEmulator(tables=("Singers", "Albums"))
    except EmulatorUnavailable as exc:
        require_part("the Cloud Spanner emulator", str(exc))
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()


def _args(
    config: SpannerConfig, broker: EmbeddedBroker, out: Path, connector: str, tasks: int = 2
) -> list[str]:
    return [
        *("--source", "spanner", "--spanner-emulator-host", config.emulator_host or ""),
        *("--spanner-project", config.project, "--spanner-instance", config.instance),
        *("--spanner-database", config.database),
        *("--spanner-change-stream", config.change_stream),
        *("--tasks", str(tasks), "--sink", "files", "--table-format", "delta"),
        *("--snapshot", "--mirror", "--snapshot-chunk-rows", str(CHUNK_ROWS)),
        *("--kafka-bootstrap-servers", broker.bootstrap),
        *("--output-dir", str(out), "--progress", "off", "--connector", connector),
    ]


def _run(args: list[str], tmp: Path, name: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "actors.runtime", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=200,
        check=False,
    )
    (tmp / f"{name}.err").write_bytes(proc.stderr)
    return proc.returncode, proc.stdout.decode() + proc.stderr.decode()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("capture", ["NEW_VALUES", "OLD_AND_NEW_VALUES"])
def test_every_type_nulls_and_partial_updates_reach_the_mirror(
    tmp_path: Path, kafka_broker: EmbeddedBroker, emulator: SpannerEmulator, capture: str
) -> None:
    config = emulator.config
    with sync_client(config) as client:
        database = client.instance(config.instance).database(config.database)
        per_table = fill(database, ROWS, capture, config.change_stream)
        load = Load(database, per_table, seed=5)
        at = _now()  # T: after every pre-filled row, before every change of the load
        load.commit(TXNS)
        end = _now() + 500_000
        asyncio.run(until_past(end))
        out = tmp_path / "out"
        connector = f"typed-{capture.lower().replace('_', '-')}"  # the broker serves the module
        args = _args(config, kafka_broker, out, connector)
        code, said = _run(
            [*args, "--start-at", _rfc3339(at), "--end-at", _rfc3339(end)], tmp_path, "run"
        )
        assert code == 0, said
        assert load.kinds["partial"] > 0, load.kinds
        assert load.kinds["delete"] > 0, load.kinds
        data = out / "data"
        got = compare(database, data, at, load, end, connector)
        assert got["snapshot_rows"] == got["rows_at_t"] == ROWS, got
        assert got["stream_rows"] == got["stream_rows_expected"] == len(load.committed), got
        assert (got["lost"], got["duplicates"]) == (0, 0), got
        assert got["mirror_mismatch"] == 0, got["mismatch_examples"]
        assert got["control_mismatch_at_t"] > 0  # the comparison sees a difference
    # NULLs: rows NULL in every non-key column are in the mirror as such
    for table in ("Accounts", "Events"):
        rows, _ = mirror_rows(data, table)
        assert any(all(v is None for v in row) for row in rows.values()), table
    log = DeltaTable(str(data / "Events")).to_pyarrow_table(
        columns=["_mod_type", "_value_capture_type"]
    )
    captured = {
        c
        for m, c in zip(*(log.column(n).to_pylist() for n in log.column_names), strict=True)
        if m != "SNAPSHOT"
    }
    assert captured == {capture}


@pytest.mark.timeout(200)
def test_a_t_too_old_stops_the_run_with_the_clear_error(
    tmp_path: Path, kafka_broker: EmbeddedBroker, emulator: SpannerEmulator
) -> None:
    now = _now()
    old = now - 2 * 3600 * 1_000_000
    out = tmp_path / "out"
    args = _args(emulator.config, kafka_broker, out, "old")
    code, said = _run(
        [*args, "--start-at", _rfc3339(old), "--end-at", _rfc3339(now)], tmp_path, "old"
    )
    assert code == 1, said
    error = [line for line in said.splitlines() if line.startswith("shoal: error:")]
    assert len(error) == 1, said
    assert "version_retention_period=3600 s" in error[0]
    assert "ALTER DATABASE" in error[0]
    assert "--start-at" in error[0]
    # nothing of a snapshot was written: no changelog and no mirror table
    data = out / "data"
    assert [p.name for p in data.glob("*") if not p.name.startswith("_")] == []
    assert not (data / "_mirror").exists()


def _ddl(database: Any, *statements: str) -> None:
    database.update_ddl(list(statements)).result(120)


@pytest.mark.timeout(300)
def test_tables_added_to_the_stream_later(
    tmp_path: Path, kafka_broker: EmbeddedBroker, emulator: SpannerEmulator
) -> None:
    """Singers is watched at T and snapshotted. Albums holds rows at T but joins the change
    stream only after the connector started: it is not snapshotted, and its mirror holds only
    what changed after it joined (a partial update of a row from before makes a row with the
    column it wrote). Later is created after the start and watched from its creation: its
    INSERTs bring every row."""
    from google.cloud import spanner_v1

    key_set: Any = spanner_v1.KeySet
    config = emulator.config
    stream = config.change_stream
    with sync_client(config) as client:
        database = client.instance(config.instance).database(config.database)
        _ddl(database, f"ALTER CHANGE STREAM {stream} SET FOR Singers")
        with database.batch() as b:
            b.insert("Singers", ["Id", "Name", "Value"], [[i, f"s{i}", i] for i in range(50)])
            b.insert("Albums", ["Id", "Name", "Value"], [[i, f"a{i}", i] for i in range(40)])
        at = _now()
        end = at + 25_000_000
        out = tmp_path / "out"
        args = _args(config, kafka_broker, out, "later")
        args += ["--start-at", _rfc3339(at), "--end-at", _rfc3339(end)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        env["PYTHONPATH"] = str(REPO)
        with open(tmp_path / "run.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "actors.runtime", *args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            # the connector's start is in its output once its snapshot (of Singers) is planned
            started = OutputState(out / "data", "later")
            asyncio.run(
                wait_for(
                    lambda: started.read_start() is not None or proc.poll() is not None,
                    90,
                    "the connector's start recorded",
                )
            )
            assert proc.poll() is None, (tmp_path / "run.log").read_text()
            _ddl(
                database,
                "CREATE TABLE Later (Id INT64 NOT NULL, Name STRING(MAX), Value INT64) "
                "PRIMARY KEY (Id)",
            )
            # FOR ALL: the emulator keeps only the last table of a list (``SET FOR Singers,
            # Albums, Later`` left only Later watched, as its CHANGE_STREAM_TABLES said)
            _ddl(database, f"ALTER CHANGE STREAM {stream} SET FOR ALL")
            with database.batch() as b:
                b.update("Albums", ["Id", "Name"], [[1, "renamed"]])  # a row from before
                b.insert("Albums", ["Id", "Name", "Value"], [[100, "new", 7]])
                b.delete("Albums", key_set(keys=[[2]]))
                b.insert("Later", ["Id", "Name", "Value"], [[i, f"l{i}", i] for i in range(30)])
                b.update("Singers", ["Id", "Value"], [[3, 333]])
            assert _micros(b.committed) < end, "the changes came after the run's end"
            code = proc.wait(200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        said = (tmp_path / "run.log").read_text()
        assert code == 0, said
        assert "snapshot: 2/2 partitions done" in said  # Singers' two partitions only
        data = out / "data"
        mark = int(json.loads((data / completeness_path("later")).read_text())["low_watermark_us"])
        assert mark >= end
        store = mirror_store(open_store(str(data)))

        def mirror(table: str) -> dict[int, tuple[Any, Any]]:
            rows = read_mirror(store, table).to_pylist()
            return {int(r["Id"]): (r["Name"], r["Value"]) for r in rows}

        def spanner(table: str) -> dict[int, tuple[Any, Any]]:
            when = dt.datetime.fromtimestamp(0, UTC) + dt.timedelta(microseconds=mark)
            with database.snapshot(read_timestamp=when) as snap:
                got = snap.execute_sql(f"SELECT Id, Name, Value FROM {table}")
                return {int(r[0]): (r[1], r[2]) for r in got}

        # watched at T: snapshotted, then its changes: the database's rows exactly
        assert mirror("Singers") == spanner("Singers")
        assert mirror("Singers")[3] == ("s3", 333)
        # created after the start with the stream watching it: every row, through its INSERTs
        assert mirror("Later") == spanner("Later")
        assert len(spanner("Later")) == 30
        # existed at T, joined later: only what changed after it joined; the partial update
        # of an earlier row has only the column it wrote
        assert mirror("Albums") == {1: ("renamed", None), 100: ("new", 7)}
        assert len(spanner("Albums")) == 40  # the database has the others too (the difference)
        assert "SNAPSHOT" not in _mod_types(data / "Albums")


def _micros(when: dt.datetime) -> int:
    return (when - dt.datetime.fromtimestamp(0, UTC)) // dt.timedelta(microseconds=1)


def _mod_types(path: Path) -> set[str]:
    table = DeltaTable(str(path)).to_pyarrow_table(columns=["_mod_type"])
    return {str(m) for m in table.column(0).to_pylist()}


@pytest.mark.timeout(300)
def test_processes_started_together_share_one_snapshot(
    tmp_path: Path, kafka_broker: EmbeddedBroker, emulator: SpannerEmulator
) -> None:
    """Two processes of one connector started at the same moment with ``--snapshot
    --start-at``: both run to the end and the snapshot is taken once. (The output's start record
    used to be written by the first process at once, and the second, finding it before the
    sync topic held the snapshot, refused to run: exit 2, "already started".)"""
    config = emulator.config
    with sync_client(config) as client:
        database = client.instance(config.instance).database(config.database)
        with database.batch() as b:
            b.insert("Singers", ["Id", "Name", "Value"], [[i, f"s{i}", i] for i in range(300)])
            b.insert("Albums", ["Id", "Name", "Value"], [[i, f"a{i}", i] for i in range(200)])
        at = _now()
        end = at + 8_000_000
        out = tmp_path / "out"
        args = _args(config, kafka_broker, out, "together", tasks=1)
        args += ["--start-at", _rfc3339(at), "--end-at", _rfc3339(end)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        env["PYTHONPATH"] = str(REPO)
        procs = []
        for n in range(2):
            with open(tmp_path / f"p{n}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "actors.runtime", "--task-id", f"p{n}", *args],
                        cwd=REPO,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        try:
            codes = [p.wait(200) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        logs = [(tmp_path / f"p{n}.log").read_text() for n in range(2)]
        assert codes == [0, 0], logs
        data = out / "data"
        for table, rows in (("Singers", 300), ("Albums", 200)):
            log = DeltaTable(str(data / table)).to_pyarrow_table(columns=["_mod_type", "Id"])
            ids = sorted(r["Id"] for r in log.to_pylist() if r["_mod_type"] == "SNAPSHOT")
            assert ids == list(range(rows)), table  # every row once
            mirror = read_mirror(mirror_store(open_store(str(data))), table)
            assert mirror.num_rows == rows
