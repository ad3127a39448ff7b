"""``python -m bench sim --seeds N``: run N seeds of the deterministic fault simulator (in
parallel processes) and report how many passed. A failing seed is printed with its violation so
it can be replayed with ``--seed``.

Every connector starts with a snapshot of ``--snapshot-partitions`` partitions (8 by default;
0: none, the histories the simulator's tests run by default), read while the faults go on.

The JSON's ``digest`` hashes every seed's whole result: a refactor of the cores that changes no
decision leaves it unchanged over the same seeds.

``--partition-mode mutable`` runs the fault simulator over a ``MUTABLE_KEY_RANGE`` stream
(``runtime/sim/mutable.py``, ``MutableStreamModel``): keys moving between live partitions,
partitions announced and ended, with the tasks, kills, zombies and hand-offs of the default
mode; besides its invariants a seed checks every key's changes reach the sink in timestamp
order. ``--ignore-move-in-holds`` is its teeth: the same seeds with the holds ignored must
fail; ``--ignore-claims`` reads a partition announced by a partition start at once instead of
claiming it (half the model's new partitions are announced by two partitions: some seeds then
read one partition on two tasks). ``--model-only`` runs instead the small lifecycle model of that module (no tasks: the
lifecycle core alone against readers at unrelated speeds, milliseconds a seed)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from types import FrameType

import msgspec

from protocol.task import Rules
from runtime.sim.faultsim import SimParams, SimResult, run

# A seed normally takes well under a second and a few hundred MB at most. A seed that runs away
# (a message storm, a livelock) is a failure of that seed, reported with its number, not a worker
# killed by the kernel's OOM killer taking the whole sweep down with it.
SEED_SECONDS = 120
WORKER_MEMORY_BYTES = 4 << 30


class _SeedTimeout(Exception):
    pass


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _SeedTimeout


def _init_worker(memory_bytes: int) -> None:
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    signal.signal(signal.SIGALRM, _on_alarm)


def run_guarded(
    seed: int,
    seconds: int = SEED_SECONDS,
    append_fail_p: float = 0.0,
    sink_fail_p: float = 0.0,
    snapshot_partitions: int = 0,
    partition_mode: str = "immutable",
    move_in_holds: bool = True,
    claim_announced: bool = True,
) -> SimResult:
    """One seed under a wall-time budget (and the worker's memory limit)."""
    signal.alarm(seconds)
    try:
        return run(
            SimParams(
                seed=seed,
                append_fail_p=append_fail_p,
                sink_fail_p=sink_fail_p,
                snapshot_partitions=snapshot_partitions,
                partition_mode=partition_mode,
                rules=Rules(move_in_holds=move_in_holds, claim_announced=claim_announced),
            )
        )
    except _SeedTimeout:
        return SimResult(seed=seed, passed=False, violation=f"seed ran over {seconds} s")
    except MemoryError:
        return SimResult(seed=seed, passed=False, violation="seed ran out of its memory budget")
    finally:
        signal.alarm(0)


def _run_range(args: tuple[int, int, float, float, int, str, bool, bool]) -> list[SimResult]:
    start, stop, append_fail_p, sink_fail_p, snapshot_partitions, mode, holds, claims = args
    return [
        run_guarded(
            seed,
            append_fail_p=append_fail_p,
            sink_fail_p=sink_fail_p,
            snapshot_partitions=snapshot_partitions,
            partition_mode=mode,
            move_in_holds=holds,
            claim_announced=claims,
        )
        for seed in range(start, stop)
    ]


def _digest(results: list[SimResult]) -> str:
    """A hash of every seed's result (steps, rebalances, epochs, records, ...), in seed order."""
    h = hashlib.sha256()
    for r in sorted(results, key=lambda r: r.seed):
        h.update(msgspec.json.encode(r))
    return h.hexdigest()[:16]


def _mutable(args: argparse.Namespace) -> int:
    """The MUTABLE_KEY_RANGE lifecycle model over the seeds, in this process (milliseconds a
    seed)."""
    from runtime.sim.mutable import run as run_mutable

    seeds = (
        [args.seed]
        if args.seed is not None
        else range(args.first, args.first + (50 if args.quick else args.seeds))
    )
    started = time.perf_counter()
    failed: list[int] = []
    moves = holds = writes = 0
    for seed in seeds:
        result = run_mutable(seed, honour_holds=not args.ignore_move_in_holds)
        moves, holds, writes = moves + result.moves, holds + result.holds, writes + result.writes
        problems = []
        if result.out_of_order:
            first, then = result.out_of_order[0]
            problems.append(
                f"key {first.key}: ts {then.ts} delivered after ts {first.ts} "
                f"({len(result.out_of_order)} out of order)"
            )
        if result.lost or result.doubled:
            problems.append(f"lost {result.lost}, doubled {result.doubled}")
        if problems:
            failed.append(seed)
            if len(failed) <= 20:
                print(f"seed {seed} FAILED: {'; '.join(problems)}", flush=True)
    seconds = time.perf_counter() - started
    n = len(seeds)
    print(
        f"{n - len(failed)}/{n} seeds passed in {seconds:.1f} s (MUTABLE_KEY_RANGE lifecycle "
        f"model{', move-in holds IGNORED' if args.ignore_move_in_holds else ''}); "
        f"{writes} writes, {moves} key moves, {holds} holds"
    )
    print(
        json.dumps(
            {
                "scenario": "sim",
                "partition_mode": "mutable",
                "ignore_move_in_holds": args.ignore_move_in_holds,
                "seeds": n,
                "passed": n - len(failed),
                "seconds": round(seconds, 1),
                "failed_seeds": failed[:50],
                "writes": writes,
                "moves": moves,
                "holds": holds,
            }
        )
    )
    return 0 if not failed else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench sim")
    parser.add_argument("--seeds", type=int, default=200, help="how many seeds (default 200)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seed", type=int, help="replay one seed and print its result")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="50 seeds")
    parser.add_argument(
        "--append-fail-p",
        type=float,
        default=0.0,
        help="chance that a sync append is reported failed (half of those are lost; default 0)",
    )
    parser.add_argument(
        "--sink-fail-p",
        type=float,
        default=0.0,
        help="chance that the simulated sink fails a batch (the reader re-reads; default 0)",
    )
    parser.add_argument(
        "--snapshot-partitions",
        type=int,
        default=8,
        help="the connector starts with a snapshot of this many partitions (0: none; default 8)",
    )
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=WORKER_MEMORY_BYTES / (1 << 30),
        help="address-space limit per worker process; 0 for none (default 4)",
    )
    parser.add_argument(
        "--partition-mode",
        choices=("immutable", "mutable"),
        default="immutable",
        help="the stream the fault simulator reads: immutable (splits, moves, merges; default) "
        "or mutable (MUTABLE_KEY_RANGE: keys moving between live partitions)",
    )
    parser.add_argument(
        "--ignore-move-in-holds",
        action="store_true",
        help="with --partition-mode mutable: ignore the move-in holds (the teeth: seeds fail)",
    )
    parser.add_argument(
        "--ignore-claims",
        action="store_true",
        help="with --partition-mode mutable: read a partition announced by a partition start "
        "at once, without waiting for the sync topic to credit the claim (the teeth: a "
        "partition announced twice is read twice)",
    )
    parser.add_argument(
        "--model-only",
        action="store_true",
        help="with --partition-mode mutable: the lifecycle model alone (no tasks, kills or "
        "hand-offs)",
    )
    args = parser.parse_args(argv)
    mode, holds = args.partition_mode, not args.ignore_move_in_holds
    claims = not args.ignore_claims
    if mode == "mutable" and args.model_only:
        return _mutable(args)
    if args.seed is not None:
        result = run(
            SimParams(
                seed=args.seed,
                append_fail_p=args.append_fail_p,
                sink_fail_p=args.sink_fail_p,
                snapshot_partitions=args.snapshot_partitions,
                partition_mode=mode,
                rules=Rules(move_in_holds=holds, claim_announced=claims),
            )
        )
        print(result)
        print(json.dumps({"scenario": "sim", "seeds": 1, "passed": int(result.passed)}))
        return 0 if result.passed else 1
    seeds = 50 if args.quick else args.seeds
    chunk = max(1, min(50, seeds // (args.jobs * 4) or 1))
    ranges = [
        (
            s,
            min(s + chunk, args.first + seeds),
            args.append_fail_p,
            args.sink_fail_p,
            args.snapshot_partitions,
            mode,
            holds,
            claims,
        )
        for s in range(args.first, args.first + seeds, chunk)
    ]
    started = time.perf_counter()
    results: list[SimResult] = []
    memory = int(args.memory_gb * (1 << 30))
    with ProcessPoolExecutor(
        max_workers=args.jobs, initializer=_init_worker, initargs=(memory,)
    ) as pool:
        for batch in pool.map(_run_range, ranges):
            results.extend(batch)
            for r in batch:
                if not r.passed:
                    print(f"seed {r.seed} FAILED: {r.violation}", flush=True)
            if len(results) % 1000 < len(batch):
                elapsed = time.perf_counter() - started
                print(f"... {len(results)} seeds in {elapsed:.0f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started
    passed = sum(r.passed for r in results)
    ok = [r for r in results if r.passed]
    print(
        f"{passed}/{len(results)} seeds passed in {seconds:.1f} s "
        f"({args.jobs} processes); per seed: {sum(r.rebalances for r in ok) / max(1, len(ok)):.1f} "
        f"rebalances, {sum(r.crashes for r in ok) / max(1, len(ok)):.1f} crashes, "
        f"{sum(r.pauses for r in ok) / max(1, len(ok)):.1f} zombie pauses, "
        f"{sum(r.partitions for r in ok) / max(1, len(ok)):.0f} partitions"
        + (
            f"; {mode} partitions, {sum(r.holds_passed for r in results)} move-in holds passed"
            f"{', move-in holds IGNORED' if not holds else ''}"
            f", {sum(r.claims_lost for r in results)} claims given up"
            f"{', claims IGNORED' if not claims else ''}"
            if mode == "mutable"
            else ""
        )
    )
    print(
        json.dumps(
            {
                "scenario": "sim",
                "seeds": len(results),
                "passed": passed,
                "seconds": round(seconds, 1),
                "failed_seeds": [r.seed for r in results if not r.passed][:50],
                # every seed's whole result, in seed order: a change that alters no decision of
                # any core (a refactor) leaves it as it was on the same seeds
                "digest": _digest(results),
                "append_fail_p": args.append_fail_p,
                "append_failures": sum(r.append_failures for r in results),
                "sink_fail_p": args.sink_fail_p,
                "sink_failures": sum(r.sink_failures for r in results),
                # how often the rules of docs/design.md that only some histories need ran
                "resets": sum(r.resets for r in results),
                "read_on_answer": sum(r.read_on_answer for r in results),
                # the snapshot: its partitions, chunks in the sink, readers that resumed a
                # partition another reader had begun, faults while it was not done
                "snapshot_partitions": args.snapshot_partitions,
                "snapshot_chunks": sum(r.snapshot_chunks for r in results),
                "snapshot_resumed": sum(r.snapshot_resumed for r in results),
                "snapshot_faults": sum(r.snapshot_faults for r in results),
                "partition_mode": mode,
                "move_in_holds": holds,
                "holds_passed": sum(r.holds_passed for r in results),
                "claim_announced": claims,
                "claims_lost": sum(r.claims_lost for r in results),
            }
        )
    )
    return 0 if passed == len(results) else 1
