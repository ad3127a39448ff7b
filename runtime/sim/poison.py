"""A poison partition for the real-part test and ``python -m bench poison``: a simulated stream
with one record the typed conversion cannot hold, and a sink that writes each batch through the
real typed conversion (``runtime.typed.typed_tables``) and keeps the rows it wrote, raw.

* :class:`PoisonedSource` wraps a :class:`~runtime.sim.source.SimulatedSource`: the first data
  record of partition ``token`` committed at or after ``at_ts`` comes with its ``Value`` column
  (``INT64``) set to a string no INT64 holds. Its identity (commit timestamp, transaction,
  sequence) stays the model's, so the exactly-once checks count it like any other.
* :class:`TypedRowSink` is an ``on_batch`` callback (``actors.embed.open_task``): it
  converts the batch to typed Arrow tables; a value that does not fit fails the batch (the
  reader re-reads it) until :meth:`TypedRowSink.heal` is called, as when the conversion is
  fixed; after that a value that does not fit is written as its JSON text. ``rows`` holds one
  entry per mod written, in order, nothing de-duplicated.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import msgspec

from protocol.records import ChangeRecord, DataChange, Mod
from runtime.ports import ChangeStreamSource, SinkBatch
from runtime.sim.source import SimulatedSource
from runtime.typed import TypedError, typed_tables

__all__ = ["POISON_VALUE", "PoisonedSource", "TypedRowSink", "poisoned"]

POISON_VALUE = "9223372036854775808 apples"  # no INT64


def poisoned(record: DataChange) -> DataChange:
    """``record`` with its first mod's ``Value`` set to :data:`POISON_VALUE`."""
    first = record.mods[0]
    values = json.loads(first.new_values or "{}")
    values["Value"] = POISON_VALUE
    mod = Mod(first.keys, json.dumps(values, separators=(",", ":")), first.old_values)
    return msgspec.structs.replace(record, mods=(mod, *record.mods[1:]))


class PoisonedSource(ChangeStreamSource):
    """``ChangeStreamSource``: ``inner``, with the record of :meth:`poison` made poison."""

    def __init__(self, inner: SimulatedSource, token: str, at_ts: int) -> None:
        self.inner = inner
        self.token = token
        self.at_ts = at_ts
        self._poison: tuple[int, str, str] | None = None

    def poison(self, until_ts: int) -> tuple[int, str, str] | None:
        """The identity of the poison record (once the stream has reached it by ``until_ts``)."""
        if self._poison is None:
            for record in self.inner.model.records(self.token, self.at_ts, until_ts):
                if isinstance(record, DataChange):
                    self._poison = record.identity
                    break
        return self._poison

    async def watched_tables(self) -> tuple[str, ...]:
        return await self.inner.watched_tables()

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        stream = self.inner.query(token, start_ts, end_ts)
        try:
            async for batch in stream:
                if token == self.token:
                    batch = [self._swap(r) for r in batch]
                yield batch
        finally:
            await stream.aclose()

    def _swap(self, record: ChangeRecord) -> ChangeRecord:
        if not isinstance(record, DataChange) or record.commit_ts < self.at_ts:
            return record
        if self.poison(record.commit_ts) == record.identity:
            return poisoned(record)
        return record


class TypedRowSink:
    """An ``on_batch`` callback writing through the typed conversion; see the module docstring."""

    def __init__(self) -> None:
        self.rows: list[tuple[tuple[int, str, str], int]] = []  # (record identity, mod index)
        self.healed = False
        self.failed = 0  # batches failed by the conversion
        self.kept_as_text = 0  # values written as text after healing

    def heal(self) -> None:
        self.healed = True

    async def __call__(self, batch: SinkBatch) -> None:
        if batch.records:
            try:
                typed_tables([(batch.token, batch.records)])
            except TypedError:
                if not self.healed:
                    self.failed += 1
                    raise
                self.kept_as_text += 1
        for record in batch.records:
            self.rows.extend((record.identity, i) for i in range(len(record.mods)))
