"""The parts around shoal fail, Spark's (docs/operations.md, "When the parts around shoal fail"):
the local Spark JVM is killed under a run, Spark cannot be started again, a Spark Connect server
is restarted. A run recovers and loses nothing, or stops with exit 1 and one line naming Spark and
the cause, within a bounded time. (The other parts' failures are in test_faults.py; the files are
apart so that the test runs spread them over workers.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from bench.procs import spark_jvm_pids
from protocol.records import DataChange
from runtime import compat
from runtime.ports import SinkBatch, Unrecoverable
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spark import SparkBridge, SparkConfig
from runtime.spark.output import streaming_sink_files
from runtime.spark.supervisor import SparkLost
from tests.helpers import (
    assert_catches_a_double,
    assert_no_row_twice,
    assert_one_cut,
    stream_rows,
    wait_until,
)
from tests.integration.test_cli import (
    SIM,
    _cli,
    _finish,
    _ids,
    _logs,
    _model,
    _now_us,
    _summary,
)
from tests.parts import require_java


def first_commit(out: Path) -> bool:
    """A micro-batch is committed in either layout (typed ``<table>/batch=<id>``, the default;
    generic ``table=<name>/batch=<id>``); staged batches live under ``_staging``."""
    return any(
        not p.parts[-3].startswith(("_", ".")) for p in (out / "data").glob("*/batch=*/*.parquet")
    )


def _first_streaming_commit(out: Path) -> bool:
    """The streaming path's file sink committed a micro-batch with rows."""
    files = streaming_sink_files(out / "data")
    return bool(files)


def _kill_jvm(pid: int) -> int:
    jvms = spark_jvm_pids(pid)
    assert len(jvms) == 1, f"expected one Spark JVM under {pid}, found {jvms}"
    os.kill(jvms[0], signal.SIGKILL)
    return jvms[0]


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["typed", "streaming", "streaming-generic"])
def test_spark_jvm_killed_mid_run_is_survived_and_output_equals_stream(
    tmp_path: Path, layout: str
) -> None:
    """The local Spark JVM is SIGKILLed after the first micro-batch committed; the bounded run
    exits 0 with exactly the rows the stream produced (none lost, none written twice). On the
    embedded path (the typed layout, the default; the generic layout goes through the same
    supervisor and session restart) Spark writes every micro-batch with rows: the bridge starts
    a new session and writes the batch again. On the
    streaming path the query dies with the JVM: the bridge starts a new session and a new
    query, which goes on from the checkpoint (the typed layout, committed by the bridge; or the
    generic one, read through Spark's sink log, ``_spark_metadata``)."""
    out = tmp_path / "out"
    start = _now_us()
    how = {
        "typed": ["--output-layout", "typed"],
        "streaming": ["--spark-path", "streaming"],
        "streaming-generic": ["--spark-path", "streaming", "--output-layout", "generic"],
    }[layout]
    proc = _cli(
        [
            *("--duration", "20", "--drain-timeout", "240", *how),
            *SIM,
            *("--sim-start-ts", str(start), "--output-dir", str(out)),
            *("--summary-json", str(tmp_path / "summary.json"), "--progress", "on"),
        ],
        tmp_path,
    )
    try:
        committed = _first_streaming_commit if layout == "streaming-generic" else first_commit
        wait_until(lambda: committed(out) or proc.poll() is not None, 300, "first commit")
        assert proc.poll() is None, _logs(tmp_path, "run")
        jvm = _kill_jvm(proc.pid)
    finally:
        code = _finish(proc, tmp_path, "run", 500)
    ended = _now_us()
    logs = _logs(tmp_path, "run")
    assert code == 0, logs[-5000:]
    assert f"its JVM (pid {jvm}) was killed by SIGKILL" in logs
    if layout.startswith("streaming"):
        assert "the streaming query runs again on the new session" in logs
    assert "a new session is up" in logs
    ids = _ids(out / "data")
    assert_no_row_twice(ids)
    assert_catches_a_double(assert_no_row_twice, ids)  # the check sees a doubled row
    model = _model(start)
    cut = assert_one_cut(model, ids, earliest=start + 20_000_000, latest=ended)
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
    and one line naming Spark, the JVM and why it was not replaced (here with the generic
    layout; the typed one goes through the same supervisor)."""
    out = tmp_path / "out"
    proc = _cli(
        [*SIM, "--output-dir", str(out), "--spark-restarts", "0", "--output-layout", "generic"],
        tmp_path,
    )
    try:
        wait_until(lambda: first_commit(out) or proc.poll() is not None, 300, "first commit")
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


@pytest.mark.asyncio
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_spark_whose_restarts_fail_breaks_the_bridge_naming_spark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bridge's own JVM is killed and no new one can start (Spark's installation is gone:
    SPARK_HOME points at an empty directory): after ``restarts`` failed starts the batch fails
    with ``SparkLost`` naming Spark, the JVM and the last error, and later puts are refused
    with it. Bounded: the restarts' backoff and each start's failure, not a retry loop."""
    require_java()
    model = StreamModel(StreamParams(seed=32, roots=1, records_per_s=60, split_p=0.0))
    token = model.root_record().children[0].token
    start = model.params.start_ts
    records = tuple(
        r for r in model.records(token, start, start + 2_000_000) if isinstance(r, DataChange)
    )
    config = SparkConfig(
        master="local[1]",
        output_dir=str(tmp_path / "out"),
        max_age_s=0.2,
        output_layout="generic",
        restarts=2,
        restart_backoff_s=0.2,
    )
    async with SparkBridge(config) as bridge:
        proc = compat.spark_jvm_process(bridge.spark)
        assert proc is not None
        proc.kill()
        proc.wait()
        monkeypatch.setenv("SPARK_HOME", str(tmp_path / "no-spark-here"))
        t0 = time.monotonic()
        future = await bridge.put(SinkBatch(token, records, records[-1].commit_ts))
        with pytest.raises(SparkLost) as caught:
            await asyncio.wait_for(future, 120)
        took = time.monotonic() - t0
        with pytest.raises(SparkLost):
            await bridge.put(SinkBatch(token, records, records[-1].commit_ts))
    text = str(caught.value)
    assert text.startswith(f"Spark (local[1]): its JVM (pid {proc.pid}) was killed by SIGKILL; ")
    assert "2 restart(s) failed, the last: " in text
    assert isinstance(caught.value, Unrecoverable)
    assert took < 60, f"took {took:.0f}s"
