"""The parts around shoal fail: a Spark Connect server restarted (docs/operations.md, "When the parts around shoal fail"):
the local Spark JVM is killed under a run, Spark cannot be started again, a Spark Connect server
is restarted. A run recovers and loses nothing, or stops with exit 1 and one line naming Spark and
the cause, within a bounded time. (The other parts' failures are in test_faults.py; the files are
apart so that the test runs spread them over workers.)"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from protocol.records import DataChange
from runtime.ports import SinkBatch
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spark import SparkBridge, SparkConfig, read_output
from tests.fixtures.spark import expected_rows, output_rows
from tests.fixtures.spark_connect import (
    connect_mode,
    start_connect_server,
    stop_connect_server,
    with_signal,
)
from tests.fixtures.spark_connect import free_port as connect_free_port
from tests.helpers import assert_catches_a_double, exactly
from tests.parts import require_java

__all__ = ["connect_mode"]  # a module-scoped fixture


# -- Spark Connect ---------------------------------------------------------------------------------
# A module of its own: a Connect session marks the process as Connect, and the connect_mode fixture
# unmarks it only after the module, so no local-Spark test may follow it in one module.


@pytest.mark.asyncio
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("connect_mode")
async def test_connect_server_restart_is_survived_by_reconnecting(tmp_path: Path) -> None:
    """The Spark Connect server is killed (its whole process group) after a committed batch and
    started again on the same port: the next batch finds its session gone, the bridge connects
    again with a new session and commits it; the output is exactly the rows put, once."""
    require_java("the Spark Connect server")
    port = connect_free_port()
    server = start_connect_server(tmp_path / "first", port=port)
    out = tmp_path / "out"
    model = StreamModel(StreamParams(seed=31, roots=1, records_per_s=60, split_p=0.0))
    token = model.root_record().children[0].token
    start = model.params.start_ts
    records = [
        r for r in model.records(token, start, start + 4_000_000) if isinstance(r, DataChange)
    ]
    half = len(records) // 2
    config = SparkConfig(
        remote=server.url, output_dir=str(out), max_age_s=0.2, output_layout="generic"
    )
    try:
        async with SparkBridge(config) as bridge:
            first = tuple(records[:half])
            await asyncio.wait_for(
                await bridge.put(SinkBatch(token, first, first[-1].commit_ts)), 90
            )
            with_signal(server.proc, signal.SIGKILL)
            server.proc.wait(30)
            server = start_connect_server(tmp_path / "second", port=port)
            assert server.url == config.remote, "the new server took another port"
            second = tuple(records[half:])
            future = await bridge.put(SinkBatch(token, second, second[-1].commit_ts))
            await asyncio.wait_for(future, 300)
            stats = bridge.stats()
            replaced = bridge._supervisor.restarts if bridge._supervisor is not None else 0
    finally:
        stop_connect_server(server)
    assert replaced == 1
    assert stats.batches_failed == 0
    written = list(output_rows(read_output(str(out), dedupe=False)))
    exactly(expected_rows(iter(records)))(written)
    assert_catches_a_double(exactly(expected_rows(iter(records))), written)
