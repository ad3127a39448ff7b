"""Fast decoding of change-stream rows into ``protocol.records``.

The change-stream query returns one column, ``ChangeRecord ARRAY<STRUCT<data_change_record
ARRAY<STRUCT<...>>, heartbeat_record ARRAY<STRUCT<timestamp>>, child_partitions_record
ARRAY<STRUCT<...>>>>``. The client's default decoding turns every STRUCT into a list, every
timestamp into a ``DatetimeWithNanoseconds`` and parses every JSON field; that costs more than
the network. Here the query runs with ``lazy_decode=True`` and the raw protobuf ``Value`` trees are
walked once, straight into msgspec records:

- field positions are resolved by *name* from the result-set metadata once per result set (a
  ``RecordLayout``), so a server that adds fields or reorders them still decodes correctly;
- timestamps (RFC 3339 text, always UTC ``Z``) become int microseconds with a per-second cache;
- JSON fields stay JSON text (``protocol.records`` keeps them as text);
- ``column_types`` repeat for every record of a table, so their decoded tuples are interned by
  their serialized bytes.

PostgreSQL-dialect databases (:class:`PgRecordDecoder`) read their change stream with
``spanner."read_json_<stream>"($1, $2, $3, $4, null)``, whose one column (JSON, annotated
``PG_JSONB``) holds each record as a JSON object with one of the keys ``data_change_record``,
``heartbeat_record``, ``child_partitions_record``: the same fields as the GoogleSQL STRUCTs, but
nested JSON instead of JSON text (``keys``, ``new_values``, ``old_values``, a column's ``type``),
numbers instead of INT64 strings, and timestamps ending in ``+00:00``. One msgspec decode per row
into typed structs does the parsing in C; the nested JSON parts are taken as raw slices of the
row's text (``msgspec.Raw``), not parsed and re-encoded, so ``keys`` / ``new_values`` /
``old_values`` become the same JSON text the GoogleSQL form carries (the server sends compact JSON
with sorted keys). The result is the same ``protocol.records`` types, so nothing downstream knows
the dialect.

Pure and synchronous: no I/O, no clock.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Iterable, Sequence
from json import dumps as _json_dumps
from typing import Any, cast

import msgspec

from protocol.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitions,
    ColumnType,
    DataChange,
    Heartbeat,
    Mod,
    ModType,
)
from runtime.timestamps import DecodeError, parse_timestamp

__all__ = [
    "DecodeError",
    "PgRecordDecoder",
    "RecordLayout",
    "count_default_decoded",
    "parse_timestamp",
    "records_from_default_row",
]

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_MOD_TYPES: dict[str, ModType] = {"INSERT": "INSERT", "UPDATE": "UPDATE", "DELETE": "DELETE"}


def _struct_fields(type_pb: Any) -> list[tuple[str, Any]]:
    """(name, type) of the STRUCT fields of an ``ARRAY<STRUCT<...>>`` type (raw protobuf)."""
    element = type_pb.array_element_type
    return [(f.name, _type_of(f)) for f in element.struct_type.fields]


def _type_of(field: Any) -> Any:
    """A ``StructType.Field``'s type: proto-plus generates the raw message with ``type_``."""
    return field.type_ if hasattr(field, "type_") else field.type


def _positions(type_pb: Any, names: Sequence[str], what: str) -> dict[str, int]:
    fields = _struct_fields(type_pb)
    index = {name: i for i, (name, _) in enumerate(fields)}
    missing = [n for n in names if n not in index]
    if missing:
        raise DecodeError(f"{what} lacks fields {missing}; has {[n for n, _ in fields]}")
    return index


def _child_type(type_pb: Any, name: str) -> Any:
    for field_name, field_type in _struct_fields(type_pb):
        if field_name == name:
            return field_type
    raise DecodeError(f"no field {name!r}")


_DATA_FIELDS = (
    "commit_timestamp",
    "record_sequence",
    "server_transaction_id",
    "is_last_record_in_transaction_in_partition",
    "table_name",
    "column_types",
    "mods",
    "mod_type",
    "value_capture_type",
    "number_of_records_in_transaction",
    "number_of_partitions_in_transaction",
    "transaction_tag",
    "is_system_transaction",
)


