"""The typed per-table changelog: change records as rows of their own table's columns, in their
Spanner types (docs/reading-output.md). Pure: no I/O, no clock; it needs pyarrow, which is why it
lives here and not in ``protocol/``.

A record carries its table's columns in ``column_types`` (name, Spanner type as JSON text such as
``{"code":"INT64"}`` or ``{"array_element_type":{"code":"DATE"},"code":"ARRAY"}``, primary key
flag, ordinal position) and, per mod, ``keys`` / ``new_values`` / ``old_values`` as JSON objects
in Spanner's JSON encoding (INT64 and NUMERIC as strings, BYTES as base64, FLOAT64 NaN and
infinities as ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``, DATE ``"2024-02-29"``, TIMESTAMP
RFC 3339, a JSON column's value as its JSON text).

Spanner type → Arrow type (:func:`arrow_type`; Spark reads each as the type in brackets):

==========================  ====================================  ==================
Spanner                     Arrow                                 Spark
==========================  ====================================  ==================
INT64 (also ENUM)           int64                                 long
FLOAT64 / FLOAT32           float64 / float32                     double / float
NUMERIC                     decimal128(38, 9)                     decimal(38,9)
PostgreSQL numeric          string (its exact text)               string
STRING, JSON (and others)   string                                string
BYTES (also PROTO)          binary                                binary
BOOL                        bool                                  boolean
DATE                        date32                                date
TIMESTAMP                   timestamp[us, tz=UTC]                 timestamp
ARRAY<T>                    list<T>                               array<T>
==========================  ====================================  ==================

PostgreSQL-dialect databases send the same type codes (bigint INT64, float8 FLOAT64, float4
FLOAT32, varchar/text STRING, jsonb JSON, bytea BYTES, bool BOOL, date DATE, timestamptz
TIMESTAMP, arrays ARRAY), so they map alike, except ``numeric`` (NUMERIC with the annotation
``PG_NUMERIC``): it has no fixed precision or scale and holds ``NaN``, so no decimal type holds
every value; it is written as a string with the value's exact text (cast it in Spark, e.g.
``CAST(n AS DECIMAL(38,9))``, where the values fit).

One row per mod: the key columns from ``keys``, the other columns from ``new_values`` (a
column an UPDATE did not write is null; ``_columns`` says which were written), the old values
(when the stream captures them: ``value_capture_type`` OLD_AND_NEW_VALUES or
NEW_ROW_AND_OLD_VALUES) as ``_old_<column>``, and the metadata columns :data:`METADATA`. Spanner
names start with a letter, so the ``_`` names never collide with a table's own columns.

A table's schema (:func:`table_schema`) is the union of its records' columns in the batch, by
ordinal position: a column added by ``ALTER TABLE ADD COLUMN`` appears in the batches after it
(readers merge the files' schemas, e.g. Spark's ``mergeSchema``). A column whose type differs
between records of one batch (``ALTER COLUMN`` STRING ↔ BYTES) is written as ``string`` holding
each value's JSON text in that batch.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec
import pyarrow as pa

from protocol.records import DataChange
from runtime.timestamps import parse_timestamp

__all__ = [
    "METADATA",
    "OLD_PREFIX",
    "WIRE",
    "TableSpec",
    "TypedError",
    "arrow_type",
    "arrow_value",
    "captures_old_values",
    "decode_specs",
    "encode_specs",
    "table_columns",
    "table_schema",
    "table_spec",
    "tables_from_wire",
    "typed_tables",
    "wire_schema",
    "wire_table",
]

OLD_PREFIX = "_old_"
"""Old values of column ``C`` are in column ``_old_C``."""

METADATA: tuple[tuple[str, pa.DataType], ...] = (
    ("_commit_ts", pa.timestamp("us", tz="UTC")),
    ("_mod_type", pa.string()),
    ("_server_transaction_id", pa.string()),
    ("_record_sequence", pa.string()),
    ("_mod_index", pa.int32()),
    ("_partition_token", pa.string()),
    ("_transaction_tag", pa.string()),
    ("_number_of_records_in_transaction", pa.int32()),
    ("_number_of_partitions_in_transaction", pa.int32()),
    ("_value_capture_type", pa.string()),
    ("_is_system_transaction", pa.bool_()),
    ("_columns", pa.list_(pa.string())),  # the columns new_values holds (an UPDATE's written)
)
"""The metadata columns of every typed table, first in its files."""

_OLD_CAPTURES = frozenset({"OLD_AND_NEW_VALUES", "NEW_ROW_AND_OLD_VALUES"})
_STRING = '{"code":"STRING"}'  # the type of a column whose type changed within a batch


class TypedError(ValueError):
    """A column type or value that does not have the shape Spanner sends."""


class _Type(msgspec.Struct, frozen=True):
    code: str
    array_element_type: _Type | None = None
    type_annotation: str = ""  # PG_NUMERIC, PG_JSONB, ... (PostgreSQL-dialect databases)


_type_decoder = msgspec.json.Decoder(_Type)
_json_decoder = msgspec.json.Decoder()


@functools.lru_cache(maxsize=4096)
def _parse(type_json: str) -> _Type:
    try:
        return _type_decoder.decode(type_json)
    except msgspec.DecodeError as exc:
        raise TypedError(f"not a Spanner column type: {type_json!r}") from exc


def _arrow(t: _Type) -> pa.DataType:
    match t.code:
        case "INT64" | "ENUM":
            return pa.int64()
        case "FLOAT64":
            return pa.float64()
        case "FLOAT32":
            return pa.float32()
        case "NUMERIC" if t.type_annotation == "PG_NUMERIC":
            return pa.string()
        case "NUMERIC":
            return pa.decimal128(38, 9)
        case "BYTES" | "PROTO":
            return pa.binary()
        case "BOOL":
            return pa.bool_()
        case "DATE":
            return pa.date32()
        case "TIMESTAMP":
            return pa.timestamp("us", tz="UTC")
        case "ARRAY":
            if t.array_element_type is None:
                raise TypedError("ARRAY without array_element_type")
            return pa.list_(_arrow(t.array_element_type))
        case _:  # STRING, JSON, and types without a better match (UUID, INTERVAL, ...)
            return pa.string()


def arrow_type(type_json: str) -> pa.DataType:
    """The Arrow type of a column of Spanner type ``type_json`` (see the module docstring)."""
    return _arrow(_parse(type_json))


def _float(value: Any) -> float:
    if isinstance(value, str):
        match value:
            case "NaN":
                return math.nan
            case "Infinity":
                return math.inf
            case "-Infinity":
                return -math.inf
    return float(value)


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


def _converter(t: _Type) -> Callable[[Any], Any]:
    match t.code:
        case "INT64" | "ENUM":
            return int
        case "FLOAT64" | "FLOAT32":
            return _float
        case "NUMERIC" if t.type_annotation == "PG_NUMERIC":
            return str
        case "NUMERIC":
            return decimal.Decimal
        case "BYTES" | "PROTO":
            return base64.b64decode
        case "BOOL":
            return bool
        case "DATE":
            return _dt.date.fromisoformat
        case "TIMESTAMP":
            return parse_timestamp
        case "ARRAY":
            assert t.array_element_type is not None
            element = _converter(t.array_element_type)
            return lambda values: [None if v is None else element(v) for v in values]
        case "STRING":
            return str
        case _:  # JSON: its text, as Spanner sends it; others: the value's JSON text
            return _json_text


@functools.lru_cache(maxsize=4096)
def _convert(type_json: str) -> Callable[[Any], Any]:
    t = _parse(type_json)
    _arrow(t)  # refuses a malformed type here too
    return _converter(t)


def arrow_value(type_json: str, value: Any) -> Any:
    """A value decoded from Spanner's JSON (``new_values`` etc.) as the Python value Arrow takes
    for :func:`arrow_type` (``type_json``): INT64 ``"12"`` → 12, NUMERIC → ``Decimal``, BYTES
    base64 → bytes, FLOAT64 ``"NaN"`` → nan, DATE → ``date``, TIMESTAMP → int microseconds
    since the epoch, JSON → its text, ARRAY → a list of its elements' values; None stays None."""
    if value is None:
        return None
    try:
        return _convert(type_json)(value)
    except TypedError:
        raise
    except (ValueError, TypeError, decimal.InvalidOperation) as exc:
        raise TypedError(f"value {value!r} is not a {type_json}") from exc


