"""A ``--source spanner`` run on the Cloud Spanner emulator checked against the test's own ledger:
the test writes inserts, updates and deletes itself (partitions churning: they split, move and
merge every 2-4 s), records each change's table, key, kind and the commit timestamp Spanner
returned, and runs three tasks of the command line over exactly that window (``--start-at`` /
``--end-at``). The output, read back raw, is that ledger: every change once, nothing else. The
oracle owes nothing to the code under test (not the run's own load generator, not its counts);
the control is the same comparison with one change doubled. The same check holds across the
emulator frozen for longer than the readers' stall timeout.

Skips, with the reason printed, where the emulator binary or the embedded broker is absent."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import os
import signal
import time
from pathlib import Path
from random import Random
from typing import Any

import msgspec
import pytest

from actors.cli.progress import RunSummary
from bench.procs import descendants
from runtime.files.typed import read_table
from runtime.kafka.broker import EmbeddedBroker
from runtime.spanner.config import SpannerConfig
from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator, sync_client
from tests.fixtures.kafka import kafka_broker
from tests.fixtures.spanner import CHURN_ALIVE_S, until_past
from tests.helpers import assert_catches_a_double, exactly, wait_until
from tests.integration.test_cli import _cli, _finish, _logs, _nothing_read_twice
from tests.integration.test_faults_spark import first_commit
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


class _Writer:
    """The test's own write load and its ledger: each commit is one table's inserts, updates or
    deletes (distinct keys in a commit; updates and deletes only of rows that exist), and the
    ledger holds every change with the commit timestamp Spanner returned."""

    def __init__(self, database: Any, seed: int) -> None:
        self.database = database
        self.rng = Random(seed)
        self.ids = itertools.count(1)
        self.live: dict[str, list[int]] = {t: [] for t in TABLES}
        self.ledger: list[Change] = []

    def commit(self, commits: int, until_us: int | None = None) -> None:
        """``commits`` commits 0.1 s apart (pacing the load over the partitions' lifetimes),
        none at or after ``until_us`` (a commit takes milliseconds: 1 s of margin)."""
        from google.cloud import spanner_v1

        key_set: Any = spanner_v1.KeySet
        rng = self.rng
        for _ in range(commits):
            if until_us is not None and _now() >= until_us - 1_000_000:
                return
            table = rng.choice(TABLES)
            rows = self.live[table]
            draw = rng.random()
            with self.database.batch() as batch:
                if rows and draw < 0.3:
                    kind, keys = "UPDATE", rng.sample(rows, min(len(rows), rng.randint(1, 3)))
                    values = [[k, f"n{rng.random():.6f}"] for k in keys]
                    batch.update(table, ["Id", "Name"], values)
                elif rows and draw < 0.45:
                    kind, keys = "DELETE", rng.sample(rows, min(len(rows), rng.randint(1, 2)))
                    batch.delete(table, key_set(keys=[[k] for k in keys]))
                    for k in keys:
                        rows.remove(k)
                else:
                    kind, keys = "INSERT", [next(self.ids) for _ in range(rng.randint(1, 4))]
                    batch.insert(table, ["Id", "Name", "Value"], [[k, "new", k] for k in keys])
                    rows.extend(keys)
            self.ledger += [(table, k, kind, _micros(batch.committed)) for k in keys]
            time.sleep(0.1)


def _now() -> int:
    return _micros(dt.datetime.now(dt.UTC))


def _args(
    config: SpannerConfig, kafka: EmbeddedBroker, tmp: Path, start: int, end: int
) -> list[str]:
    return [
        *("--source", "spanner", "--spanner-emulator-host", config.emulator_host or ""),
        *("--spanner-project", config.project, "--spanner-instance", config.instance),
        *("--spanner-database", config.database),
        *("--spanner-change-stream", config.change_stream),
        *("--sink", "files", "--connector", f"ledgered-{tmp.name}"),
        *("--start-at", _rfc3339(start), "--end-at", _rfc3339(end)),
        *("--kafka-bootstrap-servers", kafka.bootstrap),
        *("--output-dir", str(tmp / "out"), "--progress", "off"),
        *("--summary-json", str(tmp / "summary.json")),
    ]


def _check(tmp: Path, ledger: list[Change]) -> None:
    """The run wrote exactly the ledger (raw rows), and read nothing twice."""
    summary = msgspec.json.decode((tmp / "summary.json").read_bytes(), type=RunSummary)
    _nothing_read_twice(summary)
    assert {kind for _, _, kind, _ in ledger} == {"INSERT", "UPDATE", "DELETE"}
    written = _written(tmp / "out" / "data")
    exactly(ledger)(written)  # every change the test committed, once; nothing else
    assert_catches_a_double(exactly(ledger), written)


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
            writer = _Writer(client.instance(config.instance).database(config.database), seed=11)
            start = _now()
            writer.commit(COMMITS)
        end = max(ts for *_, ts in writer.ledger) + 500_000
        asyncio.run(until_past(end))
        args = [*_args(config, kafka_broker, tmp_path, start, end), "--tasks", "3"]
        proc = _cli(args, tmp_path)
        code = _finish(proc, tmp_path, "run", 240)
    finally:
        emulator.stop()
    assert code == 0, _logs(tmp_path, "run")[-5000:]
    _check(tmp_path, writer.ledger)


@pytest.mark.timeout(420)
def test_emulator_frozen_past_the_stall_timeout_heals_and_writes_exactly_the_ledger(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    """The Spanner emulator is frozen (SIGSTOP) for longer than the readers' stall timeout
    (8 s here, ``--task-stall-timeout-s``; 8 heartbeats of the queries) in the middle of a run
    bounded by ``--end-at``, then continued: the silent queries are restarted from their
    committed positions and the run exits 0 by itself with exactly the changes the test
    committed before and after the freeze."""
    try:
        emulator = SpannerEmulator(tables=TABLES)
    except EmulatorUnavailable as exc:
        require_part("the Cloud Spanner emulator", str(exc))
    config = emulator.start()
    frozen: list[int] = []
    try:
        with sync_client(config) as client:
            writer = _Writer(client.instance(config.instance).database(config.database), seed=12)
            start = _now()
            end = start + 60_000_000
            args = [*_args(config, kafka_broker, tmp_path, start, end), "--tasks", "2"]
            args += ["--task-stall-timeout-s", "8"]
            proc = _cli([*args, "--drain-timeout", "180"], tmp_path)
            try:
                writer.commit(30, until_us=end)
                out = tmp_path / "out"
                wait_until(lambda: first_commit(out) or proc.poll() is not None, 120, "a commit")
                assert proc.poll() is None, _logs(tmp_path, "run")
                frozen = [emulator.pid, *descendants(emulator.pid)]
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)
                time.sleep(14)  # past the readers' 8 s stall timeout
            finally:
                for pid in frozen:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            writer.commit(40, until_us=end)
            code = _finish(proc, tmp_path, "run", 300)
    finally:
        emulator.stop()
    assert frozen, "the emulator was never frozen"
    logs = _logs(tmp_path, "run")
    assert code == 0, logs[-5000:]
    assert "QueryStalled" in logs, "no query was restarted as stalled: the freeze proved nothing"
    _check(tmp_path, writer.ledger)
