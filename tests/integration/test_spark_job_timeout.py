"""A Spark job that never finishes (a cluster that lost its master and executors, a hung JVM):
past ``SparkConfig.job_timeout_s`` the bridge cancels it and replaces the session like a lost
one (docs/operations.md, "When the parts around shoal fail"); a session that keeps hanging stops
the bridge with ``SparkLost`` naming Spark and the timeout, within a bounded time. Here the
hang is a job whose tasks sleep, in a real local Spark."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from protocol.records import DataChange
from runtime.ports import SinkBatch, Unrecoverable
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spark import SparkBridge, SparkConfig
from runtime.spark.supervisor import SparkLost
from tests.parts import require_java

pytestmark = [
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.asyncio,
]


@pytest.fixture(autouse=True)
def _java() -> None:
    require_java()


def _records() -> tuple[str, tuple[DataChange, ...]]:
    model = StreamModel(StreamParams(seed=41, roots=1, records_per_s=60, split_p=0.0))
    token = model.root_record().children[0].token
    start = model.params.start_ts
    records = tuple(
        r for r in model.records(token, start, start + 2_000_000) if isinstance(r, DataChange)
    )
    assert records
    return token, records


def _hang(_: Any) -> None:
    time.sleep(600)


def _config(tmp_path: Path, restarts: int) -> SparkConfig:
    return SparkConfig(
        master="local[1]",
        output_dir=str(tmp_path / "out"),
        max_age_s=0.2,
        output_layout="generic",
        restarts=restarts,
        restart_backoff_s=0.2,
        job_timeout_s=4.0,
    )


@pytest.mark.timeout(300)
async def test_a_hung_job_is_cancelled_and_run_again_on_a_new_session(tmp_path: Path) -> None:
    token, records = _records()
    calls: list[tuple[int, int]] = []  # (batch id, rows) of each call that returned

    def foreach(df: Any, batch_id: int) -> None:
        if not calls and not getattr(foreach, "hung", False):
            foreach.hung = True  # type: ignore[attr-defined]
            df.foreach(_hang)  # a Spark job whose task never ends
        calls.append((batch_id, df.count()))

    async with SparkBridge(_config(tmp_path, restarts=1), foreach_batch=foreach) as bridge:
        first_jvm = bridge.spark.sparkContext._gateway.proc.pid
        t0 = time.monotonic()
        future = await bridge.put(SinkBatch(token, records, records[-1].commit_ts))
        await asyncio.wait_for(future, 120)
        took = time.monotonic() - t0
        stats = bridge.stats()
        supervisor = bridge._supervisor
        assert supervisor is not None
        assert supervisor.restarts == 1
        assert bridge.spark.sparkContext._gateway.proc.pid != first_jvm
    rows = sum(len(r.mods) for r in records)
    assert calls == [(calls[0][0], rows)], "the batch ran once to its end, on the new session"
    assert stats.batches_committed == 1
    assert stats.batches_failed == 0
    assert stats.attempts_failed == 0, "a hung session is not the batch's fault"
    assert took >= 4.0


@pytest.mark.timeout(300)
async def test_a_session_that_keeps_hanging_stops_the_bridge_naming_spark(
    tmp_path: Path,
) -> None:
    token, records = _records()

    def foreach(df: Any, batch_id: int) -> None:
        df.foreach(_hang)

    async with SparkBridge(_config(tmp_path, restarts=1), foreach_batch=foreach) as bridge:
        t0 = time.monotonic()
        future = await bridge.put(SinkBatch(token, records, records[-1].commit_ts))
        with pytest.raises(SparkLost) as caught:
            await asyncio.wait_for(future, 200)
        took = time.monotonic() - t0
        with pytest.raises(SparkLost):
            await bridge.put(SinkBatch(token, records, records[-1].commit_ts))
    text = str(caught.value)
    assert isinstance(caught.value, Unrecoverable)
    assert text.startswith("Spark (local[1]): a Spark job ran past spark.job_timeout_s (4s)"), text
    assert "died 2 times in a row" in text, text
    # two timeouts, a restart and the cancels between them: bounded, not a retry loop
    assert took < 8.0 + 2 * 30 + 60, f"took {took:.0f}s"


@pytest.mark.timeout(300)
async def test_a_master_that_never_answers_is_a_start_error_naming_the_timeout(
    tmp_path: Path,
) -> None:
    """``--spark-master spark://...`` with no master there: Spark itself keeps trying to
    register for a minute and more; past ``spark.start_timeout_s`` the bridge gives up with an
    error that names Spark's address and the setting to change."""
    from runtime.net import free_port
    from runtime.spark import SparkStartError

    master = f"spark://127.0.0.1:{free_port()}"
    config = msgspec.structs.replace(_config(tmp_path, 0), master=master, start_timeout_s=8.0)
    began = time.monotonic()
    with pytest.raises(SparkStartError, match=r"spark\.start_timeout_s") as caught:
        async with SparkBridge(config):
            pass
    assert time.monotonic() - began < 40.0  # not Spark's own minute of registration retries
    message = str(caught.value)
    assert "within 8s" in message
    assert master in message or "first job" in message
    from pyspark.core.context import SparkContext

    assert SparkContext._gateway is None  # its JVM was killed and forgotten, not left retrying
