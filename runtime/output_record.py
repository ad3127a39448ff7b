"""One output row (one mod of one data change) as the Kafka sink writes it and the Spark
bridge keeps it in its retry and dead-letter queues, with its record id and ordering key (pure:
no Kafka, no Spark), so both adapters share it without importing each other."""

from __future__ import annotations

import msgspec

from protocol.records import DataChange

__all__ = ["OutputRecord", "decode_output", "ordering_key", "output_records", "split_key"]


def ordering_key(table: str, keys: str) -> str:
    """The ordering key of a row (Spanner table names have no ':')."""
    return f"{table}:{keys}"


def split_key(key: str) -> tuple[str, str]:
    table, _, keys = key.partition(":")
    return table, keys


class OutputRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One row change on the output topic (JSON)."""

    record_id: str  # "<commit_ts>/<server_transaction_id>/<record_sequence>/<mod index>"
    table: str
    keys: str  # primary-key JSON text, as Spanner sends it
    mod_type: str
    commit_ts: int
    server_transaction_id: str
    record_sequence: str
    mod_index: int
    new_values: str
    old_values: str

    @property
    def key(self) -> str:
        return ordering_key(self.table, self.keys)


_out_decoder: msgspec.json.Decoder[OutputRecord] = msgspec.json.Decoder(OutputRecord)


def decode_output(raw: bytes) -> OutputRecord:
    return _out_decoder.decode(raw)


def output_records(change: DataChange) -> list[OutputRecord]:
    """One output record per mod of ``change``."""
    return [
        OutputRecord(
            record_id=f"{change.commit_ts}/{change.server_transaction_id}/"
            f"{change.record_sequence}/{i}",
            table=change.table,
            keys=mod.keys,
            mod_type=change.mod_type,
            commit_ts=change.commit_ts,
            server_transaction_id=change.server_transaction_id,
            record_sequence=change.record_sequence,
            mod_index=i,
            new_values=mod.new_values,
            old_values=mod.old_values,
        )
        for i, mod in enumerate(change.mods)
    ]
