"""``python -m bench e2e``: change records from the simulator through three task nodes and the
Spark bridge into the default parquet sink, against the same records handed straight to Spark.

Phases on one local Spark session (started and warmed first, not timed):

0. **floor** and **pyarrow**: the same rows, already built as Arrow tables of ``max_rows`` rows
   (built before the clock starts), each handed to Spark by one
   ``createDataFrame(table).write.parquet(...)`` (no partitioning, nothing else): what Spark
   itself sustains on this machine, the floor the bridge is measured against; and the same
   tables written by pyarrow alone (no Spark), to show where the ceiling is set.
1. **raw**: the stream's records, already in memory, cut into micro-batches of ``max_rows`` rows,
   each built into Arrow and written by ``createDataFrame`` into parquet partitioned by table,
   by the bridge's own write (``write_staged``) — the bridge's ceiling (no reading, no tasks, no
   acks, no commits).
2. **e2e**: the same records as a backlog (the simulator's clock jumps to the stream's end
   once the three task nodes formed their group): the nodes, over in-memory coordination,
   read them and put them into the bridge (the simulated source serves records its model
   generated before the clock starts, as the floor's tables and the raw phase's records are:
   the seeded generator is a stand-in for Spanner, whose decoding ``bench spanner``
   measures), which writes its default output (the typed per-table layout, one Spark job per
   micro-batch whose executors write every table, ``runtime.spark.datasource``;
   ``--output-layout generic``: Spark's partitioned write, as in raw); timed from the first
   put until every row is committed.

Phases 0–2 run ``--rounds`` times (default 3), interleaved (floor, pyarrow, raw, e2e, then
again), on the same rows: the machine's load drifts between rounds, so ``ratio`` and
``floor_ratio`` are the medians of the per-round ratios (each round's are printed and in the
JSON), the rates the medians of the rounds' rates.

3. **latency**: a live stream (clock at real time) for a few seconds; commit-to-visible is, per
   record, the time from its commit timestamp to the moment the bridge committed the
   micro-batch holding it (its reader's future resolved).

Last line: ``{"scenario": "e2e", "records_per_s", "raw_spark_records_per_s", "ratio",
"spark_floor_records_per_s", "floor_ratio", "spark_jobs_per_batch", "pyarrow_records_per_s",
"latency_p50_s", "latency_p99_s", ...}`` (``ratio``: e2e against raw; ``floor_ratio``: e2e
against the floor; ``spark_jobs_per_batch``: the Spark jobs per micro-batch with rows of the
typed output over the e2e phases, null for the generic layout).

``--tables N --vs-one-table`` runs only the e2e phase, over a stream of N tables and over one of
one table (the same number of records and seed), alternately for ``--rounds`` rounds, and
reports ``tables_ratio``, the median of the per-round ratios of their rates: the many-table
cost of the default output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import uvloop

from actors.node import NodeConfig, TaskNode
from protocol.records import DataChange
from protocol.task import TaskConfig
from runtime.ports import Membership, Sink, SinkBatch
from runtime.sim.memory import MemoryGroup, MemorySyncLog
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spark import SparkBridge, SparkConfig, read_output
from runtime.spark.output import write_default, write_staged
from runtime.spark.rows import to_arrow
from runtime.spark.session import start_session, warm


class _Timed(Sink):
    """The bridge as the tasks see it: remembers when the first batch came and, per record, the
    model time at which its batch committed."""

    def __init__(self, inner: Sink, source: SimulatedSource, speedup: float) -> None:
        self.inner = inner
        self.source = source
        self.speedup = speedup
        self.first_put: float | None = None
        self.latencies: list[float] = []

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        if self.first_put is None and batch.records:
            self.first_put = time.monotonic()
        future = await self.inner.put(batch)
        stamps = [r.commit_ts for r in batch.records]

        def done(f: asyncio.Future[None]) -> None:
            if not f.cancelled() and f.exception() is None:
                now = self.source.now()
                self.latencies.extend((now - ts) / 1e6 / self.speedup for ts in stamps)

        future.add_done_callback(done)
        return future


def _params(roots: int, seed: int, tables: int | None = None) -> StreamParams:
    names = StreamParams().tables if tables is None else tuple(f"T{i:04d}" for i in range(tables))
    return StreamParams(
        seed=seed,
        roots=roots,
        records_per_s=2000.0,
        round_us=2_000_000,
        split_p=0.05,
        merge_p=0.05,
        tables=names,
    )


def _stream_end(params: StreamParams, records: int) -> int:
    seconds = records / (params.roots * params.records_per_s)
    return params.start_ts + int(seconds * 1e6)


def _nodes(source: SimulatedSource, sink: Sink, start_ts: int) -> list[TaskNode]:
    """Three task nodes over the in-memory group and sync log. The group's session timeout is
    a real Kafka's default (10 s): with 2 s, a machine loaded by others starved the event loop
    past the lease often enough that readers stopped mid-backlog and re-read what they had not
    committed (a lease lapse, measured by ``bench rebalance`` and ``bench chaos``, not here)."""
    log = MemorySyncLog()
    group = MemoryGroup(rebalance_delay=0.1, session_timeout=10.0)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    return [
        TaskNode(
            NodeConfig(
                task=TaskConfig(task_id=f"t{i}", answer_timeout=500_000, publish_interval=200_000),
                stream_start=start_ts,
            ),
            sync_log=log,
            join=join,
            source=source,
            sink=sink,
        )
        for i in range(3)
    ]


def arrow_batches(records: list[tuple[str, DataChange]], max_rows: int) -> list[Any]:
    """``records`` as Arrow tables of about ``max_rows`` rows each, as the bridge cuts them."""
    tables = []
    chunk: list[DataChange] = []
    rows = 0
    for _, change in records:
        chunk.append(change)
        rows += len(change.mods)
        if rows >= max_rows:
            tables.append(to_arrow([("raw", chunk)]))
            chunk, rows = [], 0
    if chunk:
        tables.append(to_arrow([("raw", chunk)]))
    return tables


def floor_phase(spark: Any, tables: list[Any], out: Path) -> float:
    """Seconds for Spark to write ready-made Arrow ``tables``, one plain parquet write each."""
    t0 = time.monotonic()
    for n, table in enumerate(tables):
        spark.createDataFrame(table).write.parquet(str(out / f"floor-{n:06d}"))
    return time.monotonic() - t0


def pyarrow_phase(tables: list[Any], out: Path) -> float:
    """Seconds for pyarrow alone to write ``tables`` (snappy parquet, as Spark writes)."""
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for n, table in enumerate(tables):
        pq.write_table(table, str(out / f"part-{n:06d}.parquet"), compression="snappy")
    return time.monotonic() - t0


def raw_phase(spark: Any, records: list[tuple[str, DataChange]], max_rows: int, out: Path) -> float:
    """Seconds to hand ``records`` straight to Spark in micro-batches of ``max_rows`` rows."""
    t0 = time.monotonic()
    chunk: list[DataChange] = []
    rows = 0
    n = 0

    def flush() -> None:
        nonlocal chunk, rows, n
        df = spark.createDataFrame(to_arrow([("raw", chunk)]))
        write_staged(df, str(out / f"raw-{n:06d}"))  # the bridge's own write
        chunk, rows, n = [], 0, n + 1

    for _, change in records:
        chunk.append(change)
        rows += len(change.mods)
        if rows >= max_rows:
            flush()
    if chunk:
        flush()
    return time.monotonic() - t0


async def _settled(nodes: list[TaskNode], partitions: int, timeout: float = 120.0) -> None:
    """Wait until every node is a member of one generation and the ``partitions`` roots are
    owned and being read, with no offer open, twice in a row 0.2 s apart."""

    def settled() -> bool:
        status = [n.status() for n in nodes]
        return (
            all(s.member for s in status)
            and len({s.generation for s in status}) == 1
            and sum(s.owned for s in status) == partitions
            and sum(s.reading for s in status) == partitions
            and not any(s.offers for s in status)
        )

    async with asyncio.timeout(timeout):
        while True:
            if settled():
                await asyncio.sleep(0.2)
                if settled():
                    return
            await asyncio.sleep(0.05)


async def e2e_phase(
    spark: Any, config: SparkConfig, model: StreamModel, end_ts: int, total_rows: int
) -> tuple[float, int, tuple[int, int]]:
    """Seconds from the first put until every row committed, the rows in the output, and the
    Spark jobs of the typed micro-batches with rows and those micro-batches (0, 0 for the
    generic layout, whose writes count no jobs).

    The stream stays at its start (no records, heartbeats only) until the three nodes have
    formed their group and own every root; only then does its clock jump to ``end_ts``, so a
    node that joins late on a loaded machine cannot move partitions whose readers would then
    re-read what they had not committed yet. Re-reads show as ``rows_deduplicated`` in the
    bridge's statistics printed after each phase (0 when the phase ran as intended)."""
    opened = False
    params = model.params
    source = SimulatedSource(
        model,
        clock=lambda: end_ts if opened else params.start_ts,
        heartbeat_ms=1000,
    )
    async with SparkBridge(config, spark=spark) as bridge:
        timed = _Timed(bridge, source, 1.0)
        async with AsyncExitStack() as stack:
            nodes = _nodes(source, timed, params.start_ts)
            for node in nodes:
                await stack.enter_async_context(node)
            await _settled(nodes, params.roots)
            opened = True
            try:
                async with asyncio.timeout(600):
                    # polling the bridge's counters is the measurement itself
                    while bridge.stats().rows_committed < total_rows:  # noqa: ASYNC110
                        await asyncio.sleep(0.02)
            except TimeoutError:
                # say where the rows stopped (an output directory that already held them, for
                # one: the bridge drops rows its output has committed, rows_deduplicated)
                print(f"  e2e: not every row committed after 600 s; bridge: {bridge.stats()}")
                for node in nodes:
                    print(f"  node: {node.status()}")
                raise
            done = time.monotonic()
        stats = bridge.stats()
        jobs = (bridge.typed_write_jobs, bridge.typed_writes)
    assert timed.first_put is not None
    print(f"  bridge: {stats}; Spark jobs {jobs[0]} for {jobs[1]} typed micro-batches")
    return done - timed.first_put, read_output(config.output_dir).num_rows, jobs


