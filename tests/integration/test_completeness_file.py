"""The completeness watermark written beside the output (docs/design.md#completeness-watermark):
a run of the command line with the parquet file sink keeps
``<data>/_shoal/<connector>/completeness.json`` up to date while it runs and leaves it when it
ends, and every change the stream model committed at or before each mark is already in the
output when the mark is written: the claim is checked against the model alone, at marks sampled
during the run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from actors.cli.admin import format_status
from protocol.cim import Cim
from protocol.messages import Partition
from runtime.sim.stream import StreamModel
from tests.helpers import epoch, state, stream_rows
from tests.integration.test_cli import FILES, SIM, _cli, _finish, _logs, _model, _now_us


def test_status_shows_the_completeness_watermark() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 1, "a"))
    cim.apply(1, state("a", 1, Partition("p", start_ts=1_000_000, watermark=1_700_000_000_000_001)))
    text = format_status("c", cim, 1_700_000_002_000_000)
    assert "complete up to 2023-11-14T22:13:20Z" in text
    assert "(2.0s behind)" in text


def _batch_files(data: Path) -> list[Path]:
    """The committed output files of a generic-layout file-sink output, at this moment: a batch
    directory is renamed into place whole, so every file listed is complete."""
    return sorted(
        path
        for path in data.rglob("*.parquet")
        if not any(part.startswith((".", "_")) for part in path.relative_to(data).parts)
    )


def _record_ids(files: list[Path]) -> set[str]:
    return {str(row["record_id"]) for path in files for row in pq.read_table(path).to_pylist()}


def _missing(model: StreamModel, mark: int, files: list[Path]) -> set[str]:
    return stream_rows(model, mark).keys() - _record_ids(files)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_mark_of_a_running_stream_is_already_honoured_by_the_output(
    tmp_path: Path,
) -> None:
    """The completeness file is sampled while a ``--duration`` run goes on: at each new mark, the
    output files on disk at that moment (listed right after the mark was read) hold every change
    the stream model committed at or before it. The control: the files of the first sample that
    covers rows do not hold what the final mark claims (a mark that claimed too much would be
    caught). The generic layout keeps a batch's files in one directory renamed into place whole."""
    data = tmp_path / "out" / "data"
    marker = data / "_shoal" / "shoal" / "completeness.json"
    start = _now_us()
    proc = _cli(
        [
            *("--duration", "20", *SIM, *FILES, "--sim-start-ts", str(start)),
            *("--output-layout", "generic", "--output-dir", str(tmp_path / "out")),
        ],
        tmp_path,
    )
    samples: list[tuple[int, list[Path]]] = []
    try:
        while proc.poll() is None:
            try:
                mark = json.loads(marker.read_text())["low_watermark_us"]
            except FileNotFoundError:
                mark = None
            if mark is not None and (not samples or mark != samples[-1][0]):
                samples.append((mark, _batch_files(data)))  # the files there at this moment
            time.sleep(0.05)
    finally:
        code = _finish(proc, tmp_path, "run", 200)
    assert code == 0, _logs(tmp_path, "run")
    final = json.loads(marker.read_text())
    assert final["low_watermark"].endswith("Z")
    assert final["low_watermark_us"] >= start, final
    model = _model(start)
    while_running = [
        s for s in samples if s[0] != final["low_watermark_us"] and stream_rows(model, s[0])
    ]
    print(f"completeness marks sampled while the run went on: {len(while_running)}")
    assert len(while_running) >= 3, f"too few marks covering rows while it ran: {samples}"
    for mark, files in [*samples, (final["low_watermark_us"], _batch_files(data))]:
        missing = _missing(model, mark, files)
        assert not missing, (
            f"mark {mark}: {len(missing)} changes at or before it were not on disk when it was "
            f"written, e.g. {sorted(missing)[:3]}"
        )
    # The control: the files of the first mark that covered rows, against the final mark.
    early = while_running[0][1]
    assert early, "no output yet at a mark that covers rows"
    assert _missing(model, final["low_watermark_us"], early), "the check cannot fail"
