"""The record filter (protocol/filters.py): include globs, exclusions that win, mod types,
case-insensitive names, and the parsing of the comma-separated settings."""

from __future__ import annotations

import pytest

from protocol.filters import FilterError, RecordFilter, parse_list
from protocol.records import DataChange, ModType


def rec(table: str, mod_type: ModType = "INSERT") -> DataChange:
    return DataChange(1, "0", "t", False, table, (), (), mod_type)


TABLES = ("Orders", "OrderItems", "Users", "users_archive", "Audit_2024", "Audit_2025")


def kept(rule: RecordFilter, mod_type: ModType = "INSERT") -> list[str]:
    return [t for t in TABLES if rule.keeps(rec(t, mod_type))]


def test_no_setting_keeps_everything() -> None:
    rule = RecordFilter.parse(None, None, None)
    assert rule.keeps_everything
    assert kept(rule) == list(TABLES)
    assert RecordFilter.parse("", " ", "").keeps_everything


def test_include_globs_match_the_whole_name_case_insensitively() -> None:
    rule = RecordFilter.parse("order*, users", None, None)
    assert not rule.keeps_everything
    assert kept(rule) == ["Orders", "OrderItems", "Users"]  # not users_archive: whole name
    assert kept(RecordFilter.parse("audit_202?", None, None)) == ["Audit_2024", "Audit_2025"]
    assert kept(RecordFilter.parse("Audit_202[4]", None, None)) == ["Audit_2024"]
    assert kept(RecordFilter.parse("Order", None, None)) == []  # a plain name is exact


def test_exclusion_wins_over_inclusion() -> None:
    rule = RecordFilter.parse("*", "audit_*,OrderItems", None)
    assert kept(rule) == ["Orders", "Users", "users_archive"]
    only_exclude = RecordFilter.parse(None, "*_archive", None)
    assert kept(only_exclude) == ["Orders", "OrderItems", "Users", "Audit_2024", "Audit_2025"]
    assert kept(RecordFilter.parse("Orders", "orders", None)) == []


def test_mod_types_and_tables_both_apply() -> None:
    rule = RecordFilter.parse("Orders", None, "insert, DELETE")
    assert rule.keeps(rec("Orders", "INSERT"))
    assert rule.keeps(rec("Orders", "DELETE"))
    assert not rule.keeps(rec("Orders", "UPDATE"))
    assert not rule.keeps(rec("Users", "INSERT"))
    updates = RecordFilter.parse(None, None, "UPDATE")
    assert kept(updates, "UPDATE") == list(TABLES)
    assert kept(updates, "INSERT") == []


def test_bad_settings_are_refused_with_their_name() -> None:
    with pytest.raises(FilterError, match=r"mod_types: unknown mod type 'UPSERT'"):
        RecordFilter.parse(None, None, "INSERT,UPSERT")
    with pytest.raises(FilterError, match=r"tables: empty item in 'a,,b'"):
        RecordFilter.parse("a,,b", None, None)
    with pytest.raises(FilterError, match=r"exclude_tables: empty item"):
        RecordFilter.parse(None, "a,", None)
    assert parse_list(" a , b ", "x") == ("a", "b")


def test_a_table_decision_is_the_same_from_the_cache() -> None:
    rule = RecordFilter.parse("Ord*", None, None)
    first = [rule.keeps_table(t) for t in TABLES]
    assert [rule.keeps_table(t) for t in TABLES] == first == [t.startswith("Ord") for t in TABLES]


def test_patterns_that_match_no_table_of_the_stream_are_found() -> None:
    rule = RecordFilter(("orders", "Ordres", "audit_*"), ("users", "Userz"))
    assert rule.unmatched(TABLES) == (("Ordres",), ("Userz",))
    assert not rule.keeps_no_table(TABLES)
    assert RecordFilter(("Ordres",)).keeps_no_table(TABLES)  # a typo: nothing is kept
    assert RecordFilter((), ("*",)).keeps_no_table(TABLES)
    assert RecordFilter().unmatched(TABLES) == ((), ())
    assert not RecordFilter().keeps_no_table(TABLES)
    assert RecordFilter(("Orders",)).keeps_no_table(())  # a stream without tables


# -- transaction tags, system transactions, columns (issue 37) --------------------------------
def tagged(tag: str, *, system: bool = False, ts: int = 1, table: str = "Orders") -> DataChange:
    return DataChange(
        ts, "0", f"t{ts}", False, table, (), (), "INSERT", transaction_tag=tag,
        is_system_transaction=system,
    )  # fmt: skip


