"""Fast decoding of ``MUTABLE_KEY_RANGE`` change-stream rows into shoal's records.

A change stream with ``partition_mode = 'MUTABLE_KEY_RANGE'`` answers ``READ_<stream>`` with one
column, ``ChangeRecord``, of type ``PROTO<google.spanner.v1.ChangeStreamRecord>``: each row's
value is the serialized message, base64 text in the ``Value``'s ``string_value`` (as for any
PROTO column; ``google.cloud.spanner_v1.types.ChangeStreamRecord`` documents it). One row, one
record: a data change, a heartbeat, a partition start, a partition end or a partition event.

The decoder parses each message once with the C protobuf runtime (the raw ``_pb`` class, not
proto-plus wrappers) and builds ``protocol.records`` / ``protocol.mutable`` records directly:

- timestamps become int microseconds (``seconds * 10**6 + nanos // 1000``);
- a data change's ``column_metadata`` becomes ``column_types`` (the column ``type`` as the same
  compact JSON text with sorted keys the other mode sends, ``{"code":"INT64"}``), decoded once
  per distinct metadata (interned by its serialized bytes, as the other decoder does);
- a mod's ``keys`` / ``new_values`` / ``old_values`` (lists of column index and
  ``google.protobuf.Value``) become JSON object text keyed by column name, in the order sent,
  with values as Spanner's JSON form carries them (INT64 as a string, FLOAT64 a number);
- the mod type and value capture type enums become their names.

The baseline it is measured against (tests/shells/test_mutable_decode.py) is the client's own
decoding of the column (``_parse_value_pb`` with the message type as ``column_info``, which
returns the parsed message) followed by ``json_format.MessageToDict`` to get at the values.

Pure and synchronous: no I/O, no clock.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any, Final

import msgspec
from google.cloud.spanner_v1.types import ChangeStreamRecord, TypeCode

from protocol.mutable import PartitionEnd, PartitionEvent, PartitionStart
from protocol.records import ColumnType, DataChange, Heartbeat, Mod, ModType
from runtime.spanner.decode import DecodeError, _type_of

__all__ = ["MutableRecord", "MutableRecordDecoder", "change_record_pb"]

MutableRecord = DataChange | Heartbeat | PartitionStart | PartitionEnd | PartitionEvent

change_record_pb: Final[Any] = ChangeStreamRecord.pb()  # the raw protobuf class

_MOD_TYPES: Final[dict[int, ModType]] = {10: "INSERT", 20: "UPDATE", 30: "DELETE"}
_CAPTURE: Final[dict[int, str]] = {
    10: "OLD_AND_NEW_VALUES",
    20: "NEW_VALUES",
    30: "NEW_ROW",
    40: "NEW_ROW_AND_OLD_VALUES",
}
_encode = msgspec.json.Encoder().encode
_encode_sorted = msgspec.json.Encoder(order="sorted").encode


def _type_json(type_pb: Any) -> dict[str, Any]:
    """A ``google.spanner.v1.Type`` as the JSON object the other mode sends for a column."""
    out: dict[str, Any] = {"code": TypeCode(type_pb.code).name}
    if type_pb.HasField("array_element_type"):
        out["array_element_type"] = _type_json(type_pb.array_element_type)
    if type_pb.HasField("struct_type"):
        out["struct_type"] = {
            "fields": [
                {"name": f.name, "type": _type_json(_type_of(f))}
                for f in type_pb.struct_type.fields
            ]
        }
    if type_pb.proto_type_fqn:
        out["proto_type_fqn"] = type_pb.proto_type_fqn
    if type_pb.type_annotation:
        out["type_annotation"] = type_pb.type_annotation
    return out


def _value(v: Any) -> Any:
    """A ``google.protobuf.Value`` as a Python value for JSON."""
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return v.string_value
    if kind == "number_value":
        return v.number_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "list_value":
        return [_value(x) for x in v.list_value.values]
    if kind == "struct_value":
        return {k: _value(x) for k, x in v.struct_value.fields.items()}
    return None  # null_value, or unset


def _micros(ts: Any) -> int:
    return int(ts.seconds) * 1_000_000 + int(ts.nanos) // 1000


class MutableRecordDecoder:
    """Decoder of ``MUTABLE_KEY_RANGE`` rows: ``decode_values(values, out)`` as the other
    decoders (``runtime/spanner/decode.py``), ``values`` the rows' raw ``Value``s."""

    def __init__(self) -> None:
        self._columns_cache: dict[bytes, tuple[tuple[ColumnType, ...], tuple[str, ...]]] = {}

    def _columns(self, metadata: Any) -> tuple[tuple[ColumnType, ...], tuple[str, ...]]:
        key = b"\0".join([c.SerializeToString() for c in metadata])
        cached = self._columns_cache.get(key)
        if cached is not None:
            return cached
        columns = tuple(
            ColumnType(
                c.name,
                _encode_sorted(_type_json(_type_of(c))).decode(),
                c.is_primary_key,
                int(c.ordinal_position),
            )
            for c in metadata
        )
        result = (columns, tuple(c.name for c in columns))
        if len(self._columns_cache) >= 4096:
            self._columns_cache.clear()
        self._columns_cache[key] = result
        return result

    def decode_message(self, msg: Any) -> MutableRecord:
        """One parsed raw ``ChangeStreamRecord`` as a record."""
        kind = msg.WhichOneof("record")
        if kind == "data_change_record":
            d = msg.data_change_record
            columns, names = self._columns(d.column_metadata)

            def obj(values: Any) -> str:
                if not values:
                    return "{}"
                return _encode(
                    {names[m.column_metadata_index]: _value(m.value) for m in values}
                ).decode()

            try:
                mod_type = _MOD_TYPES[d.mod_type]
            except KeyError:
                raise DecodeError(f"unknown mod_type {d.mod_type}") from None
            return DataChange(
                _micros(d.commit_timestamp),
                d.record_sequence,
                d.server_transaction_id,
                d.is_last_record_in_transaction_in_partition,
                d.table,
                columns,
                tuple([Mod(obj(m.keys), obj(m.new_values), obj(m.old_values)) for m in d.mods]),
                mod_type,
                _CAPTURE.get(d.value_capture_type, ""),
                int(d.number_of_records_in_transaction) or 1,
                int(d.number_of_partitions_in_transaction) or 1,
                d.transaction_tag,
                d.is_system_transaction,
            )
        if kind == "heartbeat_record":
            return Heartbeat(_micros(msg.heartbeat_record.timestamp))
        if kind == "partition_start_record":
            s = msg.partition_start_record
            return PartitionStart(
                _micros(s.start_timestamp), s.record_sequence, tuple(s.partition_tokens)
            )
        if kind == "partition_end_record":
            e = msg.partition_end_record
            return PartitionEnd(_micros(e.end_timestamp), e.record_sequence, e.partition_token)
        if kind == "partition_event_record":
            p = msg.partition_event_record
            return PartitionEvent(
                _micros(p.commit_timestamp),
                p.record_sequence,
                p.partition_token,
                tuple([m.source_partition_token for m in p.move_in_events]),
                tuple([m.destination_partition_token for m in p.move_out_events]),
            )
        raise DecodeError(f"ChangeStreamRecord of no known kind ({kind})")

    def decode_values(self, values: Iterable[Any], out: list[MutableRecord]) -> int:
        """Decode rows (raw ``Value``s, base64 of a serialized ``ChangeStreamRecord``) and
        append their records to ``out``; return how many were appended."""
        n0 = len(out)
        parse = change_record_pb.FromString
        decode = self.decode_message
        b64 = base64.b64decode
        for value in values:
            try:
                msg = parse(b64(value.string_value))
            except (binascii.Error, ValueError) as exc:  # DecodeError of protobuf is a ValueError
                raise DecodeError(f"ChangeRecord is not a ChangeStreamRecord: {exc}") from exc
            out.append(decode(msg))
        return len(out) - n0