class RecordLayout:
    """Field positions of one change-stream result set, and the decoder built on them.

    Build it from the raw protobuf ``Type`` of the ``ChangeRecord`` column (``from_type``) or from
    the ``ResultSetMetadata`` fields the client exposes (``from_fields``)."""

    def __init__(self, change_record_type: Any) -> None:
        top = _positions(
            change_record_type,
            ("data_change_record", "heartbeat_record", "child_partitions_record"),
            "ChangeRecord",
        )
        self._i_data = top["data_change_record"]
        self._i_hb = top["heartbeat_record"]
        self._i_child = top["child_partitions_record"]
        data_t = _child_type(change_record_type, "data_change_record")
        hb_t = _child_type(change_record_type, "heartbeat_record")
        child_t = _child_type(change_record_type, "child_partitions_record")
        self._data = _positions(data_t, _DATA_FIELDS, "data_change_record")
        col = _positions(
            _child_type(data_t, "column_types"),
            ("name", "type", "is_primary_key", "ordinal_position"),
            "column_types",
        )
        self._col = (col["name"], col["type"], col["is_primary_key"], col["ordinal_position"])
        mod = _positions(_child_type(data_t, "mods"), ("keys", "new_values", "old_values"), "mods")
        self._mod = (mod["keys"], mod["new_values"], mod["old_values"])
        self._hb_ts = _positions(hb_t, ("timestamp",), "heartbeat_record")["timestamp"]
        cp = _positions(
            child_t, ("start_timestamp", "record_sequence", "child_partitions"), "child_partitions"
        )
        self._cp = (cp["start_timestamp"], cp["record_sequence"], cp["child_partitions"])
        kid = _positions(
            _child_type(child_t, "child_partitions"),
            ("token", "parent_partition_tokens"),
            "child_partitions",
        )
        self._kid = (kid["token"], kid["parent_partition_tokens"])
        self._columns_cache: dict[bytes, tuple[ColumnType, ...]] = {}
        self.decode_values = self._build_decoder()

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def column_type(fields: Sequence[Any]) -> Any:
        """The raw protobuf ``Type`` of the single ``ChangeRecord`` column of
        ``StreamedResultSet.fields`` (proto-plus or raw ``StructType.Field`` objects)."""
        if len(fields) != 1:
            raise DecodeError(f"expected one ChangeRecord column, got {len(fields)}")
        field = fields[0]
        to_pb = getattr(type(field), "pb", None)
        return _type_of(to_pb(field) if to_pb is not None else field)

    @classmethod
    def from_fields(cls, fields: Sequence[Any]) -> RecordLayout:
        """From ``StreamedResultSet.fields``."""
        return cls(cls.column_type(fields))

    # -- decoding -----------------------------------------------------------------------------
    def _columns(self, value: Any) -> tuple[ColumnType, ...]:
        key: bytes = value.SerializeToString()
        cached = self._columns_cache.get(key)
        if cached is not None:
            return cached
        i_name, i_type, i_pk, i_ord = self._col
        out = []
        for c in value.list_value.values:
            f = c.list_value.values
            ordinal = f[i_ord].string_value
            out.append(
                ColumnType(
                    f[i_name].string_value,
                    f[i_type].string_value,
                    f[i_pk].bool_value,
                    int(ordinal) if ordinal else 0,
                )
            )
        result = tuple(out)
        if len(self._columns_cache) >= 4096:
            self._columns_cache.clear()
        self._columns_cache[key] = result
        return result

    def _build_decoder(self) -> Callable[[Iterable[Any], list[ChangeRecord]], int]:
        """A closure with every position bound to a local: the hot loop of the reader."""
        i_data, i_hb, i_child = self._i_data, self._i_hb, self._i_child
        d = self._data
        d_ts, d_seq, d_txn = d["commit_timestamp"], d["record_sequence"], d["server_transaction_id"]
        d_last, d_table = d["is_last_record_in_transaction_in_partition"], d["table_name"]
        d_cols, d_mods, d_type = d["column_types"], d["mods"], d["mod_type"]
        d_vct, d_nrec = d["value_capture_type"], d["number_of_records_in_transaction"]
        d_npart, d_tag = d["number_of_partitions_in_transaction"], d["transaction_tag"]
        d_sys = d["is_system_transaction"]
        m_keys, m_new, m_old = self._mod
        hb_ts = self._hb_ts
        cp_ts, cp_seq, cp_kids = self._cp
        k_token, k_parents = self._kid
        columns = self._columns
        ts = parse_timestamp
        mod_types = _MOD_TYPES
        data_change, heartbeat, mod_cls = DataChange, Heartbeat, Mod

        def decode_values(values: Iterable[Any], out: list[ChangeRecord]) -> int:
            """Decode ``ChangeRecord`` column values (raw protobuf ``Value``, one per row) and
            append the records to ``out``; return how many were appended."""
            n0 = len(out)
            append = out.append
            last_ts_text = ""
            last_ts = 0
            for value in values:
                for rec in value.list_value.values:
                    parts = rec.list_value.values
                    for dv in parts[i_data].list_value.values:
                        f = dv.list_value.values
                        ts_text = f[d_ts].string_value
                        if ts_text != last_ts_text:  # records of one transaction share it
                            last_ts = ts(ts_text)
                            last_ts_text = ts_text
                        mod_values = f[d_mods].list_value.values
                        if len(mod_values) == 1:  # the common case: no list-comprehension frames
                            mf = mod_values[0].list_value.values
                            mods: tuple[Mod, ...] = (
                                mod_cls(
                                    mf[m_keys].string_value,
                                    mf[m_new].string_value or "{}",
                                    mf[m_old].string_value or "{}",
                                ),
                            )
                        else:
                            mods = tuple(
                                [
                                    mod_cls(
                                        mf[m_keys].string_value,
                                        mf[m_new].string_value or "{}",
                                        mf[m_old].string_value or "{}",
                                    )
                                    for mf in [m.list_value.values for m in mod_values]
                                ]
                            )
                        mod_type = f[d_type].string_value
                        nrec = f[d_nrec].string_value
                        npart = f[d_npart].string_value
                        append(
                            data_change(
                                last_ts,
                                f[d_seq].string_value,
                                f[d_txn].string_value,
                                f[d_last].bool_value,
                                f[d_table].string_value,
                                columns(f[d_cols]),
                                mods,
                                mod_types.get(mod_type) or _bad_mod_type(mod_type),
                                f[d_vct].string_value,
                                int(nrec) if nrec else 1,
                                int(npart) if npart else 1,
                                f[d_tag].string_value,
                                f[d_sys].bool_value,
                            )
                        )
                    hbs = parts[i_hb].list_value.values
                    if hbs:
                        for hv in hbs:
                            append(heartbeat(ts(hv.list_value.values[hb_ts].string_value)))
                    kids_records = parts[i_child].list_value.values
                    if kids_records:
                        for cv in kids_records:
                            cf = cv.list_value.values
                            kids = tuple(
                                [
                                    ChildPartition(
                                        kf[k_token].string_value,
                                        tuple(
                                            [
                                                p.string_value
                                                for p in kf[k_parents].list_value.values
                                            ]
                                        ),
                                    )
                                    for kf in [
                                        k.list_value.values for k in cf[cp_kids].list_value.values
                                    ]
                                ]
                            )
                            append(
                                ChildPartitions(
                                    ts(cf[cp_ts].string_value), cf[cp_seq].string_value, kids
                                )
                            )
            return len(out) - n0

        return decode_values


