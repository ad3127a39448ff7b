"""Current-state tables in Delta Lake: one **mirror table** per Spanner table, holding the
newest row per primary key, merged from change records one micro-batch at a time. The rules
of the merge are :mod:`protocol.mirror`'s; this module reads the rows a batch touches, runs
:func:`protocol.mirror.merge_changes` and writes its plan as one idempotent Delta commit.

**Where.** The mirror of table ``T`` is the Delta table ``<root>/T`` of the store it is given;
the output's mirror root is ``<output>/_mirror`` (:data:`MIRROR_DIR`, :func:`mirror_store`).
Spanner table names start with a letter, so ``_mirror`` never collides with a changelog
table's directory.

**Columns.** In this order:

* ``_mirror_key`` (string): the row's primary key as the core names it — the JSON text of its
  (column, value) pairs sorted by column, values as Spanner's JSON spells them. It is the merge
  key and comes first so that every data file has min/max statistics on it (Delta collects
  them for the first 32 columns).
* the key columns, then the other columns, typed like the typed changelog
  (:func:`runtime.typed.arrow_type`; a column added to the Spanner table is added to the
  mirror's schema by the merge that first sees it),
* ``_deleted`` (bool): the row does not exist; it is a **tombstone**, kept so that an older
  change arriving later cannot resurrect it. Readers select ``WHERE NOT _deleted``.
* ``_commit_ts`` (timestamp): the commit timestamp of the row's newest change.
* ``_mirror_state`` (string, JSON): the rest of the core's :class:`~protocol.mirror.MirrorRow`
  — its version, base, whether the base is a delete, and the versions of the columns written
  after the base — so that the merge round-trips rows exactly.

A row's values are stored only in the typed columns: a live row with a base holds every
column (a null one is null), a row without a base or with a deleted base holds exactly the
columns its state lists (the others are unknown and read as null).

**One batch** (:meth:`MirrorWriter.apply_batch`): the records' mods become the core's changes
with their values converted to the column types; the rows of exactly the keys the batch
touches are read (see *Cost*); the core merges; and the rows it changed (live rows and
tombstones) are written by one ``DeltaTable.merge`` keyed on ``_mirror_key`` (update when
matched, insert when not), sorted by key, carrying the batch's identity as a Delta application
transaction (``app_id``, ``version``) and ``shoal.app_id`` / ``shoal.txn_version`` in its
commit info. Before it the table's ``transaction_version(app_id)`` is read: a batch already
committed writes nothing, so a batch applied again after a crash changes nothing (and, since the
core is idempotent, a batch applied again under a *new* identity changes no row either). A batch
that changes no row still commits its identity (an empty commit).

**Cost.** The rows a batch touches are read from only the data files whose statistics can hold
one of its keys: the add actions' min/max of ``_mirror_key`` and, when the first key column is
INT64 or STRING and never null in the batch, of that column (for an INT64 key the text order of
``_mirror_key`` is not the numbers' order, so the typed column is what keeps an ascending key
range in few files). The merge's join also bounds that column to the batch's range, so delta-rs
rewrites only the files that can match. Both grow with the batch when its keys are clustered
(ascending ids, one partition's key range) and approach the whole table when a batch's keys
are spread over all of it: Delta's copy-on-write rewrites every file holding a changed row.
Measured (``python -m bench mirrormerge``, local disk, a shared and busy 2-core machine, two
runs): batches of 10,000 updated rows (clustered: plus 1,000 new keys) merge at 5,000–15,000
rows/s into tables of 10,000 and of 200,000 rows alike when the keys are clustered (a batch
reads 2 of 22–23 files and delta-rs copies 10,000 untouched rows), and at 3,000–11,000 rows/s
into 200,000 rows when they are spread (every file read, 190,000 rows copied). Most of a
clustered batch's time is Python (reading the touched rows into :class:`MirrorRow` s, the
core's merge, converting values), not delta-rs (about 0.15 s of 1.2 s).

**Creating the table.** The first batch creates it with its rows (``write_deltalake``) as
version 0 or not at all (no commit retries): left to retry, delta-rs 1.6 committed a creator that
lost the race as version 1, next to the winner's rows, duplicating keys (measured). The loser
then merges into the winner's table.

**Concurrent writers.** Several processes may merge batches of different partitions into one
mirror table. Every commit also carries the application transaction :data:`SERIAL_APP`, and
delta-rs's conflict checker fails a commit when a concurrent one wrote an application id it
writes: so two merges that overlap in time conflict whatever rows they touch (delta-rs 1.6 also
fails such merges on its own — measured for two merges inserting the same new key — the shared
id makes correctness not depend on how it scopes a merge's reads). The loser reads the table
again — the touched rows included, so the core merges into the newest state — and retries, with
jittered backoff, up to ``retries`` times (:class:`~runtime.lake.delta.DeltaCommitFailed` after).
Merges into one table are thereby serialized: one commits at a time.

Mirror tables are written only through this module: it reads their data files itself, so a
table another engine gave deletion vectors or column mapping would be read wrong. Compacting
them (``OPTIMIZE``) is fine: a merge that overlaps it conflicts and retries. Garbage collection
of tombstones (:func:`protocol.mirror.collect`) is not run here yet: tombstones stay.
"""

