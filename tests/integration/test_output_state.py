"""The output's own state belongs to its connector (docs/design.md, exactly-once rule 5), end to
end in subprocesses of the command line on the simulated stream, with the embedded broker (whose
sync topic does not outlive a run, so only the output remembers anything):

* two connectors writing one output one after the other each write their whole window (keyed
  by token only, the second resumed from the first's progress and wrote almost nothing);
* the documented reset under a new name re-reads the window before the old start;
* a different explicit start is refused (exit 2) by the output's record, the same start resumes
  and a re-run of a finished bounded run exits 0 at once, caught up;
* a bounded run leaves its connector's completeness mark at its end;
* a truncated progress file stops the run (exit 1) naming the file.

Expected rows come from the stream model and the literal filters of ``test_cli_bounds``; the
output is read back row by row, and a row there twice counts (no set comparison that would hide
it)."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import msgspec
import pytest

from actors.cli.progress import RunSummary
from runtime.files.sink import read_rows
from tests.helpers import assert_catches_a_double
from tests.integration.test_cli_bounds import SIM, _exactly, _expected, _rfc3339, _run, _window

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _args(out: Path, connector: str, start: int, end: int, *extra: str) -> list[str]:
    return [
        *SIM,
        "--sink",
        "files",
        "--progress",
        "off",
        "--output-dir",
        str(out),
        "--connector",
        connector,
        "--start-at",
        _rfc3339(start),
        "--end-at",
        _rfc3339(end),
        *extra,
    ]


def _counts(out: Path, table: str | None = None) -> collections.Counter[str]:
    return collections.Counter(
        str(row["record_id"])
        for row in read_rows(out / "data")
        if table is None or row["table"] == table
    )


def _mark(out: Path, connector: str) -> int:
    record = json.loads((out / "data" / "_shoal" / connector / "completeness.json").read_text())
    assert record["connector"] == connector
    return int(record["low_watermark_us"])


@pytest.mark.timeout(240)
def test_two_connectors_one_output_each_write_their_whole_window(tmp_path: Path) -> None:
    start, end = _window(ago_s=30, length_s=6)
    out = tmp_path / "out"
    for connector, table in (("ca", "Albums"), ("cb", "Singers")):
        code, stdout, stderr = _run(
            _args(out, connector, start, end, "--tables", table), tmp_path, connector
        )
        assert code == 0, stdout + stderr
        expected = _expected(start, end, tables=(table,))
        written = list(_counts(out, table).elements())
        _exactly(expected)(written)  # no row lost or doubled
        assert_catches_a_double(_exactly(expected), written)
        assert _mark(out, connector) >= end  # the final mark, at the run's end
    assert sorted(p.name for p in (out / "data" / "_shoal").iterdir()) == ["ca", "cb"]


@pytest.mark.timeout(240)
def test_a_reset_under_a_new_name_reads_its_whole_window_again(tmp_path: Path) -> None:
    t0, end = _window(ago_s=30, length_s=8)
    t1 = t0 + 4_000_000
    out = tmp_path / "out"
    one_stream = ("--sim-start-ts", str(t0))  # both runs read the same simulated stream
    code, stdout, stderr = _run(_args(out, "orders", t1, end, *one_stream), tmp_path, "orders")
    assert code == 0, stdout + stderr
    code, stdout, stderr = _run(_args(out, "orders-2", t0, end, *one_stream), tmp_path, "o2")
    assert code == 0, stdout + stderr
    written = _counts(out)
    everything = _expected(t0, end)  # the stream starts at t0
    before = [row for row in everything if int(row.split("/")[0]) < t1]
    overlap = [row for row in everything if int(row.split("/")[0]) >= t1]
    assert before, "the window before the first start has rows"
    assert all(written[row] == 1 for row in before), "the reset lost rows before the old start"
    assert all(written[row] == 2 for row in overlap)  # documented: the overlap twice
    assert sum(written.values()) == len(before) + 2 * len(overlap)
    assert _mark(out, "orders-2") >= end


@pytest.mark.timeout(240)
def test_the_output_refuses_another_start_and_a_finished_run_reruns_at_once(
    tmp_path: Path,
) -> None:
    start, end = _window(ago_s=30, length_s=6)
    out = tmp_path / "out"
    args = _args(out, "ca", start, end, "--summary-json", str(tmp_path / "summary.json"))
    code, stdout, stderr = _run(args, tmp_path, "first")
    assert code == 0, stdout + stderr
    earlier = _args(out, "ca", start - 2_000_000, end)
    code, stdout, stderr = _run(earlier, tmp_path, "earlier")
    assert code == 2, stdout + stderr
    assert "start_at" in stderr, stderr
    assert "start.json" in stderr, stderr
    assert stderr.count("\n") <= 3, stderr  # one line, not a traceback
    began = time.monotonic()
    code, stdout, stderr = _run(args, tmp_path, "again")
    took = time.monotonic() - began
    assert code == 0, stdout + stderr
    summary = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=RunSummary)
    assert summary.caught_up is True  # judged by the output, which holds the earlier run's rows
    assert took < 60, took
    written = list(_counts(out).elements())
    _exactly(_expected(start, end))(written)
    assert_catches_a_double(_exactly(_expected(start, end)), written)


@pytest.mark.timeout(240)
def test_a_truncated_progress_file_stops_the_run_naming_it(tmp_path: Path) -> None:
    start, end = _window(ago_s=30, length_s=4)
    out = tmp_path / "out"
    code, stdout, stderr = _run(_args(out, "ca", start, end), tmp_path, "first")
    assert code == 0, stdout + stderr
    progress = sorted((out / "data" / "_shoal" / "ca" / "progress").iterdir())
    assert progress
    victim = progress[0]
    victim.write_bytes(victim.read_bytes()[:5])
    later = _args(out, "ca", start, end + 10_000_000)
    code, stdout, stderr = _run(later, tmp_path, "truncated", timeout=120)
    assert code == 1, stdout + stderr
    assert str(victim) in stderr.splitlines()[-1], stderr[-2000:]


@pytest.mark.timeout(240)
def test_a_restart_never_writes_its_mark_back(tmp_path: Path) -> None:
    """A restart on the embedded broker starts a new sync topic, whose watermark begins low
    until its partitions have caught up with their progress files: the mark a reader may
    already have seen is not replaced by a lower one."""
    start, end = _window(ago_s=30, length_s=4)
    out = tmp_path / "out"
    code, stdout, stderr = _run(_args(out, "ca", start, end), tmp_path, "first")
    assert code == 0, stdout + stderr
    first = _mark(out, "ca")
    code, stdout, stderr = _run(_args(out, "ca", start, end + 4_000_000), tmp_path, "second")
    assert code == 0, stdout + stderr
    assert _mark(out, "ca") >= max(first, end + 4_000_000)
