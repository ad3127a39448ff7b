"""``bench outputstate``'s own checks (its figures are only as true as these): the oracle's window
and table filter, the reading of a real file sink's output, and the counts that call a row lost,
duplicated or falsely claimed complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench import outputstate, procs
from bench.outputstate import Key, Oracle, Sim
from protocol.records import DataChange
from runtime.files.sink import FileSink
from runtime.ports import SinkBatch
from tests.helpers import wait_until

SIM = Sim(seed=3, start_ts=1_700_000_000_000_000, roots=2, records_per_s=40.0)
UNTIL = SIM.start_ts + 12_000_000  # two rounds and more: some partitions split or move


def test_the_oracle_keeps_the_window_with_both_bounds_and_only_the_tables_named() -> None:
    oracle = Oracle(SIM)
    rows = oracle.rows(UNTIL)
    stamps = sorted({key[0] for key, _ in rows})
    start, end = stamps[10], stamps[-10]
    window = oracle.expected(start, end)
    assert {k for k, _ in rows if k[0] == start} <= window  # both bounds inclusive
    assert {k for k, _ in rows if k[0] == end} <= window
    assert all(start <= k[0] <= end for k in window)
    assert len(window) == sum(1 for k, _ in rows if start <= k[0] <= end)
    albums = oracle.expected(start, end, ["albums"])  # names compared without case
    assert albums == {k for k, table in rows if table == "Albums" and start <= k[0] <= end}
    assert 0 < len(albums) < len(window)
    assert oracle.expected(start, end, ["Albums", "Singers"]) == albums | oracle.expected(
        start, end, ["Singers"]
    )


async def _write(data: Path, records: list[DataChange]) -> None:
    async with FileSink(data, max_age_s=0.01) as sink:
        half = len(records) // 2
        await (await sink.put(SinkBatch("p0", tuple(records[:half]), records[half - 1].commit_ts)))
        await (await sink.put(SinkBatch("p1", tuple(records[half:]), records[-1].commit_ts)))


@pytest.mark.asyncio
async def test_a_real_file_output_reads_back_as_the_oracle_says_and_damage_shows(
    tmp_path: Path,
) -> None:
    """The oracle's identities are the ones the file sink writes; a batch copied in twice is
    counted as duplicates, a batch missing as lost; ``_`` and ``.`` names are not data."""
    start, end = SIM.start_ts + 2_000_000, SIM.start_ts + 9_000_000
    records = [r for r in SIM.model().expected(end) if r.commit_ts >= start]
    data = tmp_path / "data"
    await _write(data, records)
    expected = Oracle(SIM).expected(start, end)
    output = outputstate.read_output(data)
    assert output == Counter(expected)  # each expected row once, nothing else
    hist = outputstate.histogram(expected, output)
    assert (outputstate.missing(hist), outputstate.more_than(hist, 1)) == (0, 0)

    batches = sorted(data.glob("*/batch=*"))
    assert len(batches) >= 2
    shutil.copytree(batches[0], batches[0].with_name("batch=copy"))  # one batch twice
    shutil.copytree(batches[1], data / "_staging" / "x" / batches[1].name)  # not data
    shutil.copytree(batches[1], data / batches[1].parent.name / ".hidden")  # not data
    doubled = outputstate.read_output(data)
    hist = outputstate.histogram(expected, doubled)
    assert outputstate.more_than(hist, 1) == hist[2] > 0
    assert outputstate.missing(hist) == 0

    shutil.rmtree(batches[1])  # one batch gone
    hist = outputstate.histogram(expected, outputstate.read_output(data))
    assert outputstate.missing(hist) > 0
    assert outputstate.missing(hist) + hist[1] + hist[2] == len(expected)


K1: Key = (10, "t.1", "00000000", 0)
K2: Key = (20, "t.2", "00000000", 0)
K3: Key = (20, "t.2", "00000000", 1)
K4: Key = (30, "t.3", "00000000", 0)


def test_a_doubled_row_is_a_duplicate_and_a_missing_one_lost() -> None:
    expected = {K1, K2, K3}
    output = Counter({K1: 1, K2: 2, K4: 1})  # K3 missing, K2 twice, K4 not asked for
    hist = outputstate.histogram(expected, output)
    assert (outputstate.missing(hist), hist[1], outputstate.more_than(hist, 1)) == (1, 1, 1)
    assert outputstate._unexpected(output, expected) == 1


def test_a_mark_above_missing_rows_is_false_complete_and_below_the_end_counts() -> None:
    expected = {K1, K2, K3, K4}
    output = Counter({K1: 1, K2: 1, K4: 1})  # K3 (at 20) is missing
    assert outputstate.false_complete(expected, output, 19) == 0  # claims only K1
    assert outputstate.false_complete(expected, output, 20) == 1  # claims K3, not there
    assert outputstate.false_complete(expected, output, 99) == 1
    assert outputstate.false_complete(expected, output, None) == 0  # no mark claims nothing
    assert outputstate.mark_below_end(None, 30)
    assert outputstate.mark_below_end(29, 30)
    assert not outputstate.mark_below_end(30, 30)


def test_the_reset_overlap_twice_is_documented_but_not_three_times() -> None:
    before, overlap = {K1}, {K2, K3, K4}
    output = Counter({K1: 1, K2: 2, K3: 1, K4: 3})
    counts = outputstate.reset_counts(before, overlap, output, promised=True)
    assert counts == {
        "before_T1_present": 1,
        "before_T1": 1,
        "overlap_once": 1,
        "overlap_twice": 1,
        "lost": 0,
        "duplicates": 1,  # K4 three times
    }
    skipped = Counter({K2: 1, K3: 1, K4: 1})  # the second connector read nothing
    assert outputstate.reset_counts(before, overlap, skipped, promised=True)["lost"] == 1
    assert outputstate.reset_counts(before, overlap, skipped, promised=False)["lost"] == 0


def _mark(path: Path, connector: str, micros: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"connector": connector, "low_watermark_us": micros}))


def test_the_mark_is_the_connectors_own_else_the_shared_one_when_it_names_it(
    tmp_path: Path,
) -> None:
    assert outputstate.read_mark(tmp_path, "ca") is None
    _mark(tmp_path / "_shoal" / "completeness.json", "cb", 5)
    assert outputstate.read_mark(tmp_path, "ca") is None  # another connector's
    assert outputstate.read_mark(tmp_path, "cb") == 5
    _mark(tmp_path / "_shoal" / "ca" / "completeness.json", "ca", 7)
    assert outputstate.read_mark(tmp_path, "ca") == 7


def test_the_damaged_progress_file_is_the_furthest_one_in_any_connector_directory(
    tmp_path: Path,
) -> None:
    assert outputstate._progress_file(tmp_path) is None
    for directory, name, body in [
        ("_shoal/progress", "a", b"[10,[]]"),
        ("_shoal/ca/progress", "b", b"[30,[]]"),
        ("_shoal/cb/progress", "c", b"[20,[]]"),
        ("_shoal/cb/progress", "d", b"[2"),  # already broken: ranks last
    ]:
        (tmp_path / directory).mkdir(parents=True, exist_ok=True)
        (tmp_path / directory / name).write_bytes(body)
    assert outputstate._progress_file(tmp_path) == tmp_path / "_shoal/ca/progress/b"


def test_any_failing_figure_fails_the_bench() -> None:
    good = {
        "lost": 0,
        "duplicates": 0,
        "false_complete": 0,
        "mark_below_end": 0,
        "silent_stuck": 0,
        "silent_skips": 0,
        "rerun_exit": 0,
        "refused_start_ok": True,
        "scenarios_run": list(outputstate.SCENARIOS),
    }
    assert outputstate.passed(good)
    for key, bad in [
        ("lost", 1),
        ("duplicates", 1),
        ("false_complete", 1),
        ("mark_below_end", 1),
        ("silent_stuck", 1),
        ("silent_skips", 1),
        ("rerun_exit", 1),
        ("rerun_exit", "killed"),
        ("refused_start_ok", False),
    ]:
        assert not outputstate.passed({**good, key: bad}), key
    # a scenario not chosen leaves its figure None, which does not fail the others
    only = {**good, "rerun_exit": None, "refused_start_ok": None, "scenarios_run": ["reset"]}
    assert outputstate.passed(only)


def test_the_process_tree_holds_a_grandchild_in_a_session_of_its_own() -> None:
    """What the bench kills at the end: a run's embedded broker leads its own session, so the
    run's process group would miss it; the tree from ``/proc`` does not."""
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); print(p.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = 0
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        below = procs.tree(parent.pid)
        assert grandchild in below
        assert below[grandchild] == procs.start_time(grandchild)
        os.kill(grandchild, signal.SIGKILL)
        wait_until(lambda: procs.start_time(grandchild) != below[grandchild], 10, "grandchild gone")
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if grandchild:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)