from __future__ import annotations

import bisect
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple
from urllib.parse import unquote

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from protocol.mirror import (
    Key,
    MirrorChange,
    MirrorError,
    MirrorRow,
    RowId,
    Version,
    merge_changes,
    mirror_changes,
)
from protocol.records import DataChange
from runtime.lake.delta import (
    CHECKPOINT_KEY,
    DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_TXN_RETENTION_S,
    RETENTION_KEY,
    DeltaCommitFailed,
    SchemaConflict,
)
from runtime.lake.store import Store
from runtime.typed import TypedError, arrow_type, arrow_value, table_columns

__all__ = [
    "BOOKKEEPING",
    "KEY_COLUMN",
    "MIRROR_DIR",
    "MirrorResult",
    "MirrorWriter",
    "apply_batch",
    "mirror_store",
    "read_mirror",
]

log = logging.getLogger("shoal.mirror")

MIRROR_DIR: Final = "_mirror"
KEY_COLUMN: Final = "_mirror_key"
DELETED: Final = "_deleted"
COMMIT_TS: Final = "_commit_ts"
STATE: Final = "_mirror_state"
BOOKKEEPING: Final = (KEY_COLUMN, DELETED, COMMIT_TS, STATE)
"""The mirror's own columns (a reader drops them, after ``WHERE NOT _deleted``)."""

_TS: Final = pa.timestamp("us", tz="UTC")
SERIAL_APP: Final = "shoal/mirror/serial"
"""The application id every mirror commit writes, to make concurrent merges conflict."""


def mirror_store(output: Store) -> Store:
    """The root of the mirror tables of an output store."""
    return output.child(MIRROR_DIR)


class MirrorResult(msgspec.Struct, frozen=True):
    """What :meth:`MirrorWriter.apply_batch` did to one mirror table."""

    table: str
    already: bool  # the batch's identity was in the table: nothing written
    mods: int  # mods in the batch
    stale: int  # mods that changed nothing
    upserts: int  # live rows written
    tombstones: int  # tombstones written
    rows_read: int  # current rows read (the touched keys the table held)
    files_read: int  # data files read to find them
    files_total: int  # data files in the table
    columns_added: tuple[str, ...]
    attempts: int
    created: bool


class _State(msgspec.Struct, frozen=True, array_like=True):
    """The bookkeeping of a :class:`MirrorRow` that is not in the typed columns."""

    version: Version
    base: Version | None
    deleted: bool
    columns: dict[str, Version]


