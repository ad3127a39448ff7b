"""A snapshot of the watched tables at one exact read timestamp T, split into partitions that
any task can read (issue 34, "Snapshot, then stream": the Spanner side only).

How it works, and what was checked on the Cloud Spanner emulator:

- :func:`plan_snapshot` opens one ``BatchSnapshot`` at T and asks Spanner for a partitioned
  *read* of every table (``PartitionRead`` over all its columns, whole key set). Each partition
  becomes a :class:`SnapshotPartition`: plain data (msgspec, frozen; ``bytes`` travel as base64
  in JSON) holding the partition token **and** the batch transaction it belongs to (session id,
  transaction id). A partition token is valid only inside that read-only transaction, so another
  process executes it by rebuilding the transaction with ``BatchSnapshot.from_dict`` (session +
  transaction id), which reads at the same T. The planner must therefore *not* close its batch
  snapshot (closing deletes a non-multiplexed session and invalidates every token);
  :func:`release_snapshot` does that once every partition is read. A read after that (or after
  the server dropped the session) fails with "Session not found", raised as
  :class:`SnapshotSessionLost`. On the emulator the planner's session id is ``"0"``.
- The emulator splits every table into exactly 2 partitions whatever ``partition_size_bytes`` /
  ``max_partitions`` say, the first empty and the second holding every row (5,600 and 20,000
  rows tried).
- Reads, not queries: a ``Read`` returns rows in primary-key order (Spanner's default
  ``ORDER_BY_PRIMARY_KEY``), so a partition re-read at the same T yields the same rows in the
  same order and its chunks are the same chunks. A partitioned query has no such promise (it
  cannot have ORDER BY).
- :func:`read_partition` runs one partition with ``lazy_decode`` (raw protobuf values) and
  yields :class:`SnapshotChunk` s of at most ``chunk_rows`` rows. Each chunk carries one
  :class:`SnapshotChange`, shaped field for field like ``protocol.records.DataChange`` (same
  field order, array-like) with ``mod_type`` ``"SNAPSHOT"``, ``commit_ts`` = T, one ``Mod`` per
  row (``keys`` = the primary-key columns, ``new_values`` = the others, ``old_values`` ``{}``),
  ``value_capture_type`` ``"NEW_ROW"`` and the table's ``column_types`` as a change stream's data
  change record gives them. ``protocol.records.ModType`` does not admit ``"SNAPSHOT"`` yet, so
  this is its own Struct until the protocol takes it.
- Identities: ``server_transaction_id`` = ``"snapshot:<table>/<partition index>"``,
  ``record_sequence`` = the chunk number in decimal digits (0, 1, ...), and a row is the chunk's
  mod at its index. With ``commit_ts`` = T, ``(commit_ts, server_transaction_id,
  record_sequence, mod index)`` is unique per row, and stable across re-reads (key order).
- The JSON spelling is the change stream's: compact, keys sorted, non-ASCII kept, INT64 as a
  string, FLOAT64/FLOAT32 as JSON numbers (a FLOAT32 widened to double, e.g.
  ``0.10000000149011612``; the shortest text that reads back, a tie at that length rounded
  away from zero as the emulator's change stream does; NaN and infinities as the strings
  ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, as a read returns them), NUMERIC / DATE /
  TIMESTAMP / BYTES (base64) / JSON as the text a read returns, arrays as JSON arrays, NULL as
  ``null``.
  Emulator 1.5.28 quirks (its change stream, not this code): it drops the fraction of TIMESTAMP
  values in change records (``...09.1234Z`` becomes ``...09Z``; the snapshot keeps the fraction)
  and sends NaN and infinities as ``null``.
- Retention: T must stay readable until the last partition is read. :func:`check_retention`
  reads the database's ``version_retention_period`` (INFORMATION_SCHEMA.DATABASE_OPTIONS; absent
  means Spanner's default, 1 hour) and raises :class:`SnapshotTooOld` when T would leave it; a
  read that fails because T became too old is turned into the same error
  (:func:`classify_read_error`). The emulator ignores ``ALTER DATABASE ... SET OPTIONS
  (version_retention_period = ...)`` (accepted, not listed in DATABASE_OPTIONS) and enforces a
  fixed limit: a read 30 minutes back works, 3 hours back fails with FAILED_PRECONDITION
  "Read-only transaction timestamp ... has exceeded the maximum timestamp staleness" —
  ``PartitionRead`` itself still succeeds there; only the read fails. It keeps schema versions:
  INFORMATION_SCHEMA at a T before a table was created does not list it (and a query of the
  table says "Table not found"), so :func:`plan_snapshot` reports such a table as missing at T.

Blocking (the synchronous client): call from a worker thread in an actor.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import decimal as _decimal
import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import msgspec

from protocol.records import ColumnType, Micros, Mod
from runtime.ports import Unrecoverable

__all__ = [
    "DEFAULT_RETENTION_S",
    "Retention",
    "SnapshotChange",
    "SnapshotChunk",
    "SnapshotPartition",
    "SnapshotSessionLost",
    "SnapshotTooOld",
    "check_retention",
    "classify_read_error",
    "open_partition_snapshot",
    "parse_retention_period",
    "plan_snapshot",
    "read_partition",
    "release_snapshot",
]

DEFAULT_RETENTION_S = 3600  # Spanner's default version_retention_period
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_RETENTION_HINT = (
    "set the database option version_retention_period long enough to cover the whole snapshot "
    "(ALTER DATABASE `<db>` SET OPTIONS (version_retention_period = '7d'); at most 7 days), or "
    "give --start-at a more recent time"
)


class SnapshotTooOld(Unrecoverable):
    """The snapshot's read timestamp T is, or would become, older than Spanner keeps versions:
    the snapshot cannot be completed at T."""


class SnapshotSessionLost(Unrecoverable):
    """The batch transaction a partition belongs to is gone (its session was deleted: released,
    or expired on the server): its token can no longer be read."""


class SnapshotPartition(msgspec.Struct, frozen=True):
    """One partition of one table's snapshot: everything another process needs to read it at T.

    ``session`` / ``transaction_id`` name the batch read-only transaction the ``token`` belongs
    to; ``columns`` are the table's columns in ordinal order, ``keys`` its primary-key columns,
    ``ordinals`` each column's ordinal position (INFORMATION_SCHEMA.COLUMNS)."""

    table: str
    index: int  # this partition's place among its table's partitions (0-based)
    count: int  # how many partitions the table was split into
    read_ts: Micros  # T
    session: str
    transaction_id: bytes
    token: bytes
    columns: tuple[str, ...]
    keys: tuple[str, ...]
    ordinals: tuple[int, ...]

    @property
    def id(self) -> str:
        """``<table>/<index>``: unique within one snapshot (Spanner names hold no ``/``)."""
        return f"{self.table}/{self.index}"


