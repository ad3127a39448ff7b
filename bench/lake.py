"""``python -m bench lake``: the command line writing Delta tables into an S3-compatible store
through Spark (``--sink spark --table-format delta --output-dir s3://...``), against Spark's own
floor for the same rows into the same store, and one run SIGKILLed mid-way and restarted.

The store is moto's S3 server (``moto[server]``), started on a loopback port for the bench
with random test credentials in the environment (as an operator's ``AWS_*`` would be). The
stream is the simulator's (seeded; the window ``--seconds`` long, in the past, so it is a
backlog every run reads at full speed), over its three tables.

Each of ``--rounds`` rounds (default 3) runs, interleaved, on the same rows (the machine's load
drifts between rounds, so ratios are taken per round and their median reported):

* **floor**: the window's rows, already built as each micro-batch's typed Arrow tables (cut at
  ``--max-rows`` rows, as the bridge cuts them; built before the clock starts), each table
  handed to Spark by one ``createDataFrame(table).write`` into the same store: Spark takes the
  Arrow rows in and its Python workers write them as one parquet file per task through pyarrow's
  S3 file system (a minimal Python data source, :class:`FloorParquet`: Spark cannot write
  ``s3a://`` here, its Hadoop S3 jars are not installed), one Spark job per table and
  micro-batch, no commit;
* **local floor** (for reference): the same tables by Spark's own ``write.parquet`` to a local
  directory;
* **lake**: the command line, a bounded run over the window (``--start-at``/``--end-at``) into a
  fresh prefix, exiting by itself; its rate is the rows over the seconds from the first record
  handed to Spark to the last micro-batch's commit (the run's summary, ``sink_write_s``: Spark's
  start, the broker and the group forming are not counted), checked against the floor's.

Then **kill**: one more run into its own prefix with smaller micro-batches, SIGKILLed (with its
JVM and broker) right after its first Delta commit appears in the store, then started again
over the same output; the second run must end by itself.

Every run's Delta tables are read back with delta-rs and compared with the stream model's rows
of the window: ``lost`` (rows missing) and ``duplicates`` (rows more than once, or not in the
window) over all runs. ``spark_jobs_per_batch`` is the runs' Spark jobs per micro-batch with
rows (their summaries: the typed write counts its jobs).

**S3 requests** of the timed runs, counted from moto's log (exact, whatever the machine's load):
``s3_requests_per_batch`` is all of a run's requests (its start, the executors' data files, the
receipts, the Delta commits, its progress files) over its micro-batches;
``s3_log_requests_per_commit`` the requests on the Delta logs (``<table>/_delta_log/``: reading
the table, committing, checkpoints) over the Delta commits the run made (one per table and
micro-batch; the metadata commits of new columns count too).

Last line: ``{"scenario": "lake", "store": "s3", "table_format": "delta", "tables", "rows",
"spark_jobs_per_batch", "lost", "duplicates", "killed", "exited_by_itself", "floor_ratio",
"rows_per_s", "floor_rows_per_s", "local_floor_rows_per_s", "s3_requests_per_batch",
"s3_log_requests_per_commit", ...}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

from bench.procs import tree
from protocol.records import DataChange
from runtime.lake.s3server import S3Request, S3Server, S3Unavailable, running_s3_server
from runtime.sim.stream import StreamModel, StreamParams

REPO = Path(__file__).resolve().parent.parent
BUCKET = "shoal-bench-lake"
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
ID_COLUMNS = ["_commit_ts", "_server_transaction_id", "_record_sequence", "_mod_index"]


# --- the store ----------------------------------------------------------------------------------


@contextlib.contextmanager
def s3_server(work: Path) -> Iterator[S3Server]:
    """moto's S3 server on a free loopback port (``runtime.lake.s3server``), with the bench's
    bucket; stopped after."""
    try:
        with running_s3_server(work, BUCKET) as server:
            yield server
    except S3Unavailable as exc:
        raise SystemExit(f"lake: moto's S3 server is not available: {exc}") from exc


# --- the floor ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Wrote(WriterCommitMessage):
    rows: int


class FloorWriter(DataSourceArrowWriter):
    """Each task writes what it got as one parquet file under option ``path`` (any pyarrow
    file system), nothing else: no conversion, no receipt, no commit."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.path = options["path"]

    def write(self, iterator: Iterator[pa.RecordBatch]) -> _Wrote:
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        from runtime.spark.datasource import filesystem

        batches = list(iterator)
        if not batches:
            return _Wrote(0)
        table = pa.Table.from_batches(batches)
        ctx = TaskContext.get()
        part = ctx.partitionId() if ctx is not None else 0
        fs, base = filesystem(self.path)
        with fs.open_output_stream(f"{base}/part-{part:05d}-{uuid.uuid4().hex}.parquet") as out:
            pq.write_table(table, out)
        return _Wrote(table.num_rows)