def captures_old_values(changes: Iterable[DataChange]) -> bool:
    """Whether the stream captured old values for these records (their ``_old_`` columns)."""
    return any(c.value_capture_type in _OLD_CAPTURES for c in changes)


def table_columns(changes: Iterable[DataChange]) -> list[tuple[str, str, bool]]:
    """(name, Spanner type JSON, is primary key) of the columns of ``changes`` (one table's
    records), the union over the records, ordered by ordinal position (then name). A column
    whose type differs between records becomes STRING (see the module docstring)."""
    seen: dict[str, tuple[int, str, bool]] = {}
    last_types: tuple[object, ...] = ()
    for change in changes:
        if change.column_types is last_types:
            continue  # the decoder interns column_types: most records share one tuple
        last_types = change.column_types
        for col in change.column_types:
            prior = seen.get(col.name)
            if prior is None:
                seen[col.name] = (col.ordinal_position, col.type, col.is_primary_key)
            elif prior[1] != col.type and _parse(prior[1]) != _parse(col.type):
                seen[col.name] = (prior[0], _STRING, prior[2])
    ordered = sorted(seen.items(), key=lambda item: (item[1][0], item[0]))
    return [(name, type_json, key) for name, (_, type_json, key) in ordered]


def table_schema(columns: Sequence[tuple[str, str, bool]], old_values: bool) -> pa.Schema:
    """The Arrow schema of a typed table with ``columns`` (:func:`table_columns`)."""
    fields = [pa.field(name, t) for name, t in METADATA]
    fields += [pa.field(name, arrow_type(t)) for name, t, _ in columns]
    if old_values:
        fields += [
            pa.field(OLD_PREFIX + name, arrow_type(t)) for name, t, key in columns if not key
        ]
    return pa.schema(fields)


