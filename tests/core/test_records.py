"""Change records are not tracked by Python's cycle collector (``gc=False`` in
``protocol/records.py``): they are many, frozen and acyclic, and tracking them made every full
collection scan them all."""

from __future__ import annotations

import gc

import msgspec

from protocol.records import ChangeRecord, ColumnType, DataChange, Mod


def test_records_are_not_tracked_by_the_cycle_collector() -> None:
    change = DataChange(
        commit_ts=1,
        record_sequence="00000001",
        server_transaction_id="t1",
        is_last_record_in_transaction_in_partition=True,
        table="T",
        column_types=(ColumnType("Id", '{"code":"INT64"}', True, 1),),
        mods=(Mod('{"Id":"1"}', "{}", "{}"),),
        mod_type="INSERT",
    )
    decoded = msgspec.json.decode(msgspec.json.encode(change), type=ChangeRecord)
    assert decoded == change
    assert isinstance(decoded, DataChange)
    for record in (change, decoded, decoded.mods[0], decoded.column_types[0]):
        assert not gc.is_tracked(record)
