"""A ``--source spanner`` run on the Cloud Spanner emulator checked against the test's own ledger:
the test writes inserts, updates and deletes itself (partitions churning: they split, move and
merge every 2-4 s), records each change's table, key, kind and the commit timestamp Spanner
returned, and runs three tasks of the command line over exactly that window (``--start-at`` /
``--end-at``). The output, read back raw, is that ledger: every change once, nothing else. The
oracle owes nothing to the code under test (not the run's own load generator, not its counts);
the control is the same comparison with one change doubled.

Skips, with the reason printed, where the emulator binary or the embedded broker is absent."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from random import Random
from typing import Any

import msgspec
import pytest

from actors.cli.progress import RunSummary
from runtime.kafka.broker import EmbeddedBroker
from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator, sync_client
from runtime.typed_files import read_table
from tests.fixtures.kafka import kafka_broker
from tests.fixtures.spanner import CHURN_ALIVE_S, until_past
from tests.helpers import REPO, assert_catches_a_double, exactly
from tests.integration.test_cli import _nothing_read_twice
from tests.parts import require_part

__all__ = ["kafka_broker"]  # fixture, imported for pytest

pytestmark = [pytest.mark.spanner, pytest.mark.kafka, pytest.mark.slow]

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
TABLES = ("Singers", "Albums")
COMMITS = 80  # over about 8 s: several generations of churning partitions
Change = tuple[str, int, str, int]  # table, Id, mod type, commit timestamp (Unix micros)


def _micros(when: dt.datetime) -> int:
    return (when - EPOCH) // dt.timedelta(microseconds=1)


def _rfc3339(micros: int) -> str:
    return (EPOCH + dt.timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")


def _write_load(database: Any, seed: int) -> list[Change]:
    """Commits one table's inserts, updates or deletes at a time (distinct keys in a commit,
    updates and deletes only of rows that exist) and returns the ledger of every change."""
    from google.cloud import spanner_v1

    key_set: Any = spanner_v1.KeySet
    rng = Random(seed)
    ids = itertools.count(1)
    live: dict[str, list[int]] = {t: [] for t in TABLES}
    ledger: list[Change] = []
    for _ in range(COMMITS):
        table = rng.choice(TABLES)
        rows = live[table]
        draw = rng.random()
        with database.batch() as batch:
            if rows and draw < 0.3:
                kind, keys = "UPDATE", rng.sample(rows, min(len(rows), rng.randint(1, 3)))
                batch.update(table, ["Id", "Name"], [[k, f"n{rng.random():.6f}"] for k in keys])
            elif rows and draw < 0.45:
                kind, keys = "DELETE", rng.sample(rows, min(len(rows), rng.randint(1, 2)))
                batch.delete(table, key_set(keys=[[k] for k in keys]))
                for k in keys:
                    rows.remove(k)
            else:
                kind, keys = "INSERT", [next(ids) for _ in range(rng.randint(1, 4))]
                batch.insert(table, ["Id", "Name", "Value"], [[k, "new", k] for k in keys])
                rows.extend(keys)
        ledger += [(table, k, kind, _micros(batch.committed)) for k in keys]
        time.sleep(0.1)  # paces the load over the partitions' lifetimes
    return ledger


def _written(out: Path) -> list[Change]:
    """Every row of the typed output, raw (nothing de-duplicated)."""
    rows: list[Change] = []
    for table in TABLES:
        data = read_table(out, table)
        for key, kind, ts in zip(
            data.column("Id").to_pylist(),
            data.column("_mod_type").to_pylist(),
            data.column("_commit_ts").to_pylist(),
            strict=True,
        ):
            rows.append((table, int(key), kind, _micros(ts)))
    return rows


@pytest.mark.timeout(300)
def test_a_spanner_run_writes_exactly_the_tests_own_ledger(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    try:
        emulator = SpannerEmulator(tables=TABLES, partition_alive_s=CHURN_ALIVE_S)
    except EmulatorUnavailable as exc:
        require_part("the Cloud Spanner emulator", str(exc))
    config = emulator.start()
    try:
        with sync_client(config) as client:
            database = client.instance(config.instance).database(config.database)
            start = _micros(dt.datetime.now(dt.UTC))
            ledger = _write_load(database, seed=11)
        end = max(ts for *_, ts in ledger) + 500_000
        asyncio.run(until_past(end))
        assert {kind for _, _, kind, _ in ledger} == {"INSERT", "UPDATE", "DELETE"}
        out = tmp_path / "out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        env["PYTHONPATH"] = str(REPO)
        args = [
            *("--source", "spanner", "--spanner-emulator-host", config.emulator_host or ""),
            *("--spanner-project", config.project, "--spanner-instance", config.instance),
            *("--spanner-database", config.database),
            *("--spanner-change-stream", config.change_stream),
            *("--tasks", "3", "--sink", "files", "--connector", "ledgered"),
            *("--start-at", _rfc3339(start), "--end-at", _rfc3339(end)),
            *("--kafka-bootstrap-servers", kafka_broker.bootstrap),
            *("--output-dir", str(out), "--progress", "off"),
            *("--summary-json", str(tmp_path / "summary.json")),
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "actors.runtime", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    finally:
        emulator.stop()
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=RunSummary)
    _nothing_read_twice(summary)
    written = _written(out / "data")
    exactly(ledger)(written)  # every change the test committed, once; nothing else
    assert_catches_a_double(exactly(ledger), written)
