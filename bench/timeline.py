"""``python -m bench timeline``: who owns how many partitions over time, while tasks join and die.

Real actors and cores over the in-memory group, sync log and sink, the seeded simulated change
stream in real time (splits, moves and merges). Three tasks start; two join; one is killed (its
membership expelled at once, as if its session had just timed out); one leaves cleanly. Sampled
every 0.2 s: partitions owned per task, rows delivered, and the delay from a record's commit
timestamp to its delivery. ``--out FILE`` writes the series as JSON (the report plots it).
Checks at the end: every delivered record was committed, none missing before the horizon.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

from actors.node import TaskNode
from bench.common import MemoryCluster
from runtime.ports import SinkBatch
from runtime.sim.memory import MemorySink
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams


class TimedSink(MemorySink):
    """The in-memory sink, remembering how late each record was delivered (model time)."""

    def __init__(self, source: SimulatedSource) -> None:
        super().__init__(commit_delay=0.02, max_in_flight=256)
        self.source = source
        self.delays: list[float] = []

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        future = await super().put(batch)

        def done(f: asyncio.Future[None]) -> None:
            if not f.cancelled() and f.exception() is None:
                now = self.source.now()
                self.delays.extend((now - r.commit_ts) / 1e6 for r in batch.records[:50])

        future.add_done_callback(done)
        return future


async def measure(duration: float, roots: int) -> dict[str, object]:
    params = StreamParams(seed=21, roots=roots, records_per_s=10.0, round_us=3_000_000)
    model = StreamModel(params)
    source = SimulatedSource(model, heartbeat_ms=500)
    sink = TimedSink(source)
    cluster = MemoryCluster(
        source, params.start_ts, sink=sink, rebalance_delay=0.3, session_timeout=3.0
    )
    group = cluster.group

    def node(name: str) -> TaskNode:
        return cluster.node(name, answer_timeout=500_000, publish_interval=200_000)

    samples: list[dict[str, object]] = []
    events: list[tuple[float, str]] = []
    t0 = time.monotonic()
    nodes: dict[str, TaskNode] = {}
    stacks: dict[str, AsyncExitStack] = {}

    async def start(name: str) -> None:
        stack = AsyncExitStack()
        nodes[name] = await stack.enter_async_context(node(name))
        stacks[name] = stack
        events.append((round(time.monotonic() - t0, 2), f"{name} joins"))

    async def stop(name: str, *, kill: bool) -> None:
        events.append((round(time.monotonic() - t0, 2), f"{name} {'killed' if kill else 'leaves'}"))
        if kill:
            group.expel(name, "killed")
        await stacks.pop(name).aclose()
        nodes.pop(name)

    script = [
        (0.0, "start", "t0"),
        (0.0, "start", "t1"),
        (0.0, "start", "t2"),
        (duration * 0.3, "start", "t3"),
        (duration * 0.3, "start", "t4"),
        (duration * 0.55, "kill", "t1"),
        (duration * 0.75, "leave", "t3"),
    ]
    try:
        while time.monotonic() - t0 < duration:
            elapsed = time.monotonic() - t0
            while script and script[0][0] <= elapsed:
                _, action, name = script.pop(0)
                if action == "start":
                    await start(name)
                else:
                    await stop(name, kill=action == "kill")
            owned = {n: node.status().owned for n, node in nodes.items()}
            samples.append(
                {"t": round(elapsed, 2), "owned": owned, "rows": sum(sink.rows.values())}
            )
            await asyncio.sleep(0.2)
        horizon = source.now() - 3_000_000
        expected = {r.identity for r in model.expected(horizon)}
        missing = expected - set(sink.rows)
        extra = {i for i in sink.rows if i[0] <= horizon} - expected
    finally:
        for name in list(stacks):
            await stacks.pop(name).aclose()
    delays = sorted(sink.delays)
    return {
        "samples": samples,
        "events": events,
        "delays_s": delays[:: max(1, len(delays) // 2000)],
        "rows": sum(sink.rows.values()),
        "distinct_rows": len(sink.rows),
        "expected_before_horizon": len(expected),
        "missing": len(missing),
        "extra": len(extra),
        "delay_p50_s": delays[len(delays) // 2] if delays else None,
        "delay_p99_s": delays[int(len(delays) * 0.99)] if delays else None,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench timeline", description=__doc__)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--roots", type=int, default=60)
    parser.add_argument("--out", type=Path, help="write the series here as JSON")
    parser.add_argument("--quick", action="store_true", help="20 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = 20.0
    import uvloop

    result = uvloop.run(measure(args.duration, args.roots))
    if args.out:
        args.out.write_text(json.dumps(result))
    summary = {k: v for k, v in result.items() if k not in ("samples", "delays_s")}
    for key, value in summary.items():
        print(f"{key:>24}: {value}")
    print(json.dumps({"scenario": "timeline", **summary}))
    if result["missing"] or result["extra"]:
        print("timeline: records missing or never committed", file=sys.stderr)
        return 1
    return 0
