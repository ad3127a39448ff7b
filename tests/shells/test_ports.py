"""The ports of ``runtime/ports.py`` say what a port may do; an implementation overrides what it
can, inherits the port's do-nothing defaults for the rest, and nobody looks a capability up by
name. These tests hold the two places where mypy cannot help: a wrapper must hand every call
on (a capability added to ``Sink`` but not to ``SinkWrapper`` would silently answer the default
through ``Ledger`` and ``CountingSink``), and the implementations that can do something must
override its default (else the default would answer for them without an error)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence

import pytest

from actors.cli.run import Ledger
from actors.cli.sinks import CountingSink
from protocol.dedup import Position
from runtime.files.sink import FileSink
from runtime.kafka.membership import KafkaMembership
from runtime.kafka.sink import KafkaSink
from runtime.ports import ChangeStreamSource, Membership, Sink, SinkBatch, SinkWrapper, fence_sink
from runtime.sim.memory import MemoryGroup, MemorySink
from runtime.sim.source import SimulatedSource
from runtime.snapshot_routing import SnapshotRouting
from runtime.spanner.reader import SpannerSource
from runtime.spark.bridge import SparkBridge


def _members(port: type) -> set[str]:
    return {
        name
        for name, value in vars(port).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }


def test_the_sink_wrapper_hands_on_every_call_of_the_port() -> None:
    members = _members(Sink)
    assert members == {"put", "prepare", "durable_position", "flush", "fence"}
    assert {m for m in members if getattr(SinkWrapper, m) is getattr(Sink, m)} == set()


@pytest.mark.parametrize(
    ("implementation", "port", "capabilities"),
    [
        (FileSink, Sink, {"durable_position", "flush", "fence"}),
        (SparkBridge, Sink, {"prepare", "durable_position", "flush", "fence"}),
        (KafkaSink, Sink, {"prepare"}),
        (MemorySink, Sink, {"durable_position"}),
        (KafkaMembership, Membership, {"rebalance_in_progress", "set_epoch_floor"}),
        (SpannerSource, ChangeStreamSource, {"watched_tables"}),
        (SimulatedSource, ChangeStreamSource, {"watched_tables"}),
        (SnapshotRouting, ChangeStreamSource, {"watched_tables"}),
    ],
)
def test_what_an_implementation_can_do_overrides_the_ports_default(
    implementation: type, port: type, capabilities: set[str]
) -> None:
    assert port in implementation.__mro__  # declared in its class statement
    inherited = {c for c in capabilities if getattr(implementation, c) is getattr(port, c)}
    assert inherited == set()


class _Fencing(Sink):
    """A sink whose fence answers ``answer`` and records what it was asked."""

    def __init__(self, answer: list[bool] | None) -> None:
        self.answer = answer
        self.asked: list[str] = []
        self.prepared: list[str] = []

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def prepare(self, token: str) -> None:
        self.prepared.append(token)

    async def durable_position(self, token: str) -> Position | None:
        return Position(7, ())

    async def fence(self, batches: Sequence[SinkBatch]) -> list[bool] | None:
        self.asked.extend(b.token for b in batches)
        return self.answer


class _PutOnly(Sink):
    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        raise AssertionError("not called")


BATCHES = [SinkBatch("p", (), 1), SinkBatch("q", (), 2)]


@pytest.mark.asyncio
async def test_wrappers_reach_the_capabilities_of_the_sink_inside() -> None:
    inner = _Fencing([True, False])
    outer = CountingSink(Ledger(inner, check=False))
    await outer.prepare("p")
    assert inner.prepared == ["p"]
    assert await outer.durable_position("p") == Position(7, ())
    assert await fence_sink(outer, BATCHES) == [True, False]
    assert inner.asked == ["p", "q"]


@pytest.mark.asyncio
async def test_a_sink_without_a_capability_answers_the_ports_default() -> None:
    bare = CountingSink(Ledger(_PutOnly(), check=False))
    await bare.prepare("p")  # nothing to prepare: returns
    assert await bare.durable_position("p") is None
    assert await fence_sink(bare, BATCHES) is None
    members = MemoryGroup().join("t")
    assert not members.rebalance_in_progress
    members.set_epoch_floor(lambda: 3)  # generations that never go back: ignored


@pytest.mark.asyncio
async def test_a_fence_answering_for_other_batches_is_refused() -> None:
    with pytest.raises(ValueError, match="answered 1 of 2 batches"):
        await fence_sink(CountingSink(_Fencing([True])), BATCHES)
