"""``python -m bench cluster``: the command line against a real standalone Spark cluster.

Starts a standalone master and two workers from the installed pyspark on loopback
(``runtime.spark.standalone``: free ports, one core and 768 MB each), reads the master's JSON UI
for its alive workers, runs ``python -m actors.runtime --spark-master spark://127.0.0.1:PORT
--duration N`` over a bounded simulated stream (the embedded broker, three tasks), and checks the
output against the stream: the rows the seeded stream model produced up to the instant the run
closed the stream (its summary's ``stream_end``), computed here from the model alone. Then it
stops the cluster.

Last line: ``{"scenario": "cluster", "workers", "records", "rows", "lost", "extra",
"duplicates", "seconds", ...}``; ``lost`` counts rows of the stream missing from the output,
``extra`` rows written that the stream never produced plus rows written twice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from actors.cli.progress import RunSummary
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spark import KEY_COLUMNS, read_output
from runtime.spark.standalone import StandaloneCluster

REPO = Path(__file__).resolve().parents[1]


def params(seed: int, start_ts: int) -> StreamParams:
    """The stream the run reads (every value is also passed on the command line)."""
    return StreamParams(
        seed=seed,
        start_ts=start_ts,
        roots=4,
        round_us=2_000_000,
        split_p=0.05,
        move_p=0.03,
        merge_p=0.05,
        records_per_s=60.0,
    )


def sim_args(p: StreamParams) -> list[str]:
    return [
        *("--sim-seed", str(p.seed), "--sim-roots", str(p.roots)),
        *("--sim-records-per-s", str(p.records_per_s), "--sim-round-s", str(p.round_us / 1e6)),
        *("--sim-split-p", str(p.split_p), "--sim-move-p", str(p.move_p)),
        *("--sim-merge-p", str(p.merge_p), "--sim-start-ts", str(p.start_ts)),
    ]


def expected_rows(model: StreamModel, until_ts: int) -> set[str]:
    """Row ids (``commit/txn/seq/mod``) of every row committed at or before ``until_ts``."""
    return {
        f"{r.commit_ts}/{r.server_transaction_id}/{r.record_sequence}/{i}"
        for r in model.expected(until_ts)
        for i in range(len(r.mods))
    }


def written_rows(directory: Path) -> list[str]:
    """Row ids of the output, every raw row (duplicates kept)."""
    table = read_output(directory, dedupe=False)
    columns = [table.column(c).to_pylist() for c in KEY_COLUMNS]
    return ["/".join(str(v) for v in key) for key in zip(*columns, strict=True)]


def run_cli(
    cluster: StandaloneCluster, p: StreamParams, duration: float, work: Path, timeout_s: float
) -> tuple[int, RunSummary | None, str]:
    """The command line against ``cluster``: exit code, summary and the tail of its output."""
    config = work / "shoal.toml"
    # each executor fits in its worker's memory; Spark's default (1g) would never be granted
    config.write_text('[spark.conf]\n"spark.executor.memory" = "512m"\n')
    summary = work / "summary.json"
    env = {k: v for k, v in cluster.env().items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args = [
        *(sys.executable, "-m", "actors.runtime", "--config", str(config)),
        *("--spark-master", cluster.master_url, "--duration", str(duration)),
        *sim_args(p),
        *("--output-dir", str(work / "out"), "--summary-json", str(summary)),
    ]
    log = work / "run.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    text = log.read_text(errors="replace")[-4000:]
    if not summary.exists():
        return proc.returncode, None, text
    return proc.returncode, msgspec.json.decode(summary.read_bytes(), type=RunSummary), text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench cluster", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run (about 2 minutes)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of stream")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    duration = args.duration or (10.0 if args.quick else 60.0)
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-cluster-"))
    keep = False
    try:
        t0 = time.monotonic()
        with StandaloneCluster(work / "cluster", workers=args.workers) as cluster:
            status = cluster.statistics()
            print(
                f"cluster: {cluster.master_url}, {status.alive_workers} workers alive, "
                f"{status.cores} cores (started in {time.monotonic() - t0:.1f}s)"
            )
            p = params(args.seed, time.time_ns() // 1000)
            t1 = time.monotonic()
            code, summary, tail = run_cli(cluster, p, duration, work, 300 + 4 * duration)
            seconds = time.monotonic() - t1
        if code != 0 or summary is None or summary.stream_end is None:
            print(f"cluster: the run failed (exit {code}):\n{tail}", file=sys.stderr)
            print(f"cluster: its files are kept in {work}", file=sys.stderr)
            keep = True
            return 1
        ids = written_rows(work / "out" / "data")
        model = StreamModel(p)
        expected = expected_rows(model, summary.stream_end)
        records = sum(1 for _ in model.expected(summary.stream_end))
        written = set(ids)
        lost = len(expected - written)
        duplicates = len(ids) - len(written)
        extra = len(written - expected) + duplicates
        print(
            f"cluster: {records} records ({len(expected)} rows) produced up to the stream's "
            f"end, {len(ids)} rows written: lost {lost}, extra {extra} "
            f"({duplicates} duplicates); run {seconds:.1f}s"
        )
        result = {
            "scenario": "cluster",
            "workers": status.alive_workers,
            "records": records,
            "rows": len(expected),
            "lost": lost,
            "extra": extra,
            "duplicates": duplicates,
            "seconds": round(seconds, 1),
            "duration_s": duration,
            "caught_up": summary.caught_up,
            "quick": args.quick,
        }
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0 if lost == 0 and extra == 0 and status.alive_workers >= args.workers else 1
