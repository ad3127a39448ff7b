"""The Cloud Spanner emulator's live partition queries skip a commit whose timestamp is exactly
the end of one of their internal scan steps; a source that reads only the past (``trail_s``,
which the CLI uses against the emulator) returns every commit (runtime/spanner/reader.py,
"Trailing"; ``python -m bench emutail`` prints the live reader's misses beside it)."""

from __future__ import annotations

import argparse

import pytest

from bench import emutail
from runtime.spanner.emulator import EmulatorUnavailable
from tests.parts import require_part

pytestmark = [pytest.mark.spanner, pytest.mark.slow, pytest.mark.asyncio]


async def test_a_trailing_reader_gets_every_commit_under_fast_writes() -> None:
    # 2 ms scan steps (the emulator's default is 100 ms) make its gap fifty times as frequent:
    # a live reader of such a run typically misses one or two commits of ~2,500 (bench emutail)
    # (no live reader here: with such short steps it falls behind and takes a minute or more)
    args = argparse.Namespace(chop_ms=2, seconds=8.0, trail_s=0.25, seed=5, live=False)
    try:
        out = await emutail.run(args)
    except EmulatorUnavailable as exc:
        require_part("the Cloud Spanner emulator", str(exc))
    assert out["commits"] > 300, out
    assert out["trailing_lost"] == 0, out
    assert out["trailing_extra"] == 0, out
    assert out["reread_lost"] == 0, out
