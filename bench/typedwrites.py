"""``python -m bench typedwrites``: the typed changelog written by Spark (one job per micro-batch,
``runtime.spark.datasource``) against Spark's own floor for the same rows, with 1, 2 and 300
tables in a micro-batch, in one local session.

For each number of tables the rows are one micro-batch of the simulated stream (``--rows``
rows, the bridge's ``max_rows``), its tables spread evenly, built before the clock starts. Each
round runs, in turn (the order reversed every other round), after a warm-up round:

* ``spark``: ``write_staged_typed`` of the micro-batch's wire table (what the bridge's
  committer thread waits for: the Arrow transfer, one Spark job whose executors convert the
  rows and write every table's files, the driver's receipt, the caller's check);
* ``floor``: the same typed tables, already built as Arrow tables, each written by
  ``createDataFrame(table).write.parquet(new dir)``: one job per table, what Spark itself
  sustains for these rows;
* ``pyarrow``: today's ``--sink files`` path in this process (``typed_tables`` then
  ``write_tables``), no Spark.

Also timed once per round, to tell where the time goes: ``wire_s`` (building the wire table
from the records, done by the bridge off the event loop while the previous micro-batch is
written), ``convert_s`` (``tables_from_wire`` in this process: the executors' CPU work, split
among their tasks), ``noop`` (the wire table through ``createDataFrame`` and one job into
Spark's ``noop`` sink, as the chunks the Spark write takes in: the transfer and the job
without conversion or files) and ``tiny_s`` (a one-row micro-batch through
``write_staged_typed``: the fixed cost of a write). The one-row write runs right before each
timed ``spark`` write: Spark stops Python workers idle for a minute (its
``PythonWorkerFactory``), and a floor of 300 jobs takes longer than that, so without it the
``spark`` write after the floor would pay for new workers (3-20 s here, by the load), which a
running stream, writing every second or so, does not. ``tasks`` (the per-task read, convert and
write seconds of the last ``spark`` write, from its receipt) shows where a task's time goes.

Last line: ``{"scenario": "typedwrites", "spark_jobs_per_batch": ..., "floor_ratio_2": ...,
"floor_ratio_300": ..., "many_vs_one": <300 tables against 1, rows/s>, "by_tables": {...}}``.
Ratios are the medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.e2e import _params, _stream_end
from protocol.records import DataChange
from runtime.files.typed import write_tables
from runtime.sim.stream import StreamModel
from runtime.spark.datasource import wire_chunks, write_staged_typed
from runtime.spark.session import start_session, warm
from runtime.typed import tables_from_wire, typed_tables, wire_table

WAYS = ("spark", "floor", "pyarrow")


def _entries(tables: int, rows: int) -> list[tuple[str, list[DataChange]]]:
    """About ``rows`` rows of the simulated stream over ``tables`` tables, as one partition."""
    params = _params(roots=8, seed=1, tables=tables)
    out: list[DataChange] = []
    n = 0
    for change in StreamModel(params).expected(_stream_end(params, rows * 2)):
        out.append(change)
        n += len(change.mods)
        if n >= rows:
            break
    return [("raw", out)]


def _measure(
    spark: Any, work: Path, count: int, rows: int, rounds: int, jobs: list[int]
) -> dict[str, Any]:
    """The figures of one number of tables (see the module docstring)."""
    entries = _entries(count, rows)
    wire, specs = wire_table(entries)
    typed = typed_tables(entries)
    one_row, one_spec = wire_table([(entries[0][0], entries[0][1][:1])])
    print(f"typedwrites: {count} tables, {wire.num_rows} rows, {rounds} rounds")

    def fresh() -> Path:
        return work / uuid.uuid4().hex

    tasks: list[list[float]] = []

    def spark_way() -> None:
        receipt = write_staged_typed(spark, wire, str(fresh()), specs)
        assert receipt.spark_jobs is not None
        jobs.append(receipt.spark_jobs)
        tasks[:] = [
            [round(t.read_s, 3), round(t.convert_s, 3), round(t.write_s, 3)] for t in receipt.tasks
        ]

    def floor_way() -> None:
        base = fresh()
        for name, table in typed.items():
            spark.createDataFrame(table).write.parquet(str(base / name))

    def pyarrow_way() -> None:
        write_tables(fresh(), "_staging/b", "b", typed_tables(entries))

    ways: dict[str, Callable[[], None]] = {
        "spark": spark_way,
        "floor": floor_way,
        "pyarrow": pyarrow_way,
    }
    rates: dict[str, list[float]] = {name: [] for name in ways}
    probes: dict[str, list[float]] = {"wire_s": [], "convert_s": [], "noop_s": [], "tiny_s": []}
    parallelism = spark.sparkContext.defaultParallelism
    for r in range(rounds + 1):  # round 0 warms up
        order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
        for name, way in order:
            if name == "spark":  # keeps the Python workers (see the module docstring)
                t0 = time.monotonic()
                write_staged_typed(spark, one_row, str(fresh()), one_spec)
                if r:
                    probes["tiny_s"].append(time.monotonic() - t0)
            t0 = time.monotonic()
            way()
            took = time.monotonic() - t0
            if r:
                rates[name].append(wire.num_rows / took)
                print(f"  round {r} {name:8s} {took:7.2f} s {wire.num_rows / took:10,.0f} rows/s")
        t0 = time.monotonic()
        wire_table(entries)
        t1 = time.monotonic()
        tables_from_wire(wire, specs)
        t2 = time.monotonic()
        df = spark.createDataFrame(wire_chunks(wire, parallelism))
        df.write.format("noop").mode("overwrite").save()
        t3 = time.monotonic()
        if r:
            for key, value in zip(
                ("wire_s", "convert_s", "noop_s"), (t1 - t0, t2 - t1, t3 - t2), strict=True
            ):
                probes[key].append(value)
        for path in work.iterdir():  # what the round wrote
            if path.name != "spark-local":
                shutil.rmtree(path, ignore_errors=True)
    floor_ratios = [s / f for s, f in zip(rates["spark"], rates["floor"], strict=True)]
    entry: dict[str, Any] = {
        "rows": wire.num_rows,
        **{f"{n}_rows_per_s": round(statistics.median(v)) for n, v in rates.items()},
        "floor_ratio": round(statistics.median(floor_ratios), 3),
        "floor_ratios": [round(x, 3) for x in floor_ratios],
        **{k: round(statistics.median(v), 3) for k, v in probes.items()},
        "tasks": tasks,
    }
    print("  " + json.dumps(entry))
    return entry


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench typedwrites", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="50k-row micro-batches")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=None, help="rows per micro-batch (100k)")
    parser.add_argument("--tables", default="1,2,300", help="numbers of tables, comma-separated")
    args = parser.parse_args(argv)
    rows = args.rows or (50_000 if args.quick else 100_000)
    counts = [int(x) for x in args.tables.split(",")]
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-typed-"))
    results: dict[str, dict[str, Any]] = {}
    jobs: list[int] = []
    try:
        spark = start_session(
            master="local[2]",
            remote=None,
            app_name="shoal-bench-typed",
            conf={},
            local_dir=str(work / "spark-local"),
        )
        spark.sparkContext.setLogLevel("ERROR")
        warm(spark)
        for count in counts:
            results[str(count)] = _measure(spark, work, count, rows, args.rounds, jobs)
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"scenario": "typedwrites"}
    out["spark_jobs_per_batch"] = round(statistics.mean(jobs), 3) if jobs else None
    for key, entry in results.items():
        out[f"floor_ratio_{key}"] = entry["floor_ratio"]
    if "1" in results and "300" in results:
        out["many_vs_one"] = round(
            results["300"]["spark_rows_per_s"] / results["1"]["spark_rows_per_s"], 3
        )
    out.update(by_tables=results, rounds=args.rounds, quick=args.quick)
    print(json.dumps(out))
    return 0
