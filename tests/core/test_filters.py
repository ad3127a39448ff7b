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
