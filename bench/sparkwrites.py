"""``python -m bench sparkwrites``: the ways of handing one micro-batch to Spark, compared on the
same rows in one session, interleaved batch by batch (so a machine whose speed drifts affects
each alike), each figure the median over every batch.

The rows are the e2e scenario's (the simulated stream, about 172 bytes per row), cut into Arrow
tables of ``--max-rows`` rows before the clock starts. Each batch is written, in turn (the order
reversed every other round), by:

* ``floor``: ``createDataFrame(table).write.parquet(new dir)``, no partitioning: what Spark
  itself sustains;
* ``staged``: the bridge's write of an atomically committed micro-batch
  (``runtime.spark.output.write_staged``: partitioned by table into a fresh directory);
* ``dynamic``: the write the bridge used before (``write_default``: partitioned by table and a
  constant batch column, dynamic partition overwrite);
* ``noop``: Spark's ``noop`` sink (the Arrow transfer and the job, no files);
* ``pyarrow``: ``pyarrow.parquet.write_table`` alone (no Spark).

Last line: ``{"scenario": "sparkwrites", "<way>_rows_per_s": ..., "staged_vs_floor": ...}``.
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

from bench.e2e import _params, _stream_end, arrow_batches
from runtime.sim.stream import StreamModel
from runtime.spark.output import write_default, write_staged
from runtime.spark.session import start_session, warm


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench sparkwrites", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two rounds over 130k records")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--records", type=int, default=133_000)
    parser.add_argument("--max-rows", type=int, default=100_000)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    params = _params(roots=8, seed=1)
    stream = [("raw", c) for c in StreamModel(params).expected(_stream_end(params, args.records))]
    tables = arrow_batches(stream, args.max_rows)
    print(f"sparkwrites: {len(tables)} tables of about {args.max_rows} rows, {rounds} rounds")
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-writes-"))
    try:
        spark = start_session(
            master="local[2]",
            remote=None,
            app_name="shoal-bench-writes",
            conf={},
            local_dir=str(work / "spark-local"),
        )
        spark.sparkContext.setLogLevel("ERROR")
        warm(spark)

        def fresh() -> str:
            return str(work / uuid.uuid4().hex)

        def pyarrow_write(table: Any) -> None:
            import pyarrow.parquet as pq

            pq.write_table(table, fresh() + ".parquet", compression="snappy")

        ways: dict[str, Callable[[Any], None]] = {
            "floor": lambda t: spark.createDataFrame(t).write.parquet(fresh()),
            "staged": lambda t: write_staged(spark.createDataFrame(t), fresh()),
            "dynamic": lambda t: write_default(spark.createDataFrame(t), fresh(), "b"),
            "noop": lambda t: (
                spark.createDataFrame(t).write.format("noop").mode("overwrite").save()
            ),
            "pyarrow": pyarrow_write,
        }
        for write in ways.values():  # the first write of each kind costs seconds
            write(tables[0])
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(rounds):
            for table in tables:
                order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
                for name, write in order:
                    t0 = time.monotonic()
                    write(table)
                    rates[name].append(table.num_rows / (time.monotonic() - t0))
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {"scenario": "sparkwrites"}
    for name, values in rates.items():
        median = statistics.median(values)
        print(
            f"  {name:8s} median {median:12,.0f} rows/s  (min {min(values):,.0f}, max {max(values):,.0f})"
        )
        result[f"{name}_rows_per_s"] = round(median)
    result["staged_vs_floor"] = round(result["staged_rows_per_s"] / result["floor_rows_per_s"], 3)
    result["dynamic_vs_floor"] = round(result["dynamic_rows_per_s"] / result["floor_rows_per_s"], 3)
    result.update(batches=len(tables) * rounds, max_rows=args.max_rows, quick=args.quick)
    print(json.dumps(result))
    return 0
