"""The typed per-table changelog's pure part (runtime/typed.py): Spanner type → Arrow type,
Spanner JSON value → Arrow value, and a table's schema and rows from its records."""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
import math
from typing import Any

import pyarrow as pa
import pytest

from protocol.records import ColumnType, DataChange, Mod
from runtime.typed import (
    METADATA,
    TypedError,
    arrow_type,
    arrow_value,
    decode_specs,
    encode_specs,
    table_columns,
    table_schema,
    tables_from_wire,
    typed_tables,
    wire_schema,
    wire_table,
)
from tests.fixtures.typed_records import all_types_entries, comparable

UTC = dt.UTC


def t(code: str) -> str:
    return f'{{"code":"{code}"}}'


def arr(code: str) -> str:
    return f'{{"array_element_type":{{"code":"{code}"}},"code":"ARRAY"}}'


@pytest.mark.parametrize(
    ("type_json", "expected"),
    [
        (t("INT64"), pa.int64()),
        (t("FLOAT64"), pa.float64()),
        (t("FLOAT32"), pa.float32()),
        (t("NUMERIC"), pa.decimal128(38, 9)),
        (t("STRING"), pa.string()),
        (t("JSON"), pa.string()),
        (t("BYTES"), pa.binary()),
        (t("BOOL"), pa.bool_()),
        (t("DATE"), pa.date32()),
        (t("TIMESTAMP"), pa.timestamp("us", tz="UTC")),
        (arr("INT64"), pa.list_(pa.int64())),
        (arr("TIMESTAMP"), pa.list_(pa.timestamp("us", tz="UTC"))),
        (t("UUID"), pa.string()),
    ],
)
def test_arrow_type(type_json: str, expected: pa.DataType) -> None:
    assert arrow_type(type_json) == expected


@pytest.mark.parametrize("bad", ["", "{}", '{"code":"ARRAY"}', "INT64"])
def test_a_malformed_type_is_refused(bad: str) -> None:
    with pytest.raises(TypedError):
        arrow_type(bad)


ARROW_VALUES: list[tuple[str, Any, Any]] = [
    (t("INT64"), "4611686018427387904", 4611686018427387904),
    (t("INT64"), 7, 7),
    (t("FLOAT64"), 1.5, 1.5),
    (t("FLOAT64"), "Infinity", math.inf),
    (t("FLOAT64"), "-Infinity", -math.inf),
    (t("FLOAT32"), 2.5, 2.5),
    (t("NUMERIC"), "12345.123456789", decimal.Decimal("12345.123456789")),
    (t("STRING"), "héllo", "héllo"),
    (t("JSON"), '{"x":[1,2]}', '{"x":[1,2]}'),
    (t("BYTES"), "AP9hYg==", b"\x00\xffab"),
    (t("BOOL"), True, True),
    (t("DATE"), "2024-02-29", dt.date(2024, 2, 29)),
    (t("TIMESTAMP"), "1970-01-01T00:00:01.000002Z", 1_000_002),
    (t("TIMESTAMP"), "1970-01-01T00:00:01.123456789Z", 1_123_456),
    (arr("INT64"), ["1", None, "3"], [1, None, 3]),
    (arr("BYTES"), ["AQ=="], [b"\x01"]),
    (arr("JSON"), ['{"a":1}'], ['{"a":1}']),
    (t("INT64"), None, None),
    (arr("DATE"), None, None),
]


@pytest.mark.parametrize(("type_json", "value", "expected"), ARROW_VALUES)
def test_arrow_value(type_json: str, value: Any, expected: Any) -> None:
    assert arrow_value(type_json, value) == expected


@pytest.mark.parametrize("type_json", sorted({case[0] for case in ARROW_VALUES}))
def test_a_column_holds_each_value_as_arrow_value_converts_it(type_json: str) -> None:
    """typed_tables builds a column at a time (whole columns through Arrow's cast where it
    parses as arrow_value does): the same values, also with other shapes in one column (an
    INT64 as a JSON number beside one as a string) and nulls."""
    import msgspec

    values = [v for tj, v, _ in ARROW_VALUES if tj == type_json] + [None]
    col = ColumnType("V", type_json, False, 2)
    mods = tuple(
        Mod(f'{{"K1":"k{i}"}}', msgspec.json.encode({"V": v}).decode(), "{}")
        for i, v in enumerate(values)
    )
    record = change(1, "INSERT", mods, cols=(K1, col), capture="NEW_ROW")
    column = typed_tables([("p", [record])])["T"].column("V")
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.int64())
    assert column.to_pylist() == [arrow_value(type_json, v) for v in values]


