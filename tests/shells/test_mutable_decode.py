"""The MUTABLE_KEY_RANGE decoder (runtime/spanner/mutable_decode.py) on result sets built from
the documented protobuf types (``google.cloud.spanner_v1.types.ChangeStreamRecord`` in a
``ResultSet`` whose one column is ``PROTO<google.spanner.v1.ChangeStreamRecord>``): every kind of
record, exact outputs, the client's own decoding of the same rows as a cross-check, a bad row
refused, and the decode rate against the client's default decoding."""

from __future__ import annotations

import base64
import time
from typing import Any

import pytest
from google.cloud.spanner_v1 import _helpers
from google.cloud.spanner_v1.types import (
    ChangeStreamRecord,
    ResultSet,
    ResultSetMetadata,
    StructType,
    Type,
    TypeCode,
)
from google.protobuf import json_format
from google.protobuf.struct_pb2 import ListValue, Value
from google.protobuf.timestamp_pb2 import Timestamp

from protocol.mutable import PartitionEnd, PartitionEvent, PartitionStart
from protocol.records import ColumnType, DataChange, Heartbeat, Mod
from runtime.spanner.decode import DecodeError
from runtime.spanner.mutable_decode import MutableRecord, MutableRecordDecoder, change_record_pb

# the client's decoder of one column value (untyped in the library)
_parse_value_pb: Any = _helpers._parse_value_pb
CSR = ChangeStreamRecord
DCR = ChangeStreamRecord.DataChangeRecord
T_S = 1_795_000_000  # seconds


def _ts(seconds: int, nanos: int = 0) -> Timestamp:
    return Timestamp(seconds=seconds, nanos=nanos)


def _mv(index: int, value: Value) -> DCR.ModValue:
    return DCR.ModValue(column_metadata_index=index, value=value)


def _s(text: str) -> Value:
    return Value(string_value=text)


COLUMNS = [
    DCR.ColumnMetadata(name="Id", type_=Type(code=TypeCode.INT64), is_primary_key=True,
                       ordinal_position=1),
    DCR.ColumnMetadata(name="Name", type_=Type(code=TypeCode.STRING), ordinal_position=2),
    DCR.ColumnMetadata(name="Score", type_=Type(code=TypeCode.FLOAT64), ordinal_position=3),
    DCR.ColumnMetadata(
        name="Tags",
        type_=Type(code=TypeCode.ARRAY, array_element_type=Type(code=TypeCode.STRING)),
        ordinal_position=4,
    ),
]  # fmt: skip


def _update(seconds: int = T_S, nanos: int = 123_456_789) -> CSR:
    return CSR(
        data_change_record=DCR(
            commit_timestamp=_ts(seconds, nanos),
            record_sequence="00000001",
            server_transaction_id="tx-1",
            is_last_record_in_transaction_in_partition=True,
            table="Singers",
            column_metadata=COLUMNS,
            mods=[
                DCR.Mod(
                    keys=[_mv(0, _s("7"))],
                    new_values=[
                        _mv(1, _s("Ann")),
                        _mv(2, Value(number_value=1.5)),
                        _mv(3, Value(list_value=ListValue(values=[_s("a"), Value(null_value=0)]))),
                    ],
                    old_values=[_mv(1, _s("Bo")), _mv(2, Value(null_value=0))],
                )
            ],
            mod_type=DCR.ModType.UPDATE,
            value_capture_type=DCR.ValueCaptureType.OLD_AND_NEW_VALUES,
            number_of_records_in_transaction=2,
            number_of_partitions_in_transaction=1,
            transaction_tag="app=loop",
            is_system_transaction=False,
        )
    )


def _records() -> list[CSR]:
    return [
        CSR(partition_start_record=CSR.PartitionStartRecord(
            start_timestamp=_ts(T_S), record_sequence="0", partition_tokens=["p1", "p2"])),
        _update(),
        CSR(heartbeat_record=CSR.HeartbeatRecord(timestamp=_ts(T_S + 1, 5_000))),
        CSR(partition_event_record=CSR.PartitionEventRecord(
            commit_timestamp=_ts(T_S + 2), record_sequence="3", partition_token="p1",
            move_in_events=[CSR.PartitionEventRecord.MoveInEvent(source_partition_token="p2"),
                            CSR.PartitionEventRecord.MoveInEvent(source_partition_token="p3")])),
        CSR(partition_event_record=CSR.PartitionEventRecord(
            commit_timestamp=_ts(T_S + 2), record_sequence="4", partition_token="p2",
            move_out_events=[
                CSR.PartitionEventRecord.MoveOutEvent(destination_partition_token="p1")])),
        CSR(partition_end_record=CSR.PartitionEndRecord(
            end_timestamp=_ts(T_S + 3), record_sequence="9", partition_token="p2")),
    ]  # fmt: skip


