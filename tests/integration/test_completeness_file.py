"""The completeness watermark written beside the output (docs/design.md#completeness-watermark):
a bounded run of the command line with the parquet file sink leaves
``<data>/_shoal/<connector>/completeness.json``, and every change the stream model committed at or before
that time is in the output: the claim is checked against the model alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.cli.admin import format_status
from actors.cli.sinks import read_rows
from protocol.cim import Cim
from protocol.messages import Partition
from tests.helpers import epoch, state, stream_rows
from tests.integration.test_cli import FILES, SIM, _cli, _finish, _logs, _model, _now_us


def test_status_shows_the_completeness_watermark() -> None:
    cim = Cim()
    cim.apply(0, epoch("a", 1, "a"))
    cim.apply(1, state("a", 1, Partition("p", start_ts=1_000_000, watermark=1_700_000_000_000_001)))
    text = format_status("c", cim, 1_700_000_002_000_000)
    assert "complete up to 2023-11-14T22:13:20Z" in text
    assert "(2.0s behind)" in text


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_bounded_run_writes_a_completeness_watermark_the_output_honours(tmp_path: Path) -> None:
    out = tmp_path / "out"
    start = _now_us()
    proc = _cli(
        ["--duration", "6", *SIM, *FILES, "--sim-start-ts", str(start), "--output-dir", str(out)],
        tmp_path,
    )
    code = _finish(proc, tmp_path, "run", 200)
    assert code == 0, _logs(tmp_path, "run")
    marker = out / "data" / "_shoal" / "shoal" / "completeness.json"
    record = json.loads(marker.read_text())
    t = record["low_watermark_us"]
    assert start <= t, record
    assert record["low_watermark"].endswith("Z")
    written = {row["record_id"] for row in read_rows(out / "data")}
    must = stream_rows(_model(start), t)
    assert must, "the watermark covers some of the stream"
    missing = must.keys() - written
    assert not missing, f"{len(missing)} changes at or before the watermark are not in the output"