def test_nan_is_nan() -> None:
    assert math.isnan(arrow_value(t("FLOAT64"), "NaN"))


@pytest.mark.parametrize(
    ("type_json", "value"),
    [(t("INT64"), "x"), (t("DATE"), "2024-13-01"), (t("TIMESTAMP"), "yesterday")],
)
def test_a_bad_value_is_refused(type_json: str, value: Any) -> None:
    with pytest.raises(TypedError):
        arrow_value(type_json, value)


K1 = ColumnType("K1", t("STRING"), True, 1)
K2 = ColumnType("K2", t("INT64"), True, 2)
N = ColumnType("N", t("NUMERIC"), False, 3)
A = ColumnType("A", arr("DATE"), False, 4)
EXTRA = ColumnType("Extra", t("BYTES"), False, 5)


def change(
    ts: int,
    mod_type: str,
    mods: tuple[Mod, ...],
    cols: tuple[ColumnType, ...] = (K1, K2, N, A),
    table: str = "T",
    capture: str = "OLD_AND_NEW_VALUES",
) -> DataChange:
    return DataChange(
        commit_ts=ts,
        record_sequence=f"{ts:08d}",
        server_transaction_id=f"tx{ts}",
        is_last_record_in_transaction_in_partition=True,
        table=table,
        column_types=cols,
        mods=mods,
        mod_type=mod_type,  # type: ignore[arg-type]
        value_capture_type=capture,
        transaction_tag="tag",
    )


def test_table_columns_are_the_union_by_ordinal_position() -> None:
    early = change(1, "INSERT", (), cols=(N, K2, K1))
    late = change(2, "INSERT", (), cols=(K1, K2, N, EXTRA, A))
    assert table_columns([early, late]) == [
        ("K1", t("STRING"), True),
        ("K2", t("INT64"), True),
        ("N", t("NUMERIC"), False),
        ("A", arr("DATE"), False),
        ("Extra", t("BYTES"), False),
    ]


def test_a_column_whose_type_changed_becomes_string() -> None:
    first = change(1, "INSERT", (), cols=(K1, ColumnType("C", t("STRING"), False, 2)))
    second = change(2, "INSERT", (), cols=(K1, ColumnType("C", t("BYTES"), False, 2)))
    assert table_columns([first, second])[1] == ("C", t("STRING"), False)
    tables = typed_tables(
        [
            (
                "p",
                [
                    change(
                        1, "INSERT", (Mod('{"K1":"a"}', '{"C":"x"}', "{}"),), first.column_types
                    ),
                    change(
                        2, "INSERT", (Mod('{"K1":"b"}', '{"C":"AQ=="}', "{}"),), second.column_types
                    ),
                ],
            )
        ]
    )
    assert tables["T"].column("C").to_pylist() == ["x", "AQ=="]


def test_table_schema() -> None:
    columns = [("K1", t("STRING"), True), ("N", t("NUMERIC"), False)]
    meta = [pa.field(n, ty) for n, ty in METADATA]
    assert table_schema(columns, old_values=True) == pa.schema(
        [*meta, ("K1", pa.string()), ("N", pa.decimal128(38, 9)), ("_old_N", pa.decimal128(38, 9))]
    )
    assert table_schema(columns, old_values=False).names == [*(f.name for f in meta), "K1", "N"]


