"""Change-stream records, shaped like Spanner's change-stream ``ChangeRecord``.

Timestamps are integer microseconds since the Unix epoch (Spanner commit timestamps have
microsecond precision). JSON fields (``keys``, ``new_values``, ``old_values``, column ``type``)
stay JSON text as Spanner sends them: decoding them is the consumer's choice, not the reader's cost.

The identity of a data change for de-duplication is ``(commit_ts, server_transaction_id,
record_sequence)``; of one row of output, that plus the mod's index.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Micros = int
ModType = Literal["INSERT", "UPDATE", "DELETE", "SNAPSHOT"]
"""A change stream's three kinds, and ``SNAPSHOT``: a row of the connector's snapshot at its
read timestamp T (``protocol/snapshot.py``; ``commit_ts`` = T, every column in ``new_values``)."""

# ``gc=False``: a running process holds hundreds of thousands of these (buffered micro-batches,
# reader chunks) and Python's cycle collector scanned every one of them on each full
# collection: building a 100k-row typed micro-batch took 0.385 s with them tracked, 0.265 s
# untracked (docs/benchmarks.md, "The Spark path"). They are frozen and hold only strings,
# numbers and tuples of each other, so they can never be part of a reference cycle.


class ColumnType(msgspec.Struct, frozen=True, array_like=True, gc=False):
    name: str
    type: str  # JSON text, e.g. '{"code":"STRING"}'
    is_primary_key: bool
    ordinal_position: int


class Mod(msgspec.Struct, frozen=True, array_like=True, gc=False):
    keys: str  # JSON object text
    new_values: str  # JSON object text ("{}" for DELETE)
    old_values: str  # JSON object text ("{}" unless OLD_AND_NEW_VALUES)


class DataChange(msgspec.Struct, frozen=True, tag="data", tag_field="k", array_like=True, gc=False):
    commit_ts: Micros
    record_sequence: str  # a string; never compare as fixed width
    server_transaction_id: str
    is_last_record_in_transaction_in_partition: bool
    table: str
    column_types: tuple[ColumnType, ...]
    mods: tuple[Mod, ...]
    mod_type: ModType
    value_capture_type: str = "OLD_AND_NEW_VALUES"
    number_of_records_in_transaction: int = 1
    number_of_partitions_in_transaction: int = 1
    transaction_tag: str = ""
    is_system_transaction: bool = False

    @property
    def identity(self) -> tuple[Micros, str, str]:
        """The de-duplication key of this record."""
        return (self.commit_ts, self.server_transaction_id, self.record_sequence)


class Heartbeat(msgspec.Struct, frozen=True, tag="hb", tag_field="k", array_like=True):
    timestamp: Micros


class ChildPartition(msgspec.Struct, frozen=True, array_like=True):
    token: str
    parent_tokens: tuple[str, ...]


class ChildPartitions(msgspec.Struct, frozen=True, tag="child", tag_field="k", array_like=True):
    start_ts: Micros
    record_sequence: str
    children: tuple[ChildPartition, ...]


ChangeRecord = DataChange | Heartbeat | ChildPartitions


def record_ts(record: ChangeRecord) -> Micros:
    """The read position a record moves its partition to."""
    match record:
        case DataChange():
            return record.commit_ts
        case Heartbeat():
            return record.timestamp
        case ChildPartitions():
            return record.start_ts
