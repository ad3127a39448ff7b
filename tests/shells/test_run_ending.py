"""The run's wait for its end (``Pipeline._wait_for_end`` over ``protocol.ending.decide``): it
wakes on a stop, a deadline or a port's failure when it happens, not at the next poll or the
fallback look, and fails with the port's own exception. No broker: the run has no task."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import pytest

from actors.cli import config as options
from actors.cli.ports import Ledger
from actors.cli.run import _FALLBACK_S, Pipeline
from runtime.ports import Sink, SinkBatch, Unrecoverable


class _NoSink(Sink):
    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        raise AssertionError("nothing is handed over")


def _pipeline(tmp_path: Path, **run: str) -> Pipeline:
    settings = {"run__output_dir": str(tmp_path), **{f"run__{k}": v for k, v in run.items()}}
    return Pipeline(options.load(settings, environ={}), stop=asyncio.Event(), out=io.StringIO())


async def _wait(pipeline: Pipeline) -> tuple[str, float]:
    """The reason ``_wait_for_end`` returns, and after how many seconds."""
    began = time.monotonic()
    async with asyncio.TaskGroup() as group:
        relay = group.create_task(pipeline._relay_stop())
        try:
            reason = await pipeline._wait_for_end()
        finally:
            relay.cancel()
    return reason, time.monotonic() - began


@pytest.mark.asyncio
async def test_the_duration_ends_the_run_at_its_deadline(tmp_path: Path) -> None:
    reason, took = await _wait(_pipeline(tmp_path, duration="0.3"))
    assert reason == "duration"
    assert 0.3 <= took < 0.3 + _FALLBACK_S / 2


@pytest.mark.asyncio
async def test_a_stop_ends_the_run_when_it_comes(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path)
    asyncio.get_running_loop().call_later(0.2, pipeline.stop.set)
    reason, took = await _wait(pipeline)
    assert reason == "signal"
    assert took < _FALLBACK_S  # not at the fallback look


@pytest.mark.asyncio
async def test_a_port_failing_for_good_fails_the_run_with_its_own_exception(
    tmp_path: Path,
) -> None:
    pipeline = _pipeline(tmp_path)
    ledger = pipeline._ledger = Ledger(_NoSink(), check=False, changed=pipeline._notice)
    failure = Unrecoverable("Spark: the session is gone and could not be restarted")
    asyncio.get_running_loop().call_later(0.2, ledger._fail, failure)
    began = time.monotonic()
    with pytest.raises(ExceptionGroup) as caught:
        await _wait(pipeline)
    assert time.monotonic() - began < _FALLBACK_S  # not at the fallback look
    assert caught.value.exceptions == (failure,)
    assert pipeline.failed == str(failure)
