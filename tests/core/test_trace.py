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


def _reader_and_retry_trace() -> list[bytes]:
    """A task's trace with one reader core in it, and a retry core's steps."""
    from protocol.dedup import Position
    from protocol.reader import (
        BatchCommitted,
        Chunk,
        ReaderConfig,
        ReaderCore,
        ReaderEvent,
        ReaderTick,
        Start,
    )
    from protocol.records import DataChange, Heartbeat, Mod
    from protocol.retry import (
        Deliver,
        DeliveryFailed,
        ForgetSettled,
        RetryCore,
        RetryEvent,
        RetryPolicy,
        Tick,
    )

    t0 = 1_700_000_000_000_000
    config = ReaderConfig("p1", batch_records=1)
    start = Position(t0)
    reader = ReaderCore(config, start)
    lines = [trace.encode(trace.ReaderStart("reader:p1:0", config, start))]
    record = DataChange(
        commit_ts=t0 + 1,
        record_sequence="0",
        server_transaction_id="x",
        is_last_record_in_transaction_in_partition=True,
        table="T",
        column_types=(),
        mods=(Mod('{"Id":"1"}', "{}", "{}"),),
        mod_type="INSERT",
    )
    reader_events: list[ReaderEvent] = [
        Start(None),
        Chunk(1, (record, Heartbeat(t0 + 5))),
        BatchCommitted(1),
        ReaderTick(),
    ]
    for now, event in enumerate(reader_events, 1):
        commands = reader.handle(event, now)
        lines.append(trace.encode(trace.ReaderStep("reader:p1:0", now, event, tuple(commands))))
    policy = RetryPolicy(max_attempts=2, base_backoff=1.0, jitter=0.5)
    retry = RetryCore(policy, 7)
    lines.append(trace.encode(trace.RetryStart("out", policy, 7, shared=False)))
    retry_events: list[RetryEvent] = [
        Deliver("r1", "k"),
        DeliveryFailed("r1", "boom"),
        Tick(),
        ForgetSettled(0),
    ]
    for at, stimulus in zip([1.0, 2.0, 9.0, 10.0], retry_events, strict=True):
        got = retry.handle(stimulus, at)
        step = trace.RetryStep("out", at, stimulus, tuple(got))  # type: ignore[arg-type]
        lines.append(trace.encode(step))
    return lines


def test_reader_and_retry_cores_replay_from_their_trace() -> None:
    lines = list(trace.decode(_reader_and_retry_trace()))
    readers = [line for line in lines if isinstance(line, trace.ReaderStep)]
    retries = [line for line in lines if isinstance(line, trace.RetryStep)]
    assert sum(len(s.commands) for s in readers) >= 3  # a query, a batch, its report
    assert sum(len(s.commands) for s in retries) >= 2  # sent, parked (and sent again)
    assert trace.mismatches(lines) == []
    # the control: the retry core's jitter comes from its seed, so another seed differs, and a
    # reader step left out leaves the replayed reader behind
    reseeded = [
        msgspec.structs.replace(line, seed=8) if isinstance(line, trace.RetryStart) else line
        for line in lines
    ]
    assert trace.mismatches(reseeded)
    chunk = next(i for i, s in enumerate(lines) if isinstance(s, trace.ReaderStep) and s.now == 2)
    assert trace.mismatches([*lines[:chunk], *lines[chunk + 1 :]])


def test_a_step_of_a_core_never_started_is_a_clear_error() -> None:
    lines = list(trace.decode(_reader_and_retry_trace()))[1:]  # the reader's start left out
    with pytest.raises(trace.TraceError, match="reader core 'reader:p1:0' before its start"):
        trace.mismatches(lines)


def test_a_member_core_replays_from_its_trace() -> None:
    from protocol.lease import LeaseTiming
    from protocol.membership import (
        Assigned,
        HeartbeatAnswered,
        JoinSent,
        MemberCore,
        MemberEvent,
        SyncAnswered,
    )

    timing = LeaseTiming(session=3_000, rebalance=6_000, margin=500)
    core = MemberCore("a", timing)
    lines = [trace.encode(trace.MemberStart("a", "a", timing))]
    events: list[MemberEvent] = [
        JoinSent(100),
        SyncAnswered(200),
        Assigned(0, 0, "a", ("a",)),
        HeartbeatAnswered(1_000, rebalancing=False),
    ]
    for now, event in enumerate(events, 1):
        lines.append(
            trace.encode(trace.MemberStep("a", now, event, tuple(core.handle(event, now))))
        )
    decoded = list(trace.decode(lines))
    assert trace.mismatches(decoded) == []
    assert trace.mismatches([*decoded[:2], *decoded[3:]])  # without the SyncGroup's answer