async def latency_phase(
    spark: Any, config: SparkConfig, params: StreamParams, seconds: float
) -> list[float]:
    source = SimulatedSource(StreamModel(params), heartbeat_ms=250, speedup=1.0)
    async with SparkBridge(config, spark=spark) as bridge:
        timed = _Timed(bridge, source, 1.0)
        async with AsyncExitStack() as stack:
            for node in _nodes(source, timed, params.start_ts):
                await stack.enter_async_context(node)
            await asyncio.sleep(seconds)
        print(f"  bridge: {bridge.stats()}")
    # the first seconds include the nodes' start and first rebalance
    return timed.latencies


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _jobs_per_batch(jobs: list[tuple[int, int]]) -> float | None:
    """Spark jobs per micro-batch with rows over the e2e phases (None: no typed micro-batch,
    e.g. the generic layout)."""
    batches = sum(b for _, b in jobs)
    return round(sum(j for j, _ in jobs) / batches, 3) if batches else None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _stream(params: StreamParams, end_ts: int) -> tuple[StreamModel, list[tuple[str, DataChange]]]:
    """The model of the stream up to ``end_ts``, its records generated (the model keeps them:
    the e2e phase's source serves them from there, as the floor's tables are built before its
    clock starts), and those records."""
    model = StreamModel(params)
    return model, [("raw", change) for change in model.expected(end_ts)]


