"""``python -m actors.runtime`` end to end, in subprocesses: a bounded embedded run writes exactly
the records the stream produced; SIGTERM mid-run drains and loses nothing (and the metrics
endpoint, scraped during that run, shows the figures); bad options exit 2 naming the problem;
production mode (one task per process against a shared Kafka) and the ``status`` subcommand.

What a run must have written is computed from the seeded stream model alone (``StreamModel``
built here from the seed, start and parameters the test hands the command line) and the test's
own clock, never from the run's summary, its list of partitions or the CLI's helpers: a run
that reports less than it should cannot shrink what it is checked against. The summary's
figures are then checked against that, as claims."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.cli.progress import RunSummary
from runtime.files.sink import read_rows
from runtime.kafka.broker import EmbeddedBroker
from runtime.net import free_port
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spark import KEY_COLUMNS, read_output
from tests.fixtures.kafka import kafka_broker
from tests.helpers import (
    REPO,
    assert_catches_a_double,
    assert_no_row_twice,
    assert_one_cut,
    assert_read_without_gaps,
    partition_rows,
    stream_rows,
    wait_until,
)
from tests.parts import require_emulator

__all__ = ["kafka_broker"]

# A small, quick stream: 4 partitions, partition churn every 2 s of stream time. Every parameter
# is passed explicitly, so the model below is the stream the run reads whatever the defaults.
SEED = 5
PARAMS = StreamParams(
    seed=SEED,
    roots=4,
    round_us=2_000_000,
    split_p=0.05,
    move_p=0.03,
    merge_p=0.05,
    records_per_s=60.0,
)
SIM = [
    *("--sim-seed", str(PARAMS.seed), "--sim-roots", str(PARAMS.roots)),
    *("--sim-records-per-s", "60", "--sim-round-s", "2"),
    *("--sim-split-p", "0.05", "--sim-move-p", "0.03", "--sim-merge-p", "0.05"),
]
FILES = ["--sink", "files"]  # the pyarrow parquet sink: no JVM, for the tests about tasks
LAG_S = 15  # a run that stops must have written every row older than this (a generous bound)

# The output is exactly-once (docs/design.md#exactly-once-output): a partition handed to another
# process moves with its exact position, so the two-process test requires that no row is written
# twice across the processes.
EXACTLY_ONCE = True


def _now_us() -> int:
    return time.time_ns() // 1000


def _model(start: int) -> StreamModel:
    """The stream the run reads: the test's own parameters and the start it passed."""
    return StreamModel(msgspec.structs.replace(PARAMS, start_ts=start))


def _env() -> dict[str, str]:
    # no SHOAL_ settings of the caller's environment reach the runs, except the log level (to
    # debug a failing run: SHOAL_LOG_LEVEL=info)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") or k == "SHOAL_LOG_LEVEL"
    }
    env["PYTHONPATH"] = str(REPO)
    return env


def _cli(args: list[str], tmp: Path, name: str = "run") -> subprocess.Popen[bytes]:
    with (tmp / f"{name}.out").open("wb") as out, (tmp / f"{name}.err").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "actors.runtime", *args],
            cwd=REPO,
            env=_env(),
            stdout=out,
            stderr=err,
        )


def _finish(proc: subprocess.Popen[bytes], tmp: Path, name: str, timeout: float) -> int:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait()
        raise AssertionError(
            f"{name} did not end: {(tmp / f'{name}.err').read_text()[-3000:]}"
        ) from exc
    return code


