"""The mirror's merge rule (protocol/mirror.py): exact cases, the blind control, and properties
over random histories, batchings and orders against the reference (every change applied in
version order) and against the model database itself."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.mirror import (
    MergePlan,
    MirrorChange,
    MirrorError,
    MirrorRow,
    RowId,
    Version,
    collect,
    merge,
    merge_changes,
    mirror_changes,
    row_ids,
    snapshot_version,
    validate,
)
from protocol.records import DataChange, Mod
from tests.mirror_model import (
    COLUMNS,
    Database,
    Op,
    apply,
    blind,
    record,
    reference,
    row_id,
    visible,
)

K1 = row_id("T", "1")
K2 = row_id("T", "2")
FULL = {"A": 1, "B": 2, "C": 3}


class Mirror:
    """An in-memory mirror: a dict of rows, merged into batch by batch."""

    def __init__(self) -> None:
        self.rows: dict[RowId, MirrorRow] = {}
        self.plans: list[MergePlan] = []

    def merge(self, *records: DataChange) -> MergePlan:
        before = msgspec.json.encode(list(self.rows.values()))
        plan = merge(self.rows, records)
        assert (
            msgspec.json.encode(list(self.rows.values())) == before
        )  # the current rows stay as they were
        apply(self.rows, plan)
        for row in self.rows.values():
            validate(row)
        self.plans.append(plan)
        return plan

    def seen(self) -> dict[RowId, dict[str, Any]]:
        return visible(self.rows)


def ins(ts: int, key: str = "1", txn: str = "", **values: Any) -> DataChange:
    return record(ts, "INSERT", (key, values or dict(FULL)), txn=txn or f"t{ts}")


def upd(ts: int, key: str = "1", capture: str = "OLD_AND_NEW_VALUES", **values: Any) -> DataChange:
    return record(ts, "UPDATE", (key, values), txn=f"t{ts}", capture=capture)


def dele(ts: int, key: str = "1") -> DataChange:
    return record(ts, "DELETE", (key, {}), txn=f"t{ts}")


def snap(ts: int, *rows: tuple[str, dict[str, Any]]) -> DataChange:
    return record(ts, "SNAPSHOT", *rows, txn="snapshot-chunk-7", seq="3")


# ---- versions ---------------------------------------------------------------------------------


def test_versions_order_by_commit_ts_then_transaction_then_record_sequence_as_a_number() -> None:
    recs = [
        record(10, "INSERT", ("1", {}), ("2", {}), txn="b", seq="9"),
        record(10, "UPDATE", ("1", {}), txn="b", seq="10"),
        record(10, "UPDATE", ("3", {}), txn="a", seq="00000011"),
        record(9, "UPDATE", ("1", {}), txn="z", seq="99"),
    ]
    versions = [c.version for c in mirror_changes(recs)]
    assert versions == [
        Version(10, "b", 9, 0),
        Version(10, "b", 9, 1),
        Version(10, "b", 10, 0),
        Version(10, "a", 11, 0),
        Version(9, "z", 99, 0),
    ]
    # "10" after "9" (text order would put it first), the mod index orders one record's mods
    assert Version(10, "b", 9, 1) < Version(10, "b", 10, 0)
    assert sorted(versions)[0] == Version(9, "z", 99, 0)


def test_a_snapshot_row_is_the_lowest_version_of_its_read_timestamp() -> None:
    (change,) = mirror_changes([snap(50, ("1", FULL))])
    assert change.version == snapshot_version(50) == Version(50, "", -1, -1)
    assert change.kind == "row"
    (at_t,) = mirror_changes([record(50, "UPDATE", ("1", {}), txn="", seq="0")])
    assert change.version < at_t.version  # even below a change with an empty transaction id
    (before,) = mirror_changes([record(49, "UPDATE", ("1", {}), txn="zz", seq="999")])
    assert before.version < change.version


def test_kinds_by_mod_type_and_capture_type() -> None:
    def kind(mod_type: str, capture: str) -> str:
        (change,) = mirror_changes([record(1, mod_type, ("1", {"A": 1}), capture=capture)])
        return change.kind

    for capture in ("OLD_AND_NEW_VALUES", "NEW_VALUES", "NEW_ROW", "NEW_ROW_AND_OLD_VALUES"):
        assert kind("INSERT", capture) == "row"
        assert kind("DELETE", capture) == "delete"
        assert kind("SNAPSHOT", capture) == "row"
    assert kind("UPDATE", "OLD_AND_NEW_VALUES") == "columns"
    assert kind("UPDATE", "NEW_VALUES") == "columns"
    assert kind("UPDATE", "NEW_ROW") == "row"
    assert kind("UPDATE", "NEW_ROW_AND_OLD_VALUES") == "row"


def test_a_change_names_its_row_by_table_and_sorted_key_columns_and_drops_keys_from_values() -> (
    None
):
    # a composite key, given in another column order, and a key column repeated in the values
    rec = DataChange(
        5,
        "0",
        "t",
        True,
        "Orders",
        (),
        (Mod('{"Shop":"7","Day":"2024-02-29"}', '{"Shop":"7","Total":"12.5"}', "{}"),),
        "INSERT",
    )
    (change,) = mirror_changes([rec])
    assert change.row_id == ("Orders", (("Day", "2024-02-29"), ("Shop", "7")))
    assert change.values == {"Total": "12.5"}


@pytest.mark.parametrize(
    ("rec", "message"),
    [
        (record(1, "INSERT", ("1", {}), seq="x1"), "record_sequence 'x1' is not a decimal number"),
        (record(1, "UPSERT", ("1", {})), "mod_type 'UPSERT' is not INSERT, UPDATE, DELETE or"),
        (record(1, "UPDATE", ("1", {}), capture="ODD"), "value_capture_type 'ODD' is not one of"),
    ],
)
def test_records_the_mirror_cannot_place_are_refused_with_what_is_wrong(
    rec: DataChange, message: str
) -> None:
    with pytest.raises(MirrorError, match=message) as info:
        mirror_changes([rec])
    assert "record 1/tx/" in str(info.value)
    assert "table 'T'" in str(info.value)


@pytest.mark.parametrize(
    ("keys", "new", "message"),
    [
        ("not json", "{}", "keys is not JSON"),
        ("[1]", "{}", "keys is not a JSON object"),
        ('{"Id":[1]}', "{}", "key column 'Id' is not a scalar"),
        ('{"Id":"1"}', "7", "new_values is not a JSON object"),
    ],
)
def test_malformed_keys_and_values_are_refused(keys: str, new: str, message: str) -> None:
    rec = DataChange(1, "0", "tx", True, "T", (), (Mod(keys, new, "{}"),), "INSERT")
    with pytest.raises(MirrorError, match=message):
        mirror_changes([rec])


# ---- exact merges -----------------------------------------------------------------------------


def test_insert_then_partial_update_changes_only_the_written_columns() -> None:
    m = Mirror()
    plan = m.merge(ins(10))
    assert plan == MergePlan(
        (MirrorRow("T", K1[1], dict(FULL), Version(10, "t10", 0, 0), Version(10, "t10", 0, 0)),),
        mods=1,
        stale=0,
    )
    plan = m.merge(upd(20, B=20))
    (row,) = plan.rows
    assert row.values == {"A": 1, "B": 20, "C": 3}
    assert row.base == Version(10, "t10", 0, 0)
    assert row.columns == {"B": Version(20, "t20", 0, 0)}
    assert row.version == Version(20, "t20", 0, 0)
    assert plan.upserts == plan.rows
    assert plan.tombstones == ()


def test_a_full_row_update_replaces_every_column() -> None:
    m = Mirror()
    m.merge(ins(10), upd(20, B=20))
    m.merge(upd(30, capture="NEW_ROW", A=7, B=8))  # the whole new row: C is null now
    row = m.rows[K1]
    assert row.values == {"A": 7, "B": 8}
    assert row.base == row.version == Version(30, "t30", 0, 0)
    assert row.columns == {}


def test_a_delete_leaves_a_tombstone_and_a_later_insert_brings_the_row_back() -> None:
    m = Mirror()
    m.merge(ins(10))
    plan = m.merge(dele(20))
    (tomb,) = plan.tombstones
    assert plan.upserts == ()
    assert (tomb.deleted, tomb.exists, tomb.tombstone, tomb.values) == (True, False, True, {})
    assert m.seen() == {}
    m.merge(ins(30, A=5))
    assert m.seen() == {K1: {"A": 5}}
    assert not m.rows[K1].deleted


def test_an_older_insert_after_the_delete_does_not_resurrect_the_row() -> None:
    m = Mirror()
    m.merge(dele(20))  # the child partition's batch commits first
    plan = m.merge(ins(10), upd(15, A=9))  # the parent's older batch
    assert plan.rows == ()
    assert (plan.mods, plan.stale) == (2, 2)
    assert m.seen() == {}


def test_an_older_partial_update_after_a_newer_insert_changes_nothing() -> None:
    m = Mirror()
    m.merge(ins(20))
    plan = m.merge(upd(10, A=99))
    assert (plan.rows, plan.stale) == ((), 1)
    assert m.seen() == {K1: FULL}


def test_an_older_update_of_one_column_after_a_newer_update_of_another_still_applies() -> None:
    m = Mirror()
    m.merge(ins(10))
    m.merge(upd(30, B=30))
    m.merge(upd(20, A=20, B=20))  # newer for A, older for B
    assert m.seen() == {K1: {"A": 20, "B": 30, "C": 3}}
    assert m.rows[K1].columns == {"A": Version(20, "t20", 0, 0), "B": Version(30, "t30", 0, 0)}
    assert m.rows[K1].version == Version(30, "t30", 0, 0)


def test_a_newer_partial_update_before_its_insert_shows_what_is_known_until_the_insert_comes() -> (
    None
):
    m = Mirror()
    m.merge(upd(20, B=20))
    row = m.rows[K1]
    assert (row.base, row.exists, row.values) == (None, True, {"B": 20})  # A, C unknown: null
    m.merge(ins(10))
    assert m.seen() == {K1: {"A": 1, "B": 20, "C": 3}}
    assert m.rows[K1].columns == {"B": Version(20, "t20", 0, 0)}


def test_a_partial_update_after_a_delete_whose_insert_is_still_on_its_way() -> None:
    m = Mirror()
    m.merge(ins(10))
    m.merge(dele(20))
    m.merge(upd(40, C=40))  # the INSERT at 30 has not arrived
    row = m.rows[K1]
    assert (row.deleted, row.exists, row.values) == (True, True, {"C": 40})
    m.merge(ins(30, A=30, B=31, C=32))
    assert m.seen() == {K1: {"A": 30, "B": 31, "C": 40}}
    assert not m.rows[K1].deleted


def test_the_same_batch_twice_changes_nothing() -> None:
    m = Mirror()
    batch = [ins(10), upd(20, A=2), ins(10, key="2"), dele(30, key="2"), upd(25, C=5)]
    first = m.merge(*batch)
    assert len(first.rows) == 2
    before = dict(m.rows)
    again = m.merge(*batch)
    assert again == MergePlan((), mods=5, stale=5)
    assert m.rows == before


def test_several_changes_of_one_row_in_one_batch_give_one_row_in_the_plan() -> None:
    m = Mirror()
    plan = m.merge(upd(30, A=3), ins(10), upd(20, A=2, B=2), dele(5))
    assert [r.row_id for r in plan.rows] == [K1]
    assert m.seen() == {K1: {"A": 3, "B": 2, "C": 3}}
    assert plan.stale == 1  # the delete at 5, older than the insert at 10


def test_changes_within_one_transaction_apply_in_record_then_mod_order() -> None:
    m = Mirror()
    txn = [
        record(10, "UPDATE", ("1", {"A": "second"}), txn="x", seq="10"),
        record(10, "INSERT", ("1", {"A": "first", "B": 0}), txn="x", seq="9"),
        record(10, "UPDATE", ("1", {"B": 1}), ("1", {"B": 2}), txn="x", seq="11"),
    ]
    m.merge(*txn)
    assert m.seen() == {K1: {"A": "second", "B": 2}}
    assert blind(txn) != m.seen()  # in arrival order the INSERT at "9" wipes "second"


def test_a_snapshot_row_then_newer_changes() -> None:
    m = Mirror()
    m.merge(snap(100, ("1", dict(FULL)), ("2", dict(FULL))))
    m.merge(upd(110, A=11), dele(120, key="2"))
    assert m.seen() == {K1: {"A": 11, "B": 2, "C": 3}}


def test_a_snapshot_row_committed_after_newer_changes_fills_only_what_they_did_not_write() -> None:
    m = Mirror()
    m.merge(upd(110, A=11), dele(120, key="2"), ins(130, key="3"))
    m.merge(snap(100, ("1", dict(FULL)), ("2", dict(FULL))))
    assert m.seen() == {K1: {"A": 11, "B": 2, "C": 3}, row_id("T", "3"): FULL}


def test_a_snapshot_row_is_superseded_by_older_changes_only_when_they_are_not_older() -> None:
    m = Mirror()
    m.merge(snap(100, ("1", dict(FULL))))
    plan = m.merge(upd(90, A=90), dele(95), ins(80))  # the stream reached back before T
    assert plan.rows == ()
    m.merge(upd(100, A=100))  # a change at T itself: applied over it (the snapshot holds it)
    assert m.seen() == {K1: {"A": 100, "B": 2, "C": 3}}


def test_the_same_snapshot_chunk_twice_changes_nothing() -> None:
    m = Mirror()
    chunk = snap(100, ("1", dict(FULL)), ("2", dict(FULL)))
    m.merge(chunk)
    m.merge(upd(110, A=11))
    assert m.merge(chunk).rows == ()
    assert m.seen()[K1]["A"] == 11


def test_out_of_order_batches_of_two_partitions_against_the_blind_control() -> None:
    # key 1 lives in the parent partition until a split at 50, then in a child: the child's
    # batches (newer) commit before the parent's last batch (older)
    parent = [ins(10), upd(20, B=20), ins(30, key="2"), upd(40, A=40)]
    child = [upd(60, C=60), dele(70, key="2"), upd(80, A=80, capture="NEW_VALUES")]
    m = Mirror()
    m.merge(*child)
    m.merge(*parent)
    right = {K1: {"A": 80, "B": 20, "C": 60}}
    assert m.seen() == right
    assert reference(mirror_changes(parent + child)) == right
    wrong = blind(child + parent)  # the same batches applied blindly in arrival order
    assert wrong != right
    assert wrong == {K1: {"A": 40, "B": 20, "C": 3}, row_id("T", "2"): FULL}  # lost and risen
    assert blind(parent + child) == right  # the control is right when nothing is out of order


def test_a_late_snapshot_chunk_against_the_blind_control() -> None:
    stream = [upd(110, A=11), dele(120, key="2")]
    late = snap(100, ("1", dict(FULL)), ("2", dict(FULL)))
    m = Mirror()
    m.merge(*stream)
    m.merge(late)
    assert m.seen() == {K1: {"A": 11, "B": 2, "C": 3}}
    assert blind([*stream, late]) == {K1: FULL, row_id("T", "2"): FULL}  # overwrote, resurrected


def test_merge_reads_each_touched_row_once_through_a_lookup() -> None:
    m = Mirror()
    m.merge(ins(10), ins(10, key="2"))
    asked: list[RowId] = []

    def lookup(rid: RowId) -> MirrorRow | None:
        asked.append(rid)
        return m.rows.get(rid)

    changes = mirror_changes([upd(20, A=1), upd(21, B=1), upd(22, key="3", A=3), upd(23, C=1)])
    assert row_ids(changes) == [K1, row_id("T", "3")]
    plan = merge_changes(lookup, changes)
    assert asked == [K1, row_id("T", "3")]
    assert [r.row_id for r in plan.rows] == [K1, row_id("T", "3")]
    assert merge_changes(m.rows, changes) == plan  # a mapping gives the same plan


def test_a_lookup_that_returns_another_row_is_refused() -> None:
    m = Mirror()
    m.merge(ins(10, key="2"))
    with pytest.raises(MirrorError, match="returned the row of"):
        merge(lambda rid: m.rows[K2], [upd(20, A=1)])


def test_an_update_that_writes_no_column_still_says_the_row_exists() -> None:
    m = Mirror()
    m.merge(dele(10))
    m.merge(upd(20))  # e.g. only unwatched columns changed
    row = m.rows[K1]
    assert (row.exists, row.values, row.version) == (True, {}, Version(20, "t20", 0, 0))


def test_rows_of_two_tables_with_the_same_key_are_two_rows() -> None:
    m = Mirror()
    m.merge(ins(10), record(10, "INSERT", ("1", {"A": "u"}), txn="t10", table="U"))
    m.merge(dele(20))
    assert m.seen() == {row_id("U", "1"): {"A": "u"}}


def test_a_row_round_trips_through_msgspec_json_and_msgpack() -> None:
    m = Mirror()
    m.merge(snap(5, ("1", {"A": [1, None], "B": None, "C": {"j": 1.5}})), upd(20, B="x"))
    m.merge(dele(30, key="2"))
    for row in m.rows.values():
        for codec in (msgspec.json, msgspec.msgpack):
            assert codec.decode(codec.encode(row), type=MirrorRow) == row


# ---- garbage collection -----------------------------------------------------------------------


def test_collect_drops_tombstones_at_or_before_the_watermark_and_keeps_newer_ones() -> None:
    m = Mirror()
    m.merge(dele(20), dele(30, key="2"))
    assert collect(m.rows[K1], 19) is m.rows[K1]
    assert collect(m.rows[K1], 20) is None
    assert collect(m.rows[K2], 29) is m.rows[K2]


def test_collect_forgets_column_versions_no_change_to_come_can_be_older_than() -> None:
    m = Mirror()
    m.merge(ins(10), upd(20, A=2), upd(30, B=3))
    row = m.rows[K1]
    assert collect(row, 29) is row  # the version at 30 is after it: keep everything
    small = collect(row, 30)
    assert small is not None
    assert (small.values, small.base, small.version, small.columns, small.deleted) == (
        {"A": 2, "B": 3, "C": 3},
        row.version,
        row.version,
        {},
        False,
    )
    assert collect(small, 1000) is small
    validate(small)
    # what comes after the watermark merges the same into either
    later = mirror_changes([upd(31, A=31), ins(40, key="1", A=40), upd(35, C=35)])
    for order in (later, later[::-1]):
        assert visible({K1: merge_changes({K1: row}, order).rows[0]}) == visible(
            {K1: merge_changes({K1: small}, order).rows[0]}
        )


def test_teeth_a_change_at_or_before_the_watermark_merged_after_collection_resurrects() -> None:
    # why the watermark must mean "merged and never merged again": a re-delivered old INSERT
    m = Mirror()
    m.merge(ins(10), dele(20))
    m.rows = {rid: r for rid, row in m.rows.items() if (r := collect(row, 20)) is not None}
    assert m.rows == {}
    m.merge(ins(10))
    assert m.seen() == {K1: FULL}  # wrong: the row was deleted at 20


# ---- properties -------------------------------------------------------------------------------

VERSION = st.builds(
    Version,
    st.integers(1, 6),
    st.sampled_from(("a", "b")),
    st.integers(0, 3),
    st.integers(0, 2),
)
CHANGE = st.tuples(
    st.sampled_from((K1, K2, row_id("U", "1"))),
    VERSION,
    st.sampled_from(("row", "columns", "delete")),
    st.dictionaries(st.sampled_from(COLUMNS), st.integers(0, 9) | st.none(), max_size=3),
)


def changes_of(drawn: list[tuple[RowId, Version, str, dict[str, Any]]]) -> list[MirrorChange]:
    seen: set[tuple[RowId, Version]] = set()
    out = []
    for rid, version, kind, values in drawn:
        if (rid, version) in seen:
            continue  # one version of one row is one change
        seen.add((rid, version))
        out.append(
            MirrorChange(rid[0], rid[1], version, kind, {} if kind == "delete" else values)  # type: ignore[arg-type]
        )
    return out


def merged(batches: list[list[MirrorChange]]) -> dict[RowId, MirrorRow]:
    store: dict[RowId, MirrorRow] = {}
    for batch in batches:
        before = msgspec.json.encode(list(store.values()))
        plan = merge_changes(store, batch)
        assert msgspec.json.encode(list(store.values())) == before
        apply(store, plan)
    for row in store.values():
        validate(row)
    return store


def batchings(data: st.DataObject, items: list[Any]) -> list[list[Any]]:
    """``items`` shuffled, cut into batches, some batches delivered again, batches shuffled."""
    items = data.draw(st.permutations(items))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(items)), max_size=5)))
    batches = [items[a:b] for a, b in zip([0, *cuts], [*cuts, len(items)], strict=True)]
    again = data.draw(st.lists(st.sampled_from(batches), max_size=3)) if batches else []
    return data.draw(st.permutations(batches + again))


@settings(max_examples=400, deadline=None)
@given(drawn=st.lists(CHANGE, max_size=14), data=st.data())
def test_any_batching_and_order_of_any_changes_equals_version_order(
    drawn: list[tuple[RowId, Version, str, dict[str, Any]]], data: st.DataObject
) -> None:
    changes = changes_of(drawn)
    in_order = merged([sorted(changes, key=lambda c: c.version)])
    one_by_one = merged([[c] for c in sorted(changes, key=lambda c: c.version)])
    shuffled = merged(batchings(data, changes))
    assert visible(in_order) == reference(changes)
    assert shuffled == in_order == one_by_one  # every field of every row, tombstones included


CAPTURES = ("OLD_AND_NEW_VALUES", "NEW_VALUES", "NEW_ROW", "NEW_ROW_AND_OLD_VALUES")
OP = st.tuples(
    st.integers(0, 1), st.integers(0, 2), st.integers(0, 2), st.integers(0, 7), st.integers(1, 9)
)


def run_database(
    capture: str, txns: list[tuple[bool, list[Op]]]
) -> tuple[Database, list[tuple[int, list[DataChange]]]]:
    """Commit ``txns`` ((share the previous commit timestamp if the keys allow, ops)): two
    transactions share a timestamp only when they write different rows, as in Spanner."""
    db = Database(capture)
    out: list[tuple[int, list[DataChange]]] = []
    ts = 1000
    last_rows: set[RowId] = set()
    for same_ts, ops in txns:
        rows = {row_id(("T", "U")[t % 2], db.keys[k % 3]) for t, k, *_ in ops}
        if not (same_ts and out and not rows & last_rows):
            ts += 10
            last_rows = set()
        last_rows |= rows
        out.append((ts, db.commit(ts, ops)))
    return db, out


@settings(max_examples=300, deadline=None)
@given(
    capture=st.sampled_from(CAPTURES),
    txns=st.lists(st.tuples(st.booleans(), st.lists(OP, min_size=1, max_size=4)), max_size=10),
    data=st.data(),
)
def test_the_mirror_equals_the_database_after_any_batching_and_order(
    capture: str, txns: list[tuple[bool, list[Op]]], data: st.DataObject
) -> None:
    db, committed = run_database(capture, txns)
    records = [r for _, recs in committed for r in recs]
    store: dict[RowId, MirrorRow] = {}
    for batch in batchings(data, records):
        apply(store, merge(store, batch))
    assert visible(store) == db.rows
    assert visible(store) == reference(mirror_changes(records))
    assert blind(records) == db.rows  # the control agrees when everything comes in order


@settings(max_examples=300, deadline=None)
@given(
    capture=st.sampled_from(CAPTURES),
    txns=st.lists(st.tuples(st.booleans(), st.lists(OP, min_size=1, max_size=4)), max_size=10),
    data=st.data(),
)
def test_a_snapshot_at_t_and_the_stream_from_any_start_up_to_t_give_the_database(
    capture: str, txns: list[tuple[bool, list[Op]]], data: st.DataObject
) -> None:
    db, committed = run_database(capture, txns)
    times = [ts for ts, _ in committed] or [1000]
    read_ts = data.draw(st.integers(min(times) - 1, max(times) + 1))
    start = data.draw(st.integers(min(times) - 1, read_ts + 1))  # overlap with T is harmless
    items = db.snapshot(read_ts, chunk=data.draw(st.integers(1, 3)))
    items += [r for ts, recs in committed if ts >= start for r in recs]
    store: dict[RowId, MirrorRow] = {}
    for batch in batchings(data, items):
        apply(store, merge(store, batch))
    assert visible(store) == db.rows
