"""Delta Lake commits through delta-rs (``deltalake``): data files already written into a
table's directory — by Spark executors or by this process (:func:`write_data_file`) — become
visible as the add actions of **one** Delta transaction per table and micro-batch
(:meth:`DeltaCommitter.commit`).

**One commit, idempotent.** The commit carries the micro-batch's identity as a Delta
*application transaction* (``txn`` action: ``app_id``, ``version``). Before committing, the
table's latest version for ``app_id`` is read from its log (see "Requests per commit"); if it
is at least ``version`` the batch is already in the table and nothing is written, so a commit
retried after a crash — by the same process or by whoever recovers its manifest — adds
nothing twice. Between that read and the commit, delta-rs's conflict checker treats ``app_id``
as read: a concurrent commit of the same ``app_id`` fails ours, the retry reads the table
again and finds the batch.

**app_id and version.** ``app_id`` is ``shoal/<connector>/<writer>`` (:func:`app_id`): a
writer is one committing instance (a random id chosen when it opens, :func:`new_writer_id`),
and ``version`` counts its micro-batches up (1, 2, 3, ...). Versions only need to grow per
``app_id`` (a table a batch does not touch simply skips a number), and several processes
writing the same tables at once never share an ``app_id``. The pair goes into the committer's
manifest at the commit point, so a recovery replays exactly the identity of the first attempt.
The per-table transaction state grows by one entry per writer instance (per process start),
not per batch; to bound even that, tables created here get ``delta.setTransactionRetentionDuration``
(default 30 days) and every ``txn`` carries ``lastUpdated``: an entry of a writer gone for longer
is dropped by readers and checkpoints. A batch retried later than half that retention (a
manifest left behind for weeks) is also looked up in the table's history by its commit metadata
(``shoal.app_id``, ``shoal.txn_version``) before it is committed.

**Creating the table.** The first commit creates the table (``create_table_with_add_actions``:
protocol, metadata, adds and ``txn`` in version 0). Two writers racing to create it: version 0
is written only if absent, the loser finds the table and commits as an append.

**New columns.** delta-rs 1.6 commits external add actions with
``DeltaTable.create_write_transaction``, whose append mode ignores its schema argument (verified:
the new column is silently missing from the table schema afterwards; only the overwrite mode
writes a metadata action, and it removes every file). So a micro-batch whose files have columns
the table lacks first commits the missing columns (``alter.add_columns``: a metadata-only
commit, nullable columns, no data) and then its data. The data commit stays the single
visibility step: a crash between the two leaves a wider schema and no rows (readers see
``null`` for the new columns of older rows in any case), and the retry finds the columns there.
A column whose type differs from the table's is refused (:class:`SchemaConflict`).

**Concurrent writers.** Each commit runs a bounded loop: delta-rs retries a lost race for a log
version itself (appends do not conflict with appends); a real conflict (a concurrent metadata
change, a concurrent commit of the same ``app_id``) or a transient store error makes this loop
read the table again and retry, with jittered backoff, up to ``retries`` times
(:class:`DeltaCommitFailed` after). Safety rests on the log version being written only if
absent: locally delta-rs links a complete temporary file (atomic, no overwrite); on S3 delta-rs
1.6 sends ``If-None-Match: *`` with every commit file (measured against moto's server: the
losing writer gets 412 and retries) — AWS S3 honours it, and so must an S3-compatible store,
which :meth:`DeltaCommitter.check` probes (:meth:`Store.probe_conditional_put`); a store that
ignores it would let two writers overwrite each other's commit. ``AWS_S3_ALLOW_UNSAFE_RENAME``
switches delta-rs to a copy-and-delete log store that is unsafe with several writers:
:meth:`DeltaCommitter.check` refuses it for concurrent writers. On GCS, object_store writes
the commit with a generation precondition (not testable here).

**Requests per commit.** On an object store each request costs milliseconds, and a
micro-batch's commit waits for them. The committer keeps one ``DeltaTable`` per table open
and brings it up to date incrementally (one listing, the new commit files), and keeps each
application's ``txn`` version per table with the table version it holds at: delta-rs 1.6's
``transaction_version`` reads the checkpoint and every commit file since for each call, so
the committer reads only the commit files written after the version it knows (immutable; none
when the one commit since is its own) and asks delta-rs only the first time, or when a file is
gone. A table :meth:`DeltaCommitter.check_schema` has just loaded (or found missing) is not
read again by the commit that follows; a stale snapshot is safe anyway: delta-rs fails a
commit when a commit it did not see carries the same ``app_id``, and the retry reads the table
again. delta-rs's expired-log clean-up, a listing of the whole log after every commit, runs
only with the commits due a checkpoint. Measured on moto's server (three tables, 25
micro-batches): a micro-batch's commits cost 28 requests whatever the log's length (before:
36–57, growing with the commits since the last checkpoint), 103–136 with a checkpoint.

**Checkpoints.** Tables created here get ``delta.checkpointInterval`` 10 (Delta Lake's own
default; delta-rs's is 100), written by delta-rs after the commit that reaches the interval
(about 30 requests a table on moto's server): it keeps a reader's (and a restarted
committer's first) load of the table short. Expired log files (older than
``delta.logRetentionDuration``, default 30 days) are deleted with those commits.

**Statistics.** Every add action carries ``numRecords`` and, where the parquet footer has them,
per-column ``minValues``/``maxValues``/``nullCount`` of top-level numeric, boolean, date,
timestamp (with time zone; minimum floored and maximum ceiled to the millisecond) and string
columns, so readers can skip files (:func:`parquet_stats`).

A killed writer leaves its data files in the table directory, unreferenced by the log: readers
never see them, and ``DeltaTable.vacuum(full=True)`` deletes them once older than its retention
(default 7 days; never set it shorter than the longest time between writing a data file and
committing it, or it deletes the files of a batch about to commit).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Field, Transaction
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import (
    AddAction,
    PostCommitHookProperties,
    RemoveAction,
    create_table_with_add_actions,
)

from protocol.commit import DataFile, delta_app_id
from runtime.lake.store import Store, StoreError
from runtime.ports import Unrecoverable

__all__ = [
    "CommitResult",
    "DataFile",
    "DeltaCommitFailed",
    "DeltaCommitter",
    "SchemaConflict",
    "add_action",
    "app_id",
    "delta_schema",
    "new_writer_id",
    "parquet_stats",
    "write_data_file",
]

log = logging.getLogger("shoal.delta")

DEFAULT_TXN_RETENTION_S: Final = 30 * 86400.0
RETENTION_KEY: Final = "delta.setTransactionRetentionDuration"
CHECKPOINT_KEY: Final = "delta.checkpointInterval"
DEFAULT_CHECKPOINT_INTERVAL: Final = 10
DELTA_RS_CHECKPOINT_INTERVAL: Final = 100  # delta-rs's own default, for tables without the key


class DeltaCommitFailed(RuntimeError):
    """A commit still conflicted (or the store still failed) after the bounded retries; nothing
    of it is visible."""


class SchemaConflict(Unrecoverable):
    """A micro-batch's column has a type that differs from the table's column of that name:
    retrying cannot mend it (the run stops with the message)."""


def add_action(f: DataFile) -> AddAction:
    """The Delta add action of a data file (unpartitioned, a data change)."""
    return AddAction(f.path, f.size, {}, f.modification_time_ms, True, f.stats)


class CommitResult(msgspec.Struct, frozen=True):
    """What :meth:`DeltaCommitter.commit` did to one table."""

    table: str
    # the table version of the data commit; None if nothing was committed (or not looked up:
    # ``find_versions=False``)
    version: int | None
    already: bool  # the batch was in the table already: nothing written
    created: bool  # this commit created the table
    columns_added: tuple[str, ...]  # columns merged into the schema (a metadata commit before)
    attempts: int


app_id = delta_app_id


def new_writer_id() -> str:
    """A fresh writer id (one per committing instance)."""
    return uuid.uuid4().hex[:16]


# --- statistics -------------------------------------------------------------------------------


def _ts_text(value_us: int) -> str:
    when = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC) + _dt.timedelta(microseconds=value_us)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


_UNIT_US: Final = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": None}


def _to_us(raw: int, unit: str, ceil: bool) -> int | None:
    if unit == "ns":
        return -(-raw // 1000) if ceil else raw // 1000
    factor = _UNIT_US.get(unit)
    return None if factor is None else raw * factor


def _stat_value(field_type: Any, stats: Any, which: str) -> Any:
    """The JSON value of a min (``which`` "min") or max of a column chunk, or None to omit."""
    t = field_type
    if pa.types.is_timestamp(t):
        if t.tz is None:
            return None  # timestamp_ntz: not a plain Delta timestamp
        raw = stats.min_raw if which == "min" else stats.max_raw
        us = _to_us(int(raw), t.unit, ceil=which == "max")
        if us is None:
            return None
        ms = us // 1000 if which == "min" else -(-us // 1000)  # floor / ceil to milliseconds
        return _ts_text(ms * 1000)
    value = stats.min if which == "min" else stats.max
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        return value if isinstance(value, bool | int) else None
    if pa.types.is_floating(t):
        return value if isinstance(value, float) and math.isfinite(value) else None
    if pa.types.is_date32(t):
        return value.isoformat() if isinstance(value, _dt.date) else None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return value if isinstance(value, str) else None
    return None


def parquet_stats(metadata: Any, schema: pa.Schema | None = None) -> str:
    """The Delta statistics JSON of a parquet file from its footer (``pyarrow.parquet
    .FileMetaData``): ``numRecords``, and ``minValues``/``maxValues``/``nullCount`` for the
    top-level columns whose every row group has them (see the module docstring)."""
    schema = metadata.schema.to_arrow_schema() if schema is None else schema
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    if metadata.num_row_groups:
        first = metadata.row_group(0)
        for j in range(first.num_columns):
            name = first.column(j).path_in_schema
            if "." in name or schema.get_field_index(name) < 0:
                continue  # nested: no stats
            field_type = schema.field(name).type
            lo: Any = None
            hi: Any = None
            nc: int | None = 0
            usable = True
            for i in range(metadata.num_row_groups):
                st = metadata.row_group(i).column(j).statistics
                if st is None:
                    usable, nc = False, None
                    break
                if nc is not None:
                    nc = nc + st.null_count if st.has_null_count else None
                if not usable:
                    continue
                if not st.has_min_max:
                    if metadata.row_group(i).num_rows > (st.null_count or 0):
                        usable = False  # values without bounds
                    continue
                a = _stat_value(field_type, st, "min")
                b = _stat_value(field_type, st, "max")
                if a is None or b is None:
                    usable = False
                    continue
                lo = a if lo is None or a < lo else lo
                hi = b if hi is None or b > hi else hi
            if usable and lo is not None:
                mins[name], maxs[name] = lo, hi
            if nc is not None:
                nulls[name] = nc
    out: dict[str, Any] = {"numRecords": metadata.num_rows}
    if mins:
        out["minValues"] = mins
        out["maxValues"] = maxs
    if nulls:
        out["nullCount"] = nulls
    return json.dumps(out, separators=(",", ":"))


def write_data_file(
    store: Store,
    table: str,
    data: pa.Table,
    *,
    name: str | None = None,
    compression: str = "snappy",
) -> DataFile:
    """Blocking: write ``data`` as one parquet file into table directory ``table`` of
    ``store`` (``part-<uuid>.parquet`` unless ``name`` is given) and describe it for a commit.
    Not visible to readers until committed."""
    name = name or f"part-{uuid.uuid4().hex}.parquet"
    collector: list[Any] = []
    with store.open_output_stream(f"{table}/{name}") as sink:
        pq.write_table(data, sink, compression=compression, metadata_collector=collector)
        size = sink.tell()
    metadata = collector[0]
    return DataFile(
        path=name,
        size=int(size),
        num_records=int(metadata.num_rows),
        modification_time_ms=int(time.time() * 1000),
        stats=parquet_stats(metadata, data.schema),
    )


# --- the committer ---------------------------------------------------------------------------

_INTERVAL: Final = re.compile(r"^\s*interval\s+(\d+)\s+([a-z]+?)s?\s*$", re.IGNORECASE)
_UNIT_S: Final = {
    "nanosecond": 1e-9,
    "microsecond": 1e-6,
    "millisecond": 1e-3,
    "second": 1.0,
    "minute": 60.0,
    "hour": 3600.0,
    "day": 86400.0,
    "week": 604800.0,
}


def _interval(seconds: float) -> str:
    whole = int(seconds)
    if whole % 86400 == 0:
        return f"interval {whole // 86400} days"
    return f"interval {whole} seconds"


def _parse_interval(text: str | None) -> float | None:
    """Seconds of a Delta interval setting (``interval 30 days``), None if absent or unknown."""
    if not text:
        return None
    m = _INTERVAL.match(text)
    if m is None or m.group(2).lower() not in _UNIT_S:
        return None
    return int(m.group(1)) * _UNIT_S[m.group(2).lower()]


def delta_schema(schema: pa.Schema | DeltaSchema) -> DeltaSchema:
    """``schema`` as a Delta schema with every top-level column nullable (a table's files
    written before a column existed hold nulls in it)."""
    if isinstance(schema, pa.Schema):
        schema = DeltaSchema.from_arrow(pa.schema([f.with_nullable(True) for f in schema]))
    return DeltaSchema(
        [Field(f.name, f.type, nullable=True, metadata=f.metadata) for f in schema.fields]
    )


class _AppTxn(msgspec.Struct, frozen=True):
    """What a committer knows of one application's transactions in one table: as of table
    version ``as_of`` the application's latest ``txn`` version was ``version``; ``own``: this
    committer then committed application version ``own`` in a commit after ``as_of`` (whose
    table version delta-rs does not say)."""

    as_of: int
    version: int | None
    own: int | None = None


_GONE: Final = object()  # a commit file that is not (or no longer) in the log


def _type_json(field: Any) -> str:
    return json.dumps(json.loads(field.to_json())["type"], sort_keys=True)


class DeltaCommitter:
    """Commits data files into the Delta tables under ``store`` (one table per directory
    ``<table>`` below it); see the module docstring. Thread-safe: commits to different tables
    may run in parallel threads; commits to one table are serialized in this process.
    ``find_versions``: look up the table version each commit got (delta-rs does not return it;
    two more requests per commit)."""

    def __init__(
        self,
        store: Store,
        *,
        retries: int = 10,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        txn_retention_s: float | None = DEFAULT_TXN_RETENTION_S,
        checkpoint_interval: int | None = DEFAULT_CHECKPOINT_INTERVAL,
        find_versions: bool = True,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if retries < 1:
            raise ValueError("retries must be at least 1")
        self.store = store
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.txn_retention_s = txn_retention_s
        self.checkpoint_interval = checkpoint_interval
        self.find_versions = find_versions
        self.clock = clock
        self.sleep = sleep
        self._options = store.storage_options()
        self._lock = threading.Lock()
        self._table_locks: dict[str, threading.Lock] = {}
        self._tables: dict[str, DeltaTable] = {}
        # tables whose snapshot was read from the store after this committer last committed to
        # them (check_schema loaded it just now): the next commit needs no update first
        self._fresh: set[str] = set()
        self._absent: set[str] = set()  # tables check_schema found missing (to be created)
        # table -> app -> its txn version (one table's entries are used under its lock)
        self._txns: dict[str, dict[str, _AppTxn]] = {}
        self._rng = random.Random()
        self.conflicts = 0  # commit attempts lost to a concurrent writer or a store error

    def __repr__(self) -> str:
        return f"DeltaCommitter({self.store.describe()})"

    def table_uri(self, table: str) -> str:
        return self.store.uri_for(table)

    # --- checks -----------------------------------------------------------------------------

    def check(self, *, concurrent: bool = True) -> list[str]:
        """Blocking, at start: the store can be written (:meth:`Store.check`), delta-rs reaches
        it with the same endpoint and credentials, and — if several writers may commit to the
        same tables (``concurrent``) — its commits cannot overwrite each other. Raises
        :class:`StoreError` naming the option when the store is unusable or concurrent commits
        would be unsafe; returns warnings (also logged) where safety could not be verified."""
        self.store.check()
        probe = self.table_uri(f"_shoal/probe/{uuid.uuid4().hex}")
        try:
            DeltaTable.is_deltatable(probe, storage_options=self._options)
        except (OSError, DeltaError) as exc:
            raise self.store.error("delta-rs cannot read the store", exc) from None
        warnings: list[str] = []
        if not concurrent:
            return warnings
        where = f"{self.store.option} ({self.store.describe()})"
        if self.store.kind == "s3" and _truthy(
            _env_or(self._options, "AWS_S3_ALLOW_UNSAFE_RENAME")
        ):
            raise StoreError(
                f"{where}: AWS_S3_ALLOW_UNSAFE_RENAME makes delta-rs commit by copy and delete, "
                "which lets concurrent writers overwrite each other's commits; unset it "
                "(delta-rs then writes each commit only if absent)"
            )
        safe = self.store.probe_conditional_put()
        if safe is False:
            raise StoreError(
                f"{where}: the store ignores conditional writes (If-None-Match: *), so two "
                "writers committing to one Delta table at once could overwrite each other's "
                "commit; use a store that honours them (AWS S3 does) or a single writer"
            )
        if safe is None:
            text = (
                f"{where}: whether the store refuses to overwrite a Delta commit could not be "
                + (
                    "checked (install boto3 to probe it); AWS S3 does"
                    if self.store.kind == "s3"
                    else "checked here; GCS does (generation preconditions)"
                )
            )
            log.warning("%s", text)
            warnings.append(text)
        return warnings

    # --- reading ----------------------------------------------------------------------------

    def _table_lock(self, table: str) -> threading.Lock:
        with self._lock:
            return self._table_locks.setdefault(table, threading.Lock())

    def _load(self, table: str) -> DeltaTable | None:
        """The table, brought up to date; None if there is no Delta table there yet."""
        dt = self._tables.get(table)
        if dt is not None:
            if table in self._fresh:
                self._fresh.discard(table)  # read from the store just now
            else:
                dt.update_incremental()
            return dt
        try:
            dt = DeltaTable(self.table_uri(table), storage_options=self._options)
        except TableNotFoundError:
            return None
        self._tables[table] = dt
        return dt

    def _forget(self, table: str) -> None:
        """Drop what this committer knows of ``table``: read it again from the store."""
        self._tables.pop(table, None)
        self._fresh.discard(table)
        self._absent.discard(table)
        self._txns.pop(table, None)

    def committed(self, table: str, app: str) -> int | None:
        """Blocking: the latest version of application ``app`` committed to ``table``."""
        with self._table_lock(table):
            dt = self._load(table)
            return None if dt is None else self._app_version(dt, table, app)

    def _app_version(self, dt: DeltaTable, table: str, app: str) -> int | None:
        """The latest ``txn`` version of ``app`` in ``table`` as of snapshot ``dt``.

        delta-rs's ``transaction_version`` reads the checkpoint and every commit file since it
        for each call. So the answer is kept per (table, app) with the table version it holds
        at, and brought forward by reading only the commit files after that version (immutable;
        none at all when the one commit since is this committer's own, whose ``txn`` it knows);
        delta-rs is asked only the first time, or when a file is gone or the table went back."""
        current = dt.version()
        known = self._txns.get(table, {}).get(app)
        version: int | None
        if (
            known is None
            or known.as_of > current
            or (known.own is not None and known.as_of == current)
        ):
            version = dt.transaction_version(app)
        else:
            version, start = known.version, known.as_of + 1
            if known.own is not None and current == known.as_of + 1:
                version, start = known.own, current + 1  # the one commit since is ours
            for v in range(start, current + 1):
                found = self._txn_in_commit(table, v, app)
                if found is _GONE:
                    version = dt.transaction_version(app)
                    break
                if found is not None:
                    assert isinstance(found, int)
                    version = found
        self._txns.setdefault(table, {})[app] = _AppTxn(current, version)
        return version

    def _txn_in_commit(self, table: str, version: int, app: str) -> object:
        """The ``txn`` version of ``app`` in commit file ``version`` of ``table`` (None if it has
        none, :data:`_GONE` if the file is not there)."""
        data = self.store.read_bytes(f"{table}/_delta_log/{version:020d}.json")
        if data is None:
            return _GONE
        found: int | None = None
        if app.encode() in data:
            for line in data.splitlines():
                if b'"txn"' not in line:
                    continue
                txn = json.loads(line).get("txn")
                if isinstance(txn, dict) and txn.get("appId") == app:
                    found = int(txn["version"])
        return found

    def _in_history(self, dt: DeltaTable, app: str, version: int) -> bool:
        for entry in dt.history():
            if entry.get("shoal.app_id") == app and entry.get("shoal.txn_version") == version:
                return True
        return False

    def _maybe_expired(self, dt: DeltaTable, first_attempt_ms: int | None) -> bool:
        if first_attempt_ms is None:
            return False
        retention = _parse_interval(dt.metadata().configuration.get(RETENTION_KEY))
        if retention is None:
            return False
        return self.clock() * 1000 - first_attempt_ms > retention * 1000 / 2

    # --- committing -------------------------------------------------------------------------

    def commit(
        self,
        table: str,
        files: Sequence[DataFile],
        schema: pa.Schema | DeltaSchema,
        *,
        app: str,
        version: int | None,
        metadata: Mapping[str, str | int | float | bool] | None = None,
        first_attempt_ms: int | None = None,
    ) -> CommitResult:
        """Blocking: make ``files`` (written under ``<table>/``, of columns ``schema``, their
        union) visible in Delta table ``table`` as one commit carrying application transaction
        (``app``, ``version``) and ``metadata`` in its commit info; creates the table if needed
        and first merges new columns into its schema. If ``app`` already committed ``version``
        (or a later one) nothing is written (``already``); ``version=None`` commits without an
        application transaction (not idempotent: a retry adds the files again).
        ``first_attempt_ms``: when this batch first reached its commit point (epoch ms), for
        retries much later than that (see the module docstring). Raises
        :class:`DeltaCommitFailed` after ``retries`` lost attempts, :class:`SchemaConflict`."""
        columns = delta_schema(schema)
        custom: dict[str, Any] = dict(metadata or {})
        custom["shoal.app_id"] = app
        custom["shoal.commit"] = uuid.uuid4().hex  # this call's, to find its version after
        if version is not None:
            custom["shoal.txn_version"] = version
        adds = [add_action(f) for f in files]
        with self._table_lock(table):
            last: BaseException | None = None
            for attempt in range(1, self.retries + 1):
                if attempt > 1:
                    with self._lock:
                        self.conflicts += 1
                    self._backoff(attempt)
                try:
                    result = self._attempt(
                        table, adds, columns, app, version, custom, attempt, first_attempt_ms
                    )
                except (CommitFailedError, OSError) as exc:
                    # a concurrent writer won (metadata change, same app_id) or the store
                    # failed: read the table again and retry
                    log.info("%r: commit to %s lost attempt %d: %s", self, table, attempt, exc)
                    self._forget(table)
                    last = exc
                    continue
                if result is not None:
                    return result
            raise DeltaCommitFailed(
                f"{self!r}: committing {len(files)} files to table {table} failed after "
                f"{self.retries} attempts: {last}"
            ) from last

    def _backoff(self, attempt: int) -> None:
        cap = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 2))
        self.sleep(self._rng.uniform(0, cap))

    def _txn(self, app: str, version: int | None) -> list[Transaction] | None:
        if version is None:
            return None
        return [Transaction(app, version, last_updated=int(self.clock() * 1000))]

    def _attempt(
        self,
        table: str,
        adds: list[AddAction],
        schema: DeltaSchema,
        app: str,
        version: int | None,
        custom: dict[str, Any],
        attempt: int,
        first_attempt_ms: int | None,
    ) -> CommitResult | None:
        """One try; None to try again (a racing creator)."""
        if table in self._absent:
            # check_schema found no table just now: create it (only if absent: a table created
            # meanwhile makes the creation fail, and the next attempt appends)
            self._absent.discard(table)
            return self._create(table, adds, schema, app, version, custom, attempt)
        dt = self._load(table)
        if dt is None:
            return self._create(table, adds, schema, app, version, custom, attempt)
        if self._already(dt, table, app, version, first_attempt_ms):
            return CommitResult(table, None, True, False, (), attempt)
        checked = dt.version()
        added = self._merge_schema(dt, table, schema, custom)
        read_version = dt.version()
        if read_version != checked and self._already(dt, table, app, version, first_attempt_ms):
            # the snapshot moved on (columns added): a recovery may have committed the batch
            # meanwhile, in a commit our commit would not conflict with any more
            return CommitResult(table, None, True, False, added, attempt)
        before = self._txns.get(table, {}).get(app)
        actions: list[AddAction | RemoveAction] = [*adds]
        dt.create_write_transaction(
            actions,
            "append",
            dt.schema(),
            commit_properties=CommitProperties(
                custom_metadata=custom, app_transactions=self._txn(app, version)
            ),
            post_commithook_properties=self._hooks(dt, read_version),
        )
        if version is not None and before is not None and before.as_of == read_version:
            self._txns[table][app] = _AppTxn(read_version, before.version, own=version)
        return CommitResult(
            table,
            (
                self._own_version(table, read_version, custom["shoal.commit"])
                if self.find_versions
                else None
            ),
            False,
            False,
            added,
            attempt,
        )

    def _already(
        self,
        dt: DeltaTable,
        table: str,
        app: str,
        version: int | None,
        first_attempt_ms: int | None,
    ) -> bool:
        """Whether ``app`` committed ``version`` (or a later one) to the table, as of ``dt``."""
        if version is None:
            return False
        done = self._app_version(dt, table, app)
        if (done is not None and done >= version) or (
            done is None
            and self._maybe_expired(dt, first_attempt_ms)
            and self._in_history(dt, app, version)
        ):
            log.info(
                "%r: batch %s/%d is already in table %s: nothing committed",
                self,
                app,
                version,
                table,
            )
            return True
        return False

    def _hooks(self, dt: DeltaTable, read_version: int) -> PostCommitHookProperties:
        """delta-rs's post-commit hooks for a commit read at ``read_version``: the checkpoint
        at the table's interval as always, but the expired-log clean-up (a listing of the whole
        log, every commit) only with the commits likely to write a checkpoint."""
        text = dt.metadata().configuration.get(CHECKPOINT_KEY)
        interval = int(text) if text and text.isdigit() and int(text) > 0 else 0
        interval = interval or DELTA_RS_CHECKPOINT_INTERVAL
        due = (read_version + 1) % interval == 0
        return PostCommitHookProperties(
            create_checkpoint=True, cleanup_expired_logs=None if due else False
        )

    def _own_version(self, table: str, read_version: int, commit_id: str) -> int | None:
        """The version our commit got. delta-rs does not say, and its ``history()`` can label
        commits written after its snapshot with wrong versions, so the commit files after
        ``read_version`` are read (immutable, usually one or two) until ours."""
        version = read_version + 1
        while True:
            data = self.store.read_bytes(f"{table}/_delta_log/{version:020d}.json")
            if data is None:
                return None
            if commit_id.encode() in data:
                for line in data.splitlines():
                    info = json.loads(line).get("commitInfo") if b"commitInfo" in line else None
                    if info is not None and info.get("shoal.commit") == commit_id:
                        return version
            version += 1

    def _create(
        self,
        table: str,
        adds: list[AddAction],
        schema: DeltaSchema,
        app: str,
        version: int | None,
        custom: dict[str, Any],
        attempt: int,
    ) -> CommitResult | None:
        configuration: dict[str, str | None] = {}
        if self.txn_retention_s is not None:
            configuration[RETENTION_KEY] = _interval(self.txn_retention_s)
        if self.checkpoint_interval is not None:
            configuration[CHECKPOINT_KEY] = str(self.checkpoint_interval)
        uri = self.table_uri(table)
        try:
            create_table_with_add_actions(
                uri,
                schema,
                adds,
                mode="error",
                configuration=configuration,
                storage_options=self._options,
                commit_properties=CommitProperties(
                    custom_metadata=custom, app_transactions=self._txn(app, version)
                ),
            )
        except DeltaError as exc:
            if DeltaTable.is_deltatable(uri, storage_options=self._options):
                log.info("%r: table %s was created by another writer meanwhile", self, table)
                return None  # it exists now: commit to it as an append
            raise DeltaCommitFailed(f"{self!r}: creating table {table} failed: {exc}") from exc
        log.info("%r: created table %s", self, table)
        if version is not None:
            # usually version 0; but a writer creating the table at the same moment may have
            # written version 0, and delta-rs then commits ours (protocol, metadata, adds and
            # txn) as the next version
            self._txns.setdefault(table, {})[app] = _AppTxn(-1, None, own=version)
        return CommitResult(
            table,
            self._own_version(table, -1, custom["shoal.commit"]) if self.find_versions else None,
            False,
            True,
            (),
            attempt,
        )

    def _merge_schema(
        self, dt: DeltaTable, table: str, schema: DeltaSchema, custom: dict[str, Any]
    ) -> tuple[str, ...]:
        """Commit the columns of ``schema`` the table lacks (a metadata-only commit). The
        snapshot may be the one check_schema loaded (not brought up to date for the commit):
        before adding columns it is, so a column another writer added meanwhile is not added
        twice."""
        missing = self._missing_columns(dt, table, schema)
        if missing:
            dt.update_incremental()
            missing = self._missing_columns(dt, table, schema)
        if not missing:
            return ()
        names = tuple(f.name for f in missing)
        log.info("%r: adding columns %s to table %s", self, ", ".join(names), table)
        dt.alter.add_columns(
            [Field(f.name, f.type, nullable=True) for f in missing],
            commit_properties=CommitProperties(
                custom_metadata={k: v for k, v in custom.items() if k != "shoal.txn_version"}
            ),
        )
        dt.update_incremental()
        return names

    def _missing_columns(self, dt: DeltaTable, table: str, schema: DeltaSchema) -> list[Any]:
        """The fields of ``schema`` the table lacks; :class:`SchemaConflict` for a column whose
        type differs from the table's."""
        current = {f.name: f for f in dt.schema().fields}
        missing = []
        for f in schema.fields:
            have = current.get(f.name)
            if have is None:
                missing.append(f)
            elif _type_json(have) != _type_json(f):
                raise SchemaConflict(
                    f"{self.store.option} ({self.store.describe()}): Delta table {table}: "
                    f"column {f.name} has type {_type_json(f)} in the new data files but "
                    f"{_type_json(have)} in the table; nothing of the batch was committed. "
                    "Alter the table's column, or write to a new output"
                )
        return missing

    def check_schema(self, table: str, schema: pa.Schema | DeltaSchema) -> None:
        """Blocking: raise :class:`SchemaConflict` now if ``schema`` cannot merge into the
        table (as last seen by this committer; loaded once if never seen), so a batch is
        refused before its commit point rather than after."""
        with self._table_lock(table):
            dt = self._tables.get(table)
            if dt is None:
                dt = self._load(table)
                if dt is None:
                    self._absent.add(table)
                else:
                    self._fresh.add(table)
            if dt is not None:
                self._missing_columns(dt, table, delta_schema(schema))

    def discard(self, table: str, files: Sequence[DataFile]) -> None:
        """Delete data files that were never committed (a batch found already committed, or
        abandoned)."""
        for f in files:
            self.store.delete(f"{table}/{f.path}")


def _env_or(options: Mapping[str, str], name: str) -> str | None:
    return options.get(name) or os.environ.get(name)


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")