_RECORD_META = METADATA[:4] + METADATA[5:11]  # one value per record (not _mod_index, _columns)


class TableSpec(msgspec.Struct, frozen=True, array_like=True):
    """What a table's typed rows take from the whole micro-batch rather than from each row:
    its columns (:func:`table_columns`) and whether it holds old values
    (:func:`captures_old_values`). Rows converted in parts (by Spark's tasks) with the same
    spec have the same schema."""

    columns: tuple[tuple[str, str, bool], ...]
    old_values: bool

    def schema(self) -> pa.Schema:
        return _spec_schema(self)


@functools.lru_cache(maxsize=4096)
def _spec_schema(spec: TableSpec) -> pa.Schema:
    return table_schema(spec.columns, spec.old_values)


def table_spec(changes: Sequence[DataChange]) -> TableSpec:
    """The spec of one table's records in a micro-batch (all of them)."""
    columns = tuple(table_columns(changes))
    for _, type_json, _ in columns:
        arrow_type(type_json)  # refuses a malformed type here, before any row is converted
    return TableSpec(columns, captures_old_values(changes))


def _text_columns(types: dict[str, str], column_types: Sequence[Any]) -> frozenset[str]:
    """The columns of a record whose type differs from its table's (it became STRING): their
    values stay JSON text, like any STRING-typed fallback."""
    return frozenset(c.name for c in column_types if types.get(c.name) == _STRING != c.type)


def _record_metadata(records: Sequence[tuple[str, DataChange]]) -> pa.Table:
    """The per-record metadata columns of every record of a batch, built once for all tables
    (Arrow builds a column far faster than a row at a time)."""
    cols: list[list[Any]] = [[] for _ in _RECORD_META]
    ts, mod_type, txn, seq, token_col, tag, nrec, npart, vct, system = cols
    for token, change in records:
        ts.append(change.commit_ts)
        mod_type.append(change.mod_type)
        txn.append(change.server_transaction_id)
        seq.append(change.record_sequence)
        token_col.append(token)
        tag.append(change.transaction_tag)
        nrec.append(change.number_of_records_in_transaction)
        npart.append(change.number_of_partitions_in_transaction)
        vct.append(change.value_capture_type)
        system.append(change.is_system_transaction)
    arrays = [_array(values, t, name) for (name, t), values in zip(_RECORD_META, cols, strict=True)]
    return pa.Table.from_arrays(arrays, names=[name for name, _ in _RECORD_META])


_Cells = list[tuple[str, Callable[[Any], Any], list[Any]]]  # (column, converter, values)
_ModText = tuple[str, str, str, frozenset[str]]  # keys, new_values, old_values, text columns
_NO_TEXT: frozenset[str] = frozenset()