# -- PostgreSQL dialect ------------------------------------------------------------------------
class _PgColumn(msgspec.Struct):
    name: str
    type: msgspec.Raw
    is_primary_key: bool = False
    ordinal_position: int = 0


_EMPTY_OBJECT = msgspec.Raw(b"{}")


class _PgMod(msgspec.Struct):
    keys: msgspec.Raw
    new_values: msgspec.Raw = _EMPTY_OBJECT  # a JSON null arrives as Raw(b"null")
    old_values: msgspec.Raw = _EMPTY_OBJECT


class _PgData(msgspec.Struct):
    commit_timestamp: str
    record_sequence: str
    server_transaction_id: str
    table_name: str
    column_types: msgspec.Raw
    mods: list[_PgMod]
    mod_type: str
    is_last_record_in_transaction_in_partition: bool = False
    value_capture_type: str = ""
    number_of_records_in_transaction: int = 1
    number_of_partitions_in_transaction: int = 1
    transaction_tag: str | None = None
    is_system_transaction: bool = False


class _PgHeartbeat(msgspec.Struct):
    timestamp: str


class _PgChild(msgspec.Struct):
    token: str
    parent_partition_tokens: list[str] = []


class _PgChildren(msgspec.Struct):
    start_timestamp: str
    record_sequence: str
    child_partitions: list[_PgChild]


class _PgRow(msgspec.Struct):
    data_change_record: _PgData | None = None
    heartbeat_record: _PgHeartbeat | None = None
    child_partitions_record: _PgChildren | None = None


_pg_row = msgspec.json.Decoder(_PgRow)
_pg_columns = msgspec.json.Decoder(list[_PgColumn])
_json_any = msgspec.json.Decoder()
_sorted_json = msgspec.json.Encoder(order="sorted")


def _raw_text(raw: msgspec.Raw) -> str:
    text = bytes(raw).decode()
    return "{}" if text == "null" else text