def test_transaction_tag_globs_are_case_sensitive_and_never_match_an_untagged_record() -> None:
    rule = RecordFilter.parse(None, None, None, exclude_transaction_tags="replicator*, app=loop")
    assert not rule.keeps_everything
    assert [rule.drop_reason(tagged(t)) for t in ("replicator-7", "app=loop", "Replicator-7")] == [
        "transaction_tag",
        "transaction_tag",
        None,  # case-sensitive
    ]
    assert rule.keeps(tagged(""))
    every_tag = RecordFilter.parse(None, None, None, exclude_transaction_tags="*")
    assert not every_tag.keeps(tagged("x"))
    assert every_tag.keeps(tagged(""))  # "*" drops tagged transactions, not untagged ones


def test_system_transactions_are_dropped_only_when_asked() -> None:
    ttl = tagged("", system=True)
    assert RecordFilter().keeps(ttl)
    rule = RecordFilter(exclude_system_transactions=True)
    assert not rule.keeps_everything
    assert rule.drop_reason(ttl) == "system_transaction"
    assert rule.keeps(tagged(""))


def test_the_first_rule_that_drops_a_record_is_the_reason() -> None:
    rule = RecordFilter.parse(
        "Orders", None, "INSERT", exclude_transaction_tags="t", exclude_system_transactions=True
    )
    assert rule.drop_reason(tagged("t", system=True, table="Users")) == "table"
    assert rule.drop_reason(tagged("t", system=True)) == "system_transaction"
    assert rule.drop_reason(tagged("t")) == "transaction_tag"


def _users(mod_new: str, mod_old: str = "{}") -> DataChange:
    from protocol.records import ColumnType, Mod

    columns = (
        ColumnType("Id", '{"code":"INT64"}', True, 1),
        ColumnType("Email", '{"code":"STRING"}', False, 2),
        ColumnType("Name", '{"code":"STRING"}', False, 3),
        ColumnType("Ssn", '{"code":"STRING"}', False, 4),
    )
    return DataChange(
        7, "0", "t7", False, "Users", columns, (Mod('{"Id":"1"}', mod_new, mod_old),), "UPDATE"
    )


def test_excluded_columns_leave_new_values_old_values_and_the_column_list() -> None:
    rule = RecordFilter.parse(None, None, None, exclude_columns="users.email, *.SSN, Users.Id")
    record = _users('{"Email":"a@x","Name":"A","Ssn":"1"}', '{"Email":"b@x","Name":"B","Ssn":"2"}')
    stripped = rule.strip_columns(record)
    assert [c.name for c in stripped.column_types] == ["Id", "Name"]  # the key column stays
    assert stripped.mods[0].keys == '{"Id":"1"}'
    assert stripped.mods[0].new_values == '{"Name":"A"}'
    assert stripped.mods[0].old_values == '{"Name":"B"}'
    # a record of another table, or without the columns, is the same object
    orders = tagged("")
    assert rule.strip_columns(orders) is orders
    assert rule.strip_columns(_users('{"Name":"A"}')).mods[0].new_values == '{"Name":"A"}'
    assert RecordFilter().strip_columns(record) is record


def test_apply_replaces_dropped_records_by_heartbeats_in_place_and_counts_by_rule() -> None:
    from protocol.filters import FilterCounts
    from protocol.records import ChangeRecord, ChildPartitions, Heartbeat

    rule = RecordFilter.parse(
        None,
        "Audit",
        None,
        exclude_transaction_tags="loop",
        exclude_system_transactions=True,
        exclude_columns="Users.Email",
    )
    child = ChildPartitions(9, "0", ())
    batch: list[ChangeRecord] = [
        tagged("loop", ts=1),
        tagged("", system=True, ts=2),
        tagged("", ts=3, table="Audit"),
        _users('{"Email":"a@x","Name":"A"}'),
        tagged("", ts=8),
        Heartbeat(8),
        child,
    ]
    out, counts = rule.apply(batch)
    assert out == [
        Heartbeat(1),
        Heartbeat(2),
        Heartbeat(3),
        rule.strip_columns(_users('{"Email":"a@x","Name":"A"}')),
        tagged("", ts=8),
        Heartbeat(8),
        child,
    ]
    assert out[3].mods[0].new_values == '{"Name":"A"}'  # type: ignore[union-attr]
    assert counts == FilterCounts(
        kept=2, table=1, mod_type=0, system_transaction=1, transaction_tag=1, columns_stripped=1
    )
    assert counts.dropped == 3
    assert (counts + counts).by_reason() == {
        "table": 2,
        "mod_type": 0,
        "system_transaction": 2,
        "transaction_tag": 2,
    }


def test_bad_column_items_are_refused_with_the_option_name() -> None:
    for bad in ("Email", ".Email", "Users.", "Users.Email,,Name"):
        with pytest.raises(FilterError, match="exclude_columns"):
            RecordFilter.parse(None, None, None, exclude_columns=bad)
