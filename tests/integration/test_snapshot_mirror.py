"""``--snapshot --mirror`` end to end on the Cloud Spanner emulator (docs/mirror.md): a database
of two tables with rows, changes after T (updates, deletes, inserts), and one bounded run of the
command line (two tasks, the file sink writing Delta tables). It exits 0 by itself; the changelog
holds every row at T once as a ``SNAPSHOT`` row at T, and the mirror equals a stale read of the
database at the run's final completeness watermark, row for row (the control: the same
comparison with one change left out fails). (A snapshot asked of a connector that already
started, and a T the database no longer keeps: tests/sim/test_nodes_snapshot.py and
tests/integration/test_spanner_snapshot.py.)

Skips, with the reason printed, where the emulator binary or the embedded broker is absent."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from protocol.commit import completeness_path
from runtime.kafka.broker import EmbeddedBroker
from runtime.lake.mirror import mirror_store, read_mirror
from runtime.lake.store import open_store
from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator, sync_client
from tests.fixtures.kafka import kafka_broker
from tests.fixtures.spanner import until_past
from tests.helpers import REPO
from tests.parts import require_part

__all__ = ["kafka_broker"]  # fixture, imported for pytest

pytestmark = [pytest.mark.spanner, pytest.mark.kafka]

UTC = dt.UTC
TABLES = ("Singers", "Albums")
ROWS = 300  # per table at T: several chunks of CHUNK_ROWS in each partition
CHUNK_ROWS = 64
# the rows the changes after T write, per table (below): the stream's part of the changelog
CHANGES = {"Singers": len(range(0, ROWS, 7)) + 2, "Albums": 20 + 15}


def _rfc3339(micros: int) -> str:
    when = dt.datetime.fromtimestamp(0, UTC) + dt.timedelta(microseconds=micros)
    return when.isoformat().replace("+00:00", "Z")


def _now() -> int:
    return time.time_ns() // 1000


def _write(database: Any, apply: Any) -> None:
    with database.batch() as batch:
        apply(batch)


def _rows(database: Any, table: str, at: int) -> dict[int, tuple[str | None, int | None]]:
    """The table as Spanner reads it at ``at`` (Unix micros): a stale read at that timestamp."""
    when = dt.datetime.fromtimestamp(0, UTC) + dt.timedelta(microseconds=at)
    with database.snapshot(read_timestamp=when) as snap:
        got = snap.execute_sql(f"SELECT Id, Name, Value FROM {table}")
        return {int(r[0]): (r[1], None if r[2] is None else int(r[2])) for r in got}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _run(args: list[str], tmp: Path, name: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "actors.runtime", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=150,
        check=False,
    )
    (tmp / f"{name}.err").write_bytes(proc.stderr)
    return proc.returncode, proc.stdout.decode() + proc.stderr.decode()


@pytest.mark.timeout(240)
def test_snapshot_then_stream_into_a_mirror_equal_to_the_database(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    from google.cloud import spanner_v1

    key_set: Any = spanner_v1.KeySet
    try:
        emulator = SpannerEmulator(tables=TABLES)
    except EmulatorUnavailable as exc:
        require_part("the Cloud Spanner emulator", str(exc))
    config = emulator.start()
    try:
        with sync_client(config) as client:
            database = client.instance(config.instance).database(config.database)
            for n, table in enumerate(TABLES):
                rows = [[i, f"{table[0]}{i}", i * (n + 2)] for i in range(ROWS)]
                _write(database, lambda b, t=table, r=rows: b.insert(t, ["Id", "Name", "Value"], r))
            at = _now() + 200_000  # T: after every row above
            time.sleep(0.4)
            # changes after T: the stream's (updates of names only, deletes, new rows)
            _write(
                database,
                lambda b: b.update(
                    "Singers", ["Id", "Name"], [[i, f"renamed{i}"] for i in range(0, ROWS, 7)]
                ),
            )
            _write(database, lambda b: b.delete("Albums", key_set(keys=[[i] for i in range(20)])))
            _write(
                database,
                lambda b: b.insert(
                    "Albums", ["Id", "Name", "Value"], [[ROWS + i, "new", i] for i in range(15)]
                ),
            )
            _write(database, lambda b: b.delete("Singers", key_set(keys=[[5], [ROWS - 1]])))
            end = _now() + 500_000
            asyncio.run(until_past(end))
            at_t = {t: _rows(database, t, at) for t in TABLES}
            assert sum(len(r) for r in at_t.values()) == 2 * ROWS
            out = tmp_path / "out"
            args = [
                *("--source", "spanner", "--spanner-emulator-host", config.emulator_host or ""),
                *("--spanner-project", config.project, "--spanner-instance", config.instance),
                *("--spanner-database", config.database),
                *("--spanner-change-stream", config.change_stream),
                *("--tasks", "2", "--sink", "files", "--table-format", "delta"),
                *("--snapshot", "--mirror", "--snapshot-chunk-rows", str(CHUNK_ROWS)),
                *("--start-at", _rfc3339(at), "--end-at", _rfc3339(end)),
                *("--kafka-bootstrap-servers", kafka_broker.bootstrap),
                *("--output-dir", str(out), "--progress", "on", "--connector", "mirrored"),
            ]
            code, said = _run(args, tmp_path, "run")
            assert code == 0, said
            assert "snapshot: 4/4 partitions done (complete)" in said
            data = out / "data"
            mark = json.loads((data / completeness_path("mirrored")).read_text())
            final = int(mark["low_watermark_us"])
            assert final >= end
            from deltalake import DeltaTable

            store = mirror_store(open_store(str(data)))
            for table in TABLES:
                # the changelog: every row at T once, as a SNAPSHOT row at T
                log = DeltaTable(str(data / table)).to_pyarrow_table().to_pylist()
                snap = [r for r in log if r["_mod_type"] == "SNAPSHOT"]
                assert sorted(r["Id"] for r in snap) == sorted(at_t[table])
                assert {int(r["_commit_ts"].timestamp() * 1e6) for r in snap} == {at}
                stream = [r for r in log if r["_mod_type"] != "SNAPSHOT"]
                assert len(stream) == CHANGES[table]  # every change after T, once
                assert all(int(r["_commit_ts"].timestamp() * 1e6) > at for r in stream)
                # the mirror: the database at the final completeness watermark
                expected = _rows(database, table, final)
                mirror = read_mirror(store, table).to_pylist()
                got = {int(r["Id"]): (r["Name"], r["Value"]) for r in mirror}
                assert len(mirror) == len(got)
                assert got == expected, table
                # the control: a row changed after T that the comparison does see
                changed = dict(got)
                changed.pop(next(iter(changed)))
                assert changed != expected
    finally:
        emulator.stop()
