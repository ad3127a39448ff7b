"""protocol/trace.py: a core's inputs recorded and replayed to the same commands; broken
traces are clear errors. (A trace of a real run on the embedded broker replays too:
tests/integration/test_kafka_nodes.py.)"""

from __future__ import annotations

from random import Random

import msgspec
import pytest

from protocol import trace
from protocol.events import Joined, Lease, SyncRead, TaskEvent, TaskTick
from protocol.messages import EpochMessage
from protocol.task import Rules, TaskConfig, TaskCore


def _recorded() -> list[bytes]:
    config = TaskConfig(task_id="a", cap=3)
    core = TaskCore(config, Random(5))
    lines = [trace.encode(trace.start(config, 5))]
    events: list[TaskEvent] = [
        SyncRead(0, EpochMessage(task_id="x", epoch=0, sync_epoch="e0", members=("x",))),
        Lease(until=10**12),
        Joined(generation=1, leader="a", members=("a",)),
        TaskTick(),
    ]
    for now, event in enumerate(events, 1):
        commands = core.handle(event, now * 1_000_000)
        lines.append(trace.encode(trace.TraceStep(now * 1_000_000, event, tuple(commands))))
    return lines


def test_a_trace_replays_to_the_same_commands() -> None:
    lines = list(trace.decode(_recorded()))
    steps = [line for line in lines if isinstance(line, trace.TraceStep)]
    assert any(step.commands for step in steps)  # it recorded something to compare
    assert trace.mismatches(lines) == []
    # the same events at another time: the commands carry the time (message timestamps)
    shifted = [
        msgspec.structs.replace(line, now=line.now + 1)
        if isinstance(line, trace.TraceStep) and isinstance(line.event, Joined)
        else line
        for line in lines
    ]
    assert trace.mismatches(shifted)


def test_broken_traces_are_clear_errors() -> None:
    with pytest.raises(trace.TraceError, match="line 2"):
        list(trace.decode([_recorded()[0], b"{not json"]))
    steps = list(trace.decode(_recorded()))[1:]
    with pytest.raises(trace.TraceError, match="before the start line"):
        trace.mismatches(steps)
    with pytest.raises(trace.TraceError, match="production rules"):
        trace.start(TaskConfig(task_id="a", rules=Rules(fence_epochs=False)), 1)
