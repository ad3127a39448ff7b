"""``python -m bench sim --seeds N``: run N seeds of the deterministic fault simulator (in
parallel processes) and report how many passed. A failing seed is printed with its violation so
it can be replayed with ``--seed``."""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor

from runtime.faultsim import SimParams, SimResult, run


def _run_range(args: tuple[int, int]) -> list[SimResult]:
    start, stop = args
    return [run(SimParams(seed=seed)) for seed in range(start, stop)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench sim")
    parser.add_argument("--seeds", type=int, default=200, help="how many seeds (default 200)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seed", type=int, help="replay one seed and print its result")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="50 seeds")
    args = parser.parse_args(argv)
    if args.seed is not None:
        result = run(SimParams(seed=args.seed))
        print(result)
        print(json.dumps({"scenario": "sim", "seeds": 1, "passed": int(result.passed)}))
        return 0 if result.passed else 1
    seeds = 50 if args.quick else args.seeds
    chunk = max(1, min(50, seeds // (args.jobs * 4) or 1))
    ranges = [
        (s, min(s + chunk, args.first + seeds))
        for s in range(args.first, args.first + seeds, chunk)
    ]
    started = time.perf_counter()
    results: list[SimResult] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for batch in pool.map(_run_range, ranges):
            results.extend(batch)
            for r in batch:
                if not r.passed:
                    print(f"seed {r.seed} FAILED: {r.violation}", flush=True)
    seconds = time.perf_counter() - started
    passed = sum(r.passed for r in results)
    ok = [r for r in results if r.passed]
    print(
        f"{passed}/{len(results)} seeds passed in {seconds:.1f} s "
        f"({args.jobs} processes); per seed: {sum(r.rebalances for r in ok) / max(1, len(ok)):.1f} "
        f"rebalances, {sum(r.crashes for r in ok) / max(1, len(ok)):.1f} crashes, "
        f"{sum(r.pauses for r in ok) / max(1, len(ok)):.1f} zombie pauses, "
        f"{sum(r.partitions for r in ok) / max(1, len(ok)):.0f} partitions"
    )
    print(
        json.dumps(
            {
                "scenario": "sim",
                "seeds": len(results),
                "passed": passed,
                "seconds": round(seconds, 1),
                "failed_seeds": [r.seed for r in results if not r.passed][:50],
            }
        )
    )
    return 0 if passed == len(results) else 1
