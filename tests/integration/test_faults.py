"""The parts around shoal fail (docs/operations.md, "When the parts around shoal fail"): the
local Spark JVM is killed under a run, the embedded broker or the Spanner emulator is frozen
past the timeouts that notice it. A run recovers and loses nothing, or stops with exit 1 and
one line naming the part and the cause, within a bounded time."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from bench.procs import spark_jvm_pids
from runtime.ports import Unrecoverable
from runtime.spanner.emulator import SpannerEmulator
from runtime.spanner.reader import FATAL_CODES, ChangeStreamUnreadable, SpannerSource
from tests.fixtures.spanner import churn_emulator
from tests.helpers import assert_one_cut, stream_rows, wait_until
from tests.integration.test_cli import (
    FILES,
    SIM,
    _cli,
    _finish,
    _ids,
    _logs,
    _model,
    _now_us,
    _summary,
)

__all__ = ["churn_emulator"]


def _first_commit(out: Path) -> bool:
    return any((out / "data").glob("table=*/batch=*/*.parquet"))


def _kill_jvm(pid: int) -> int:
    jvms = spark_jvm_pids(pid)
    assert len(jvms) == 1, f"expected one Spark JVM under {pid}, found {jvms}"
    os.kill(jvms[0], signal.SIGKILL)
    return jvms[0]


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spark_jvm_killed_mid_run_is_replaced_and_output_equals_stream(tmp_path: Path) -> None:
    """The local Spark JVM is SIGKILLed after the first micro-batch committed: the bridge starts
    a new session and the bounded run exits 0 with exactly the rows the stream produced (none
    lost, none written twice)."""
    out = tmp_path / "out"
    start = _now_us()
    proc = _cli(
        [
            *("--duration", "30", "--drain-timeout", "240"),
            *SIM,
            *("--sim-start-ts", str(start), "--output-dir", str(out)),
            *("--summary-json", str(tmp_path / "summary.json"), "--progress", "on"),
        ],
        tmp_path,
    )
    try:
        wait_until(lambda: _first_commit(out) or proc.poll() is not None, 300, "first commit")
        assert proc.poll() is None, _logs(tmp_path, "run")
        jvm = _kill_jvm(proc.pid)
    finally:
        code = _finish(proc, tmp_path, "run", 500)
    ended = _now_us()
    logs = _logs(tmp_path, "run")
    assert code == 0, logs[-5000:]
    assert f"its JVM (pid {jvm}) was killed by SIGKILL" in logs
    assert "a new session is up" in logs
    ids = _ids(out / "data")
    assert len(ids) == len(set(ids)), "rows written twice"
    model = _model(start)
    cut = assert_one_cut(model, ids, earliest=start + 30_000_000, latest=ended)
    produced = stream_rows(model, cut)
    summary = _summary(tmp_path / "summary.json")
    assert summary.caught_up
    assert summary.produced_rows == summary.rows_written == len(produced) == len(ids) > 0


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_spark_that_cannot_be_replaced_stops_the_run_naming_spark(tmp_path: Path) -> None:
    """With restarts off, a killed JVM stops the (unbounded) run within a bounded time: exit 1
    and one line naming Spark, the JVM and why it was not replaced."""
    out = tmp_path / "out"
    proc = _cli([*SIM, "--output-dir", str(out), "--spark-restarts", "0"], tmp_path)
    try:
        wait_until(lambda: _first_commit(out) or proc.poll() is not None, 300, "first commit")
        assert proc.poll() is None, _logs(tmp_path, "run")
        jvm = _kill_jvm(proc.pid)
        killed = time.monotonic()
    finally:
        code = _finish(proc, tmp_path, "run", 90)
    took = time.monotonic() - killed
    err = (tmp_path / "run.err").read_text()
    assert code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert lines == [
        f"shoal: error: Spark (local[2]): its JVM (pid {jvm}) was killed by SIGKILL; "
        "restarts are off (spark.restarts = 0)"
    ], err[-3000:]
    assert took < 60, f"took {took:.0f}s to stop after the JVM died"


# -- Spanner ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.spanner
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("change", "code"),
    [({"database": "no-such-db"}, "NOT_FOUND"), ({"change_stream": "DroppedStream"}, None)],
    ids=["wrong-database", "no-such-change-stream"],
)
async def test_wrong_database_or_change_stream_is_unrecoverable(
    churn_emulator: SpannerEmulator, change: dict[str, str], code: str | None
) -> None:
    """A query of a database or change stream that does not exist fails with a fatal status
    (not retried): ``ChangeStreamUnreadable`` names Spanner and the code. Control: the right
    names read the root partitions."""
    good = churn_emulator.config
    async with contextlib.AsyncExitStack() as stack:
        source = await SpannerSource.connect(good)
        stack.push_async_callback(source.close)
        roots = [b async for b in source.query(None, _now_us(), None)]
        assert roots, "the control query read nothing"
        bad = await SpannerSource.connect(msgspec.structs.replace(good, **change))
        stack.push_async_callback(bad.close)
        with pytest.raises(ChangeStreamUnreadable) as caught:
            _ = [b async for b in bad.query(None, _now_us(), None)]
    assert caught.value.code in FATAL_CODES
    if code is not None:
        assert caught.value.code == code
    assert str(caught.value).startswith(
        f"Spanner: the change-stream query failed with {caught.value.code}"
    )
    assert isinstance(caught.value, Unrecoverable)


@pytest.mark.spanner
@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_run_against_a_dropped_change_stream_stops_naming_spanner(
    churn_emulator: SpannerEmulator, tmp_path: Path
) -> None:
    """An (unbounded) run whose change stream does not exist stops with exit 1 and one line
    naming Spanner and the status, instead of retrying the query forever."""
    cfg = churn_emulator.config
    proc = _cli(
        [
            *FILES,
            *("--source", "spanner", "--spanner-emulator-host", churn_emulator.host),
            *("--spanner-project", cfg.project, "--spanner-instance", cfg.instance),
            *("--spanner-database", cfg.database, "--spanner-change-stream", "DroppedStream"),
            *("--output-dir", str(tmp_path / "out"), "--progress", "off"),
        ],
        tmp_path,
    )
    code = _finish(proc, tmp_path, "run", 150)
    err = (tmp_path / "run.err").read_text()
    assert code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("shoal: error: Spanner: the change-stream query failed with "), lines
