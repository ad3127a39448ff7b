"""Output rows as keyed records, for the Spark bridge's retry queue and dead-letter queue (pure: no
Spark, no Kafka, no event loop).

* :class:`SparkRecord` is one output row (one mod of one data change) with its record id (the
  row key ``commit_ts/server_transaction_id/record_sequence/mod_index``, as the Kafka sink's) and
  its ordering key ``<table>:<primary-key JSON>`` (:attr:`SparkRecord.key`). Its JSON is the
  payload the bridge keeps in the RQ/DLQ topics; it extends
  :class:`runtime.output_record.OutputRecord`, so ``dlq list`` decodes both sinks' payloads alike.
* :func:`records_table` turns records back into the Arrow table Spark takes in (the output
  schema of :mod:`runtime.spark.rows`).
* :func:`halves` splits records in two **by ordering key**: every key's records stay together
  and in order, so a half that commits never commits a key's later record without its earlier
  ones. The bridge bisects a failing micro-batch with it until single keys fail.
* :class:`RowsFailed` is what a user's ``foreach_batch`` may raise to name the ordering keys it
  could not write: the bridge then parks those keys' rows at once instead of bisecting.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from protocol.records import DataChange
from runtime.output_record import OutputRecord

__all__ = [
    "RowsFailed",
    "SparkRecord",
    "decode_record",
    "encode_record",
    "halves",
    "record_keys",
    "records_table",
    "spark_records",
]


class SparkRecord(OutputRecord, frozen=True, kw_only=True):
    """One output row of the Spark bridge, as the RQ/DLQ payload (JSON): the Kafka sink's
    output record plus the columns only the Spark rows carry."""

    partition_token: str
    transaction_tag: str = ""
    number_of_records_in_transaction: int = 0
    number_of_partitions_in_transaction: int = 0


class RowsFailed(Exception):
    """Raised by a ``foreach_batch`` that wrote nothing and knows which ordering keys' rows it
    could not write (``SparkRecord.key``, ``<table>:<keys JSON>``); the bridge re-runs the rest
    and parks those keys' rows in the retry queue."""

    def __init__(self, keys: Iterable[str], message: str = "rows failed") -> None:
        self.keys = frozenset(keys)
        super().__init__(f"{message} ({len(self.keys)} key(s))")


_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[SparkRecord] = msgspec.json.Decoder(SparkRecord)


def encode_record(record: SparkRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(raw: bytes) -> SparkRecord:
    return _decoder.decode(raw)


def spark_records(token: str, changes: Iterable[DataChange]) -> list[SparkRecord]:
    """One record per mod of every change of partition ``token``, in order."""
    return [
        SparkRecord(
            record_id=f"{c.commit_ts}/{c.server_transaction_id}/{c.record_sequence}/{i}",
            table=c.table,
            keys=mod.keys,
            mod_type=c.mod_type,
            commit_ts=c.commit_ts,
            server_transaction_id=c.server_transaction_id,
            record_sequence=c.record_sequence,
            mod_index=i,
            new_values=mod.new_values,
            old_values=mod.old_values,
            partition_token=token,
            transaction_tag=c.transaction_tag,
            number_of_records_in_transaction=c.number_of_records_in_transaction,
            number_of_partitions_in_transaction=c.number_of_partitions_in_transaction,
        )
        for c in changes
        for i, mod in enumerate(c.mods)
    ]


def records_table(records: Sequence[SparkRecord]) -> Any:
    """The rows of ``records`` as a ``pyarrow.Table`` of ``rows.arrow_schema()``."""
    import pyarrow as pa

    from runtime.spark.rows import arrow_schema

    schema = arrow_schema()
    return pa.table(
        [pa.array([getattr(r, field.name) for r in records], type=field.type) for field in schema],
        schema=schema,
    )


def record_keys(records: Iterable[SparkRecord]) -> list[str]:
    """The distinct ordering keys of ``records``, in order of first appearance."""
    return list(dict.fromkeys(r.key for r in records))


def halves(records: Sequence[SparkRecord]) -> tuple[list[SparkRecord], list[SparkRecord]]:
    """Split by ordering key (the first half of the distinct keys, then the rest); each record
    keeps its order. ``records`` must hold at least two keys."""
    keys = record_keys(records)
    if len(keys) < 2:
        raise ValueError("halves() needs records of at least two keys")
    left = set(keys[: len(keys) // 2])
    return [r for r in records if r.key in left], [r for r in records if r.key not in left]