class FloorParquet(DataSource):
    @classmethod
    def name(cls) -> str:
        return "bench_floor_parquet"

    def writer(self, schema: Any, overwrite: bool) -> FloorWriter:
        return FloorWriter(self.options)


# --- the stream ---------------------------------------------------------------------------------

ROOTS, RATE, ROUND_S = 8, 200.0, 5.0
SIM = [
    *("--sim-seed", "1", "--sim-roots", str(ROOTS)),
    *("--sim-records-per-s", str(RATE), "--sim-round-s", str(ROUND_S)),
    *("--sim-split-p", "0.05", "--sim-move-p", "0.03", "--sim-merge-p", "0.05"),
]


def _params(start: int) -> StreamParams:
    """The stream of :data:`SIM`'s flags."""
    return StreamParams(
        seed=1,
        roots=ROOTS,
        start_ts=start,
        round_us=int(ROUND_S * 1e6),
        split_p=0.05,
        move_p=0.03,
        merge_p=0.05,
        records_per_s=RATE,
    )


def _rfc3339(micros: int) -> str:
    return (EPOCH + dt.timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")


def _window_records(start: int, end: int) -> list[DataChange]:
    return [r for r in StreamModel(_params(start)).expected(end) if r.commit_ts >= start]


def _row_ids(records: list[DataChange]) -> collections.Counter[str]:
    return collections.Counter(
        f"{r.commit_ts}/{r.server_transaction_id}/{r.record_sequence}/{i}"
        for r in records
        for i in range(len(r.mods))
    )


def _floor_tables(records: list[DataChange], max_rows: int) -> list[pa.Table]:
    """Each micro-batch's typed tables (cut at ``max_rows`` rows), in order."""
    from runtime.typed import typed_tables

    out: list[pa.Table] = []
    chunk: list[DataChange] = []
    rows = 0
    for change in records:
        chunk.append(change)
        rows += len(change.mods)
        if rows >= max_rows:
            out += typed_tables([("raw", chunk)]).values()
            chunk, rows = [], 0
    if chunk:
        out += typed_tables([("raw", chunk)]).values()
    return out


def _floor(spark: Any, tables: list[pa.Table], uri: str) -> float:
    t0 = time.monotonic()
    for n, table in enumerate(tables):
        spark.createDataFrame(table).write.format(FloorParquet.name()).mode("append").option(
            "path", f"{uri}/t{n:05d}"
        ).save()
    return time.monotonic() - t0


def _local_floor(spark: Any, tables: list[pa.Table], out: Path) -> float:
    t0 = time.monotonic()
    for n, table in enumerate(tables):
        spark.createDataFrame(table).write.parquet(str(out / f"t{n:05d}"))
    return time.monotonic() - t0


# --- the command line ---------------------------------------------------------------------------


def _env(s3: S3Server) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "AWS_"))}
    env.update(s3.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _cli(s3: S3Server, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "actors.runtime", *args],
            cwd=REPO,
            env=_env(s3),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _args(
    s3: S3Server, prefix: str, start: int, end: int, summary: Path, extra: list[str]
) -> list[str]:
    return [
        *SIM,
        *("--sink", "spark", "--table-format", "delta", "--progress", "off"),
        *("--output-dir", s3.uri(prefix), "--start-at", _rfc3339(start)),
        *("--end-at", _rfc3339(end), "--sim-start-ts", str(start)),
        *("--summary-json", str(summary), *extra),
    ]


def _wait(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        print(f"  the run did not end within {timeout:.0f} s; its log: {log}")
        return -1


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run and everything it started (JVM, broker), as a machine failure would."""
    below = list(tree(proc.pid))
    proc.send_signal(signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _delta_commits(s3: S3Server, prefix: str) -> int:
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/data/")
    return sum(
        1
        for o in listed.get("Contents", [])
        if "/_delta_log/" in o["Key"] and o["Key"].endswith(".json")
    )


def _read_rows(s3: S3Server, prefix: str, tables: tuple[str, ...]) -> collections.Counter[str]:
    from deltalake import DeltaTable

    counts: collections.Counter[str] = collections.Counter()
    options = s3.storage_options()
    for name in tables:
        uri = f"{s3.uri(prefix)}/data/{name}"
        if not DeltaTable.is_deltatable(uri, storage_options=options):
            continue
        data = DeltaTable(uri, storage_options=options).to_pyarrow_table(columns=ID_COLUMNS)
        ts = data.column("_commit_ts").cast(pa.int64()).to_pylist()
        cols = [data.column(c).to_pylist() for c in ID_COLUMNS[1:]]
        counts.update(f"{a}/{b}/{c}/{d}" for a, b, c, d in zip(ts, *cols, strict=True))
    return counts


def _compare(got: collections.Counter[str], expected: collections.Counter[str]) -> tuple[int, int]:
    """(lost, duplicates): rows missing; rows written more than once or never expected."""
    lost = sum(1 for r in expected if r not in got)
    dup = sum(n - 1 for n in got.values() if n > 1) + sum(
        n for r, n in got.items() if r not in expected
    )
    return lost, dup


_LOG_COMMIT = re.compile(r"/_delta_log/\d{20}\.json$")


class _Requests(collections.Counter[str]):
    """S3 requests by kind: ``all``, ``log`` (on a Delta log), ``commits`` (log versions
    written), ``timed_batches`` (the micro-batches of the runs counted)."""

    def add(self, requests: list[S3Request]) -> None:
        for r in requests:
            self["all"] += 1
            if "/_delta_log/" in r.key:
                self["log"] += 1
                if r.method == "PUT" and r.status == 200 and _LOG_COMMIT.search(r.key):
                    self["commits"] += 1

    def per(self, kind: str, of: str) -> float | None:
        return round(self[kind] / self[of], 1) if self[of] else None


class _Tally:
    def __init__(self) -> None:
        self.lost = self.duplicates = self.jobs = self.writes = 0
        self.exited = True
        self.runs = 0
        self.requests = _Requests()


def _run_timed(
    s3: S3Server,
    work: Path,
    name: str,
    window: tuple[int, int],
    expected: collections.Counter[str],
    tables: tuple[str, ...],
    tally: _Tally,
    extra: list[str],
) -> float | None:
    """One bounded run into prefix ``name``: rows/s by its summary (None if it failed)."""
    start, end = window
    summary = work / f"{name}.json"
    log = work / f"{name}.log"
    offset = s3.log_offset()
    t0 = time.monotonic()
    rc = _wait(_cli(s3, _args(s3, name, start, end, summary, extra), log), log, 900)
    wall = time.monotonic() - t0
    tally.runs += 1
    requests = _Requests()
    requests.add(s3.requests(offset))
    lost, dup = _compare(_read_rows(s3, name, tables), expected)
    tally.lost += lost
    tally.duplicates += dup
    if rc != 0 or not summary.exists():
        tally.exited = False
        print(f"  {name}: exit {rc} after {wall:.1f} s; log {log}:\n{log.read_text()[-3000:]}")
        return None
    figures = json.loads(summary.read_text())
    tally.jobs += figures.get("spark_jobs") or 0
    tally.writes += figures.get("spark_writes") or 0
    requests["timed_batches"] = figures.get("spark_writes") or 0
    tally.requests.update(requests)
    busy = figures.get("sink_write_s")
    rows = sum(expected.values())
    rate = rows / busy if busy else None
    print(
        f"  {name}: exit 0 in {wall:.1f} s; rows written {figures.get('rows_written')}, "
        f"{figures.get('spark_writes')} micro-batches, {figures.get('spark_jobs')} Spark jobs, "
        f"first put to last commit {busy or 0:.2f} s ({rate or 0:,.0f} rows/s); "
        f"lost {lost}, duplicates {dup}; S3 requests {requests['all']} "
        f"({requests.per('all', 'timed_batches')} per micro-batch), on the Delta logs "
        f"{requests['log']} ({requests.per('log', 'commits')} per Delta commit, "
        f"{requests['commits']} commits)"
    )
    return rate


def _run_killed(
    s3: S3Server,
    work: Path,
    window: tuple[int, int],
    expected: collections.Counter[str],
    tables: tuple[str, ...],
    tally: _Tally,
    max_rows: int,
) -> int:
    """A run SIGKILLed right after its first Delta commit, then run again to its end: 1 if the
    kill landed mid-run."""
    name = "killed"
    start, end = window
    extra = ["--spark-max-rows", str(max_rows)]
    log = work / f"{name}.log"
    first = _cli(s3, _args(s3, name, start, end, work / f"{name}-1.json", extra), log)
    deadline = time.monotonic() + 600
    while first.poll() is None and _delta_commits(s3, name) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = 0
    if first.poll() is None:
        _kill(first)
        killed = 1
        at_kill = sum(_read_rows(s3, name, tables).values())
        print(f"  {name}: SIGKILLed with {at_kill} of {sum(expected.values())} rows committed")
    else:
        print(f"  {name}: the run ended (exit {first.returncode}) before it could be killed")
    summary = work / f"{name}-2.json"
    rc = _wait(_cli(s3, _args(s3, name, start, end, summary, extra), log), log, 900)
    tally.runs += 1
    lost, dup = _compare(_read_rows(s3, name, tables), expected)
    tally.lost += lost
    tally.duplicates += dup
    if rc != 0:
        tally.exited = False
        print(f"  {name}: the restart exited {rc}; log {log}:\n{log.read_text()[-3000:]}")
    else:
        figures = json.loads(summary.read_text())
        tally.jobs += figures.get("spark_jobs") or 0
        tally.writes += figures.get("spark_writes") or 0
        print(f"  {name}: the restart exited 0; lost {lost}, duplicates {dup}")
    return killed


def _no_credentials(s3: S3Server, work: Path) -> None:
    """No run printed a credential (the logs hold everything the runs wrote)."""
    secrets = (s3.env["AWS_ACCESS_KEY_ID"], s3.env["AWS_SECRET_ACCESS_KEY"])
    for log in work.glob("*.log"):
        text = log.read_text(errors="replace")
        if any(secret in text for secret in secrets):
            raise SystemExit(f"lake: a credential appears in {log}")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench lake", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 45 s window (about 150k rows)")
    parser.add_argument("--seconds", type=float, default=None, help="stream seconds (180)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-rows", type=int, default=100_000, help="rows per micro-batch")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    length = args.seconds or (45.0 if args.quick else 180.0)
    now = (dt.datetime.now(dt.UTC) - EPOCH) // dt.timedelta(microseconds=1)
    start = now - int((length + 30) * 1e6)
    end = start + int(length * 1e6)
    records = _window_records(start, end)
    expected = _row_ids(records)
    tables = tuple(sorted({r.table for r in records}))
    rows = sum(expected.values())
    floor_tables = _floor_tables(records, args.max_rows)
    print(
        f"lake: {len(records)} records, {rows} rows over {len(tables)} tables, micro-batches of "
        f"{args.max_rows} rows, {args.rounds} round(s); shared machine: figures are noisy"
    )
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-lake-"))
    tally = _Tally()
    floor: list[float] = []
    local: list[float] = []
    lake: list[float] = []
    ratios: list[float] = []
    saved = dict(os.environ)
    try:
        with s3_server(work) as s3:
            os.environ.update(s3.env)  # the floor's Spark session and its workers
            os.environ["PYTHONPATH"] = _env(s3)["PYTHONPATH"]
            from runtime.spark.session import start_session, warm

            spark = start_session(
                master="local[2]",
                remote=None,
                app_name="shoal-bench-lake",
                conf={"spark.ui.enabled": "false"},
                local_dir=str(work / "spark-local"),
            )
            spark.sparkContext.setLogLevel("ERROR")
            spark.dataSource.register(FloorParquet)
            warm(spark)
            _floor(spark, floor_tables[:1], s3.uri("warm"))  # the first job pays for workers
            _local_floor(spark, floor_tables[:1], work / "warm")
            for r in range(1, args.rounds + 1):
                print(f" round {r}/{args.rounds}")
                floor_s = _floor(spark, floor_tables, s3.uri(f"floor/r{r}"))
                floor.append(rows / floor_s)
                print(f"  floor (Spark → the store): {floor_s:.2f} s, {floor[-1]:,.0f} rows/s")
                local_s = _local_floor(spark, floor_tables, work / f"local-{r}")
                local.append(rows / local_s)
                shutil.rmtree(work / f"local-{r}", ignore_errors=True)
                print(f"  local floor (Spark's write.parquet): {local_s:.2f} s, {local[-1]:,.0f}")
                rate = _run_timed(
                    s3,
                    work,
                    f"lake-r{r}",
                    (start, end),
                    expected,
                    tables,
                    tally,
                    ["--spark-max-rows", str(args.max_rows)],
                )
                if rate is not None:
                    lake.append(rate)
                    ratios.append(rate / floor[-1])
                    print(f"  floor_ratio {ratios[-1]:.3f}")
            spark.stop()
            killed = _run_killed(
                s3, work, (start, end), expected, tables, tally, max(args.max_rows // 5, 5_000)
            )
            _no_credentials(s3, work)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "scenario": "lake",
                "store": "s3",
                "table_format": "delta",
                "tables": len(tables),
                "rows": rows,
                "records": len(records),
                "spark_jobs_per_batch": round(tally.jobs / tally.writes, 3)
                if tally.writes
                else None,
                "micro_batches": tally.writes,
                "lost": tally.lost,
                "duplicates": tally.duplicates,
                "killed": killed,
                "exited_by_itself": tally.exited,
                "runs": tally.runs,
                "floor_ratio": round(_median(ratios), 3),
                "floor_ratio_per_round": [round(x, 3) for x in ratios],
                "rows_per_s": round(_median(lake)),
                "floor_rows_per_s": round(_median(floor)),
                "local_floor_rows_per_s": round(_median(local)),
                "s3_requests_per_batch": tally.requests.per("all", "timed_batches"),
                "s3_log_requests_per_commit": tally.requests.per("log", "commits"),
                "rounds": args.rounds,
                "max_rows": args.max_rows,
                "quick": args.quick,
            }
        )
    )
    return 0