def _logs(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.out").read_text() + (tmp / f"{name}.err").read_text()


def _unfinished(
    model: StreamModel, per: dict[str, dict[str, int]], ids: Collection[str], stop: int
) -> set[str]:
    """Partitions the output does not hold in full as of ``stop``: not ended by then, or rows
    missing."""
    written = set(ids)
    return {
        token
        for token, rows in per.items()
        if (end := model.partitions[token].end_ts) is None or end > stop or rows.keys() - written
    }


def _summary(path: Path) -> RunSummary:
    return msgspec.json.decode(path.read_bytes(), type=RunSummary)


REREAD_COUNTERS = (
    "records_read_twice",
    "duplicates_dropped_by_sink",
    "duplicate_rows_dropped_by_spark",
)


def _nothing_read_twice(summary: RunSummary) -> None:
    """The counters of the sinks' defence against re-reads are 0: with exact positions none
    come (docs/operations.md, "Output and duplicates")."""
    counted = {k: summary.errors[k] for k in REREAD_COUNTERS if summary.errors.get(k)}
    assert not counted, f"records read twice: {counted}"


def _ids(directory: Path) -> list[str]:
    """Row ids (``commit/txn/seq/mod``) of a file-sink or Spark output, every raw row: duplicates
    kept (``read_output(..., dedupe=False)``)."""
    if any(directory.glob("table=*")):  # Spark's output, partitioned by table and batch
        table = read_output(directory, dedupe=False)
        columns = [table.column(c).to_pylist() for c in KEY_COLUMNS]
        return ["/".join(str(v) for v in key) for key in zip(*columns, strict=True)]
    return [row["record_id"] for row in read_rows(directory)]


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bounded_embedded_run_writes_what_was_produced(tmp_path: Path) -> None:
    """The embedded default (broker, simulated stream, 3 tasks, local Spark writing parquet),
    bounded, with the Spark retry and dead-letter queues on (nothing fails, so they stay empty,
    but they start, sit in the path of every batch and stop): it exits 0 and the output rows are
    exactly the rows the stream produced, each once (raw). Re-reads the sink dropped are
    allowed (see below); the other runs here, without the queues, require none."""
    out = tmp_path / "out"
    start = _now_us()
    proc = _cli(
        [
            "--duration",
            "8",
            *SIM,
            "--sim-start-ts",
            str(start),
            "--spark-dead-letter",
            "--output-dir",
            str(out),
            "--summary-json",
            str(tmp_path / "summary.json"),
            "--progress",
            "on",
        ],
        tmp_path,
    )
    code = _finish(proc, tmp_path, "run", 200)
    ended = _now_us()
    logs = _logs(tmp_path, "run")
    assert code == 0, logs
    assert "starting Spark (local[2], embedded path, retry/dead-letter queues" in logs
    assert "rebalance:" in logs
    assert "progress: delivered" in logs
    assert "shoal run summary (duration" in logs
    ids = _ids(out / "data")
    print(f"bounded run: {len(ids)} raw rows, {len(ids) - len(set(ids))} duplicates")
    # The stream was closed at one instant, after the 8 s the run was asked to last and before
    # it exited; the output is exactly the model's rows up to that instant, each once (raw rows:
    # the control shows a row written twice fails the check).
    model = _model(start)
    cut = assert_one_cut(model, ids, earliest=start + 8_000_000, latest=ended)
    assert_catches_a_double(
        lambda rows: assert_one_cut(model, rows, earliest=start + 8_000_000, latest=ended), ids
    )
    produced = stream_rows(model, cut)
    # the summary's claims, checked against the model
    summary = _summary(tmp_path / "summary.json")
    assert summary.caught_up
    assert summary.drained
    assert summary.stream_start == start
    assert summary.stream_end is not None
    assert cut <= summary.stream_end <= ended
    assert stream_rows(model, summary.stream_end).keys() == produced.keys()
    assert summary.sink == "spark"
    assert summary.produced_rows == summary.rows_written == len(produced) == len(ids) > 0
    # Re-reads are allowed here, and why: with the retry and dead-letter queues the Spark sink
    # cannot fence a stopped reader's batches in flight ("abandoned to a sink that cannot fence
    # them"), so the partition's next reader reads them again (docs/operations.md, "Output and
    # duplicates": at least once with the queues). The bridge drops them at the partition's
    # watermark and counts them; the raw output above is still each row once.
    reread = summary.errors.get("records_read_twice", 0)
    assert summary.records_delivered - reread == summary.produced_records
    assert len(summary.tasks) == 3
    assert all(t.records_delivered > 0 for t in summary.tasks)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def _metric(text: str, name: str) -> list[float]:
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    ]


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sink", ["files", pytest.param("spark", marks=pytest.mark.spark)])
def test_sigterm_drains_and_loses_nothing_metrics_scraped(tmp_path: Path, sink: str) -> None:
    out = tmp_path / "out"
    port = free_port()
    start = _now_us()
    proc = _cli(
        [
            *SIM,
            "--sim-start-ts",
            str(start),
            "--sink",
            sink,
            "--output-dir",
            str(out),
            "--summary-json",
            str(tmp_path / "summary.json"),
            "--metrics-port",
            str(port),
            "--progress",
            "off",
        ],
        tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # Spark takes its time to start
        while _get(f"{base}/readyz")[0] != 200:
            assert proc.poll() is None, _logs(tmp_path, "run")
            assert time.monotonic() < deadline, _get(f"{base}/readyz")
            time.sleep(0.2)
        assert _get(f"{base}/healthz") == (200, "ok\n")
        while True:  # scrape until records flow, the lag is under the bound and every root owned
            status, text = _get(f"{base}/metrics")
            assert status == 200
            lags = _metric(text, "shoal_partition_lag_seconds")
            owned = _metric(text, "shoal_owned_partitions")
            if (
                sum(_metric(text, "shoal_records_delivered_total")) > 0
                and lags
                and max(lags) < LAG_S
                and sum(owned) >= 4  # a root may still be on its way to a task a moment earlier
            ):
                break
            assert proc.poll() is None, _logs(tmp_path, "run")
            assert time.monotonic() < deadline, text
            time.sleep(0.3)
        assert sum(_metric(text, "shoal_owned_partitions")) >= 4
        assert len(_metric(text, "shoal_owned_partitions")) == 3  # one per task
        assert sum(_metric(text, "shoal_records_read_total")) > 0
        assert sum(_metric(text, "shoal_is_leader")) == 1
        assert min(_metric(text, "shoal_epoch")) >= 0
        assert sum(_metric(text, "shoal_sync_messages_total")) > 0
        assert sum(_metric(text, "shoal_sync_bytes_total")) > 0
        assert _metric(text, "shoal_mailbox_depth")
        assert sum(_metric(text, "shoal_rebalances_total")) >= 1
        assert "shoal_rebalance_duration_seconds_bucket" in text
        assert _metric(text, "shoal_sink_inflight_batches")
        assert "# TYPE shoal_errors_total counter" in text
        # Mid-run, batches in flight, and the stream old enough that the lag bound below asks
        # for something (at least 5 s of every partition's rows).
        time.sleep(max(1.5, (start - _now_us()) / 1e6 + LAG_S + 5))
    finally:
        stopped_at = _now_us()
        proc.send_signal(signal.SIGTERM)
    code = _finish(proc, tmp_path, "run", 60)
    ended = _now_us()
    logs = _logs(tmp_path, "run")
    assert code == 0, logs
    assert "SIGTERM: draining" in logs
    ids = _ids(out / "data")
    print(f"SIGTERM run ({sink}): {len(ids)} raw rows, {len(ids) - len(set(ids))} duplicates")
    model = _model(start)
    floor = stopped_at - LAG_S * 1_000_000
    cuts = assert_read_without_gaps(model, ids, floor=floor, latest=ended)
    assert_catches_a_double(
        lambda rows: assert_read_without_gaps(model, rows, floor=floor, latest=ended), ids
    )
    assert set(model.roots) <= cuts.keys(), "a root partition was never read"
    # The summary's final state (what the tasks published to the sync topic) is checked against
    # the model: it names every partition read but not finished (a finished one may have been
    # removed), and no watermark claims a row that is not in the output (a restart resumes from
    # these and would skip it).
    summary = _summary(tmp_path / "summary.json")
    assert summary.reason == "signal"
    assert summary.drained
    assert summary.stream_start == start
    _nothing_read_twice(summary)
    per = partition_rows(model, ended)
    reported = {p.token: p for p in summary.partitions}
    assert _unfinished(model, per, ids, stopped_at) & cuts.keys() <= reported.keys()
    for p in summary.partitions:
        assert p.token in per, p
        claimed = {
            i for i, ts in per[p.token].items() if p.status == "finished" or ts < p.watermark
        }
        assert claimed <= set(ids), f"{p}: {len(claimed - set(ids))} rows claimed, not written"


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--tasks", "0"], {}, "invalid value for tasks (from flag --tasks)"),
        (["--config", "/nonexistent/shoal.toml"], {}, "config file '/nonexistent/shoal.toml'"),
        ([], {"SHOAL_DRAIN_TIMEOUT": "soon"}, "SHOAL_DRAIN_TIMEOUT"),
        (["--frobnicate"], {}, "unrecognized arguments: --frobnicate"),
        (["status"], {}, "status needs a Kafka to read"),
    ],
)
def test_bad_options_exit_2(
    tmp_path: Path, args: list[str], env: dict[str, str], needle: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "actors.runtime", *args],
        cwd=REPO,
        env={**_env(), **env},
        capture_output=True,
        timeout=60,
        check=False,
    )
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert needle in err
    assert err.strip().count("\n") == 0, err  # one line
    assert "Traceback" not in err


