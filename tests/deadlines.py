"""The check behind ``TaskCore.next_deadline``'s promise, shared by the core, stateful and
simulator tests: a tick at any time before the deadline returns no commands and changes
nothing observable.

Not observable: the log of inputs and ``_now`` (every call records them), and the pacing mark of
a negotiation round that finds nothing to do (it only gates the next round; see
``next_deadline``). Everything else of the core and its CIM is compared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

from protocol.task import TaskCore, TaskTick

Deadline = Callable[[TaskCore], int | None]

_IGNORED = frozenset({"log", "_now", "_last_negotiate"})


def observable(core: TaskCore) -> dict[str, object]:
    state = {k: v for k, v in vars(core).items() if k not in _IGNORED}
    state["cim"] = dict(vars(core.cim))
    state["rng"] = core.rng.getstate()
    return state


def probe_times(now: int, deadline: int | None, far: int = 60_000_000) -> list[int]:
    """Tick times strictly before ``deadline`` worth trying from ``now``: at once, just after,
    half-way, just before (with no deadline: up to ``far`` later)."""
    end = now + far if deadline is None else deadline
    if end <= now:
        return []
    return sorted({now, now + 1, (now + end) // 2, end - 1})


def quiet_before_deadline(
    core: TaskCore, deadline: Deadline = TaskCore.next_deadline, times: Iterable[int] | None = None
) -> int | None:
    """Tick copies of ``core`` before ``deadline(core)``; raise AssertionError if one does
    anything. Returns the deadline."""
    due = deadline(core)
    before = observable(core)
    for t in probe_times(core._now, due) if times is None else times:
        twin = copy.deepcopy(core)
        out = twin.handle(TaskTick(), t)
        assert out == [], f"{core.me}: a tick at {t} before the deadline {due} gave {out}"
        after = observable(twin)
        changed = sorted(k for k in before if before[k] != after[k])
        assert not changed, f"{core.me}: a tick at {t} before the deadline {due} changed {changed}"
    return due


def acts_at_deadline(core: TaskCore) -> bool:
    """Whether a tick at the deadline does something (commands or a change): how exact it is."""
    due = core.next_deadline()
    if due is None:
        return False
    twin = copy.deepcopy(core)
    out = twin.handle(TaskTick(), due)
    return bool(out) or observable(twin) != observable(core)
