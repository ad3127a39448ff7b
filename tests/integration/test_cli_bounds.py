"""``--start-at`` / ``--end-at`` and the record filters, end to end in subprocesses on the
simulated stream: a bounded run exits 0 by itself with exactly the model's records of the window,
also when two processes share the connector (no row in both outputs: a partition moves with its
exact position); a different explicit start on a connector that already has state is refused in
one line with exit 2, and the same start resumes.

The expectation is built here, independently of the command line's code: the stream's parameters
are spelt out (every one passed as a flag, so the CLI's defaults cannot change the stream under
the test) and the filters are a literal re-statement of ``--exclude-tables`` / ``--mod-types``
for the plain names used (``_kept``). Outputs are compared as raw rows (sorted lists, duplicates
kept), and each comparison has its control: the same rows with one written twice fail it."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from actors.cli.progress import RunSummary
from protocol.records import DataChange
from runtime.files.sink import read_rows
from runtime.kafka.broker import EmbeddedBroker
from runtime.sim.stream import StreamModel, StreamParams
from tests.fixtures.kafka import kafka_broker
from tests.helpers import REPO, assert_catches_a_double

__all__ = ["kafka_broker"]

# The simulated stream, every parameter spelt out: the flags the runs get and the model below.
SIM = [
    *("--sim-seed", "1", "--sim-roots", "4"),
    *("--sim-records-per-s", "100", "--sim-round-s", "2"),
    *("--sim-split-p", "0.3", "--sim-move-p", "0.03", "--sim-merge-p", "0.2"),
]


def _params(start: int) -> StreamParams:
    """The stream the runs read (it begins at ``--start-at`` when no ``--sim-start-ts`` is
    given), from the flags above, written out by hand."""
    return StreamParams(
        seed=1,
        roots=4,
        start_ts=start,
        round_us=2_000_000,
        split_p=0.3,
        move_p=0.03,
        merge_p=0.2,
        records_per_s=100.0,
    )


def _kept(
    record: DataChange,
    exclude: tuple[str, ...] = (),
    mod_types: tuple[str, ...] = (),
    tables: tuple[str, ...] = (),
) -> bool:
    """``--tables``, ``--exclude-tables`` (plain names, matched case-insensitively; exclusion
    wins) and ``--mod-types``, as docs/operations.md states them."""
    table = record.table.lower()
    if tables and table not in {name.lower() for name in tables}:
        return False
    if table in {name.lower() for name in exclude}:
        return False
    return not mod_types or record.mod_type in mod_types


EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _rfc3339(micros: int) -> str:
    return (EPOCH + dt.timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")


def _window(ago_s: float, length_s: float) -> tuple[int, int]:
    """A window in the simulated stream's past (every record of it exists at once)."""
    now = (dt.datetime.now(dt.UTC) - EPOCH) // dt.timedelta(microseconds=1)
    start = now - int(ago_s * 1e6)
    return start, start + int(length_s * 1e6)


def _expected(
    start: int,
    end: int,
    exclude: tuple[str, ...] = (),
    mod_types: tuple[str, ...] = (),
    tables: tuple[str, ...] = (),
) -> list[str]:
    """Row ids of the window ``[start, end]`` the filters keep, from the stream model alone."""
    model = StreamModel(_params(start))
    return sorted(
        f"{r.commit_ts}/{r.server_transaction_id}/{r.record_sequence}/{i}"
        for r in model.expected(end)
        if r.commit_ts >= start and _kept(r, exclude, mod_types, tables)
        for i in range(len(r.mods))
    )