_state_encoder = msgspec.json.Encoder()
_state_decoder = msgspec.json.Decoder(_State)
_key_decoder = msgspec.json.Decoder(list[tuple[str, str | int | float | bool | None]])


def key_text(key: Key) -> str:
    """The ``_mirror_key`` of a row key."""
    return _state_encoder.encode(key).decode()


def _int_type(t: pa.DataType) -> pa.DataType:
    """``t`` with timestamps as int64 (microseconds): the form values are merged in."""
    if pa.types.is_timestamp(t):
        return pa.int64()
    if pa.types.is_list(t):
        return pa.list_(_int_type(t.value_type))
    return t


def _array(values: list[Any], t: pa.DataType, name: str) -> pa.Array:
    try:
        inner = _int_type(t)
        if inner != t:  # timestamps as int microseconds: a cast is far faster
            return pa.array(values, inner).cast(t)
        return pa.array(values, t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise TypedError(f"column {name}: values do not fit {t}: {exc}") from exc


def read_mirror(store: Store, table: str, *, tombstones: bool = False) -> pa.Table:
    """The rows of mirror table ``table`` under ``store`` as a reader sees them: the rows that
    exist (with ``tombstones``, the tombstones too), without the bookkeeping columns (with
    ``tombstones``: with them)."""
    dt = DeltaTable(store.uri_for(table), storage_options=store.storage_options())
    data = pa.table(dt.to_pyarrow_table())
    if tombstones:
        return data
    data = data.filter(pc.invert(data.column(DELETED)))
    return data.drop_columns([c for c in BOOKKEEPING if c in data.column_names])


class MirrorWriter:
    """Merges micro-batches into the mirror tables under ``store`` (one Delta table per
    directory ``<table>``); see the module docstring. Thread-safe; batches of one table are
    serialized in this process."""

    def __init__(
        self,
        store: Store,
        *,
        retries: int = 10,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        checkpoint_interval: int | None = DEFAULT_CHECKPOINT_INTERVAL,
        serialize: bool = True,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if retries < 1:
            raise ValueError("retries must be at least 1")
        self.store = store
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.checkpoint_interval = checkpoint_interval
        self.serialize = serialize
        self.clock = clock
        self.sleep = sleep
        self._options = store.storage_options()
        self._lock = threading.Lock()
        self._table_locks: dict[str, threading.Lock] = {}
        self._rng = random.Random()
        self.conflicts = 0  # attempts lost to a concurrent writer or a store error

    def __repr__(self) -> str:
        return f"MirrorWriter({self.store.describe()})"

    def table_uri(self, table: str) -> str:
        return self.store.uri_for(table)

    def _table_lock(self, table: str) -> threading.Lock:
        with self._lock:
            return self._table_locks.setdefault(table, threading.Lock())

    def _load(self, table: str) -> DeltaTable | None:
        try:
            return DeltaTable(self.table_uri(table), storage_options=self._options)
        except TableNotFoundError:
            return None

    # --- reading the touched rows --------------------------------------------------------------

    def current(
        self,
        dt: DeltaTable,
        table: str,
        keys: Sequence[str],
        ranges: Sequence[KeyRange] = (),
    ) -> tuple[dict[RowId, MirrorRow], int, int]:
        """The rows of ``keys`` (``_mirror_key`` texts) that mirror table ``dt`` holds, with the
        number of data files read and in the table. Only the files whose statistics can hold
        one of them are read: by ``_mirror_key``, and by each of ``ranges`` (a key column's
        batch values)."""
        features = set(dt.protocol().reader_features or ())
        if features & {"deletionVectors", "columnMapping"}:
            raise MirrorError(
                f"{self!r}: mirror table {table} uses {sorted(features)}, which this writer "
                "does not read; mirror tables must be written only by shoal"
            )
        wanted = sorted(set(keys))
        actions = pa.table(dt.get_add_actions(flatten=True))
        paths = actions.column("path").to_pylist()
        keep = [True] * len(paths)
        for column, sought in ((KEY_COLUMN, wanted), *((r.column, r.values) for r in ranges)):
            names = actions.column_names
            lo_name, hi_name = f"min.{column}", f"max.{column}"
            if lo_name not in names or hi_name not in names:
                continue
            los = actions.column(lo_name).to_pylist()
            his = actions.column(hi_name).to_pylist()
            for j, (lo, hi) in enumerate(zip(los, his, strict=True)):
                if keep[j] and lo is not None and hi is not None:
                    keep[j] = _may_hold(sought, lo, hi)
        files = [p for p, k in zip(paths, keep, strict=True) if k]
        schema = _table_schema(dt)
        rows: dict[RowId, MirrorRow] = {}
        if not files or not wanted:
            return rows, len(files), len(paths)
        dataset = pads.dataset(
            [self.store.path(f"{table}/{unquote(p)}") for p in files],
            schema=schema,
            format="parquet",
            filesystem=self.store.fs,
        )
        # filtered after reading: delta-rs's files keep string views in their Arrow schema,
        # which pyarrow's row-group statistics pruning cannot compare with a string
        found = dataset.to_table()
        found = found.filter(pc.is_in(found.column(KEY_COLUMN), pa.array(wanted, pa.string())))
        texts = found.column(KEY_COLUMN).to_pylist()
        parsed: list[Key] = [tuple((k, v) for k, v in _key_decoder.decode(t)) for t in texts]
        key_names = {name for key in parsed[:1] for name, _ in key}
        value_names = [n for n in found.column_names if n not in BOOKKEEPING and n not in key_names]
        value_lists = {
            n: found.column(n).cast(_int_type(found.schema.field(n).type)).to_pylist()
            for n in value_names
        }
        for i, (key, state_text) in enumerate(
            zip(parsed, found.column(STATE).to_pylist(), strict=True)
        ):
            state = _state_decoder.decode(state_text)
            if state.base is None or state.deleted:
                values = {n: value_lists[n][i] for n in state.columns}
            else:
                values = {n: value_lists[n][i] for n in value_names}
            rows[(table, key)] = MirrorRow(
                table, key, values, state.version, state.base, state.deleted, state.columns
            )
        return rows, len(files), len(paths)

    # --- one batch -----------------------------------------------------------------------------

    def apply_batch(
        self,
        table: str,
        records: Iterable[DataChange],
        *,
        app: str,
        version: int,
        metadata: Mapping[str, str | int | float | bool] | None = None,
    ) -> MirrorResult:
        """Blocking: merge the change records of ``records`` (all of table ``table``) into its
        mirror table as one Delta commit carrying application transaction (``app``,
        ``version``), the batch's identity. If ``app`` already committed ``version`` (or a later
        one) nothing is written (``already``). Raises :class:`MirrorError` for a record the
        mirror cannot place, :class:`~runtime.lake.delta.SchemaConflict` for a column whose type
        differs from the table's, :class:`~runtime.lake.delta.DeltaCommitFailed` after
        ``retries`` lost attempts."""
        records = list(records)
        for r in records:
            if r.table != table:
                raise MirrorError(f"a record of table {r.table!r} in a batch of table {table!r}")
        spanner_types = _column_types(table, records)
        changes = _typed_changes(mirror_changes(records), spanner_types)
        keys = [key_text(c.key) for c in changes]
        ranges = _key_ranges(changes, spanner_types)
        batch_fields = _batch_fields(spanner_types)
        custom: dict[str, Any] = dict(metadata or {})
        custom["shoal.app_id"] = app
        custom["shoal.txn_version"] = version
        custom["shoal.commit"] = uuid.uuid4().hex
        with self._table_lock(table):
            last: BaseException | None = None
            for attempt in range(1, self.retries + 1):
                if attempt > 1:
                    with self._lock:
                        self.conflicts += 1
                    self._backoff(attempt)
                try:
                    return self._attempt(
                        table, changes, keys, ranges, batch_fields, spanner_types, app, version,
                        custom, attempt,
                    )  # fmt: skip
                except (CommitFailedError, OSError) as exc:
                    log.info("%r: merge into %s lost attempt %d: %s", self, table, attempt, exc)
                    last = exc
                except DeltaError as exc:
                    if not _retryable(exc):
                        raise
                    log.info("%r: merge into %s lost attempt %d: %s", self, table, attempt, exc)
                    last = exc
            raise DeltaCommitFailed(
                f"{self!r}: merging batch {app}/{version} into mirror table {table} failed after "
                f"{self.retries} attempts: {last}"
            ) from last

    def _backoff(self, attempt: int) -> None:
        cap = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 2))
        self.sleep(self._rng.uniform(0, cap))

    def _attempt(
        self,
        table: str,
        changes: list[MirrorChange],
        keys: list[str],
        ranges: list[KeyRange],
        batch_fields: list[pa.Field],
        spanner_types: Mapping[str, tuple[str, bool]],
        app: str,
        version: int,
        custom: dict[str, Any],
        attempt: int,
    ) -> MirrorResult:
        dt = self._load(table)
        now_ms = int(self.clock() * 1000)
        # every commit also writes the table's shared application id, which delta-rs's conflict
        # checker treats as read: two merges that overlap in time conflict, whatever rows they
        # touch, and the loser reads the table again (see the module docstring)
        serial = 0 if dt is None else dt.version() + 1
        txn = [Transaction(app, version, last_updated=now_ms)]
        if self.serialize:
            txn.append(Transaction(SERIAL_APP, serial, last_updated=now_ms))
        props = CommitProperties(custom_metadata=custom, app_transactions=txn)
        if dt is not None:
            done = dt.transaction_version(app)
            if done is not None and done >= version:
                log.info("%r: batch %s/%d is already in mirror table %s", self, app, version, table)
                return MirrorResult(table, True, len(changes), 0, 0, 0, 0, 0, 0, (), attempt, False)
            schema = _table_schema(dt)
            current, files_read, files_total = self.current(dt, table, keys, ranges)
        else:
            schema = pa.schema([])
            current, files_read, files_total = {}, 0, 0
        plan = merge_changes(current, changes)
        target, added = _target_schema(table, schema, batch_fields)
        upserts = sum(1 for r in plan.rows if r.exists)
        result = MirrorResult(
            table, False, plan.mods, plan.stale, upserts, len(plan.rows) - upserts, len(current),
            files_read, files_total, added, attempt, dt is None,
        )  # fmt: skip
        source = _source(plan.rows, target, spanner_types)
        if dt is None:
            # as the changelog's tables (runtime.lake.delta): a writer's txn entry is dropped
            # 30 days after its last commit, so the per-writer entries stay bounded
            configuration: dict[str, str | None] = {
                RETENTION_KEY: f"interval {int(DEFAULT_TXN_RETENTION_S) // 86400} days"
            }
            if self.checkpoint_interval is not None:
                configuration[CHECKPOINT_KEY] = str(self.checkpoint_interval)
            try:
                write_deltalake(
                    self.table_uri(table),
                    source,
                    mode="error",
                    configuration=configuration,
                    storage_options=self._options,
                    # version 0 or nothing: left to retry, delta-rs would commit a creator that
                    # lost the race as version 1, next to the winner's rows (measured)
                    commit_properties=CommitProperties(
                        custom_metadata=custom, app_transactions=txn, max_commit_retries=0
                    ),
                )
            except DeltaError as exc:
                if DeltaTable.is_deltatable(self.table_uri(table), storage_options=self._options):
                    raise CommitFailedError(f"table {table} was created meanwhile") from exc
                raise
            log.info("%r: created mirror table %s", self, table)
            return result
        if source.num_rows == 0:
            # nothing changed: still commit the identity, so a retry finds the batch done
            dt.create_write_transaction([], "append", dt.schema(), commit_properties=props)
            return result
        (
            dt.merge(
                source,
                predicate=_merge_predicate(ranges),
                source_alias="s",
                target_alias="t",
                merge_schema=bool(added),
                commit_properties=props,
            )
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )
        if added:
            log.info("%r: added columns %s to mirror table %s", self, ", ".join(added), table)
        return result


