"""``python -m bench mirror``: ``--snapshot --mirror`` end to end on the Cloud Spanner emulator,
three processes, one SIGKILLed in the middle of the snapshot (docs/mirror.md).

Steps:

* The emulator, with two tables of every Spanner type (``Accounts``, keyed by ``(Region, Id)``,
  a composite key; ``Events``, keyed by ``Id``), pre-filled with ``--rows`` rows in all
  (default 100,000; ``--quick`` 20,000), every eleventh row NULL outside its key. The tables
  are filled by batched inserts before the change stream exists (the emulator's commits slow
  down with the rows a commit puts into a stream's internal table: 2,000 rows took ~1 s with a
  stream, ~0.13 s without), then the change stream is created ``FOR ALL`` with
  ``--value-capture`` (default ``OLD_AND_NEW_VALUES``).
* A write load (one thread, ``--rate`` transactions a second): inserts of new keys and of keys
  deleted before, full updates, partial updates (a few columns only) and deletes, each
  transaction one table and one kind, recording each commit's timestamp and keys. It runs
  from before T until 2 s before the end.
* T is a moment just after the load starts (``--start-at``); the end (``--end-at``) is
  ``--seconds`` later. Three processes of ``python -m actors.runtime --snapshot --mirror
  --sink files --table-format delta`` (one task each, the embedded broker, one local output
  directory, snapshot chunks of ``--chunk-rows`` rows) run the bounded run. An observer replays
  the sync topic: once a snapshot partition is owned by a member and has committed chunks while
  the snapshot is not done, its owner's process is SIGKILLed and started again
  ``--restart-after`` seconds later under the same task id.
* Every process must then exit 0 by itself at the end (``exited_by_itself``). The output is
  compared with the database:

  - the changelog's ``SNAPSHOT`` rows (``snapshot_rows``) with a stale read of every table at T
    (``rows_at_t``), key by key; its other rows with the load's commits after T;
    ``lost`` counts rows missing from either, ``duplicates`` rows there more than once or not
    expected at all;
  - ``<table>_delta_commits``: the commits of its changelog and of its mirror table;
  - every mirror table's live rows with a stale read of its table at the final completeness
    watermark (``_shoal/<connector>/completeness.json``), row by row and column by column
    (``mirror_mismatch``: keys missing, extra or with any value different). The control: the
    same comparison with the tables at T (``control_mismatch_at_t``) must find rows that
    differ (the load changed them after T).

Emulator quirks kept out of the data (its change stream, not shoal): it drops the fraction of
TIMESTAMP values in change records, so the load writes whole seconds (the pre-filled rows, read
by the snapshot, keep their fractions); NaN and infinities arrive as null and a NULL array
element crashes it, so neither is written.

Last line: ``{"scenario": "mirror", "rows": .., "snapshot_rows": .., "rows_at_t": ..,
"mirror_mismatch": .., "lost": .., "duplicates": .., "killed": .., "exited_by_itself": ..,
"fill_s": .., "snapshot_s": .., "run_s": .., ...}``. Exit code 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import datetime as dt
import decimal
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

from bench.procs import tree

REPO = Path(__file__).resolve().parent.parent
CONNECTOR = "mirror-bench"
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
D = decimal.Decimal

# every Spanner type, as (column, type); the arrays' element types too
COLUMNS: tuple[tuple[str, str], ...] = (
    ("I", "INT64"),
    ("F", "FLOAT64"),
    ("F32", "FLOAT32"),
    ("N", "NUMERIC"),
    ("S", "STRING"),
    ("J", "JSON"),
    ("B", "BYTES"),
    ("BO", "BOOL"),
    ("D", "DATE"),
    ("T", "TIMESTAMP"),
    ("A_I", "ARRAY<INT64>"),
    ("A_F", "ARRAY<FLOAT64>"),
    ("A_F32", "ARRAY<FLOAT32>"),
    ("A_N", "ARRAY<NUMERIC>"),
    ("A_S", "ARRAY<STRING>"),
    ("A_J", "ARRAY<JSON>"),
    ("A_B", "ARRAY<BYTES>"),
    ("A_BO", "ARRAY<BOOL>"),
    ("A_D", "ARRAY<DATE>"),
    ("A_T", "ARRAY<TIMESTAMP>"),
)
KEYS = {"Accounts": ("Region", "Id"), "Events": ("Id",)}
TABLES = tuple(KEYS)
# the columns a partial update writes (one set per update)
PARTIAL = (("S", "I", "A_I"), ("J", "BO"), ("T", "D", "N"), ("F", "F32", "A_F32", "B"))
FLOATS = (1.0, 0.1, 1e16, 1e-7, -0.0, 1e300, 5e-324, 123456789.0, 3.14159, -2.5)
FILL_BATCH = 2_500  # rows per insert commit (22 columns: 55,000 mutations, under 80,000)


def _ddl_type(spanner: str) -> str:
    return spanner.replace("STRING", "STRING(MAX)").replace("BYTES", "BYTES(MAX)")


def table_ddl(table: str) -> str:
    keys = ", ".join(
        f"{k} {'STRING(MAX)' if k == 'Region' else 'INT64'} NOT NULL" for k in KEYS[table]
    )
    cols = ", ".join(f"{c} {_ddl_type(t)}" for c, t in COLUMNS)
    return f"CREATE TABLE {table} ({keys}, {cols}) PRIMARY KEY ({', '.join(KEYS[table])})"


def key_of(table: str, i: int) -> tuple[Any, ...]:
    """Row ``i``'s primary key: a composite one for Accounts (negative ids too)."""
    if table == "Accounts":
        return (f"r{i % 17}-é", i * 3 - 1_000)
    return (i,)


