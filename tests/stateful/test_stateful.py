"""Model-based test: a few TaskCores sharing one in-memory sync log (every Publish is fed back
to every core as SyncRead, in log order)."""

from __future__ import annotations

from random import Random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from protocol.messages import Partition, SyncMessage
from protocol.planner import plan
from protocol.task import (
    Joined,
    Lease,
    PlanReady,
    Publish,
    RequestPlan,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
    TaskEvent,
    TaskTick,
)

TASKS = ("a", "b", "c")
ROOTS = tuple(Partition(f"r{i}", 0) for i in range(4))


class SharedLog(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.cores = {t: TaskCore(TaskConfig(t, cap=2), Random(1)) for t in TASKS}
        self.log: list[SyncMessage] = []
        self.read = dict.fromkeys(TASKS, 0)
        for t in TASKS:
            self._send(t, Joined(1, "a", TASKS))
            self._send(t, Lease(10**12))

    def _send(self, task: str, event: TaskEvent) -> None:
        core = self.cores[task]
        commands: list[TaskCommand] = core.handle(event, self.now)
        for cmd in commands:
            if isinstance(cmd, Publish):
                self.log.append(cmd.message)
            elif isinstance(cmd, RequestPlan):
                p = plan(
                    core.cim, cmd.members, task, cmd.generation,
                    self.now, core.config.cap, Random(2),
                    roots=ROOTS if cmd.need_roots else (), stream_start=0,
                )  # fmt: skip
                self._send(task, PlanReady(p))

    def _deliver_all(self) -> None:
        for t in TASKS:
            while self.read[t] < len(self.log):
                offset = self.read[t]
                self.read[t] += 1
                self._send(t, SyncRead(offset, self.log[offset]))

    @rule(task=st.sampled_from(TASKS))
    def deliver_one(self, task: str) -> None:
        if self.read[task] < len(self.log):
            offset = self.read[task]
            self.read[task] += 1
            self._send(task, SyncRead(offset, self.log[offset]))

    @rule(dt=st.integers(1, 3_000_000))
    def tick(self, dt: int) -> None:
        self.now += dt
        for t in TASKS:
            self._send(t, TaskTick())

    @invariant()
    def never_two_readers(self) -> None:
        seen: dict[str, str] = {}
        for t, core in self.cores.items():
            for token in core.reading:
                assert token not in seen, f"{token} read by {seen[token]} and {t}"
                seen[token] = t

    def teardown(self) -> None:
        for _ in range(40):
            self.now += 1_000_000
            for t in TASKS:
                self._send(t, TaskTick())
            self._deliver_all()
        self.never_two_readers()
        reading = {tok for core in self.cores.values() for tok in core.reading}
        assert reading == {r.token for r in ROOTS}


SharedLog.TestCase.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
TestSharedLog = SharedLog.TestCase