def apply_batch(
    store: Store,
    table: str,
    records: Iterable[DataChange],
    *,
    app: str,
    version: int,
    metadata: Mapping[str, str | int | float | bool] | None = None,
) -> MirrorResult:
    """:meth:`MirrorWriter.apply_batch` with a writer of its own."""
    return MirrorWriter(store).apply_batch(
        table, records, app=app, version=version, metadata=metadata
    )


def _merge_predicate(ranges: Sequence[KeyRange]) -> str:
    """The merge's join: equal ``_mirror_key``; and, so that delta-rs skips the files that
    cannot match, the first key column within the batch's range (every row that matches a
    source row has the source row's key, so this excludes none)."""
    parts = [f"t.{KEY_COLUMN} = s.{KEY_COLUMN}"]
    for r in ranges:
        column = '"' + r.column.replace('"', '""') + '"'
        parts.append(f"t.{column} >= {r.literal(r.values[0])}")
        parts.append(f"t.{column} <= {r.literal(r.values[-1])}")
    return " AND ".join(parts)


class KeyRange(NamedTuple):
    """The batch's values of one key column (sorted, none null), to skip files by."""

    column: str
    values: list[Any]
    literal: Callable[[Any], str]  # a value as a SQL literal


def _may_hold(values: Sequence[Any], lo: Any, hi: Any) -> bool:
    """Whether a file whose column lies in ``[lo, hi]`` may hold one of ``values`` (sorted)."""
    try:
        i = bisect.bisect_left(values, lo)
        if i == len(values):
            return False
        # Delta cuts string statistics short (32 characters): a max that long may be a prefix
        # of the true max, so only the lower bound is trusted
        return bool((isinstance(hi, str) and len(hi) >= 32) or values[i] <= hi)
    except TypeError:
        return True  # statistics of another type than expected: cannot skip


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _key_ranges(
    changes: Sequence[MirrorChange], types: Mapping[str, tuple[str, bool]]
) -> list[KeyRange]:
    """For the first key column, if it is INT64 or STRING and never null in the batch: its
    values, to skip files whose statistics cannot hold them (Delta keeps min/max per file)."""
    keys = [(n, t) for n, (t, key) in types.items() if key]
    if not keys or not changes:
        return []
    name, type_json = keys[0]
    code = arrow_type(type_json)
    if code == pa.int64():
        literal: Callable[[Any], str] = str
    elif code == pa.string():
        literal = _sql_string
    else:
        return []
    values = set()
    for c in changes:
        value = dict(c.key).get(name)
        if value is None:
            return []
        values.add(arrow_value(type_json, value))
    return [KeyRange(name, sorted(values), literal)]