class PgRecordDecoder:
    """Decoder of PostgreSQL-dialect change-stream rows (``spanner."read_json_<stream>"``) into
    ``protocol.records`` — the counterpart of :class:`RecordLayout`, with the same
    ``decode_values(values, out)``: ``values`` are the rows' raw protobuf ``Value``s, each a
    ``string_value`` holding one JSON record."""

    def __init__(self) -> None:
        self._columns_cache: dict[bytes, tuple[ColumnType, ...]] = {}

    def _columns(self, raw: msgspec.Raw) -> tuple[ColumnType, ...]:
        key = bytes(raw)
        cached = self._columns_cache.get(key)
        if cached is not None:
            return cached
        try:
            columns = _pg_columns.decode(key)
        except msgspec.ValidationError as exc:
            raise DecodeError(f"PostgreSQL column_types: {exc}") from exc
        result = tuple(
            # the type as compact JSON text with sorted keys, as the GoogleSQL form sends it
            ColumnType(
                c.name,
                _sorted_json.encode(_json_any.decode(c.type)).decode(),
                c.is_primary_key,
                c.ordinal_position,
            )
            for c in columns
        )
        if len(self._columns_cache) >= 4096:
            self._columns_cache.clear()
        self._columns_cache[key] = result
        return result

    def decode_values(self, values: Iterable[Any], out: list[ChangeRecord]) -> int:
        """Decode rows (raw protobuf ``Value``s holding JSON text) and append their records to
        ``out``; return how many were appended."""
        n0 = len(out)
        append = out.append
        decode = _pg_row.decode
        ts = parse_timestamp
        columns = self._columns
        mod_types = _MOD_TYPES
        last_ts_text = ""
        last_ts = 0
        for value in values:
            text = value.string_value
            try:
                row = decode(text)
            except msgspec.DecodeError as exc:
                raise DecodeError(f"PostgreSQL change record {text[:200]!r}: {exc}") from exc
            d = row.data_change_record
            if d is not None:
                if d.commit_timestamp != last_ts_text:
                    last_ts = ts(d.commit_timestamp)
                    last_ts_text = d.commit_timestamp
                append(
                    DataChange(
                        last_ts,
                        d.record_sequence,
                        d.server_transaction_id,
                        d.is_last_record_in_transaction_in_partition,
                        d.table_name,
                        columns(d.column_types),
                        tuple(
                            [
                                Mod(
                                    bytes(m.keys).decode(),
                                    _raw_text(m.new_values),
                                    _raw_text(m.old_values),
                                )
                                for m in d.mods
                            ]
                        ),
                        mod_types.get(d.mod_type) or _bad_mod_type(d.mod_type),
                        d.value_capture_type,
                        d.number_of_records_in_transaction,
                        d.number_of_partitions_in_transaction,
                        d.transaction_tag or "",
                        d.is_system_transaction,
                    )
                )
            h = row.heartbeat_record
            if h is not None:
                append(Heartbeat(ts(h.timestamp)))
            c = row.child_partitions_record
            if c is not None:
                append(
                    ChildPartitions(
                        ts(c.start_timestamp),
                        c.record_sequence,
                        tuple(
                            [
                                ChildPartition(k.token, tuple(k.parent_partition_tokens))
                                for k in c.child_partitions
                            ]
                        ),
                    )
                )
            if d is None and h is None and c is None:
                raise DecodeError(f"PostgreSQL change record of no known kind: {text[:200]!r}")
        return len(out) - n0


def _bad_mod_type(mod_type: str) -> ModType:
    raise DecodeError(f"unknown mod_type {mod_type!r}")


def count_default_decoded(row: Sequence[Any]) -> int:
    """Records in one row decoded by the client's default decoder (positional lists)."""
    n = 0
    for rec in cast(Sequence[Sequence[Sequence[Any]]], row[0]):
        n += len(rec[0]) + len(rec[1]) + len(rec[2])
    return n


def _json_text(value: Any) -> str:
    if value is None:
        return "{}"
    return _json_dumps(value, separators=(",", ":"))


def _datetime_micros(when: _dt.datetime) -> int:
    return (when - _EPOCH) // _dt.timedelta(microseconds=1)


def records_from_default_row(row: Sequence[Any]) -> list[ChangeRecord]:
    """The same records from a row the client decoded its default way (STRUCTs as positional
    lists in the canonical field order, timestamps as datetimes, JSON parsed): the benchmark's
    baseline and the tests' cross-check of ``RecordLayout``."""
    out: list[ChangeRecord] = []
    for rec in row[0]:
        out.extend(
            DataChange(
                _datetime_micros(d[0]),
                d[1],
                d[2],
                d[3],
                d[4],
                tuple(ColumnType(c[0], _json_text(c[1]), c[2], c[3]) for c in d[5]),
                tuple(Mod(_json_text(m[0]), _json_text(m[1]), _json_text(m[2])) for m in d[6]),
                _MOD_TYPES.get(d[7]) or _bad_mod_type(d[7]),
                d[8],
                d[9],
                d[10],
                d[11] or "",
                d[12],
            )
            for d in rec[0]
        )
        out.extend(Heartbeat(_datetime_micros(h[0])) for h in rec[1])
        for c in rec[2]:
            kids = tuple(ChildPartition(k[0], tuple(k[1])) for k in c[2])
            out.append(ChildPartitions(_datetime_micros(c[0]), c[1], kids))
    return out
