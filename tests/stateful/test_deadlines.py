"""``TaskCore.next_deadline`` on realistic states: the fault simulator's (crashes, zombies,
lost and duplicated messages, failed appends, a cap, splits and merges). After every event a core
handles in the run, ticks of a copy of it at several times before its deadline must do nothing
(``tests/deadlines.py``). A teeth test breaks the deadline (forgets a rule) and must be caught,
with its control on the same seed."""

from __future__ import annotations

from collections import Counter

import pytest

from protocol.task import TaskCore, TaskEvent, TaskTick
from runtime.sim.faultsim import SimParams, Simulation, _Node
from tests.deadlines import Deadline, acts_at_deadline, quiet_before_deadline


class _Checked(Simulation):
    """The simulator, checking a core's deadline after every event it handles."""

    def __init__(self, params: SimParams, deadline: Deadline) -> None:
        super().__init__(params)
        self.deadline = deadline
        self.seen: Counter[str] = Counter()

    def handle(self, node: _Node, event: TaskEvent) -> None:
        super().handle(node, event)
        core = node.core
        due = quiet_before_deadline(core, self.deadline)
        self.seen["states"] += 1
        if due is None:
            self.seen["no deadline"] += 1
        elif isinstance(event, TaskTick) and acts_at_deadline(core):
            self.seen["acts at its deadline"] += 1


# Short runs (a 4 s quiet phase): followers' assignments arrive with the leader's, or the last
# rebalance may not settle before the end (the tick rule is what is checked here).
SHORT = {"churn_us": 8_000_000, "quiet_us": 4_000_000, "follower_lag_us": (0, 0)}
CASES = [
    pytest.param(3, {}, id="seed3"),
    pytest.param(11, {"cap": 2, "tasks": 3}, id="seed11-cap"),
    pytest.param(5, {"append_fail_p": 0.05, "crash_p": 0.01}, id="seed5-append-failures"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("seed", "overrides"), CASES)
def test_a_tick_before_the_deadline_does_nothing(seed: int, overrides: dict[str, object]) -> None:
    params = SimParams(seed=seed, **{**SHORT, **overrides})  # type: ignore[arg-type]
    sim = _Checked(params, TaskCore.next_deadline)
    sim.run()
    assert sim.seen["states"] > 200  # enough states checked (ticks come only when due)
    # idle tasks sleep: most states have no deadline at all, or one far away
    assert sim.seen["no deadline"] > 0


def _forgets_publishing(core: TaskCore) -> int | None:
    """Broken: ``next_deadline`` without the publishing timers (coalescing, group commit)."""
    if core._unsettled:
        return core._now
    due = [
        d
        for d in (
            core._plan_due(),
            core._checkpoint_due(),
            core._negotiate_due(core._now),
            core._permission_ends(core._now),
        )
        if d is not None
    ]
    return max(min(due), core._now) if due else None


def test_teeth_a_deadline_that_forgets_a_rule_is_caught() -> None:
    params = SimParams(seed=3, **SHORT)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="before the deadline"):
        _Checked(params, _forgets_publishing).run()
    # its control: the same seed with the real deadline is test_a_tick_before_the_deadline_...[seed3]