def _result_set(records: list[CSR]) -> ResultSet:
    """A result set as READ_<stream> of a MUTABLE_KEY_RANGE stream sends it: one PROTO column,
    each value the base64 of a serialized ChangeStreamRecord."""
    column = Type(code=TypeCode.PROTO, proto_type_fqn="google.spanner.v1.ChangeStreamRecord")
    return ResultSet(
        metadata=ResultSetMetadata(
            row_type=StructType(fields=[StructType.Field(name="ChangeRecord", type_=column)])
        ),
        rows=[ListValue(values=[_s(base64.b64encode(CSR.serialize(r)).decode())]) for r in records],
    )


def _decode(rs: ResultSet) -> list[MutableRecord]:
    out: list[MutableRecord] = []
    raw = ResultSet.pb(rs)
    assert raw.metadata.row_type.fields[0].type_.code == TypeCode.PROTO
    MutableRecordDecoder().decode_values((row.values[0] for row in raw.rows), out)
    return out


T_US = T_S * 1_000_000


def test_every_kind_of_record_decodes_exactly() -> None:
    got = _decode(_result_set(_records()))
    assert got == [
        PartitionStart(T_US, "0", ("p1", "p2")),
        DataChange(
            T_US + 123_456,
            "00000001",
            "tx-1",
            True,
            "Singers",
            (
                ColumnType("Id", '{"code":"INT64"}', True, 1),
                ColumnType("Name", '{"code":"STRING"}', False, 2),
                ColumnType("Score", '{"code":"FLOAT64"}', False, 3),
                ColumnType("Tags", '{"array_element_type":{"code":"STRING"},"code":"ARRAY"}',
                           False, 4),
            ),
            (Mod('{"Id":"7"}', '{"Name":"Ann","Score":1.5,"Tags":["a",null]}',
                 '{"Name":"Bo","Score":null}'),),
            "UPDATE",
            "OLD_AND_NEW_VALUES",
            2,
            1,
            "app=loop",
            False,
        ),
        Heartbeat(T_US + 1_000_005),
        PartitionEvent(T_US + 2_000_000, "3", "p1", move_in_from=("p2", "p3")),
        PartitionEvent(T_US + 2_000_000, "4", "p2", move_out_to=("p1",)),
        PartitionEnd(T_US + 3_000_000, "9", "p2"),
    ]  # fmt: skip


def test_the_clients_own_decoding_of_the_column_agrees() -> None:
    """Cross-check: the client's PROTO decoding (with the message type as column_info) gives
    messages whose fields are the ones decoded."""
    rs = _result_set(_records())
    field_type = rs.metadata.row_type.fields[0].type_
    info = {"ChangeRecord": change_record_pb()}
    raw = ResultSet.pb(rs)
    messages = [
        _parse_value_pb(row.values[0], field_type, "ChangeRecord", info) for row in raw.rows
    ]
    decoder = MutableRecordDecoder()
    assert [decoder.decode_message(m) for m in messages] == _decode(rs)


def test_a_row_that_is_not_a_change_stream_record_is_refused() -> None:
    with pytest.raises(DecodeError, match="not a ChangeStreamRecord"):
        MutableRecordDecoder().decode_values([_s("!!not base64!!")], [])
    with pytest.raises(DecodeError, match="no known kind"):
        MutableRecordDecoder().decode_values([_s(base64.b64encode(b"").decode())], [])


def _default(rows: Any, field_type: Any, info: dict[str, Any]) -> int:
    n = 0
    for row in rows:
        message = _parse_value_pb(row.values[0], field_type, "ChangeRecord", info)
        n += len(json_format.MessageToDict(message))
    return n


def test_the_decode_rate_against_the_clients_default_decoding() -> None:
    """Not a timing assertion beyond "not slower": the figures are printed (pytest -s) and
    recorded in docs/benchmarks.md."""
    records = [_update(T_S + i // 100, i) for i in range(2_000)]
    rs = _result_set(records)
    raw = ResultSet.pb(rs)
    field_type = rs.metadata.row_type.fields[0].type_
    info = {"ChangeRecord": change_record_pb()}

    def best(fn: Any) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    fast = best(lambda: MutableRecordDecoder().decode_values((r.values[0] for r in raw.rows), []))
    slow = best(lambda: _default(raw.rows, field_type, info))
    print(f"\nChangeRecord rows: shoal {len(records) / fast:,.0f}/s, client default + "
          f"MessageToDict {len(records) / slow:,.0f}/s, ratio {slow / fast:.1f}x")  # fmt: skip
    assert fast < slow