def test_typed_tables_rows() -> None:
    insert = change(
        10,
        "INSERT",
        (
            Mod('{"K1":"a","K2":"1"}', '{"N":"1.5","A":["2020-01-01"]}', "{}"),
            Mod('{"K1":"b","K2":"2"}', '{"N":null,"A":null}', "{}"),
        ),
    )
    update = change(20, "UPDATE", (Mod('{"K1":"a","K2":"1"}', '{"N":"2"}', '{"N":"1.5"}'),))
    delete = change(30, "DELETE", (Mod('{"K1":"b","K2":"2"}', "{}", '{"N":null,"A":null}'),))
    added = change(
        40,
        "INSERT",
        (Mod('{"K1":"c","K2":"3"}', '{"N":null,"A":null,"Extra":"AQ=="}', "{}"),),
        cols=(K1, K2, N, A, EXTRA),
    )
    other = change(15, "INSERT", (Mod('{"K1":"z","K2":"9"}', "{}", "{}"),), table="U")
    tables = typed_tables([("p1", [insert, other, update]), ("p2", [delete, added])])
    assert sorted(tables) == ["T", "U"]
    table = tables["T"]
    assert table.schema.field("Extra").type == pa.binary()
    assert table.schema.field("_old_A").type == pa.list_(pa.date32())
    rows = table.to_pylist()
    ts = [r["_commit_ts"] for r in rows]
    assert ts == [dt.datetime.fromtimestamp(s / 1e6, UTC) for s in (10, 10, 20, 30, 40)]
    got = [
        (
            r["_mod_type"],
            r["_mod_index"],
            r["_partition_token"],
            r["_columns"],
            r["K1"],
            r["K2"],
            r["N"],
            r["A"],
            r["Extra"],
            r["_old_N"],
        )
        for r in rows
    ]
    d = decimal.Decimal
    assert got == [
        ("INSERT", 0, "p1", ["N", "A"], "a", 1, d("1.5"), [dt.date(2020, 1, 1)], None, None),
        ("INSERT", 1, "p1", ["N", "A"], "b", 2, None, None, None, None),
        ("UPDATE", 0, "p1", ["N"], "a", 1, d("2"), None, None, d("1.5")),
        ("DELETE", 0, "p2", [], "b", 2, None, None, None, None),
        ("INSERT", 0, "p2", ["N", "A", "Extra"], "c", 3, None, None, b"\x01", None),
    ]
    first = rows[0]
    assert first["_server_transaction_id"] == "tx10"
    assert first["_record_sequence"] == "00000010"
    assert first["_transaction_tag"] == "tag"
    assert first["_number_of_records_in_transaction"] == 1
    assert first["_value_capture_type"] == "OLD_AND_NEW_VALUES"
    assert first["_is_system_transaction"] is False


def test_no_old_columns_without_old_values() -> None:
    record = change(1, "INSERT", (Mod('{"K1":"a","K2":"1"}', "{}", "{}"),), capture="NEW_ROW")
    table = typed_tables([("p", [record])])["T"]
    assert not [n for n in table.schema.names if n.startswith("_old_")]


def test_a_value_that_does_not_fit_is_a_clear_error() -> None:
    record = change(1, "INSERT", (Mod('{"K1":"a","K2":"one"}', "{}", "{}"),))
    with pytest.raises(TypedError, match="one"):
        typed_tables([("p", [record])])


def test_the_wire_gives_the_same_tables_whole_and_in_parts() -> None:
    """The wire table (runtime.typed.WIRE: what Spark's executors get) with the tables' specs
    converts into exactly the tables typed_tables builds from the records, covering every
    Spanner type, a column added and a column whose type changed within the batch; also cut
    into parts anywhere (as Spark's tasks get it) and the parts' tables concatenated."""
    entries = all_types_entries()
    expected = {name: comparable(table) for name, table in typed_tables(entries).items()}
    wire, specs = wire_table(entries)
    assert wire.schema == wire_schema()
    assert wire.num_rows == sum(len(c.mods) for _, cs in entries for c in cs)
    specs = decode_specs(encode_specs(specs))  # as the option Spark carries
    whole = tables_from_wire(wire, specs)
    assert {name: comparable(table) for name, table in whole.items()} == expected
    for cuts in ([5], [1, 2, 3], [7, 19, 20]):
        bounds = [0, *cuts, wire.num_rows]
        parts: dict[str, list[pa.Table]] = {}
        for start, end in itertools.pairwise(bounds):
            for name, table in tables_from_wire(wire.slice(start, end - start), specs).items():
                parts.setdefault(name, []).append(table)
        joined = {name: comparable(pa.concat_tables(ts)) for name, ts in parts.items()}
        assert joined == expected, cuts


def test_a_wire_table_without_its_tables_spec_is_refused() -> None:
    wire, specs = wire_table(all_types_entries(1))
    del specs["Changed"]
    with pytest.raises(TypedError, match="Changed"):
        tables_from_wire(wire, specs)
