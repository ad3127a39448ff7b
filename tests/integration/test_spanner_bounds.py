"""``start_at`` / ``end_at`` and the Spanner options against the real Cloud Spanner emulator
(skipped, with the reason printed, where its binary is absent): one embedded task reads a window
``[start_at, end_at]`` inside a committed write load, through partition churn, and gets exactly
the commits in the window, then sees nothing left; a start the emulator refuses (before its
earliest read timestamp) is a one-line bad ``start_at`` of the command line, exit 2."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from google.cloud.spanner_v1.types import PartialResultSet

from actors.runtime import open_task
from protocol.records import DataChange
from runtime.bounded import BoundedSource
from runtime.kafka import KafkaConfig
from runtime.ports import SinkBatch
from runtime.spanner.emulator import (
    EMULATOR_ENV,
    SpannerEmulator,
)
from runtime.spanner.loadgen import LoadGenerator, expected_from_records
from runtime.spanner.reader import SpannerSource
from tests.fixtures.kafka import kafka_broker, kafka_config
from tests.fixtures.spanner import (
    MockSpanner,
    change_record_type,
    churn_emulator,
    mock_spanner,
    partial,
    row_value,
)
from tests.helpers import REPO
from tests.parts import require_emulator

__all__ = ["churn_emulator", "kafka_broker", "kafka_config", "mock_spanner"]


@pytest.mark.asyncio
@pytest.mark.parametrize(("priority", "code"), [("LOW", 1), ("MEDIUM", 2), ("HIGH", 3), (None, 0)])
async def test_the_rpc_priority_and_the_end_reach_every_query(
    mock_spanner: MockSpanner, priority: str | None, code: int
) -> None:
    def script(request: Any, context: Any) -> Iterator[PartialResultSet]:
        row = row_value(heartbeats=["2026-11-18T11:06:36Z"])
        yield partial([row], column_type=change_record_type(), resume=b"r1")

    mock_spanner.servicer.script = script
    config = msgspec.structs.replace(mock_spanner.config, rpc_priority=priority)
    end = 1_795_000_000_000_000
    async with await SpannerSource.connect(config) as source:
        bounded = BoundedSource(source, end_at=end)
        _ = [b async for b in bounded.query("tok-1", end - 5_000_000, None)]
    (request,) = mock_spanner.servicer.streaming_calls
    assert request.request_options.priority == code  # PRIORITY_LOW = 1 ... HIGH = 3
    assert request.params["end"] == "2026-11-18T11:06:40.000000Z"  # end_at, inclusive


@pytest.mark.asyncio
@pytest.mark.spanner
@pytest.mark.kafka
@pytest.mark.timeout(180)
async def test_a_window_inside_a_committed_load_gives_exactly_its_commits(
    churn_emulator: SpannerEmulator, kafka_config: KafkaConfig
) -> None:
    config = msgspec.structs.replace(
        churn_emulator.config, query_window_s=5.0, rpc_priority="LOW", database_role="cdc"
    )
    loader = await LoadGenerator.connect(config, churn_emulator.tables, seed=11)
    try:
        for _ in range(90):  # ~4.5 s of commits: the 2-4 s partitions split and merge inside
            await loader.commit_one()
            await asyncio.sleep(0.05)
    finally:
        await loader.close()
    commits = loader.committed
    start_at, end_at = commits[20].commit_ts, commits[70].commit_ts
    window = [c for c in commits if start_at <= c.commit_ts <= end_at]
    assert len(window) >= 51  # both ends inclusive
    expected: Counter[tuple[int, str, str, int]] = Counter()
    for c in window:
        for k in c.keys:
            expected[(c.commit_ts, c.table, c.mod_type, k)] += 1

    received: list[DataChange] = []

    async def on_batch(batch: SinkBatch) -> None:
        received.extend(batch.records)

    source = await SpannerSource.connect(config)
    try:
        async with open_task(
            kafka_config,
            connector=f"bounds-{uuid.uuid4().hex[:8]}",
            task_id="solo",
            source=source,
            on_batch=on_batch,
            start_at=start_at,
            end_at=end_at,
        ) as node:
            async with asyncio.timeout(120):
                while not node.nothing_left():
                    await asyncio.sleep(0.2)
    finally:
        await source.close()
    # every record handed over counts: one delivered twice is an extra mod (the control)
    assert expected_from_records(received) == expected
    assert expected_from_records([*received, received[len(received) // 2]]) != expected
    assert all(start_at <= r.commit_ts <= end_at for r in received)


@pytest.mark.spanner
@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_start_before_the_earliest_read_timestamp_is_a_bad_option(tmp_path: Path) -> None:
    require_emulator()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") or k == EMULATOR_ENV}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "actors.runtime",
            "--source",
            "emulator",
            "--sink",
            "files",
            "--progress",
            "off",
            "--tasks",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
            "--start-at",
            "2020-01-01T00:00:00Z",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=100,
        check=False,
    )
    err = result.stderr.decode()
    assert result.returncode == 2, err + result.stdout.decode()
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, err
    # refused at start from the stream's own options, before any query asks Spanner
    assert lines[0].startswith(
        "shoal: error: start_at 2020-01-01T00:00:00Z (--start-at) is older than change stream "
        "ShoalStream's retention_period 1d: the oldest start it keeps records for is "
    ), lines[0]
    assert lines[0].endswith("start later, or raise the stream's retention_period"), lines[0]
    assert "Traceback" not in err