def _typed_rows(
    table: str, spec: TableSpec, meta: pa.Table, mod_index: Any, mods: Iterable[_ModText]
) -> pa.Table:
    """The conversion every path shares: the typed table of one table's rows, one per mod.
    ``meta``: the :data:`_RECORD_META` columns, one row per mod; ``mod_index``: each row's
    index in its record (an int32 array); ``mods``: per row the mod's JSON texts and the
    columns whose values stay JSON text (:func:`_text_columns`)."""
    schema = spec.schema()
    old = spec.old_values
    convert: _Cells = [(name, _convert(t), []) for name, t, _ in spec.columns]
    olds: _Cells = (
        [(name, _convert(t), []) for name, t, key in spec.columns if not key] if old else []
    )
    cells: _Cells = convert + olds
    written: list[list[str]] = []
    decode = _json_decoder.decode
    try:
        for keys, new_values, old_values, as_text in mods:
            row = decode(keys)
            new = decode(new_values)
            written.append(list(new))
            row.update(new)
            before = decode(old_values) if old else row
            for name, conv, column in convert:
                value = row.get(name)
                if value is not None:
                    value = _json_text(value) if name in as_text else conv(value)
                column.append(value)
            for name, conv, column in olds:
                value = before.get(name)
                if value is not None:
                    value = _json_text(value) if name in as_text else conv(value)
                column.append(value)
    except (ValueError, TypeError, decimal.InvalidOperation) as exc:
        raise TypedError(f"table {table}: a value does not fit its column type: {exc!r}") from exc
    by_name = {name: meta.column(name) for name, _ in _RECORD_META}
    by_name["_mod_index"] = mod_index
    by_name["_columns"] = pa.array(written, pa.list_(pa.string()))
    arrays: list[Any] = [by_name[name] for name, _ in METADATA]
    fields = list(schema)[len(METADATA) :]
    for (_, _, values), field in zip(cells, fields, strict=True):
        arrays.append(_array(values, field.type, field.name))
    return pa.Table.from_arrays(arrays, schema=schema)


def _table(
    records: Sequence[tuple[str, DataChange]], indices: list[int], meta: pa.Table
) -> pa.Table:
    """The typed table of ``records[i] for i in indices`` (one table's records)."""
    changes = [records[i][1] for i in indices]
    spec = table_spec(changes)
    row_record: list[int] = []
    mod_index: list[int] = []
    for i, change in zip(indices, changes, strict=True):
        n = len(change.mods)
        row_record += [i] * n
        mod_index += range(n)
    types = {name: t for name, t, _ in spec.columns}

    def mods() -> Iterator[_ModText]:
        as_text = _NO_TEXT
        last_types: tuple[object, ...] | None = None
        for change in changes:
            # the decoder interns column_types: most records share the previous one's answer
            if change.column_types is not last_types:
                last_types = change.column_types
                as_text = _text_columns(types, last_types)
            for mod in change.mods:
                yield mod.keys, mod.new_values, mod.old_values, as_text

    taken = meta.take(pa.array(row_record, pa.int64()))
    return _typed_rows(changes[0].table, spec, taken, pa.array(mod_index, pa.int32()), mods())