def _retryable(exc: DeltaError) -> bool:
    text = str(exc).lower()
    return "conflict" in text or "concurrent" in text or ("version" in text and "exists" in text)


def _column_types(table: str, records: Sequence[DataChange]) -> dict[str, tuple[str, bool]]:
    """Per column of the batch's records: (Spanner type JSON, is primary key)."""
    columns = table_columns(records)
    if records and not any(key for _, _, key in columns):
        raise MirrorError(
            f"table {table!r}: the records carry no column types with a primary key, so the "
            "mirror's key columns are unknown"
        )
    return {name: (t, key) for name, t, key in columns}


def _typed_changes(
    changes: list[MirrorChange], types: Mapping[str, tuple[str, bool]]
) -> list[MirrorChange]:
    """``changes`` (fresh from :func:`mirror_changes`, held by nobody else) with their values
    converted to the mirror's column types (timestamps as int microseconds), in place."""
    type_of = {name: t for name, (t, _) in types.items()}
    for c in changes:
        values = c.values
        for name, value in values.items():
            t = type_of.get(name)
            if t is None:
                raise MirrorError(
                    f"table {c.table!r}: column {name!r} has a value but no column type"
                )
            if value is not None:
                values[name] = arrow_value(t, value)
    return changes


def _batch_fields(types: Mapping[str, tuple[str, bool]]) -> list[pa.Field]:
    return [
        pa.field(name, arrow_type(t), metadata={"shoal.key": "true"} if key else None)
        for name, (t, key) in types.items()
    ]


