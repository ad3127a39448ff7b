"""The PostgreSQL-dialect change-record decoder (runtime/spanner/decode.py,
``PgRecordDecoder``): rows captured from the Cloud Spanner emulator's
``spanner."read_json_<stream>"`` decode into exactly the records the GoogleSQL decoder makes of
the same changes, and malformed rows are clear errors."""

from __future__ import annotations

import pyarrow as pa
import pytest
from google.protobuf.struct_pb2 import Value

from protocol.records import ChildPartition, ChildPartitions, ColumnType, DataChange, Heartbeat, Mod
from runtime.spanner.decode import DecodeError, PgRecordDecoder, RecordLayout, parse_timestamp
from runtime.typed import arrow_type, arrow_value
from tests.fixtures.spanner import change_record_type, data_value, row_value

# captured from emulator 1.5.28 (a PostgreSQL-dialect database, CREATE CHANGE STREAM s FOR ALL)
ROOT = (
    '{"child_partitions_record":{"child_partitions":[{"parent_partition_tokens":[],'
    '"token":"QmYxRndV"}],"record_sequence":"00000000",'
    '"start_timestamp":"2026-11-27T02:43:31.158761+00:00"}}'
)
DATA = (
    '{"data_change_record":{"column_types":[{"is_primary_key":true,"name":"id",'
    '"ordinal_position":1,"type":{"code":"INT64"}},{"is_primary_key":false,"name":"s",'
    '"ordinal_position":2,"type":{"code":"STRING"}},{"is_primary_key":false,"name":"ts",'
    '"ordinal_position":3,"type":{"code":"TIMESTAMP"}},{"is_primary_key":false,"name":"ats",'
    '"ordinal_position":4,"type":{"array_element_type":{"code":"TIMESTAMP"},"code":"ARRAY"}},'
    '{"is_primary_key":false,"name":"n","ordinal_position":5,'
    '"type":{"code":"NUMERIC","type_annotation":"PG_NUMERIC"}}],'
    '"commit_timestamp":"2026-11-27T02:43:32.261482+00:00",'
    '"is_last_record_in_transaction_in_partition":true,"is_system_transaction":false,'
    '"mod_type":"INSERT","mods":[{"keys":{"id":"1"},"new_values":{"ats":["2024-01-02T03:04:05Z"],'
    '"n":"12345678901234567890.123456789","s":"h\\u00e9llo\\"","ts":"2024-01-02T03:04:05Z"},'
    '"old_values":{}}],"number_of_partitions_in_transaction":1,'
    '"number_of_records_in_transaction":1,"record_sequence":"00000000",'
    '"server_transaction_id":"2","table_name":"t","transaction_tag":"",'
    '"value_capture_type":"OLD_AND_NEW_VALUES"}}'
)
DELETE = (
    '{"data_change_record":{"column_types":[{"is_primary_key":true,"name":"Id",'
    '"ordinal_position":1,"type":{"code":"INT64"}},{"is_primary_key":true,"name":"k2",'
    '"ordinal_position":2,"type":{"code":"STRING"}},{"is_primary_key":false,"name":"v",'
    '"ordinal_position":3,"type":{"code":"STRING"}}],'
    '"commit_timestamp":"2026-11-27T02:42:12.195924+00:00",'
    '"is_last_record_in_transaction_in_partition":false,"is_system_transaction":false,'
    '"mod_type":"DELETE","mods":[{"keys":{"Id":"7","k2":"a"},"new_values":{},'
    '"old_values":{"v":"z"}},{"keys":{"Id":"8","k2":"b"},"new_values":{},"old_values":{"v":null}}],'
    '"number_of_partitions_in_transaction":2,"number_of_records_in_transaction":3,'
    '"record_sequence":"00000001","server_transaction_id":"3","table_name":"Mixed",'
    '"transaction_tag":"tag1","value_capture_type":"OLD_AND_NEW_VALUES"}}'
)
HEARTBEAT = '{"heartbeat_record":{"timestamp":"2026-11-27T02:43:32.261917+00:00"}}'
MERGE = (
    '{"child_partitions_record":{"child_partitions":[{"parent_partition_tokens":["a","b"],'
    '"token":"c"}],"record_sequence":"00000002",'
    '"start_timestamp":"2026-11-27T02:43:40+00:00"}}'
)

T = ('{"code":"INT64"}', '{"code":"STRING"}', '{"code":"TIMESTAMP"}')


def rows(*texts: str) -> list[Value]:
    return [Value(string_value=text) for text in texts]


