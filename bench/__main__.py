"""``python -m bench <scenario> [options]``: every scenario prints its figures and, as its last
line, one JSON object starting with ``{"scenario": "<name>", ...}``."""

from __future__ import annotations

import importlib
import sys

SCENARIOS = {
    "sim": "bench.sim",
    "rebalance": "bench.rebalance",
    "spanner": "bench.spanner",
    "e2e": "bench.e2e",
    "cluster": "bench.cluster",
    "sparkwrites": "bench.sparkwrites",
    "typedwrites": "bench.typedwrites",
    "dlq": "bench.dlq",
    "scale": "bench.scale",
    "capacity": "bench.capacity",
    "chaos": "bench.chaos",
    "emuleak": "bench.emuleak",
    "emutail": "bench.emutail",
    "timeline": "bench.timeline",
    "backfill": "bench.backfill",
    "faults": "bench.faults",
    "outputstate": "bench.outputstate",
    "report": "bench.report",
    "mirrormerge": "bench.mirrormerge",
    "lake": "bench.lake",
    "mirror": "bench.mirror",
    "stalls": "bench.stalls",
    "poison": "bench.poison",
    "catchup": "bench.catchup",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SCENARIOS:
        print("usage: python -m bench <scenario> [--quick] [options]", file=sys.stderr)
        print("scenarios: " + ", ".join(SCENARIOS), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(SCENARIOS[argv[0]])
    except ModuleNotFoundError as exc:
        print(f"scenario {argv[0]!r} is not available: {exc}", file=sys.stderr)
        return 2
    result: int = module.main(argv[1:])
    return result


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
