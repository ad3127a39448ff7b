"""``python -m bench emuleak``: does the Cloud Spanner emulator stop a cancelled partition query?

It does not: its partition query is a loop that scans the change stream's internal table every
100 ms until the query's end timestamp or the partition's end, and never looks at the call's
cancellation. A reader that restarts queries on a long-lived partition (a hand-off, a lapsed
lease, a stall) leaves a loop behind each time; enough of them starve the emulator, and its other
queries go silent for tens of seconds. ``SpannerSource(query_window_s=...)`` bounds each loop.

Steps: start the emulator with partitions that live ``--alive-s`` (long: no churn during the
run); for each window setting (``--window-s``, then none), open ``--queries`` partition queries on
a root partition one after the other, each from half a second before it opens (a reader resuming
near the live tail), take its first answer and cancel it (``aclose``, which cancels the gRPC
call); then sample the emulator process's CPU over 3 s, at once and again after one window.
Prints the figures, and as the last line one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import msgspec

from bench.common import cpu_seconds
from protocol.records import ChildPartitions
from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator
from runtime.spanner.reader import SpannerSource


async def _cores(pid: int, seconds: float = 3.0) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


async def _leak(source: SpannerSource, token: str, queries: int) -> None:
    """Each query from half a second ago (a reader resuming near the live tail)."""
    for _ in range(queries):
        it = source.query(token, time.time_ns() // 1000 - 500_000, None)
        await anext(it)
        await it.aclose()


async def run(args: argparse.Namespace) -> dict[str, object]:
    emulator = SpannerEmulator(partition_alive_s=args.alive_s)
    await asyncio.to_thread(emulator.start)
    out: dict[str, object] = {"scenario": "emuleak", "queries": args.queries}
    try:
        pid = emulator.pid
        base = await _cores(pid)
        print(f"emulator idle: {base:.2f} cores")
        out["idle_cores"] = round(base, 3)
        # the windowed queries first: the loops of the others would outlive the run
        later_s = args.window_s + 1.0  # a windowed query's loop has ended by then
        for window in (args.window_s, None):
            config = msgspec.structs.replace(emulator.config, query_window_s=window)
            source = await SpannerSource.connect(config)
            try:
                start = time.time_ns() // 1000
                first = (await anext(source.query(None, start, None)))[0]
                assert isinstance(first, ChildPartitions)
                token = first.children[0].token
                await _leak(source, token, args.queries)
                now = await _cores(pid)
                await asyncio.sleep(later_s)
                later = await _cores(pid)
            finally:
                await source.close()
            name = "no_window" if window is None else "window"
            print(
                f"{name:>9} ({window} s): {args.queries} cancelled queries, emulator "
                f"{now:.2f} cores at once, {later:.2f} cores {later_s:g} s later"
            )
            out[f"{name}_cores_at_once"] = round(now, 3)
            out[f"{name}_cores_later"] = round(later, 3)
        out["window_s"] = args.window_s
    finally:
        await asyncio.to_thread(emulator.stop)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench emuleak", description=__doc__)
    parser.add_argument("--queries", type=int, default=64, help="queries cancelled per setting")
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--alive-s", type=int, default=600, help="emulator partition lifetime")
    parser.add_argument("--quick", action="store_true", help="(the same run; it is short)")
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except EmulatorUnavailable as exc:
        print(f"emuleak: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
