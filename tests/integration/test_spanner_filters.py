"""Against the real Cloud Spanner emulator (skipped, with the reason, where its binary is
absent): the record filters of issue 37 on records the emulator sends. ``--exclude-columns``
takes a column out of the new values, old values and column list of every record of its table;
``--exclude-transaction-tags`` and ``--exclude-system-transactions`` drop the records of tagged /
system transactions — where the emulator marks them (it may not: the tests then skip, saying
so, after checking that the write carried the tag)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from protocol.filters import RecordFilter
from protocol.records import DataChange
from runtime.filtered import FilteredSource
from runtime.spanner.config import SpannerConfig
from runtime.spanner.emulator import SpannerEmulator, sync_client
from runtime.spanner.reader import SpannerSource, walk_stream
from tests.fixtures.spanner import _start_emulator, until_past

pytestmark = [pytest.mark.spanner]

TAG = "shoal-replicator-1"


@pytest.fixture(scope="module")
def emulator() -> Iterator[SpannerEmulator]:
    emulator = _start_emulator()
    try:
        yield emulator
    finally:
        emulator.stop()


def _now_us() -> int:
    return time.time_ns() // 1000


def _write(config: SpannerConfig, first_id: int) -> tuple[int, int]:
    """Commit an untagged insert, a tagged one (``TAG``) and an update of the first; the read
    window around them."""
    start = _now_us()
    with sync_client(config) as client:
        db: Any = client.instance(config.instance).database(config.database)
        cols = ["Id", "Name", "Value"]
        db.run_in_transaction(lambda tx: tx.insert("Singers", cols, [[first_id, "plain", 1]]))
        db.run_in_transaction(
            lambda tx: tx.insert("Singers", cols, [[first_id + 1, "tagged", 2]]),
            transaction_tag=TAG,
        )
        db.run_in_transaction(
            lambda tx: tx.update("Singers", cols, [[first_id, "plain-2", 3]]),
        )
    return start, _now_us()


async def _read(config: SpannerConfig, rule: RecordFilter | None, start: int, end: int) -> Any:
    await until_past(end)
    source = await SpannerSource.connect(config)
    try:
        if rule is None:
            walked = await walk_stream(source, start, end)
            return sorted(walked.data, key=lambda r: r.commit_ts), None
        filtered = FilteredSource(source, rule)
        walked = await walk_stream(filtered, start, end)
        return sorted(walked.data, key=lambda r: r.commit_ts), filtered.statistics()
    finally:
        await source.close()


def _singers(records: list[DataChange]) -> list[DataChange]:
    return [r for r in records if r.table == "Singers"]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_excluded_columns_leave_the_records_the_emulator_sends(
    emulator: SpannerEmulator,
) -> None:
    config = emulator.config
    start, end = await asyncio.to_thread(_write, config, 100)
    plain, _ = await _read(config, None, start, end)
    rule = RecordFilter.parse(None, None, None, exclude_columns="singers.NAME")
    stripped, stats = await _read(config, rule, start, end)
    # control: unfiltered, the emulator sends the Name column in new and old values
    assert [(r.mod_type, r.mods[0].new_values, r.mods[0].old_values) for r in plain] == [
        ("INSERT", '{"Name":"plain","Value":"1"}', "{}"),
        ("INSERT", '{"Name":"tagged","Value":"2"}', "{}"),
        ("UPDATE", '{"Name":"plain-2","Value":"3"}', '{"Name":"plain","Value":"1"}'),
    ]
    assert [(r.mod_type, r.mods[0].new_values, r.mods[0].old_values) for r in stripped] == [
        ("INSERT", '{"Value":"1"}', "{}"),
        ("INSERT", '{"Value":"2"}', "{}"),
        ("UPDATE", '{"Value":"3"}', '{"Value":"1"}'),
    ]
    assert {tuple(c.name for c in r.column_types) for r in stripped} == {("Id", "Value")}
    assert [r.identity for r in stripped] == [r.identity for r in plain]
    assert (stats.records_kept, stats.records_filtered, stats.columns_stripped) == (3, 0, 3)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_tagged_transactions_are_dropped(emulator: SpannerEmulator) -> None:
    config = emulator.config
    start, end = await asyncio.to_thread(_write, config, 200)
    plain, _ = await _read(config, None, start, end)
    assert len(_singers(plain)) == 3
    if not any(r.transaction_tag for r in plain):
        pytest.skip(
            f"this emulator leaves transaction_tag empty in change records (the write was "
            f"committed with transaction_tag={TAG!r}); the filter's rule is tested in "
            "tests/core/test_filters.py"
        )
    rule = RecordFilter.parse(None, None, None, exclude_transaction_tags="shoal-replicator-*")
    kept, stats = await _read(config, rule, start, end)
    assert [r.transaction_tag for r in kept] == ["", ""]
    assert stats.filtered_by["transaction_tag"] == 1


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_system_transactions_are_dropped(emulator: SpannerEmulator) -> None:
    """A TTL table whose rows expire at once: Spanner deletes them in a system transaction
    (within days in production); where the emulator does so within 20 s, the filter drops
    those deletes and keeps the inserts."""
    config = emulator.config
    with sync_client(config) as client:
        db: Any = client.instance(config.instance).database(config.database)
        db.update_ddl(
            [
                "CREATE TABLE Expiring (Id INT64 NOT NULL, Expiry TIMESTAMP) PRIMARY KEY (Id), "
                "ROW DELETION POLICY (OLDER_THAN(Expiry, INTERVAL 0 DAY))"
            ]
        ).result(60)
        start = _now_us()
        db.run_in_transaction(
            lambda tx: tx.insert("Expiring", ["Id", "Expiry"], [[1, "2000-01-01T00:00:00Z"]])
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with db.snapshot() as snap:
                if not list(snap.execute_sql("SELECT Id FROM Expiring")):
                    break
            await asyncio.sleep(0.5)
    end = _now_us()
    plain, _ = await _read(config, None, start, end)
    system = [r for r in plain if r.is_system_transaction]
    if not system:
        pytest.skip(
            "this emulator ran no TTL deletion as a system transaction within 20 s (no record "
            "with is_system_transaction); the filter's rule is tested in "
            "tests/core/test_filters.py"
        )
    rule = RecordFilter(exclude_system_transactions=True)
    kept, stats = await _read(config, rule, start, end)
    assert all(not r.is_system_transaction for r in kept)
    assert stats.filtered_by["system_transaction"] == len(system)
