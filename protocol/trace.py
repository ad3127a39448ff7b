"""A replayable trace of a task's cores: every input (event and ``now``) and the commands it
returned, so a production run can be replayed through the cores offline.

A trace is JSON lines. The first line, :class:`TraceStart`, holds the task's settings and the
seed of its core's random generator; a :class:`TraceStep` is one call of
:meth:`TaskCore.handle`. The task's partition readers are in the same trace: a
:class:`ReaderStart` names each reader core (``core``, unique in the trace) with its settings
and start, and a :class:`ReaderStep` is one call of its :meth:`ReaderCore.handle`. A retry
queue's core (``protocol/retry.py``) has a trace of its own, :class:`RetryStart` and
:class:`RetryStep` lines, and so has a group member's core (``protocol/membership.py``),
:class:`MemberStart` and :class:`MemberStep` lines. Every core is a pure function of its settings, its seed and its
inputs, so :func:`replay` feeds the steps through fresh cores and :func:`mismatches` names
every step whose commands differ from the recorded ones (none, unless the code changed or the
trace was not written by this code).

Only the production rules can be recorded (a core built with the simulator's broken rules of
``Rules`` refuses to be traced: those hold functions, which a trace cannot carry).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from random import Random
from typing import Any

import msgspec

from protocol.dedup import Position
from protocol.events import TaskCommand, TaskEvent
from protocol.lease import LeaseTiming
from protocol.membership import MemberCommand, MemberCore, MemberEvent, MemberRules
from protocol.messages import MoveInHold
from protocol.reader import ReaderCommand, ReaderConfig, ReaderCore, ReaderEvent
from protocol.retry import RetryCommand, RetryCore, RetryEvent, RetryPolicy
from protocol.task import Rules, TaskConfig, TaskCore


class TraceError(ValueError):
    """A trace that cannot be written or read back."""


class TraceStart(msgspec.Struct, frozen=True, tag_field="trace", tag="start"):
    settings: dict[
        str, bool | int | str
    ]  # TaskConfig's fields but ``rules`` (the production rules)
    seed: int


class TraceStep(msgspec.Struct, frozen=True, tag_field="trace", tag="step"):
    now: int
    event: TaskEvent
    commands: tuple[TaskCommand, ...]


class ReaderStart(msgspec.Struct, frozen=True, tag_field="trace", tag="reader-start"):
    core: str  # names the reader core in this trace
    config: ReaderConfig
    start: Position
    hold: MoveInHold | None = None  # a move-in hold the reader starts at (MUTABLE_KEY_RANGE)


class ReaderStep(msgspec.Struct, frozen=True, tag_field="trace", tag="reader-step"):
    core: str
    now: int
    event: ReaderEvent
    commands: tuple[ReaderCommand, ...]


class RetryStart(msgspec.Struct, frozen=True, tag_field="trace", tag="retry-start"):
    core: str
    policy: RetryPolicy
    seed: int
    shared: bool


class RetryStep(msgspec.Struct, frozen=True, tag_field="trace", tag="retry-step"):
    core: str
    now: float  # the retry core's time is float seconds
    event: RetryEvent
    commands: tuple[RetryCommand, ...]


class MemberStart(msgspec.Struct, frozen=True, tag_field="trace", tag="member-start"):
    core: str
    task_id: str
    timing: LeaseTiming
    rules: MemberRules = MemberRules()


class MemberStep(msgspec.Struct, frozen=True, tag_field="trace", tag="member-step"):
    core: str
    now: int
    event: MemberEvent
    commands: tuple[MemberCommand, ...]


TraceLine = (
    TraceStart
    | TraceStep
    | ReaderStart
    | ReaderStep
    | RetryStart
    | RetryStep
    | MemberStart
    | MemberStep
)
Step = TraceStep | ReaderStep | RetryStep | MemberStep

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TraceLine)


def start(config: TaskConfig, seed: int) -> TraceStart:
    if config.rules != Rules():
        raise TraceError("only a core with the production rules can be traced")
    settings = msgspec.structs.asdict(config)
    del settings["rules"]
    return TraceStart(settings, seed)


def core_of(first: TraceStart) -> TaskCore:
    """A fresh core with the traced settings and seed."""
    try:
        config = TaskConfig(**first.settings)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TraceError(f"trace settings do not fit this version's TaskConfig: {exc}") from exc
    return TaskCore(config, Random(first.seed))


def encode(line: TraceLine) -> bytes:
    return _encoder.encode(line) + b"\n"


def decode(lines: Iterable[bytes]) -> Iterator[TraceLine]:
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            yield _decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise TraceError(f"trace line {n}: {exc}") from exc


def replay(lines: Iterable[TraceLine]) -> Iterator[tuple[Step, list[Any]]]:
    """Each recorded step, with the commands a fresh core returns for it now."""
    core: TaskCore | None = None
    readers: dict[str, ReaderCore] = {}
    retries: dict[str, RetryCore] = {}
    members: dict[str, MemberCore] = {}
    for line in lines:
        match line:
            case TraceStart():
                if core is not None:
                    raise TraceError("a second start line: one trace holds one task core")
                core = core_of(line)
            case TraceStep():
                if core is None:
                    raise TraceError("a step before the start line")
                yield line, core.handle(line.event, line.now)
            case ReaderStart():
                readers[line.core] = ReaderCore(line.config, line.start, line.hold)
            case ReaderStep():
                reader = readers.get(line.core)
                if reader is None:
                    raise TraceError(f"a step of reader core {line.core!r} before its start line")
                yield line, list(reader.handle(line.event, line.now))
            case RetryStart():
                retries[line.core] = RetryCore(line.policy, line.seed, shared=line.shared)
            case RetryStep():
                retry = retries.get(line.core)
                if retry is None:
                    raise TraceError(f"a step of retry core {line.core!r} before its start line")
                yield line, list(retry.handle(line.event, line.now))
            case MemberStart():
                members[line.core] = MemberCore(line.task_id, line.timing, line.rules)
            case MemberStep():
                member = members.get(line.core)
                if member is None:
                    raise TraceError(f"a step of member core {line.core!r} before its start line")
                yield line, list(member.handle(line.event, line.now))


def mismatches(lines: Iterable[TraceLine]) -> list[str]:
    """Every step whose replayed commands differ from the recorded ones, described."""
    out = []
    for n, (step, got) in enumerate(replay(lines), 1):
        if tuple(got) != step.commands:
            who = "" if isinstance(step, TraceStep) else f"{step.core}: "
            out.append(
                f"step {n} ({who}{type(step.event).__name__} at {step.now}): "
                f"recorded {list(step.commands)}, replayed {got}"
            )
    return out