def _target_schema(
    table: str, schema: pa.Schema, batch_fields: list[pa.Field]
) -> tuple[pa.Schema, tuple[str, ...]]:
    """The schema the merge writes: the table's, with the batch's new columns; and those."""
    if len(schema) == 0:
        keys = [f for f in batch_fields if f.metadata]
        values = [f for f in batch_fields if not f.metadata]
        fields = [
            pa.field(KEY_COLUMN, pa.string()),
            *keys,
            *values,
            pa.field(DELETED, pa.bool_()),
            pa.field(COMMIT_TS, _TS),
            pa.field(STATE, pa.string()),
        ]
        return pa.schema(fields), ()
    out = list(schema)
    added = []
    for f in batch_fields:
        i = schema.get_field_index(f.name)
        if i < 0:
            out.append(f)
            added.append(f.name)
        elif schema.field(i).type != f.type:
            raise SchemaConflict(
                f"mirror table {table}: column {f.name} has type {f.type} in the batch but "
                f"{schema.field(i).type} in the table; nothing of the batch was merged"
            )
    return pa.schema(out), tuple(added)


def _plain(t: pa.DataType) -> pa.DataType:
    """``t`` in the Arrow types the mirror writes (delta-rs hands a table's schema back with
    string and binary views and large lists)."""
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list(t) or pa.types.is_list_view(t):
        return pa.list_(_plain(t.value_type))
    return t


