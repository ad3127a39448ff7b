"""The parquet file sink (``--sink files``) drops re-reads by the one de-duplication rule: a
partition re-read from its watermark inclusive writes each record once."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.cli.sinks import FileSink, read_rows
from protocol.records import DataChange, Mod
from runtime.ports import SinkBatch


def rec(ts: int, seq: str) -> DataChange:
    mod = Mod(keys='{"id": 1}', new_values="{}", old_values="{}")
    return DataChange(ts, seq, f"txn{ts}", False, "T", (), (mod,), "INSERT")


@pytest.mark.asyncio
async def test_a_re_read_partition_is_written_once(tmp_path: Path) -> None:
    first = (rec(10, "0"), rec(20, "0"), rec(20, "1"))
    # the reader failed after committing 20 and re-reads from 20 inclusive; one record at 20
    # is new, and so is 30; another partition has its own tail
    again = (rec(20, "0"), rec(20, "1"), rec(20, "2"), rec(30, "0"))
    async with FileSink(tmp_path, max_age_s=0.01) as sink:
        await (await sink.put(SinkBatch("p", first, 20)))
        await (await sink.put(SinkBatch("p", again, 30)))
        await (await sink.put(SinkBatch("q", first, 20)))
        stats = sink.statistics()
    rows = sorted(
        (r["partition_token"], r["commit_ts"], r["record_sequence"]) for r in read_rows(tmp_path)
    )
    assert rows == [
        ("p", 10, "0"),
        ("p", 20, "0"),
        ("p", 20, "1"),
        ("p", 20, "2"),
        ("p", 30, "0"),
        ("q", 10, "0"),
        ("q", 20, "0"),
        ("q", 20, "1"),
    ]
    assert stats.duplicates_dropped == 2