def _micros(when: dt.datetime) -> int:
    return (when - EPOCH) // dt.timedelta(microseconds=1)


def _at(micros: int) -> dt.datetime:
    return EPOCH + dt.timedelta(microseconds=micros)


def _rfc3339(micros: int) -> str:
    return _at(micros).isoformat().replace("+00:00", "Z")


def values(i: int, v: int, *, whole_seconds: bool) -> dict[str, Any]:
    """Row ``i``'s non-key columns at version ``v`` as the client takes them; every eleventh
    (by ``i + v``) NULL in every column."""
    if (i + v) % 11 == 0:
        return {c: None for c, _ in COLUMNS}
    from google.cloud import spanner_v1

    json_object: Any = spanner_v1.JsonObject
    fraction = 0 if whole_seconds else (i * 37 + 1) % 1_000_000
    when = dt.datetime(2020, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
        seconds=i * 7919 + v, microseconds=fraction
    )
    return {
        "I": (i * 2**33 + v) * (-1 if i % 2 else 1),
        "F": FLOATS[(i + v) % len(FLOATS)] * (i + 1),
        "F32": ((i + v) % 1000) * 0.1,
        "N": D(f"{i}.{(v * 7 + i) % 1000:03d}"),
        "S": f'q"\\\n\u0001/<>&😀 {i} v{v}',
        "J": json_object({"i": i, "v": v, "z": [1.5, None, "x"], "é": True}),
        "B": base64.b64encode(((i * 31 + v) % 2**63).to_bytes(8, "big")),
        "BO": (i + v) % 3 == 0,
        "D": dt.date(1, 1, 1) + dt.timedelta(days=(i * 131 + v) % 3_000_000),
        "T": when,
        "A_I": [i, -v, 2**63 - 1],
        "A_F": [0.5, float(i)],
        "A_F32": [0.25, float(v)],
        "A_N": [D("-0.000000001"), D(i)],
        "A_S": ["", f"s{i}"],
        "A_J": [json_object([1, 2]), json_object({"b": v, "a": "é"})],
        "A_B": [base64.b64encode(b"\x00\xff")] if (i + v) % 2 else [],
        "A_BO": [True, False],
        "A_D": [dt.date(2024, 2, 29)],
        "A_T": [when, when + dt.timedelta(days=1)],
    }