def _rows(stream: list[tuple[str, DataChange]]) -> int:
    return sum(len(c.mods) for _, c in stream)


def _e2e_rate(
    spark: Any,
    config: SparkConfig,
    model: StreamModel,
    end_ts: int,
    expect: tuple[int, int],
    jobs: list[tuple[int, int]] | None = None,
) -> float:
    """One e2e phase over ``params``'s stream up to ``end_ts`` (``expect``: its records and
    rows): records/s. The output must hold every row; it is removed afterwards. ``jobs``
    gets the phase's (Spark jobs, typed micro-batches with rows)."""
    records, rows = expect
    e2e_s, out_rows, phase_jobs = uvloop.run(e2e_phase(spark, config, model, end_ts, rows))
    if jobs is not None:
        jobs.append(phase_jobs)
    rate = records / e2e_s
    print(f"  e2e: {e2e_s:.2f}s, {rate:,.0f} records/s, {out_rows} rows in the output")
    if out_rows != rows:
        raise SystemExit(f"e2e: the output has {out_rows} rows, expected {rows}")
    shutil.rmtree(config.output_dir, ignore_errors=True)
    return rate


def vs_one_table(spark: Any, args: argparse.Namespace, records: int, work: Path) -> int:
    """``--vs-one-table``: only the e2e phase, over ``--tables`` tables and over one table (the
    same number of records, the same seed), alternately, ``--rounds`` times in this process."""
    runs = []
    for n in (args.tables, 1):
        params = _params(roots=8, seed=args.seed, tables=n)
        end_ts = _stream_end(params, records)
        model, stream = _stream(params, end_ts)
        runs.append((model, end_ts, (len(stream), _rows(stream))))
        print(f"  {n} table(s): {len(stream)} records, {_rows(stream)} rows")
    rates: dict[int, list[float]] = {args.tables: [], 1: []}
    for r in range(args.rounds):
        for model, end_ts, expect in runs:
            n = len(model.params.tables)
            print(f" round {r + 1}/{args.rounds}, {n} table(s)")
            config = SparkConfig(
                output_dir=str(work / f"e2e-{n}"),
                max_rows=args.max_rows,
                max_age_s=args.max_age,
                output_layout=args.output_layout,
            )
            rates[n].append(_e2e_rate(spark, config, model, end_ts, expect))
    ratios = [m / o for m, o in zip(rates[args.tables], rates[1], strict=True)]
    print(f"  {args.tables} tables vs one, per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(
        json.dumps(
            {
                "scenario": "e2e",
                "tables": args.tables,
                "records_per_s": round(_median(rates[args.tables])),
                "one_table_records_per_s": round(_median(rates[1])),
                "tables_ratio": round(_median(ratios), 3),
                "tables_ratio_per_round": [round(x, 3) for x in ratios],
                "records": records,
                "rounds": args.rounds,
                "max_rows": args.max_rows,
                "output_layout": args.output_layout or "default",
            }
        )
    )
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench e2e", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="small run (1-2 minutes idle, 3-4 under load)"
    )
    parser.add_argument("--records", type=int, default=None, help="records in the backlog")
    parser.add_argument("--max-rows", type=int, default=100_000, help="rows per micro-batch")
    parser.add_argument("--max-age", type=float, default=0.5, help="seconds a batch may wait")
    parser.add_argument("--live-seconds", type=float, default=None, help="latency phase length")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the throughput phases, interleaved (medians are reported)",
    )
    parser.add_argument(
        "--tables", type=int, default=None, help="tables in the stream (default: the sim's 3)"
    )
    parser.add_argument(
        "--vs-one-table",
        action="store_true",
        help="only the e2e phase, over --tables tables and over one table, alternately",
    )
    parser.add_argument(
        "--output-layout", choices=("typed", "generic"), default=None, help="default: the bridge's"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.vs_one_table and not args.tables:
        parser.error("--vs-one-table needs --tables N")
    records = args.records or (150_000 if args.quick else 1_000_000)
    live_s = args.live_seconds or (12.0 if args.quick else 60.0)
    params = _params(roots=8, seed=args.seed, tables=args.tables)
    end_ts = _stream_end(params, records)
    model, stream = _stream(params, end_ts)
    total_records = len(stream)
    total_rows = _rows(stream)
    print(
        f"e2e: {total_records} records, {total_rows} rows, micro-batches of {args.max_rows}, "
        f"{args.rounds} round(s)"
    )

    work = Path(tempfile.mkdtemp(prefix="shoal-bench-e2e-"))
    try:
        t0 = time.monotonic()
        spark = start_session(
            master="local[2]",
            remote=None,
            app_name="shoal-bench-e2e",
            conf={},
            local_dir=str(work / "spark-local"),
        )
        spark.sparkContext.setLogLevel("ERROR")
        warm(spark)
        # warm the parquet write too
        write_default(
            spark.createDataFrame(to_arrow([("raw", [c for _, c in stream[:1000]])])),
            str(work / "warm"),
            "w",
        )
        print(f"  spark started and warmed in {time.monotonic() - t0:.1f}s")
        if args.vs_one_table:
            rc = vs_one_table(spark, args, records, work)
            spark.stop()
            return rc

        tables = arrow_batches(stream, args.max_rows)
        floor, pyarrow_, raw, e2e = [], [], [], []
        jobs: list[tuple[int, int]] = []
        for r in range(args.rounds):
            # one round: each phase once, back to back, on the same rows; the machine's load
            # drifts between rounds, so ratios are taken per round
            print(f" round {r + 1}/{args.rounds}")
            floor_s = floor_phase(spark, tables, work / "floor")
            floor.append(total_records / floor_s)
            print(f"  Spark floor (Arrow tables → parquet): {floor_s:.2f}s, {floor[-1]:,.0f} r/s")
            pa_s = pyarrow_phase(tables, work / "pyarrow")
            pyarrow_.append(total_records / pa_s)
            print(f"  pyarrow alone: {pa_s:.2f}s, {pyarrow_[-1]:,.0f} records/s")
            raw_s = raw_phase(spark, stream, args.max_rows, work / "raw")
            raw.append(total_records / raw_s)
            print(f"  raw Spark: {raw_s:.2f}s, {raw[-1]:,.0f} records/s")
            config = SparkConfig(
                output_dir=str(work / "e2e"),
                max_rows=args.max_rows,
                max_age_s=args.max_age,
                output_layout=args.output_layout,
            )
            e2e.append(_e2e_rate(spark, config, model, end_ts, (total_records, total_rows), jobs))
            for name in ("floor", "pyarrow", "raw"):
                shutil.rmtree(work / name, ignore_errors=True)
        del tables
        ratios = [e / r for e, r in zip(e2e, raw, strict=True)]
        floor_ratios = [e / f for e, f in zip(e2e, floor, strict=True)]
        print(
            f"  per round: ratio {', '.join(f'{x:.3f}' for x in ratios)}; "
            f"floor_ratio {', '.join(f'{x:.3f}' for x in floor_ratios)}"
        )

        live = SparkConfig(
            output_dir=str(work / "live"), max_rows=args.max_rows, max_age_s=args.max_age
        )
        live_params = StreamParams(seed=args.seed + 1, roots=8, records_per_s=200.0)
        latencies = uvloop.run(latency_phase(spark, live, live_params, live_s))
        p50, p99 = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
        mean = statistics.fmean(latencies) if latencies else float("nan")
        print(f"  commit-to-visible over {len(latencies)} records: p50 {p50:.3f}s p99 {p99:.3f}s")
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "scenario": "e2e",
                "records_per_s": round(_median(e2e)),
                "raw_spark_records_per_s": round(_median(raw)),
                "ratio": round(_median(ratios), 3),
                "spark_floor_records_per_s": round(_median(floor)),
                "floor_ratio": round(_median(floor_ratios), 3),
                "spark_jobs_per_batch": _jobs_per_batch(jobs),
                "pyarrow_records_per_s": round(_median(pyarrow_)),
                "ratio_per_round": [round(x, 3) for x in ratios],
                "floor_ratio_per_round": [round(x, 3) for x in floor_ratios],
                "latency_p50_s": round(p50, 3),
                "latency_p99_s": round(p99, 3),
                "latency_mean_s": round(mean, 3),
                "records": total_records,
                "rows": total_rows,
                "rounds": args.rounds,
                "max_rows": args.max_rows,
                "max_age_s": args.max_age,
                "quick": args.quick,
                "tables": len(params.tables),
                "output_layout": args.output_layout or "default",
            }
        )
    )
    return 0
