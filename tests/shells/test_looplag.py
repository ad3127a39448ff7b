"""The event loop's lag (runtime/looplag.py): the recorder's percentiles and maximum, exactly;
the watcher records a loop blocked by a synchronous step."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.looplag import LoopLag, watch_loop


def test_percentiles_are_nearest_rank_over_the_recent_window() -> None:
    lag = LoopLag(window=100)
    assert (lag.percentile(0.99), lag.max_s, lag.samples) == (0.0, 0.0, 0)
    for i in range(1, 101):
        lag.record(i / 1000)
    assert lag.percentile(0.99) == 0.099
    assert lag.percentile(0.5) == 0.05
    assert lag.percentile(1.0) == 0.1
    lag.record(-0.002)  # a timer that woke early counts as no lag
    assert lag.percentile(0.0) == 0.0
    assert (lag.max_s, lag.samples) == (0.1, 101)


def test_the_window_forgets_old_lags_but_not_the_largest() -> None:
    lag = LoopLag(window=3)
    for value in (2.0, 0.01, 0.02, 0.03):
        lag.record(value)
    assert lag.percentile(1.0) == 0.03  # 2.0 left the window ...
    assert lag.max_s == 2.0  # ... but stays the largest seen


def test_the_recent_quantile_is_over_the_last_samples_only() -> None:
    lag = LoopLag(window=10)
    assert lag.recent() == 0.0
    for value in (0.9, 0.01, 0.05, 0.02):
        lag.record(value)
    assert lag.recent(1.0, samples=3) == 0.05  # the 0.9 s stall is older than the last three
    assert lag.recent(1.0) == 0.9
    assert lag.recent(0.5) == 0.02
    with pytest.raises(ValueError, match="samples"):
        lag.recent(samples=0)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        LoopLag(window=0)
    with pytest.raises(ValueError, match="q must be"):
        LoopLag().percentile(1.5)


@pytest.mark.asyncio
async def test_a_blocked_loop_shows_as_lag() -> None:
    lag = LoopLag()
    seen: list[float] = []
    async with asyncio.TaskGroup() as group:
        watcher = group.create_task(watch_loop(lag, period_s=0.02, observe=seen.append))
        while lag.samples < 3:
            await asyncio.sleep(0.01)
        time.sleep(0.3)  # noqa: ASYNC251 -- a synchronous step holding the loop, on purpose
        before = lag.samples
        while lag.samples == before:
            await asyncio.sleep(0.01)
        watcher.cancel()
    assert lag.max_s >= 0.25, lag.max_s  # at least the block, less the timer's period
    assert max(seen) == lag.max_s
    assert len(seen) == lag.samples