def _exactly(expected: list[str]) -> Callable[[list[str]], None]:
    """The check that raw rows are ``expected`` (sorted), each once."""

    def check(rows: list[str]) -> None:
        assert sorted(rows) == expected, (
            f"{len(rows)} rows vs {len(expected)} expected; twice: "
            f"{sorted(r for r, n in Counter(rows).items() if n > 1)[:3]}; extra: "
            f"{sorted(set(rows) - set(expected))[:3]}; missing: "
            f"{sorted(set(expected) - set(rows))[:3]}"
        )

    return check


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _run(args: list[str], tmp: Path, name: str, timeout: float = 90) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "actors.runtime", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    (tmp / f"{name}.err").write_bytes(proc.stderr)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def _ids(directory: Path) -> list[str]:
    return sorted(str(row["record_id"]) for row in read_rows(directory))


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_bounded_filtered_run_exits_0_with_exactly_the_window(tmp_path: Path) -> None:
    start, end = _window(ago_s=20, length_s=8)
    args = [
        *SIM,
        "--sink",
        "files",
        "--progress",
        "off",
        "--output-dir",
        str(tmp_path / "out"),
        "--summary-json",
        str(tmp_path / "summary.json"),
        "--start-at",
        _rfc3339(start),
        "--end-at",
        _rfc3339(end),
        "--exclude-tables",
        "albums",
        "--mod-types",
        "INSERT,UPDATE",
    ]
    code, out, err = _run(args, tmp_path, "run")
    assert code == 0, out + err
    summary = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=RunSummary)
    assert summary.reason == "end-at"
    assert summary.caught_up is True
    assert summary.drained
    assert summary.records_filtered > 0
    assert "records filtered out:" in out
    assert summary.warnings == {}, err  # control: 'albums' matches a table of the stream
    expected = _expected(start, end, exclude=("albums",), mod_types=("INSERT", "UPDATE"))
    assert len(expected) > 1000
    everything = _expected(start, end)
    assert len(everything) > len(expected), "the filters dropped nothing: they go unchecked"
    got = _ids(tmp_path / "out" / "data")
    _exactly(expected)(got)  # every row of the window once, nothing outside it
    assert_catches_a_double(_exactly(expected), got)
    rows = list(read_rows(tmp_path / "out" / "data"))
    assert not any("albums" in row["table"].lower() for row in rows)
    assert {row["mod_type"] for row in rows} == {"INSERT", "UPDATE"}


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_two_processes_each_end_by_themselves_and_share_the_window(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    """Two processes, one connector, a shared Kafka: each sees in its own CIM that every
    partition reached the end, drains and exits 0; together they wrote the window once."""
    start, end = _window(ago_s=30, length_s=10)
    common = [
        *SIM,
        "--sink",
        "files",
        "--progress",
        "off",
        "--connector",
        "bounded-two",
        "--kafka-bootstrap-servers",
        kafka_broker.bootstrap,
        "--kafka-session-timeout-ms",
        "3000",
        "--kafka-heartbeat-interval-ms",
        "1000",
        "--kafka-request-timeout-ms",
        "10000",
        "--start-at",
        _rfc3339(start),
        "--end-at",
        _rfc3339(end),
    ]
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "actors.runtime",
                *common,
                "--task-id",
                name,
                "--output-dir",
                str(tmp_path / name),
            ],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name in ("alpha", "beta")
    }
    outputs = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        outputs[name] = (proc.returncode, out.decode() + err.decode())
    for name, (code, text) in outputs.items():
        assert code == 0, f"{name}: {text[-3000:]}"
        assert "shoal run summary (end-at" in text, text
    alpha, beta = _ids(tmp_path / "alpha" / "data"), _ids(tmp_path / "beta" / "data")
    assert alpha, "alpha wrote nothing"
    assert beta, "beta wrote nothing"
    # A partition moves with its exact position (docs/operations.md, "Output and duplicates"):
    # no row is in both outputs, and together they are the window, each row once.
    both = sorted(set(alpha) & set(beta))
    assert not both, f"{len(both)} rows in both outputs: {both[:3]}"
    check = _exactly(_expected(start, end))
    check(alpha + beta)
    assert_catches_a_double(check, alpha + beta)


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_a_different_start_on_a_started_connector_is_refused_the_same_resumes(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    start, end = _window(ago_s=20, length_s=4)
    common = [
        *SIM,
        "--sink",
        "files",
        "--progress",
        "off",
        "--connector",
        "bounded-restart",
        "--kafka-bootstrap-servers",
        kafka_broker.bootstrap,
        "--kafka-session-timeout-ms",
        "3000",
        "--kafka-heartbeat-interval-ms",
        "1000",
        "--end-at",
        _rfc3339(end),
        "--output-dir",
        str(tmp_path / "out"),
    ]
    code, out, err = _run([*common, "--start-at", _rfc3339(start)], tmp_path, "first")
    assert code == 0, out + err
    first = _ids(tmp_path / "out" / "data")
    _exactly(_expected(start, end))(first)

    other = start + 1_000_000
    code, out, err = _run([*common, "--start-at", _rfc3339(other)], tmp_path, "refused")
    assert code == 2, out + err
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        f"shoal: error: start_at {_rfc3339(other)}: connector 'bounded-restart' already "
        f"started at {_rfc3339(start)}"
    ), err
    assert "docs/operations.md" in lines[0]

    # the same start (or none) resumes from the watermarks: nothing is left, nothing is new
    code, out, err = _run([*common, "--start-at", _rfc3339(start)], tmp_path, "resumed")
    assert code == 0, out + err
    assert "shoal run summary (end-at" in out
    assert _ids(tmp_path / "out" / "data") == first


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_duration_run_with_a_start_and_a_filter_catches_up_on_what_it_reads(
    tmp_path: Path,
) -> None:
    """``--duration`` closes the stream at the current time and waits for what the tasks read:
    from ``--start-at`` on, through the filter (not the whole stream, or it never catches up)."""
    start, _ = _window(ago_s=5, length_s=0)
    args = [
        *SIM,
        "--sink",
        "files",
        "--progress",
        "off",
        "--output-dir",
        str(tmp_path / "out"),
        "--summary-json",
        str(tmp_path / "summary.json"),
        "--start-at",
        _rfc3339(start),
        "--duration",
        "3",
        "--mod-types",
        "INSERT",
    ]
    code, out, err = _run(args, tmp_path, "run")
    assert code == 0, out + err
    summary = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=RunSummary)
    assert summary.reason == "duration"
    assert summary.caught_up is True
    assert summary.stream_end is not None
    got = _ids(tmp_path / "out" / "data")
    expected = _expected(start, summary.stream_end, mod_types=("INSERT",))
    _exactly(expected)(got)
    assert_catches_a_double(_exactly(expected), got)
    assert len(_expected(start, summary.stream_end)) > len(expected), "no mod type was dropped"


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_interrupted_bounded_run_resumes_its_child_partitions(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    """On a broker that outlives the process, a bounded simulated run stopped half-way (by
    ``--max-records``) and started again resumes: the new process's simulated stream serves the
    child partitions the sync topic names (it used to fail them for ever, ``KeyError: unknown
    partition token``, and never reach the end), and the two runs wrote the window."""
    start, end = _window(ago_s=60, length_s=30)
    common = [
        *SIM,
        *("--sink", "files", "--progress", "off", "--connector", "bounded-resume-children"),
        *("--kafka-bootstrap-servers", kafka_broker.bootstrap),
        *("--kafka-session-timeout-ms", "3000", "--kafka-heartbeat-interval-ms", "1000"),
        *("--start-at", _rfc3339(start), "--end-at", _rfc3339(end), "--tasks", "1"),
        *("--output-dir", str(tmp_path / "out"), "--summary-json", str(tmp_path / "s.json")),
    ]
    code, out, err = _run([*common, "--max-records", "3000"], tmp_path, "first", timeout=120)
    assert code == 0, out + err
    first = msgspec.json.decode((tmp_path / "s.json").read_bytes(), type=RunSummary)
    assert first.reason == "max-records", out
    roots = set(StreamModel(_params(start)).roots)
    live_children = [p for p in first.partitions if p.status != "finished" and p.token not in roots]
    assert live_children, f"the first run left no child partition to resume: {first.partitions}"

    code, out, err = _run(common, tmp_path, "second", timeout=150)
    assert code == 0, out + err
    second = msgspec.json.decode((tmp_path / "s.json").read_bytes(), type=RunSummary)
    assert second.reason == "end-at", out
    assert "unknown partition token" not in err
    assert "reader_failed" not in second.errors, second.errors
    assert second.records_delivered > 0
    # the two runs together: the window, each row once (the second resumed at the first's
    # exact positions)
    got = _ids(tmp_path / "out" / "data")
    _exactly(_expected(start, end))(got)
    assert_catches_a_double(_exactly(_expected(start, end)), got)


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_filters_that_match_no_table_warn_once_and_are_counted(tmp_path: Path) -> None:
    start, end = _window(ago_s=20, length_s=4)
    args = [
        *SIM,
        *("--sink", "files", "--progress", "off", "--output-dir", str(tmp_path / "out")),
        *("--summary-json", str(tmp_path / "summary.json")),
        *("--start-at", _rfc3339(start), "--end-at", _rfc3339(end)),
        *("--tables", "Ordres", "--exclude-tables", "Songs"),
    ]
    code, out, err = _run(args, tmp_path, "run")
    assert code == 0, out + err
    warned = [line for line in err.splitlines() if "WARNING" in line and "tables/" in line]
    assert len(warned) == 1, err
    assert (
        "'Ordres' (--tables) matches no table (the stream's tables: Singers, Albums, Songs)"
        in (warned[0])
    )
    assert "'Songs'" not in warned[0]  # it matches a table
    assert "the filters keep no table: this run writes nothing" in warned[0]
    summary = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=RunSummary)
    assert summary.warnings == {"filter_matches_no_table": 1}
    assert "warnings: filter_matches_no_table=1" in out
    assert summary.rows_written == 0


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_start_in_the_future_warns_once_and_is_counted(tmp_path: Path) -> None:
    start, _ = _window(ago_s=-600, length_s=0)  # ten minutes ahead
    args = [
        *SIM,
        *("--sink", "files", "--progress", "off", "--output-dir", str(tmp_path / "out")),
        *("--summary-json", str(tmp_path / "summary.json")),
        *("--start-at", _rfc3339(start), "--duration", "3"),
    ]
    code, out, err = _run(args, tmp_path, "run")
    assert code == 0, out + err
    warned = [line for line in err.splitlines() if "WARNING" in line and "start_at" in line]
    assert len(warned) == 1, err
    assert f"start_at {_rfc3339(start)} is " in warned[0]
    assert "s in the future" in warned[0]
    summary = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=RunSummary)
    assert summary.warnings == {"start_in_future": 1}
    assert summary.rows_written == 0