def test_captured_rows_decode_exactly() -> None:
    out: list[object] = []
    n = PgRecordDecoder().decode_values(rows(ROOT, DATA, DELETE, HEARTBEAT, MERGE), out)  # type: ignore[arg-type]
    assert n == 5
    assert out == [
        ChildPartitions(
            parse_timestamp("2026-11-27T02:43:31.158761Z"),
            "00000000",
            (ChildPartition("QmYxRndV", ()),),
        ),
        DataChange(
            parse_timestamp("2026-11-27T02:43:32.261482Z"),
            "00000000",
            "2",
            True,
            "t",
            (
                ColumnType("id", T[0], True, 1),
                ColumnType("s", T[1], False, 2),
                ColumnType("ts", T[2], False, 3),
                ColumnType(
                    "ats", '{"array_element_type":{"code":"TIMESTAMP"},"code":"ARRAY"}', False, 4
                ),
                ColumnType("n", '{"code":"NUMERIC","type_annotation":"PG_NUMERIC"}', False, 5),
            ),
            (
                Mod(
                    '{"id":"1"}',
                    '{"ats":["2024-01-02T03:04:05Z"],"n":"12345678901234567890.123456789",'
                    '"s":"h\\u00e9llo\\"","ts":"2024-01-02T03:04:05Z"}',
                    "{}",
                ),
            ),
            "INSERT",
            "OLD_AND_NEW_VALUES",
            1,
            1,
            "",
            False,
        ),
        DataChange(
            parse_timestamp("2026-11-27T02:42:12.195924Z"),
            "00000001",
            "3",
            False,
            "Mixed",
            (
                ColumnType("Id", T[0], True, 1),
                ColumnType("k2", T[1], True, 2),
                ColumnType("v", T[1], False, 3),
            ),
            (
                Mod('{"Id":"7","k2":"a"}', "{}", '{"v":"z"}'),
                Mod('{"Id":"8","k2":"b"}', "{}", '{"v":null}'),
            ),
            "DELETE",
            "OLD_AND_NEW_VALUES",
            3,
            2,
            "tag1",
            False,
        ),
        Heartbeat(parse_timestamp("2026-11-27T02:43:32.261917Z")),
        ChildPartitions(
            parse_timestamp("2026-11-27T02:43:40Z"), "00000002", (ChildPartition("c", ("a", "b")),)
        ),
    ]


def test_the_same_change_decodes_alike_in_both_dialects() -> None:
    """One change in the GoogleSQL STRUCT form (the fixture's builder) and in the PostgreSQL
    JSON form: equal records, so nothing downstream depends on the dialect."""
    google: list[object] = []
    layout = RecordLayout(type(change_record_type()).pb(change_record_type()))
    value = row_value(
        data=[data_value("2026-11-27T02:43:32.5Z", "00000007", "tx", "T", ['{"Id":"1"}'])]
    )
    layout.decode_values([value], google)  # type: ignore[arg-type]
    pg = (
        '{"data_change_record":{"column_types":[{"is_primary_key":true,"name":"Id",'
        '"ordinal_position":1,"type":{"code":"INT64"}},{"is_primary_key":false,"name":"Name",'
        '"ordinal_position":2,"type":{"code":"STRING"}}],'
        '"commit_timestamp":"2026-11-27T02:43:32.5+00:00",'
        '"is_last_record_in_transaction_in_partition":true,"is_system_transaction":false,'
        '"mod_type":"INSERT","mods":[{"keys":{"Id":"1"},"new_values":{"Name":"x"},'
        '"old_values":{}}],"number_of_partitions_in_transaction":1,'
        '"number_of_records_in_transaction":1,"record_sequence":"00000007",'
        '"server_transaction_id":"tx","table_name":"T","transaction_tag":"",'
        '"value_capture_type":"OLD_AND_NEW_VALUES"}}'
    )
    out: list[object] = []
    PgRecordDecoder().decode_values(rows(pg), out)  # type: ignore[arg-type]
    assert out == google


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "PostgreSQL change record"),
        ("{}", "of no known kind"),
        ('{"heartbeat_record":{}}', "timestamp"),
        ('{"heartbeat_record":{"timestamp":"yesterday"}}', "RFC 3339"),
        (DATA.replace('"INSERT"', '"UPSERT"'), "unknown mod_type"),
        (DATA.replace('"column_types":[', '"column_types":[7,'), "column_types"),
    ],
)
def test_a_malformed_row_is_a_clear_error(text: str, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        PgRecordDecoder().decode_values(rows(text), [])


def test_postgresql_timestamps() -> None:
    assert parse_timestamp("2026-11-27T02:43:32.261482+00:00") == parse_timestamp(
        "2026-11-27T02:43:32.261482Z"
    )
    assert parse_timestamp("1970-01-01T00:00:01+00:00") == 1_000_000
    assert parse_timestamp("1970-01-01T01:00:00+01:00") == 0  # another offset: the slow path


def test_postgresql_numeric_is_a_string_column() -> None:
    """PostgreSQL ``numeric`` has no fixed precision and holds NaN: written as its exact text."""
    pg_numeric = '{"code":"NUMERIC","type_annotation":"PG_NUMERIC"}'
    assert arrow_type(pg_numeric) == pa.string()
    assert arrow_value(pg_numeric, "NaN") == "NaN"
    assert arrow_value(pg_numeric, "12345678901234567890.123456789") == (
        "12345678901234567890.123456789"
    )
    arr = '{"array_element_type":{"code":"NUMERIC","type_annotation":"PG_NUMERIC"},"code":"ARRAY"}'
    assert arrow_type(arr) == pa.list_(pa.string())
    assert arrow_type('{"code":"JSON","type_annotation":"PG_JSONB"}') == pa.string()
    assert arrow_type('{"code":"NUMERIC"}') == pa.decimal128(38, 9)  # GoogleSQL: unchanged
