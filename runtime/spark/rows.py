"""The pure parts of the Spark bridge: no Spark, no event loop, no clock of its own.

* ``to_columns`` turns change records into one row per mod (the output schema ``COLUMNS``);
  ``to_arrow`` makes the Arrow table Spark takes in.
* ``row_key`` is the identity of one output row: (commit timestamp, server transaction id,
  record sequence, mod index). The default output never holds two rows with the same key.
* Replayed records, the gaps failed batches leave and the failure cascade are the output
  ledger's (``protocol.ledger``, shared with the file sink), not this module's.
* ``Batcher`` collects ``SinkBatch``es and says when a micro-batch is due: at ``max_rows`` rows
  or when its oldest entry is ``max_age_s`` old — by age only while fewer than
  ``AGE_CUT_MAX_INFLIGHT`` micro-batches are in flight (adaptive batches, see ``Batcher.due``).
  Once every reader with a batch in the micro-batch waits only for its commit (``Sink.flush``)
  it is as good as old (``Batcher.flush``, the rule of ``protocol.gather``). Every call takes
  ``now``; ``deadline()`` is when the shell must look again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from protocol.gather import Flushes
from protocol.records import DataChange, Micros
from runtime.ports import SinkBatch

__all__ = [
    "AGE_CUT_MAX_INFLIGHT",
    "COLUMNS",
    "Batcher",
    "Cut",
    "arrow_schema",
    "row_key",
    "to_arrow",
    "to_columns",
    "warm_records",
    "warm_table",
]

# (name, arrow type name); the order is the output's column order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("table", "string"),
    ("mod_type", "string"),
    ("keys", "string"),
    ("new_values", "string"),
    ("old_values", "string"),
    ("commit_ts", "int64"),  # microseconds since the epoch, exact
    ("server_transaction_id", "string"),
    ("record_sequence", "string"),
    ("mod_index", "int32"),
    ("partition_token", "string"),
    ("transaction_tag", "string"),
    ("number_of_records_in_transaction", "int32"),
    ("number_of_partitions_in_transaction", "int32"),
)
KEY_COLUMNS = ("commit_ts", "server_transaction_id", "record_sequence", "mod_index")

# A micro-batch due by age alone is not cut while this many are in flight (one being written,
# the next one built and waiting for it): see ``Batcher.due``.
AGE_CUT_MAX_INFLIGHT = 2

RowKey = tuple[Micros, str, str, int]


def row_key(change: DataChange, mod_index: int) -> RowKey:
    """The de-duplication key of one output row (one mod of one data change)."""
    return (change.commit_ts, change.server_transaction_id, change.record_sequence, mod_index)


def to_columns(entries: Iterable[tuple[str, Sequence[DataChange]]]) -> dict[str, list[Any]]:
    """One row per mod of every record; ``entries`` are (partition token, records)."""
    cols: dict[str, list[Any]] = {name: [] for name, _ in COLUMNS}
    table, mod_type, keys, new, old = (
        cols["table"],
        cols["mod_type"],
        cols["keys"],
        cols["new_values"],
        cols["old_values"],
    )
    ts, txn, seq, idx = (
        cols["commit_ts"],
        cols["server_transaction_id"],
        cols["record_sequence"],
        cols["mod_index"],
    )
    token_col, tag, nrec, npart = (
        cols["partition_token"],
        cols["transaction_tag"],
        cols["number_of_records_in_transaction"],
        cols["number_of_partitions_in_transaction"],
    )
    for token, records in entries:
        for change in records:
            for i, mod in enumerate(change.mods):
                table.append(change.table)
                mod_type.append(change.mod_type)
                keys.append(mod.keys)
                new.append(mod.new_values)
                old.append(mod.old_values)
                ts.append(change.commit_ts)
                txn.append(change.server_transaction_id)
                seq.append(change.record_sequence)
                idx.append(i)
                token_col.append(token)
                tag.append(change.transaction_tag)
                nrec.append(change.number_of_records_in_transaction)
                npart.append(change.number_of_partitions_in_transaction)
    return cols


def arrow_schema() -> Any:
    """The output schema as a ``pyarrow.Schema`` (plain ``string``: Spark wants it exactly)."""
    import pyarrow as pa

    return pa.schema([(name, getattr(pa, type_name)()) for name, type_name in COLUMNS])


def to_arrow(entries: Iterable[tuple[str, Sequence[DataChange]]]) -> Any:
    """The rows of ``entries`` as a ``pyarrow.Table`` of ``arrow_schema()``."""
    import pyarrow as pa

    schema = arrow_schema()
    cols = to_columns(entries)
    return pa.table([pa.array(cols[f.name], type=f.type) for f in schema], schema=schema)


class Cut(msgspec.Struct, frozen=True):
    """One micro-batch cut by the ``Batcher``: the ``SinkBatch``es it holds, their row count
    and, per token, the highest watermark among them (batch id → watermarks)."""

    batch_id: int
    entries: tuple[SinkBatch, ...]
    rows: int
    watermarks: dict[str, int]
    first_put: float  # ``now`` of its oldest entry


class Batcher:
    """Collects ``SinkBatch``es into micro-batches; see the module docstring."""

    def __init__(self, max_rows: int, max_age_s: float, first_batch_id: int = 0) -> None:
        if max_rows < 1 or max_age_s <= 0:
            raise ValueError("max_rows must be >= 1 and max_age_s > 0")
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.next_batch_id = first_batch_id
        self._entries: list[SinkBatch] = []
        self._rows = 0
        self._first: float | None = None
        self._flushes = Flushes()
        self._flushed: float | None = None  # when every reader of a buffered entry had flushed

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def entries(self) -> int:
        return len(self._entries)

    def add(self, batch: SinkBatch, now: float) -> None:
        self._entries.append(batch)
        self._flushes.added(batch.token)
        self._rows += sum(len(r.mods) for r in batch.records)
        if self._first is None:
            self._first = now

    def full(self) -> bool:
        return self._rows >= self.max_rows

    def flush(self, token: str, now: float) -> bool:
        """The reader of ``token`` hands nothing more until its batches commit: once every
        reader with a buffered entry has said so, the micro-batch is due by age from ``now`` on
        (whether it became so now)."""
        if not self._flushes.flushed(token) or self._flushed is not None:
            return False
        self._flushed = now
        return True

    def deadline(self) -> float | None:
        """When the current micro-batch is due by age (None: nothing buffered)."""
        if self._first is None:
            return None
        aged = self._first + self.max_age_s
        return aged if self._flushed is None else min(aged, self._flushed)

    def due(self, now: float, inflight: int = 0) -> bool:
        """Whether to cut now, with ``inflight`` micro-batches cut and not yet committed: when
        full; when old enough only while fewer than ``AGE_CUT_MAX_INFLIGHT`` are in flight.
        While one is being written and the next already waits for it, cutting another small one
        by age would only queue it behind them (each Spark job has a fixed cost, so a sink
        slower than ``max_age_s`` would fall further behind); the rows keep joining the buffer
        instead, and the micro-batch grows to what the sink's pace allows."""
        if not self._entries:
            return False
        if self.full():
            return True
        deadline = self.deadline()
        return deadline is not None and now >= deadline and inflight < AGE_CUT_MAX_INFLIGHT

    def cut(self) -> Cut | None:
        """Take everything buffered as the next micro-batch (None if nothing is buffered)."""
        if not self._entries:
            return None
        watermarks: dict[str, int] = {}
        for entry in self._entries:
            prior = watermarks.get(entry.token, entry.watermark)
            watermarks[entry.token] = max(prior, entry.watermark)
        assert self._first is not None
        cut = Cut(self.next_batch_id, tuple(self._entries), self._rows, watermarks, self._first)
        self.next_batch_id += 1
        self._entries, self._rows, self._first, self._flushed = [], 0, None, None
        self._flushes.clear()
        return cut

    def take_id(self) -> int:
        """A batch id for a Spark batch that is not a cut (the bridge's halves and retries):
        every distinct set of rows a run writes gets its own id."""
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        return batch_id

    def take_all(self) -> list[SinkBatch]:
        """Empty the buffer without cutting (its entries are being failed)."""
        entries, self._entries, self._rows, self._first = self._entries, [], 0, None
        self._flushed = None
        self._flushes.clear()
        return entries


def warm_records(rows: int = 1) -> list[DataChange]:
    """One made-up record of ``rows`` rows, to warm Spark's paths before traffic."""
    from protocol.records import ColumnType, Mod

    change = DataChange(
        commit_ts=0,
        record_sequence="0",
        server_transaction_id="warm",
        is_last_record_in_transaction_in_partition=True,
        table="_warm",
        column_types=(ColumnType("Id", '{"code":"INT64"}', True, 1),),
        mods=tuple(Mod(f'{{"Id":{i}}}', "{}", "{}") for i in range(rows)),
        mod_type="INSERT",
    )
    return [change]


def warm_table() -> Any:
    """One made-up row, to warm Spark's path before traffic."""
    return to_arrow([("warm", warm_records())])
