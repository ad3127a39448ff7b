"""A replayable trace of one task core: every input (event and ``now``) and the commands it
returned, so a production run can be replayed through the cores offline.

A trace is JSON lines. The first line, :class:`TraceStart`, holds the task's settings and the
seed of the core's random generator; every further line, :class:`TraceStep`, one call of
:meth:`TaskCore.handle`. The core is a pure function of its settings, its seed and its inputs,
so :func:`replay` feeds the steps through a fresh core and :func:`mismatches` names every step
whose commands differ from the recorded ones (none, unless the code changed or the trace was
not written by this code).

Only the production rules can be recorded (a core built with the simulator's broken rules of
``Rules`` refuses to be traced: those hold functions, which a trace cannot carry).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from random import Random

import msgspec

from protocol.events import TaskCommand, TaskEvent
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


TraceLine = TraceStart | TraceStep

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


def replay(lines: Iterable[TraceLine]) -> Iterator[tuple[TraceStep, list[TaskCommand]]]:
    """Each recorded step, with the commands a fresh core returns for it now."""
    core: TaskCore | None = None
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


def mismatches(lines: Iterable[TraceLine]) -> list[str]:
    """Every step whose replayed commands differ from the recorded ones, described."""
    out = []
    for n, (step, got) in enumerate(replay(lines), 1):
        if tuple(got) != step.commands:
            out.append(
                f"step {n} ({type(step.event).__name__} at {step.now}): "
                f"recorded {list(step.commands)}, replayed {got}"
            )
    return out