def test_bad_config_file_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "shoal.toml"
    path.write_text("[kafka]\nbootstrap_server = 'a:1'\n")
    result = subprocess.run(
        [sys.executable, "-m", "actors.runtime", "--config", str(path)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    err = result.stderr.decode()
    assert result.returncode == 2
    assert "unknown key 'bootstrap_server' in [kafka] (did you mean 'bootstrap_servers'?)" in err


ALPHA_S = 20  # alpha's duration: more than LAG_S, so the lag bound asks for its first 5 s


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_processes_share_a_kafka_then_status(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    """Production mode: one task per process; a second process with the same connector adds a
    task; stopping both leaves every partition's final state on the sync topic for `status`."""
    start = _now_us()
    common = [
        "--kafka-bootstrap-servers",
        kafka_broker.bootstrap,
        "--kafka-session-timeout-ms",
        "3000",
        "--kafka-heartbeat-interval-ms",
        "1000",
        "--connector",
        f"cli-{os.getpid()}-{time.monotonic_ns() % 10**6}",
        "--sim-start-ts",
        str(start),
        *SIM,
        *FILES,
        "--progress",
        "off",
    ]
    procs = {}
    for name in ("alpha", "beta"):
        procs[name] = _cli(
            [
                *common,
                "--task-id",
                name,
                "--output-dir",
                str(tmp_path / name),
                "--summary-json",
                str(tmp_path / f"{name}.json"),
                "--duration",
                str(ALPHA_S) if name == "alpha" else "10",
            ],
            tmp_path,
            name,
        )
        time.sleep(1.0)
    for name, proc in procs.items():
        assert _finish(proc, tmp_path, name, 90) == 0, _logs(tmp_path, name)
    ended = _now_us()
    summaries = {name: _summary(tmp_path / f"{name}.json") for name in procs}
    assert all(s.drained for s in summaries.values())
    assert all(s.records_delivered > 0 for s in summaries.values()), "both tasks read"
    final = summaries["alpha"]  # the last to leave: its CIM holds both tasks' final state
    ids = _ids(tmp_path / "alpha" / "data") + _ids(tmp_path / "beta" / "data")
    # A partition moves with its exact position (its watermark and the identities committed at
    # it), so with EXACTLY_ONCE no row is in both outputs. The weaker check below stays as the
    # diagnosis when that fails: duplicates at no more commit timestamps than the partition
    # changed hands (twice here: to beta when it joins, back when it leaves) point at the
    # hand-off's position; a re-read range would span more.
    rows = {
        name: [(r["partition_token"], r["record_id"]) for r in read_rows(tmp_path / name / "data")]
        for name in procs
    }
    both = {rid for _, rid in rows["alpha"]} & {rid for _, rid in rows["beta"]}
    stamps: dict[str, set[str]] = {}
    for token, rid in rows["alpha"] + rows["beta"]:
        if rid in both:
            stamps.setdefault(token, set()).add(rid.split("/")[0])
    assert all(len(ts) <= 2 for ts in stamps.values()), f"re-read across processes: {stamps}"
    for name, written in rows.items():
        assert len(written) == len({rid for _, rid in written}), f"{name} wrote a record twice"
    print(f"two processes: {len(ids)} raw rows, {len(ids) - len(set(ids))} written by both")
    if EXACTLY_ONCE:
        assert not both, f"{len(both)} rows written by both processes"
    # From the model: every row written is a row of the stream, each partition was read without
    # a gap and after its parents, and alpha (which ran until at least ALPHA_S after it was
    # started) left nothing older than the lag bound unwritten.
    model = _model(start)
    floor = start + (ALPHA_S - LAG_S) * 1_000_000
    cuts = assert_read_without_gaps(model, ids, floor=floor, latest=ended)
    assert_catches_a_double(
        lambda rows: assert_read_without_gaps(model, rows, floor=floor, latest=ended), ids
    )
    for summary in summaries.values():
        _nothing_read_twice(summary)
    assert set(model.roots) <= cuts.keys()
    per = partition_rows(model, ended)
    unfinished = _unfinished(model, per, ids, ended) & cuts.keys()
    assert unfinished <= {p.token for p in final.partitions}, "read, unfinished, not reported"
    for p in final.partitions:  # the final published state claims nothing not written
        assert p.token in per, p
        claimed = {
            i for i, ts in per[p.token].items() if p.status == "finished" or ts < p.watermark
        }
        assert claimed <= set(ids), f"{p}: {len(claimed - set(ids))} rows claimed, not written"

    result = subprocess.run(
        [sys.executable, "-m", "actors.runtime", "status", *common[:8], "--json"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    status: dict[str, Any] = json.loads(result.stdout)
    assert status["epoch"] >= 1
    tokens = {t for task in status["tasks"].values() for t in task["partitions"]}
    assert {p.token for p in final.partitions if p.status != "finished"} <= tokens | {
        s for task in status["tasks"].values() for s in task["share"]
    }
    table = subprocess.run(
        [sys.executable, "-m", "actors.runtime", "status", *common[:8]],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    text = table.stdout.decode()
    assert table.returncode == 0
    assert "partition" in text
    assert "watermark" in text
    assert f"epoch {status['epoch']}" in text


@pytest.mark.timeout(60)
def test_unreachable_kafka_retries_then_fails_clearly(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "actors.runtime",
            "--kafka-bootstrap-servers",
            f"127.0.0.1:{port}",
            "--connect-timeout",
            "2",
            "--output-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=50,
        check=False,
    )
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert f"Kafka at 127.0.0.1:{port} unreachable after" in err
    assert "retrying in" in err
    assert time.monotonic() - started < 30


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_second_signal_exits_at_once_and_stops_the_broker(tmp_path: Path) -> None:
    proc = _cli(
        [*SIM, *FILES, "--output-dir", str(tmp_path / "out"), "--progress", "off"], tmp_path
    )

    def started() -> bool:
        assert proc.poll() is None, _logs(tmp_path, "run")
        return "shoal: connector" in (tmp_path / "run.out").read_text()

    wait_until(started, 60, "the run to start its tasks")
    log_text = (tmp_path / "out" / "broker.log").read_text()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    code = _finish(proc, tmp_path, "run", 20)
    logs = _logs(tmp_path, "run")
    assert code == 128 + signal.SIGINT, logs
    assert "second SIGINT: exiting now" in logs
    match = re.search(r"tcp://127\.0\.0\.1:(\d+)", log_text)
    assert match, log_text
    with pytest.raises(ConnectionRefusedError):  # the embedded broker did not outlive us
        socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=2).close()


def test_config_command_prints_effective_options_without_secrets() -> None:
    env = {
        **_env(),
        "SHOAL_KAFKA_BOOTSTRAP_SERVERS": "k:9093",
        "SHOAL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SHOAL_KAFKA_SASL_MECHANISM": "PLAIN",
        "SHOAL_KAFKA_SASL_USERNAME": "u",
        "SHOAL_KAFKA_SASL_PASSWORD": "hunter2",
    }
    result = subprocess.run(
        [sys.executable, "-m", "actors.runtime", "config", "--tasks", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=60,
        check=True,
    )
    shown = json.loads(result.stdout)
    assert shown["run"]["tasks"] == 2
    assert shown["kafka"]["sasl_password"] == "***"
    assert b"hunter2" not in result.stdout + result.stderr
    reference = subprocess.run(
        [sys.executable, "-m", "actors.runtime", "config", "--reference"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert reference.stdout.decode() == (REPO / "docs" / "configuration.md").read_text()


@pytest.mark.spanner
@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_emulator_source_bounded_run(tmp_path: Path) -> None:
    """--source emulator: the Cloud Spanner emulator with a write load; the output holds every
    row the load wrote. The run starts the emulator and its load itself, so the count it is held
    to is the run's own; the check against an oracle of the test's own (a ledger of what the test
    committed) is tests/integration/test_spanner_ledger.py."""
    require_emulator()
    proc = _cli(
        [
            *FILES,
            "--source",
            "emulator",
            "--spanner-load-rate",
            "20",
            "--duration",
            "12",
            "--output-dir",
            str(tmp_path / "out"),
            "--summary-json",
            str(tmp_path / "summary.json"),
            "--progress",
            "off",
        ],
        tmp_path,
    )
    assert _finish(proc, tmp_path, "run", 120) == 0, _logs(tmp_path, "run")
    summary = _summary(tmp_path / "summary.json")
    assert summary.caught_up
    assert summary.drained
    ids = _ids(tmp_path / "out" / "data")
    assert_no_row_twice(ids)
    assert_catches_a_double(assert_no_row_twice, ids)
    assert summary.produced_rows == len(ids) > 0
    _nothing_read_twice(summary)