def _table_schema(dt: DeltaTable) -> pa.Schema:
    """The table's schema in the Arrow types the mirror writes."""
    schema = pa.schema(dt.schema().to_arrow())
    return pa.schema([pa.field(f.name, _plain(f.type)) for f in schema])


def _source(
    rows: Sequence[MirrorRow], target: pa.Schema, types: Mapping[str, tuple[str, bool]]
) -> pa.Table:
    """The plan's rows as the merge's source, in ``target``'s columns, sorted by key."""
    texts = [key_text(r.key) for r in rows]
    order = sorted(range(len(rows)), key=texts.__getitem__)
    rows = [rows[i] for i in order]
    texts = [texts[i] for i in order]
    arrays: list[pa.Array] = []
    keyed: dict[str, list[Any]] = {}
    for r in rows:
        for name, value in r.key:
            keyed.setdefault(name, []).append(value)
    for f in target:
        name = f.name
        if name == KEY_COLUMN:
            arrays.append(pa.array(texts, pa.string()))
        elif name == DELETED:
            arrays.append(pa.array([not r.exists for r in rows], pa.bool_()))
        elif name == COMMIT_TS:
            arrays.append(pa.array([r.version.commit_ts for r in rows], pa.int64()).cast(_TS))
        elif name == STATE:
            arrays.append(
                pa.array(
                    [
                        _state_encoder.encode(
                            _State(r.version, r.base, r.deleted, r.columns)
                        ).decode()
                        for r in rows
                    ],
                    pa.string(),
                )
            )
        elif name in keyed:
            t = types.get(name)
            if t is None:
                raise MirrorError(f"key column {name!r} has no column type in the batch")
            values = [arrow_value(t[0], v) for v in keyed[name]]
            arrays.append(_array(values, f.type, name))
        else:
            arrays.append(_array([r.values.get(name) for r in rows], f.type, name))
    return pa.Table.from_arrays(arrays, schema=target)