@pytest.mark.kafka
@pytest.mark.timeout(180)
def test_an_end_before_a_first_start_now_is_refused_and_records_nothing(
    tmp_path: Path, kafka_broker: EmbeddedBroker
) -> None:
    """``--end-at`` in the past with the start ``now`` on a connector that never ran: exit 2, one
    line naming end_at; nothing is recorded, so the corrected command (a start before the end)
    then runs the window, on the same connector. (A connector that already started may be
    finished with an end in the past: it resumes from its watermarks.)"""
    start, end = _window(ago_s=20, length_s=4)
    common = [
        *SIM,
        *("--sink", "files", "--progress", "off", "--connector", "bounded-empty-window"),
        *("--kafka-bootstrap-servers", kafka_broker.bootstrap),
        *("--kafka-session-timeout-ms", "3000", "--kafka-heartbeat-interval-ms", "1000"),
        *("--end-at", _rfc3339(end), "--output-dir", str(tmp_path / "out")),
    ]
    code, out, err = _run(common, tmp_path, "refused")
    assert code == 2, out + err
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        f"shoal: error: end_at {_rfc3339(end)}: connector 'bounded-empty-window' has not "
        "started yet and would start at "
    ), lines[0]
    assert "(start_at now), after its end: nothing to read" in lines[0]

    code, out, err = _run([*common, "--start-at", _rfc3339(start)], tmp_path, "corrected")
    assert code == 0, out + err  # no start was recorded by the refused run: no conflict
    assert "shoal run summary (end-at" in out
    _exactly(_expected(start, end))(_ids(tmp_path / "out" / "data"))
