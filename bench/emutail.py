"""``python -m bench emutail``: does a live partition query of the Cloud Spanner emulator return
every commit?

It does not, now and then: its partition query scans the change stream's internal table in
steps of ``--change_streams_partition_query_chop_interval`` (100 ms by default), ``[start,
end)`` and then ``[end + 1 µs, ...)``, so a commit whose timestamp is exactly a step's end is
never returned (the emulator's ``frontend/handlers/change_streams.cc``). A query whose end has
already passed is answered in one inclusive step and is complete. ``SpannerSource(trail_s=...)``
reads only such windows (runtime/spanner/reader.py, "Trailing"); the CLI does so against the
emulator.

Steps: start the emulator with steps of ``--chop-ms`` (short, so that the gap is hit often
enough to count in a short run; 100 is the emulator's default) and no partition churn; read the
whole stream from now to the end of the run twice at once, live (one query per partition) and
trailing (with short steps the live one falls far behind: the run then takes
minutes); meanwhile commit as fast as one writer can for ``--seconds``. Then read the same range
again over the past and compare each with what was committed. Prints the figures, and as the
last line one JSON object: ``live_lost``, ``trailing_lost`` and ``reread_lost`` (mods committed,
not returned).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import msgspec

from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator
from runtime.spanner.loadgen import LoadGenerator, expected_from_records
from runtime.spanner.reader import SpannerSource, walk_stream


async def run(args: argparse.Namespace) -> dict[str, Any]:
    emulator = SpannerEmulator(
        partition_alive_s=None,
        extra_args=[f"--change_streams_partition_query_chop_interval={args.chop_ms}ms"],
    )
    await asyncio.to_thread(emulator.start)
    out: dict[str, Any] = {"scenario": "emutail", "chop_ms": args.chop_ms}
    try:
        live_cfg = emulator.config
        trailing_cfg = msgspec.structs.replace(live_cfg, trail_s=args.trail_s)
        async with (
            await SpannerSource.connect(live_cfg) as live,
            await SpannerSource.connect(trailing_cfg) as trailing,
        ):
            loader = await LoadGenerator.connect(live_cfg, emulator.tables, seed=args.seed)
            try:
                start = time.time_ns() // 1000
                end = start + int((args.seconds + 3 + 2 * args.trail_s) * 1_000_000)
                readers = (live, trailing) if args.live else (trailing,)
                reads = [
                    asyncio.create_task(walk_stream(source, start, end, concurrency=16))
                    for source in readers
                ]
                await asyncio.sleep(1.0)
                out["commits"] = await loader.run(10_000, duration_s=args.seconds)
            finally:
                await loader.close()
            expected = loader.expected_mods()
            out["mods"] = sum(expected.values())
            walked = [await r for r in reads]
            walked.append(await walk_stream(live, start, end, concurrency=16))
            names = ("live", "trailing", "reread") if args.live else ("trailing", "reread")
            for name, result in zip(names, walked, strict=True):
                served = expected_from_records(result.data)
                lost = expected - served
                out[f"{name}_lost"] = sum(lost.values())
                out[f"{name}_lost_commits"] = len({k[0] for k in lost})
                out[f"{name}_extra"] = sum((served - expected).values())
                print(
                    f"{name:>9}: {len(result.partitions)} partitions, lost "
                    f"{out[f'{name}_lost']} of {out['mods']} mods "
                    f"({out[f'{name}_lost_commits']} commits), extra {out[f'{name}_extra']}"
                )
    finally:
        await asyncio.to_thread(emulator.stop)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench emutail", description=__doc__)
    parser.add_argument("--chop-ms", type=int, default=2, help="the emulator's scan step")
    parser.add_argument("--seconds", type=float, default=40.0, help="seconds of commits")
    parser.add_argument("--trail-s", type=float, default=0.25, help="the trailing reader's trail")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="skip the live reader (with short steps the emulator's live queries fall behind)",
    )
    parser.add_argument("--quick", action="store_true", help="15 seconds of commits")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 15.0
    try:
        import uvloop

        result = uvloop.run(run(args))
    except EmulatorUnavailable as exc:
        print(f"emutail: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