def _array(values: list[Any], t: pa.DataType, name: str) -> pa.Array:
    try:
        if pa.types.is_timestamp(t):  # from int microseconds: a cast is ~100x faster
            return pa.array(values, pa.int64()).cast(t)
        if pa.types.is_list(t) and pa.types.is_timestamp(t.value_type):
            return pa.array(values, pa.list_(pa.int64())).cast(t)
        return pa.array(values, type=t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise TypedError(f"column {name}: values do not fit {t}: {exc}") from exc


def _by_table(records: Sequence[tuple[str, DataChange]]) -> dict[str, list[int]]:
    by_table: dict[str, list[int]] = {}
    for i, (_, change) in enumerate(records):
        by_table.setdefault(change.table, []).append(i)
    return by_table


def typed_tables(entries: Iterable[tuple[str, Sequence[DataChange]]]) -> dict[str, pa.Table]:
    """Per table name, the typed rows of ``entries`` ((partition token, records), in order):
    one row per mod, in the order the records came."""
    records = [(token, change) for token, changes in entries for change in changes]
    if not records:
        return {}
    by_table = _by_table(records)
    meta = _record_metadata(records)
    return {name: _table(records, by_table[name], meta) for name in sorted(by_table)}


# --- the wire: the same conversion from an Arrow table of JSON text -------------------------

WIRE: tuple[tuple[str, pa.DataType], ...] = (
    ("_table", pa.string()),
    ("_commit_ts", pa.int64()),  # microseconds since the epoch
    *((name, t) for name, t in _RECORD_META if name != "_commit_ts"),
    ("_mod_index", pa.int32()),
    ("_keys", pa.string()),
    ("_new_values", pa.string()),
    ("_old_values", pa.string()),
    ("_text_columns", pa.list_(pa.string())),  # null: none (see _text_columns)
)
"""The wire table: a micro-batch's mods as one Arrow table of plain types (what Spark takes in
as it is: ``string``, not ``large_string``), one row per mod, grouped by table (tables by
name, each table's rows in the order the records came). With each table's :class:`TableSpec`
it holds everything :func:`typed_tables` needs: :func:`tables_from_wire` turns it into the
same tables, also in parts (any slices of it, each with the specs of the whole)."""


def wire_schema() -> pa.Schema:
    return pa.schema([pa.field(name, t) for name, t in WIRE])


def wire_table(
    entries: Iterable[tuple[str, Sequence[DataChange]]],
) -> tuple[pa.Table, dict[str, TableSpec]]:
    """The wire table of ``entries`` ((partition token, records), in order) and each table's
    spec, decided over all of its records."""
    records = [(token, change) for token, changes in entries for change in changes]
    cols: list[list[Any]] = [[] for _ in WIRE]
    table_col, ts, mod_type, txn, seq, token_col, tag, nrec, npart, vct, system = cols[:11]
    mod_index, keys, new, old, text = cols[11:]
    specs: dict[str, TableSpec] = {}
    by_table = _by_table(records)
    for name in sorted(by_table):
        indices = by_table[name]
        changes = [records[i][1] for i in indices]
        spec = specs[name] = table_spec(changes)
        types = {column: t for column, t, _ in spec.columns}
        as_text: list[str] | None = None
        last_types: tuple[object, ...] | None = None
        for i in indices:
            token, change = records[i]
            if change.column_types is not last_types:
                last_types = change.column_types
                as_text = sorted(_text_columns(types, last_types)) or None
            for k, mod in enumerate(change.mods):
                table_col.append(name)
                ts.append(change.commit_ts)
                mod_type.append(change.mod_type)
                txn.append(change.server_transaction_id)
                seq.append(change.record_sequence)
                token_col.append(token)
                tag.append(change.transaction_tag)
                nrec.append(change.number_of_records_in_transaction)
                npart.append(change.number_of_partitions_in_transaction)
                vct.append(change.value_capture_type)
                system.append(change.is_system_transaction)
                mod_index.append(k)
                keys.append(mod.keys)
                new.append(mod.new_values)
                old.append(mod.old_values)
                text.append(as_text)
    schema = wire_schema()
    arrays = [pa.array(values, f.type) for f, values in zip(schema, cols, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema), specs


_spec_encoder = msgspec.json.Encoder()
_spec_decoder = msgspec.json.Decoder(dict[str, TableSpec])


def encode_specs(specs: dict[str, TableSpec]) -> str:
    return _spec_encoder.encode(specs).decode()


def decode_specs(text: str | bytes) -> dict[str, TableSpec]:
    try:
        return _spec_decoder.decode(text)
    except msgspec.DecodeError as exc:
        raise TypedError(f"not the typed tables' specs: {exc}") from exc


def tables_from_wire(wire: pa.Table, specs: dict[str, TableSpec]) -> dict[str, pa.Table]:
    """Per table name, the typed rows of a wire table (or a part of one: :data:`WIRE`) with the
    micro-batch's ``specs``: what :func:`typed_tables` gives for the same records."""
    wire = wire.cast(wire_schema())  # e.g. large_string from Spark, nullability
    names = wire.column("_table").to_pylist()
    by_table: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        by_table.setdefault(name, []).append(i)
    out: dict[str, pa.Table] = {}
    for name in sorted(by_table):
        spec = specs.get(name)
        if spec is None:
            raise TypedError(f"table {name}: the wire holds rows of it but no spec")
        indices = by_table[name]
        if indices[-1] - indices[0] + 1 == len(indices):  # grouped by table: one slice
            part = wire.slice(indices[0], len(indices))
        else:
            part = wire.take(pa.array(indices, pa.int64()))
        meta_columns = [part.column(n) for n, _ in _RECORD_META]
        meta_columns[0] = meta_columns[0].cast(METADATA[0][1])  # int micros → timestamp
        meta = pa.Table.from_arrays(meta_columns, names=[n for n, _ in _RECORD_META])
        texts = (
            _NO_TEXT if t is None else frozenset(t)
            for t in part.column("_text_columns").to_pylist()
        )
        mods = zip(
            part.column("_keys").to_pylist(),
            part.column("_new_values").to_pylist(),
            part.column("_old_values").to_pylist(),
            texts,
            strict=True,
        )
        out[name] = _typed_rows(name, spec, meta, part.column("_mod_index"), mods)
    return out
