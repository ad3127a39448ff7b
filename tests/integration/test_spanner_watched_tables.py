"""Against the real Cloud Spanner emulator (skipped, with the reason, where its binary is
absent): the Spanner reader says which tables its change stream watches (all of them for a
``FOR ALL`` stream, the named ones otherwise), and a ``--source spanner`` run whose ``--tables``
pattern matches none of them warns once, naming the pattern and the stream's tables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from actors.cli.progress import RunSummary
from runtime.spanner.config import SpannerConfig
from runtime.spanner.emulator import SpannerEmulator, sync_client
from runtime.spanner.reader import SpannerSource
from tests.fixtures.spanner import churn_emulator
from tests.helpers import REPO

__all__ = ["churn_emulator"]

pytestmark = [pytest.mark.spanner]

ONLY_SINGERS = "OnlySingers"


@pytest.fixture(scope="module")
def only_singers(churn_emulator: SpannerEmulator) -> SpannerConfig:
    """A second change stream of the emulator's database, watching Singers only."""
    config = churn_emulator.config
    with sync_client(config) as client:
        db = client.instance(config.instance).database(config.database)
        db.update_ddl([f"CREATE CHANGE STREAM {ONLY_SINGERS} FOR Singers"]).result(60)
    return msgspec.structs.replace(config, change_stream=ONLY_SINGERS)


async def _watched(config: SpannerConfig) -> tuple[str, ...] | None:
    source = await SpannerSource.connect(config)
    try:
        return await source.watched_tables()
    finally:
        await source.close()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_tables_a_change_stream_watches(
    churn_emulator: SpannerEmulator, only_singers: SpannerConfig
) -> None:
    assert await _watched(churn_emulator.config) == ("Albums", "Singers", "Songs")  # FOR ALL
    assert await _watched(only_singers) == ("Singers",)
    missing = msgspec.structs.replace(only_singers, change_stream="NoSuchStream")
    assert await _watched(missing) is None  # not known: reading it reports the stream


@pytest.mark.kafka
@pytest.mark.timeout(200)
def test_a_spanner_run_whose_filter_matches_no_watched_table_warns(
    tmp_path: Path, churn_emulator: SpannerEmulator, only_singers: SpannerConfig
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(REPO)
    cfg = only_singers
    result = subprocess.run(
        [sys.executable, "-m", "actors.runtime", "--sink", "files", "--progress", "off",
         "--source", "spanner", "--spanner-emulator-host", churn_emulator.host,
         "--spanner-project", cfg.project, "--spanner-instance", cfg.instance,
         "--spanner-database", cfg.database, "--spanner-change-stream", ONLY_SINGERS,
         "--tables", "Albums", "--duration", "10", "--output-dir", str(tmp_path / "out"),
         "--summary-json", str(tmp_path / "summary.json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if "tables/exclude_tables" in line]
    assert len(warned) == 1, result.stderr[-3000:]
    assert "'Albums' (--tables) matches no table (the stream's tables: Singers)" in warned[0]
    summary = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=RunSummary)
    assert summary.warnings == {"filter_matches_no_table": 1}