class SnapshotChange(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The rows of one chunk, laid out field for field like ``protocol.records.DataChange``."""

    commit_ts: Micros  # T
    record_sequence: str  # the chunk number, decimal digits
    server_transaction_id: str  # "snapshot:<table>/<partition index>"
    is_last_record_in_transaction_in_partition: bool  # the partition's last chunk
    table: str
    column_types: tuple[ColumnType, ...]
    mods: tuple[Mod, ...]
    mod_type: Literal["SNAPSHOT"] = "SNAPSHOT"
    value_capture_type: str = "NEW_ROW"
    number_of_records_in_transaction: int = 1
    number_of_partitions_in_transaction: int = 1
    transaction_tag: str = ""
    is_system_transaction: bool = False

    @property
    def identity(self) -> tuple[Micros, str, str]:
        return (self.commit_ts, self.server_transaction_id, self.record_sequence)


class SnapshotChunk(msgspec.Struct, frozen=True):
    """One chunk of a partition: commit it once under ``(partition, chunk)``; ``last`` says the
    partition is done with it."""

    partition: str  # SnapshotPartition.id
    chunk: int
    last: bool
    change: SnapshotChange

    @property
    def rows(self) -> int:
        return len(self.change.mods)


class Retention(msgspec.Struct, frozen=True):
    """The database's version retention and until when T stays readable."""

    period_s: int
    readable_until: Micros  # T + period


# -- timestamps ---------------------------------------------------------------------------------
def _micros(when: _dt.datetime) -> Micros:
    return (when - _EPOCH) // _dt.timedelta(microseconds=1)


def _datetime(micros: Micros) -> _dt.datetime:
    return _EPOCH + _dt.timedelta(microseconds=micros)


# -- planning -----------------------------------------------------------------------------------
_COLUMNS_SQL = (
    "SELECT TABLE_NAME, COLUMN_NAME, ORDINAL_POSITION FROM INFORMATION_SCHEMA.COLUMNS "
    "WHERE TABLE_SCHEMA = '' AND TABLE_NAME IN UNNEST(@tables) ORDER BY TABLE_NAME, "
    "ORDINAL_POSITION"
)
_KEYS_SQL = (
    "SELECT TABLE_NAME, COLUMN_NAME FROM INFORMATION_SCHEMA.INDEX_COLUMNS "
    "WHERE TABLE_SCHEMA = '' AND INDEX_TYPE = 'PRIMARY_KEY' AND TABLE_NAME IN UNNEST(@tables) "
    "ORDER BY TABLE_NAME, ORDINAL_POSITION"
)


def _schema(
    batch: Any, tables: Sequence[str]
) -> dict[str, tuple[list[tuple[str, int]], list[str]]]:
    """Columns (name, ordinal) and key columns of each table, read at T inside ``batch``."""
    from google.cloud.spanner_v1 import param_types

    array: Any = param_types.Array
    params = {"tables": list(tables)}
    types = {"tables": array(param_types.STRING)}
    out: dict[str, tuple[list[tuple[str, int]], list[str]]] = {t: ([], []) for t in tables}
    for table, column, ordinal in batch.execute_sql(_COLUMNS_SQL, params, types):
        out[table][0].append((column, int(ordinal)))
    for table, column in batch.execute_sql(_KEYS_SQL, params, types):
        out[table][1].append(column)
    return out


def plan_snapshot(
    database: Any,
    tables: Sequence[str],
    read_ts: Micros,
    *,
    partition_size_bytes: int | None = None,
    max_partitions: int | None = None,
) -> list[SnapshotPartition]:
    """Split every table of ``tables`` into partitions readable at ``read_ts`` (T, microseconds).

    ``database`` is a ``google.cloud.spanner_v1.Database``. The batch transaction stays open
    (see the module docstring); :func:`release_snapshot` ends it. A table that does not exist at
    T raises :class:`Unrecoverable` naming it."""
    from google.api_core import exceptions as gexc
    from google.cloud import spanner_v1

    key_set: Any = spanner_v1.KeySet
    batch = database.batch_snapshot(read_timestamp=_datetime(read_ts))
    try:
        schema = _schema(batch, tables)
        state = batch.to_dict()
        plan: list[SnapshotPartition] = []
        for table in tables:
            columns, keys = schema[table]
            if not columns:
                raise Unrecoverable(
                    f"snapshot: table {table!r} does not exist at the snapshot's read timestamp "
                    f"{_datetime(read_ts).isoformat()} (check --tables / --exclude-tables)"
                )
            names = [name for name, _ in columns]
            tokens = [
                b["partition"]
                for b in batch.generate_read_batches(
                    table,
                    names,
                    key_set(all_=True),
                    partition_size_bytes=partition_size_bytes,
                    max_partitions=max_partitions,
                )
            ]
            plan.extend(
                SnapshotPartition(
                    table=table,
                    index=i,
                    count=len(tokens),
                    read_ts=read_ts,
                    session=str(state["session_id"]),
                    transaction_id=bytes(state["transaction_id"]),
                    token=bytes(token),
                    columns=tuple(names),
                    keys=tuple(keys),
                    ordinals=tuple(o for _, o in columns),
                )
                for i, token in enumerate(tokens)
            )
    except gexc.GoogleAPICallError as exc:
        too_old = classify_read_error(exc, read_ts)
        if too_old is not None:
            raise too_old from exc
        raise
    return plan


def open_partition_snapshot(database: Any, item: SnapshotPartition) -> Any:
    """The batch transaction ``item`` belongs to, rebuilt in this process (no RPC)."""
    from google.cloud.spanner_v1.database import BatchSnapshot

    from_dict: Any = BatchSnapshot.from_dict
    return from_dict(database, {"session_id": item.session, "transaction_id": item.transaction_id})


def release_snapshot(database: Any, item: SnapshotPartition) -> None:
    """End the batch transaction of a snapshot once every partition is read (deletes its session
    unless it is multiplexed). Every token of that snapshot is invalid afterwards."""
    from google.api_core import exceptions as gexc
    from google.cloud.spanner_v1.session import Session

    session_cls: Any = Session
    session = session_cls(database=database)
    session._session_id = item.session
    # already gone (a multiplexed session, or released before): nothing to end
    with contextlib.suppress(gexc.NotFound):
        session.delete()


# -- reading ------------------------------------------------------------------------------------
def _type_json(type_pb: Any) -> str:
    """A result column's type as the change stream spells ``column_types[].type``."""
    from google.protobuf import json_format

    as_dict = json_format.MessageToDict(type_pb, preserving_proto_field_name=True)
    return json.dumps(as_dict, separators=(",", ":"), sort_keys=True)


def _columns(item: SnapshotPartition, fields: Sequence[Any]) -> tuple[ColumnType, ...]:
    from google.cloud.spanner_v1 import Type

    if [f.name for f in fields] != list(item.columns):
        raise ValueError(
            f"snapshot {item.id}: read returned columns {[f.name for f in fields]}, "
            f"planned {list(item.columns)}"
        )
    keys = set(item.keys)
    types: list[ColumnType] = []
    for field, ordinal in zip(fields, item.ordinals, strict=True):
        raw = field.type_ if hasattr(field, "type_") else field.type
        pb = Type.pb(raw) if isinstance(raw, Type) else raw  # the client gives raw protobuf
        types.append(ColumnType(field.name, _type_json(pb), field.name in keys, ordinal))
    return tuple(types)


def _float_text(x: float) -> str:
    """A double as the change stream spells it: the shortest text that reads back as ``x``
    (Python's ``repr``), except that when ``x`` lies exactly half-way between two texts of that
    length, the tie goes away from zero (``repr`` takes the even digit). FLOAT32 values widened
    to double hit such ties often: the emulator's change stream spells ``128.10000610351563``
    and ``515.2000122070313`` where ``repr`` gives ``128.10000610351562`` and
    ``515.2000122070312`` (either text reads back as the same double)."""
    text = repr(x)
    mantissa, _, _ = text.partition("e")
    n = len(mantissa.lstrip("-").replace(".", "").lstrip("0"))
    if n < 15:  # both texts of a tie read back as x only when 10**(1-n) <= 2**-52 (an ulp)
        return text
    exact = _decimal.Decimal(x).as_tuple().digits
    if len(exact) <= n or exact[n] != 5 or any(exact[n + 1 :]) or exact[n - 1] % 2:
        return text
    # a tie that repr rounded down to an even digit: round it up instead (no carry: even < 9)
    i = len(mantissa) - 1
    return text[:i] + str(int(text[i]) + 1) + text[i + 1 :]


_encode_str: Callable[[str], str] = (
    json.encoder.encode_basestring
)  # json.dumps(s, ensure_ascii=False)


def _spell(value: Any) -> str:
    """A raw protobuf ``Value`` as the change stream's JSON text: a ``string_value`` (INT64,
    NUMERIC, DATE, TIMESTAMP, BYTES, JSON, a float's NaN / Infinity) as a JSON string, a
    ``number_value`` by :func:`_float_text`, lists element by element."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return _encode_str(value.string_value)
    if kind == "null_value" or kind is None:
        return "null"
    if kind == "number_value":
        return _float_text(value.number_value)
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind == "list_value":
        return "[" + ",".join([_spell(v) for v in value.list_value.values]) + "]"
    raise ValueError(f"snapshot: unexpected value kind {kind!r}")


def read_partition(
    database: Any, item: SnapshotPartition, chunk_rows: int
) -> Iterator[SnapshotChunk]:
    """Read ``item`` at its T and yield its rows in chunks of at most ``chunk_rows`` (the last
    chunk has ``last`` set; an empty partition yields one empty last chunk, so its completion
    commits like any other chunk). A read refused because T is too old raises
    :class:`SnapshotTooOld`."""
    from google.api_core import exceptions as gexc
    from google.cloud import spanner_v1

    key_set: Any = spanner_v1.KeySet
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    batch = open_partition_snapshot(database, item)
    snapshot = batch._get_snapshot()  # the read below needs lazy_decode, which
    # BatchSnapshot.process_read_batch does not pass on (google-cloud-spanner 3.71)
    txn = f"snapshot:{item.id}"
    try:
        result = snapshot.read(
            table=item.table,
            columns=list(item.columns),
            keyset=key_set(all_=True),
            partition=item.token,
            lazy_decode=True,
        )
        column_types: tuple[ColumnType, ...] = ()
        # the JSON objects' members in name order, each with its '"name":' prefix
        by_name = sorted(range(len(item.columns)), key=lambda i: item.columns[i])
        prefixes = [_encode_str(name) + ":" for name in item.columns]
        key_at = [(i, prefixes[i]) for i in by_name if item.columns[i] in item.keys]
        value_at = [(i, prefixes[i]) for i in by_name if item.columns[i] not in item.keys]
        mods: list[Mod] = []
        chunk = 0
        pending: SnapshotChange | None = None  # held back one chunk to know which is last
        for row in result:
            if not column_types:
                column_types = _columns(item, result.fields)
            keys_text = "{" + ",".join([p + _spell(row[i]) for i, p in key_at]) + "}"
            values_text = "{" + ",".join([p + _spell(row[i]) for i, p in value_at]) + "}"
            mods.append(Mod(keys_text, values_text, "{}"))
            if len(mods) == chunk_rows:
                if pending is not None:
                    yield SnapshotChunk(item.id, chunk - 1, False, pending)
                pending = SnapshotChange(
                    item.read_ts, str(chunk), txn, False, item.table, column_types, tuple(mods)
                )
                chunk += 1
                mods = []
        if not column_types and result.fields:
            column_types = _columns(item, result.fields)
        if mods or pending is None:
            if pending is not None:
                yield SnapshotChunk(item.id, chunk - 1, False, pending)
            last = SnapshotChange(
                item.read_ts, str(chunk), txn, True, item.table, column_types, tuple(mods)
            )
            yield SnapshotChunk(item.id, chunk, True, last)
        else:
            done = msgspec.structs.replace(pending, is_last_record_in_transaction_in_partition=True)
            yield SnapshotChunk(item.id, chunk - 1, True, done)
    except gexc.GoogleAPICallError as exc:
        too_old = classify_read_error(exc, item.read_ts)
        if too_old is not None:
            raise too_old from exc
        if isinstance(exc, gexc.NotFound) and "session not found" in str(exc).lower():
            raise SnapshotSessionLost(
                f"snapshot partition {item.id}: the batch transaction it belongs to (session "
                f"{item.session!r}) no longer exists ({str(exc).strip()[:300]}); its partitions "
                "cannot be read any more: the snapshot has to be planned again"
            ) from exc
        raise


# -- retention ----------------------------------------------------------------------------------
_PERIOD = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_retention_period(text: str) -> int:
    """``version_retention_period`` text (``"1h"``, ``"7d"``, ``"90m"``, ``"3600s"``) as
    seconds."""
    match = _PERIOD.match(text)
    if match is None:
        raise ValueError(f"version_retention_period {text!r} is not <number><s|m|h|d>")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def check_retention(
    database: Any, read_ts: Micros, now: Micros, *, needed_s: float = 0.0
) -> Retention:
    """The database's version retention, checked against T: raise :class:`SnapshotTooOld` when
    T is already older than the retention, or would be within ``needed_s`` seconds (the time the
    caller expects the snapshot to take). ``now`` is passed in (microseconds)."""
    with database.snapshot() as snap:
        rows = list(
            snap.execute_sql(
                "SELECT OPTION_VALUE FROM INFORMATION_SCHEMA.DATABASE_OPTIONS "
                "WHERE OPTION_NAME = 'version_retention_period'"
            )
        )
    period_s = parse_retention_period(str(rows[0][0])) if rows else DEFAULT_RETENTION_S
    retention = Retention(period_s, read_ts + period_s * 1_000_000)
    age_s = (now - read_ts) / 1e6
    if now + needed_s * 1e6 >= retention.readable_until:
        raise SnapshotTooOld(
            f"snapshot: the read timestamp T={_datetime(read_ts).isoformat()} is {age_s:.0f} s "
            f"old and the database keeps old versions for version_retention_period="
            f"{period_s} s; with {needed_s:.0f} s more for the snapshot, T would not stay "
            f"readable: {_RETENTION_HINT}"
        )
    return retention


_TOO_OLD = (
    "exceeded the maximum timestamp staleness",  # the emulator
    "too old",
    "version_retention_period",
    "older than the version gc",
)


def classify_read_error(exc: BaseException, read_ts: Micros) -> SnapshotTooOld | None:
    """The clear error for a Spanner error that says T is no longer readable, else ``None``."""
    from google.api_core import exceptions as gexc

    if not isinstance(exc, gexc.FailedPrecondition):
        return None
    text = str(exc)
    if not any(marker in text.lower() for marker in _TOO_OLD):
        return None
    return SnapshotTooOld(
        f"snapshot: Spanner can no longer read at T={_datetime(read_ts).isoformat()} "
        f"({text.strip()}): {_RETENTION_HINT}"
    )
