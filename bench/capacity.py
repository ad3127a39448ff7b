"""``python -m bench capacity``: one task with a per-task cap and far more partitions offered.

The cap on concurrent partitions per task (docs/design.md#cap-and-fair-spread): a task offered 5,000 partitions reads at most
``cap`` of them; the surplus waits (parked by the leader) for other tasks. Memory and event-loop
lag must stay bounded while it is over-offered. Then a second task joins and takes the surplus
up to its own cap. Real actors and cores; in-memory sync log, group and sink (the coordination
over Kafka is measured by ``bench rebalance`` and ``bench scale``).

Figures: partitions read by the first task (must equal the cap), partitions parked, RSS before
and while over-offered, event-loop lag p50/p99/max measured by a probe that sleeps 20 ms, and
what the second task picked up. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from contextlib import AsyncExitStack

from actors.node import TaskNode
from bench.common import MemoryCluster, rss_mb, static_stream, wait_for
from runtime.sim.memory import MemorySink
from runtime.sim.source import SimulatedSource


class LagProbe:
    """Event-loop lag: how late a 20 ms sleep wakes up."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.02)
            self.samples.append(time.perf_counter() - t0 - 0.02)

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        s = sorted(self.samples)
        return {
            "p50_ms": round(statistics.median(s) * 1000, 2),
            "p99_ms": round(s[int(len(s) * 0.99) - 1 if len(s) > 1 else 0] * 1000, 2),
            "max_ms": round(s[-1] * 1000, 2),
        }


async def measure(partitions: int, cap: int, hold_s: float) -> dict[str, object]:
    params = static_stream(11, partitions, records_per_s=0.5)
    source = SimulatedSource.from_params(params, heartbeat_ms=2000, poll_s=0.5)
    sink = MemorySink(commit_delay=0.0, max_in_flight=4096)
    cluster = MemoryCluster(source, params.start_ts, sink=sink)

    def node(name: str) -> TaskNode:
        return cluster.node(name, cap=cap, answer_timeout=300_000)

    probe = LagProbe()
    stop = asyncio.Event()
    rss_before = rss_mb()
    out: dict[str, object] = {}
    async with AsyncExitStack() as stack, asyncio.TaskGroup() as tg:
        tg.create_task(probe.run(stop))
        try:
            first = await stack.enter_async_context(node("solo"))
            t0 = time.perf_counter()
            ok = await wait_for(lambda: first.status().reading >= min(cap, partitions), 120)
            out["first_full_s"] = round(time.perf_counter() - t0, 2)
            if not ok:
                raise RuntimeError(f"the task read only {first.status().reading} of its cap {cap}")
            probe.samples.clear()  # lag while over-offered and steady, not while starting
            await asyncio.sleep(hold_s)
            status = first.status()
            core = first.task.core if first.task else None
            parked = sum(1 for s in core.shares.values() if s.target is None) if core else 0
            out.update(
                reading=status.reading,
                owned=status.owned,
                parked=parked,
                rss_before_mb=round(rss_before, 1),
                rss_over_offered_mb=round(rss_mb(), 1),
                lag_over_offered=probe.summary(),
                records_delivered=len(sink.rows),
            )
            second = await stack.enter_async_context(node("helper"))
            t1 = time.perf_counter()
            want = min(cap, partitions - cap)
            ok = await wait_for(lambda: second.status().reading >= want, 120)
            out["second_picked_up"] = second.status().reading
            out["second_full_s"] = round(time.perf_counter() - t1, 2)
            out["first_reading_after"] = first.status().reading
            out["rss_end_mb"] = round(rss_mb(), 1)
            out["lag_total"] = probe.summary()
        finally:
            stop.set()
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench capacity", description=__doc__)
    parser.add_argument("--partitions", type=int, default=5000)
    parser.add_argument("--cap", type=int, default=500)
    parser.add_argument("--hold", type=float, default=10.0, help="seconds over-offered")
    parser.add_argument("--quick", action="store_true", help="1,000 partitions, cap 200")
    args = parser.parse_args(argv)
    if args.quick:
        args.partitions, args.cap, args.hold = 1000, 200, 4.0
    if args.cap <= 0 or args.partitions <= args.cap:
        parser.error("need 0 < cap < partitions")
    try:
        import uvloop

        result = uvloop.run(measure(args.partitions, args.cap, args.hold))
    except RuntimeError as exc:
        print(f"capacity: {exc}", file=sys.stderr)
        return 1
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    reading = result["reading"]
    lag = result["lag_over_offered"]
    assert isinstance(lag, dict)
    print(
        json.dumps(
            {
                "scenario": "capacity",
                "partitions": args.partitions,
                "cap": args.cap,
                "reading": reading,
                "cap_respected": reading == args.cap,
                "parked": result["parked"],
                "rss_over_offered_mb": result["rss_over_offered_mb"],
                "rss_growth_mb": round(
                    float(result["rss_over_offered_mb"]) - float(result["rss_before_mb"]),  # type: ignore[arg-type]
                    1,
                ),
                "loop_lag_p99_ms": lag["p99_ms"],
                "loop_lag_max_ms": lag["max_ms"],
                "second_picked_up": result["second_picked_up"],
            }
        )
    )
    return 0