def _insert_rows(table: str, ids: range | list[int], v: int, whole: bool) -> list[list[Any]]:
    out = []
    for i in ids:
        vals = values(i, v, whole_seconds=whole)
        out.append([*key_of(table, i), *(vals[c] for c, _ in COLUMNS)])
    return out


def _all_columns(table: str) -> list[str]:
    return [*KEYS[table], *(c for c, _ in COLUMNS)]


def fill(database: Any, rows: int, capture: str, stream: str) -> dict[str, int]:
    """Creates the tables, inserts ``rows`` rows split over them, then the change stream.
    Returns the rows per table."""
    database.update_ddl([f"DROP CHANGE STREAM {stream}", *map(table_ddl, TABLES)]).result(300)
    per = {TABLES[0]: rows - rows // 2, TABLES[1]: rows // 2}
    for table, n in per.items():
        for lo in range(0, n, FILL_BATCH):
            batch_rows = _insert_rows(table, range(lo, min(n, lo + FILL_BATCH)), 0, False)
            with database.batch() as batch:
                batch.insert(table, _all_columns(table), batch_rows)
    database.update_ddl(
        [f"CREATE CHANGE STREAM {stream} FOR ALL OPTIONS (value_capture_type = '{capture}')"]
    ).result(300)
    return per


# --- the write load -------------------------------------------------------------------------


class Load:
    """The write load: see the module docstring. ``committed`` holds ``(commit_ts, table,
    mod_type, key)`` per written row."""

    def __init__(self, database: Any, per_table: dict[str, int], seed: int) -> None:
        self.database = database
        self.rng = random.Random(seed)
        self.live = {t: list(range(n)) for t, n in per_table.items()}
        self.gone: dict[str, list[int]] = {t: [] for t in per_table}
        self.next_id = dict(per_table)
        self.version = 0
        self.committed: list[tuple[int, str, str, tuple[Any, ...]]] = []
        self.kinds: collections.Counter[str] = collections.Counter()
        self.error: BaseException | None = None

    def _one(self) -> None:
        from google.cloud import spanner_v1

        key_set: Any = spanner_v1.KeySet
        rng = self.rng
        table = rng.choice(TABLES)
        live = self.live[table]
        n = rng.randint(1, 4)
        kind = rng.choice(("insert", "update", "partial", "partial", "delete"))
        if len(live) < n + 10:
            kind = "insert"
        self.version += 1
        v = self.version
        if kind == "insert":
            gone = self.gone[table]
            if gone and rng.random() < 0.3:  # a key deleted before comes back
                ids = [gone.pop(rng.randrange(len(gone)))]
            else:
                ids = list(range(self.next_id[table], self.next_id[table] + n))
                self.next_id[table] += n
        else:
            ids = [live[j] for j in rng.sample(range(len(live)), n)]
        with self.database.batch() as batch:
            if kind == "insert":
                batch.insert(table, _all_columns(table), _insert_rows(table, ids, v, True))
            elif kind == "update":
                batch.update(table, _all_columns(table), _insert_rows(table, ids, v, True))
            elif kind == "partial":
                cols = rng.choice(PARTIAL)
                rows = []
                for i in ids:
                    vals = values(i, v, whole_seconds=True)
                    rows.append([*key_of(table, i), *(vals[c] for c in cols)])
                batch.update(table, [*KEYS[table], *cols], rows)
            else:
                batch.delete(table, key_set(keys=[list(key_of(table, i)) for i in ids]))
        ts = _micros(batch.committed)
        mod_type = {"insert": "INSERT", "delete": "DELETE"}.get(kind, "UPDATE")
        for i in ids:
            self.committed.append((ts, table, mod_type, key_of(table, i)))
        if kind == "insert":
            live.extend(ids)
        elif kind == "delete":
            dropped = set(ids)
            live[:] = [i for i in live if i not in dropped]
            self.gone[table].extend(ids)
        self.kinds[kind] += 1

    def commit(self, n: int) -> None:
        """``n`` transactions, one after another."""
        for _ in range(n):
            self._one()

    def run(self, rate: float, until_us: Callable[[], int | None], stop: threading.Event) -> None:
        """Commits at ``rate`` a second until the wall clock passes ``until_us()`` (once it is
        known) or ``stop`` is set."""
        try:
            interval = 1.0 / rate
            next_at = time.monotonic()
            while not stop.is_set():
                until = until_us()
                if until is not None and time.time_ns() // 1000 >= until:
                    return
                delay = next_at - time.monotonic()
                if delay > 0:
                    stop.wait(delay)
                    continue
                self._one()
                next_at = max(next_at + interval, time.monotonic() - interval)
        except BaseException as exc:
            self.error = exc
            raise


# --- the processes ----------------------------------------------------------------------------


class Proc:
    def __init__(self, task_id: str, args: list[str], logs: Path) -> None:
        self.task_id = task_id
        self.args = args
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.codes: list[int] = []

    def start(self) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        summary = self.logs / f"{self.task_id}.{self.starts}.json"
        with open(self.logs / f"{self.task_id}.{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    *("-m", "actors.runtime", "--task-id", self.task_id),
                    *self.args,
                    *("--summary-json", str(summary)),
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def poll(self) -> int | None:
        """The exit code of the current start, or None while it runs (or before it starts)."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the process and anything it started, as a machine failure would."""
        if self.proc is None:
            return
        below = list(tree(self.proc.pid))
        self.proc.send_signal(signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)

    def log_tail(self, limit: int = 3000) -> str:
        path = self.logs / f"{self.task_id}.{self.starts}.log"
        return path.read_text(errors="replace")[-limit:] if path.exists() else ""


async def observe(bootstrap: str, cim: Any, stop: asyncio.Event) -> None:
    """Replays the connector's sync topic into ``cim`` until ``stop``."""
    from protocol import messages
    from runtime.kafka import KafkaConfig, KafkaSyncLog

    config = KafkaConfig.embedded(bootstrap)
    async with KafkaSyncLog(config, CONNECTOR) as log, aclosing(log.read(0)) as reader:
        reading = asyncio.ensure_future(anext(reader))
        while not stop.is_set():
            done, _ = await asyncio.wait({reading}, timeout=0.3)
            if done:
                offset, payload = reading.result()
                with contextlib.suppress(messages.SyncDecodeError):
                    cim.apply(offset, messages.decode(payload))
                reading = asyncio.ensure_future(anext(reader))
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await reading


def victim(cim: Any) -> tuple[str, str, int] | None:
    """(task, snapshot partition, chunks committed) of a member reading a snapshot partition
    with committed chunks while the snapshot is not done, if any."""
    from protocol.snapshot import is_snapshot

    if cim.snapshot.plan is None or cim.snapshot.complete():
        return None
    for task in cim.members:
        for token, part in cim.view(task).partitions.items():
            if (
                is_snapshot(token)
                and part.status == "owned"
                and part.tail
                and not cim.snapshot.done(token)
            ):
                return task, token, int(part.tail[-1][1]) + 1
    return None


# --- comparing ----------------------------------------------------------------------------------


def _norm(kind: str, value: Any, spanner: bool) -> Any:
    """One value as comparable plain data; ``spanner``: as the client read it, else as the
    mirror holds it (typed, runtime/typed.py)."""
    if value is None:
        return None
    if kind.startswith("ARRAY<"):
        inner = kind[6:-1]
        return tuple(_norm(inner, v, spanner) for v in value)
    if kind == "JSON":
        text = value.serialize() if spanner else value
        return json.dumps(json.loads(text), sort_keys=True)
    if kind == "BYTES":
        return base64.b64decode(value) if spanner else bytes(value)
    if kind == "TIMESTAMP":
        return _micros(value)
    if kind == "NUMERIC":
        return D(value).normalize()
    if kind == "FLOAT64" or kind == "FLOAT32":
        return float(value)
    return value


def spanner_rows(database: Any, table: str, at: int) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """``table`` as Spanner reads it at ``at`` (a stale read at that timestamp), by key."""
    cols = _all_columns(table)
    nkeys = len(KEYS[table])
    kinds = [t for _, t in COLUMNS]
    out: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    with database.snapshot(read_timestamp=_at(at)) as snap:
        for row in snap.execute_sql(f"SELECT {', '.join(cols)} FROM {table}"):
            key = tuple(row[:nkeys])
            out[key] = tuple(_norm(k, v, True) for k, v in zip(kinds, row[nkeys:], strict=True))
    return out


def mirror_rows(data: Path, table: str) -> tuple[dict[tuple[Any, ...], tuple[Any, ...]], int]:
    """The mirror table's live rows by key, and how many rows it has (a key twice counts)."""
    from runtime.lake.mirror import mirror_store, read_mirror
    from runtime.lake.store import open_store

    store = mirror_store(open_store(str(data)))
    got = read_mirror(store, table)
    names = set(got.column_names)
    out: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    n = 0
    for row in got.to_pylist():
        n += 1
        key = tuple(row[k] for k in KEYS[table])
        out[key] = tuple(_norm(t, row[c] if c in names else None, False) for c, t in COLUMNS)
    return out, n


def changelog(data: Path, table: str) -> Iterator[tuple[int, str, tuple[Any, ...]]]:
    """(commit_ts, mod_type, key) of every row of ``table``'s Delta changelog."""
    import pyarrow as pa
    from deltalake import DeltaTable

    uri = str(data / table)
    if not DeltaTable.is_deltatable(uri):
        return
    got = DeltaTable(uri).to_pyarrow_table(columns=["_commit_ts", "_mod_type", *KEYS[table]])
    ts = got.column("_commit_ts").cast(pa.int64()).to_pylist()
    mods = got.column("_mod_type").to_pylist()
    keys = zip(*(got.column(k).to_pylist() for k in KEYS[table]), strict=True)
    yield from zip(ts, mods, keys, strict=True)


def _commits(path: Path) -> int:
    """The commits of the Delta table at ``path`` (its versions)."""
    from deltalake import DeltaTable

    return DeltaTable(str(path)).version() + 1 if DeltaTable.is_deltatable(str(path)) else 0


def compare(
    database: Any, data: Path, read_ts: int, load: Load, end: int, connector: str = CONNECTOR
) -> dict[str, Any]:
    """The checks of the module docstring, of connector ``connector``'s output under
    ``data``."""
    from protocol.commit import completeness_path

    mark_path = data / completeness_path(connector)
    mark = int(json.loads(mark_path.read_text())["low_watermark_us"])
    out: dict[str, Any] = {"final_watermark_us": mark, "mark_minus_end_s": (mark - end) / 1e6}
    lost = duplicates = mismatch = control = rows_at_t = snapshot_rows = stream_rows = 0
    examples: list[str] = []
    expected_stream: collections.Counter[tuple[int, str, str, tuple[Any, ...]]] = (
        collections.Counter((ts, t, m, k) for ts, t, m, k in load.committed if read_ts < ts <= end)
    )
    got_stream: collections.Counter[tuple[int, str, str, tuple[Any, ...]]] = collections.Counter()
    for table in TABLES:
        at_t = spanner_rows(database, table, read_ts)
        rows_at_t += len(at_t)
        snap: collections.Counter[tuple[Any, ...]] = collections.Counter()
        for ts, mod, key in changelog(data, table):
            if mod == "SNAPSHOT":
                snapshot_rows += 1
                snap[key] += 1
                if ts != read_ts:
                    duplicates += 1  # a snapshot row not at T
            else:
                stream_rows += 1
                got_stream[(ts, table, mod, key)] += 1
        expected = collections.Counter(at_t.keys())
        lost += sum((expected - snap).values())
        duplicates += sum((snap - expected).values())
        # the mirror at the final completeness watermark
        want = spanner_rows(database, table, mark)
        have, n = mirror_rows(data, table)
        duplicates += n - len(have)
        for key in want.keys() | have.keys():
            if want.get(key) != have.get(key):
                mismatch += 1
                if len(examples) < 5:
                    examples.append(
                        f"{table} {key}: spanner {want.get(key)} mirror {have.get(key)}"
                    )
        # the control: the same comparison with the table at T (before the load's changes
        # after it) finds rows that differ: the comparison can fail
        control += sum(1 for key in at_t.keys() | have.keys() if at_t.get(key) != have.get(key))
        out[f"{table}_rows_at_mark"] = len(want)
        out[f"{table}_delta_commits"] = [_commits(data / table), _commits(data / "_mirror" / table)]
    lost += sum((expected_stream - got_stream).values())
    duplicates += sum((got_stream - expected_stream).values())
    out.update(
        rows_at_t=rows_at_t,
        snapshot_rows=snapshot_rows,
        stream_rows=stream_rows,
        stream_rows_expected=sum(expected_stream.values()),
        lost=lost,
        duplicates=duplicates,
        mirror_mismatch=mismatch,
        control_mismatch_at_t=control,
        mismatch_examples=examples,
    )
    return out


# --- the run ------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from protocol.cim import Cim
    from runtime.kafka.broker import EmbeddedBroker
    from runtime.spanner.emulator import SpannerEmulator, sync_client

    emulator = SpannerEmulator(tables=())
    await asyncio.to_thread(emulator.start)
    out: dict[str, Any] = {"scenario": "mirror", "rows": args.rows}
    logs = work / "logs"
    logs.mkdir(parents=True)
    data = work / "out" / "data"
    try:
        cfg = emulator.config
        with sync_client(cfg) as client:
            database = client.instance(cfg.instance).database(cfg.database)
            t0 = time.monotonic()
            per_table = await asyncio.to_thread(
                fill, database, args.rows, args.value_capture, cfg.change_stream
            )
            out["fill_s"] = round(time.monotonic() - t0, 1)
            print(f"mirror: filled {per_table} in {out['fill_s']} s")
            load = Load(database, per_table, args.seed)
            stop_load = threading.Event()
            window: dict[str, int] = {}
            loading = asyncio.create_task(
                asyncio.to_thread(load.run, args.rate, lambda: window.get("stop"), stop_load)
            )
            try:
                await asyncio.sleep(2.0)  # commits before T: in the snapshot
                read_ts = time.time_ns() // 1000
                end = read_ts + int(args.seconds * 1e6)
                window["stop"] = end - 2_000_000
                with EmbeddedBroker() as broker:
                    proc_args = [
                        *("--connector", CONNECTOR, "--source", "spanner"),
                        *("--spanner-emulator-host", emulator.host),
                        *("--spanner-project", cfg.project, "--spanner-instance", cfg.instance),
                        *("--spanner-database", cfg.database),
                        *("--spanner-change-stream", cfg.change_stream),
                        *("--sink", "files", "--table-format", "delta"),
                        *("--output-dir", str(work / "out")),
                        *("--snapshot", "--mirror", "--snapshot-chunk-rows", str(args.chunk_rows)),
                        *("--start-at", _rfc3339(read_ts), "--end-at", _rfc3339(end)),
                        *("--kafka-bootstrap-servers", broker.bootstrap),
                        *("--kafka-session-timeout-ms", "4000"),
                        *("--kafka-heartbeat-interval-ms", "500"),
                        *("--progress", "off", "--log-level", "warning"),
                    ]
                    procs = [Proc(f"m{i}", proc_args, logs) for i in range(3)]
                    cim = Cim()
                    stop_observing = asyncio.Event()
                    async with asyncio.TaskGroup() as tg:
                        tg.create_task(observe(broker.bootstrap, cim, stop_observing))
                        try:
                            out.update(await supervise(procs, cim, args))
                        finally:
                            stop_observing.set()
                            for p in procs:
                                if p.poll() is None:
                                    p.kill()
            finally:
                stop_load.set()
                await loading
            out["load"] = dict(load.kinds)
            out["load_rows"] = len(load.committed)
            if load.committed and max(c[0] for c in load.committed) > end:
                raise RuntimeError("the load committed after the end: the comparison is off")
            t0 = time.monotonic()
            out.update(await asyncio.to_thread(compare, database, data, read_ts, load, end))
            out["compare_s"] = round(time.monotonic() - t0, 1)
    finally:
        await asyncio.to_thread(emulator.stop)
    return out


async def supervise(procs: list[Proc], cim: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Starts the processes, kills one mid-snapshot and restarts it, waits for every one to
    exit; the run's figures."""
    out: dict[str, Any] = {"killed": 0, "exited_by_itself": True}
    t0 = time.monotonic()
    for p in procs:
        p.start()
    restart: tuple[float, Proc] | None = None
    deadline = t0 + args.timeout
    while True:
        now = time.monotonic()
        if "snapshot_s" not in out and cim.snapshot.plan is not None and cim.snapshot.complete():
            out["snapshot_s"] = round(now - t0, 1)
            out["snapshot_partitions"] = cim.snapshot.plan.total
        if out["killed"] == 0 and (found := victim(cim)) is not None:
            task, token, chunks = found
            p = next(p for p in procs if p.task_id == task)
            done, total = cim.snapshot.progress()
            p.kill()
            out["killed"] = 1
            out["killed_at_s"] = round(now - t0, 1)
            out["killed_task"] = task
            out["killed_reading"] = token
            out["chunks_committed_at_kill"] = chunks
            out["snapshot_done_at_kill"] = f"{done}/{total}"
            print(f"mirror: SIGKILLed {task} reading {token} ({chunks} chunks committed)")
            restart = (now + args.restart_after, p)
        if restart is not None and now >= restart[0]:
            restart[1].start()
            restart = None
        if restart is None and all(p.poll() is not None for p in procs):
            break
        if now > deadline:
            out["exited_by_itself"] = False
            print(f"mirror: the run did not end within {args.timeout:.0f} s")
            break
        await asyncio.sleep(0.1)
    out["run_s"] = round(time.monotonic() - t0, 1)
    codes = {p.task_id: p.poll() for p in procs}
    out["exit_codes"] = codes
    if any(c != 0 for c in codes.values()):
        out["exited_by_itself"] = False
        for p in procs:
            if p.poll() != 0:
                print(f"mirror: {p.task_id} exited {p.poll()}; its log:\n{p.log_tail()}")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench mirror", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="20,000 rows, a shorter run")
    parser.add_argument("--rows", type=int, default=None, help="rows pre-filled (100,000)")
    parser.add_argument("--chunk-rows", type=int, default=None, help="snapshot chunk rows")
    parser.add_argument("--seconds", type=float, default=None, help="T to the end (90; 60)")
    parser.add_argument("--rate", type=float, default=20.0, help="load transactions a second")
    parser.add_argument("--restart-after", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=1200.0, help="for the whole run")
    parser.add_argument(
        "--value-capture",
        default="OLD_AND_NEW_VALUES",
        choices=("OLD_AND_NEW_VALUES", "NEW_VALUES", "NEW_ROW", "NEW_ROW_AND_OLD_VALUES"),
        help="the change stream's value_capture_type",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    args.rows = args.rows or (20_000 if args.quick else 100_000)
    args.chunk_rows = args.chunk_rows or (500 if args.quick else 2_000)
    args.seconds = args.seconds or (60.0 if args.quick else 90.0)
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-mirror-"))
    try:
        import uvloop

        result = uvloop.run(bench(args, work))
    except Exception as exc:
        print(f"mirror: {type(exc).__name__}: {exc} (work directory kept: {work})", file=sys.stderr)
        return 1
    for key, value in result.items():
        print(f"{key:>28}: {value}")
    ok = (
        result["snapshot_rows"] == result["rows_at_t"]
        and result["mirror_mismatch"] == result["lost"] == result["duplicates"] == 0
        and result["control_mismatch_at_t"] > 0
        and result["killed"] >= 1
        and result["exited_by_itself"]
    )
    result.pop("mismatch_examples", None)
    if result.get("snapshot_s"):
        result["snapshot_rows_per_s"] = round(result["rows_at_t"] / result["snapshot_s"])
    result.update(quick=args.quick, chunk_rows=args.chunk_rows, value_capture=args.value_capture)
    print(json.dumps(result))
    if args.keep or not ok:
        print(f"work directory kept: {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1
