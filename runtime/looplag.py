"""How late the event loop runs: a stall of the loop (a CPU-heavy step on it, a loaded machine,
a long garbage collection) delays every actor at once, heartbeats and lease checks included.

:class:`LoopLag` keeps the measurements (pure: the caller passes what it measured) — a bounded
window of recent lags for percentiles and the largest ever seen; :func:`watch_loop` measures:
every ``period`` it asks to be woken ``period`` later and records how much later than that it
ran. The Prometheus histogram ``shoal_event_loop_lag_seconds`` and the run summary's
``loop_lag_p99_s`` / ``loop_lag_max_s`` come from here (docs/operations.md)."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

DEFAULT_PERIOD_S = 0.1
WINDOW = 6000  # 10 minutes of samples at the default period
RECENT = 600  # a minute of samples at the default period


class LoopLag:
    """Recorded lags of the event loop, in seconds."""

    def __init__(self, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._recent: deque[float] = deque(maxlen=window)
        self.samples = 0
        self.max_s = 0.0

    def record(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self._recent.append(lag_s)
        self.samples += 1
        self.max_s = max(self.max_s, lag_s)

    def recent(self, q: float = 0.99, samples: int = RECENT) -> float:
        """The ``q`` quantile (nearest rank) of the last ``samples`` lags (a minute at the
        default period); 0 before any sample. The lease margin grows by it
        (``protocol.lease.margin_under_lag``): a loop that lately runs late sees its lease end
        that late; one stall in a minute does not shorten every lease."""
        if samples < 1:
            raise ValueError(f"samples must be at least 1, got {samples}")
        return _quantile(list(itertools.islice(reversed(self._recent), samples)), q)

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (0-1, nearest rank) of the recent window; 0 before any sample."""
        return _quantile(list(self._recent), q)


def _quantile(values: list[float], q: float) -> float:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within 0 and 1, got {q}")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


async def watch_loop(
    lag: LoopLag,
    period_s: float = DEFAULT_PERIOD_S,
    observe: Callable[[float], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Measure the loop's lag until cancelled: each wake-up's delay past its due time is
    recorded in ``lag`` (and handed to ``observe``, e.g. a histogram)."""
    if period_s <= 0:
        raise ValueError(f"period_s must be positive, got {period_s}")
    while True:
        due = clock() + period_s
        await asyncio.sleep(period_s)
        late = clock() - due
        lag.record(late)
        if observe is not None:
            observe(max(0.0, late))
