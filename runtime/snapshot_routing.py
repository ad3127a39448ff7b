"""``SnapshotRouting``: one ``ChangeStreamSource`` for every work item of a connector, snapshot
partitions included (``protocol/snapshot.py``), so the partition reader stays unchanged.

A query of a snapshot work item (``snapshot:<table>/<index>``) reads that snapshot partition
from the :class:`~runtime.ports.SnapshotSource` — what it needs (its
:class:`~protocol.messages.SnapshotItem` and the snapshot's chunk size) comes from the
connector's consolidated state through ``lookup`` — and every other query goes to the change
stream. A snapshot partition's query ignores the start and end it is given: its records are all
at T, and a reader resuming it reads it again from its first chunk, dropping the chunks already
committed (the reader's rule 2). A query of a snapshot partition the consolidated state records
done (``done``: every chunk was committed by the reader that finished it) ends at once with
nothing: its reader finishes it without writing anything again.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence

from protocol.messages import SnapshotItem
from protocol.records import ChangeRecord
from protocol.snapshot import is_snapshot
from runtime.ports import ChangeStreamSource, SnapshotSource

__all__ = ["SnapshotLookup", "SnapshotRouting", "UnknownSnapshotPartition"]

SnapshotLookup = Callable[[str], tuple[SnapshotItem, int] | None]
"""A snapshot work item's description and the snapshot's chunk rows, or None where the
consolidated state holds none (not recorded yet here, or done)."""


class UnknownSnapshotPartition(RuntimeError):
    """A snapshot work item this process's state does not describe (yet): the reader retries."""


class SnapshotRouting(ChangeStreamSource):
    """See the module docstring."""

    def __init__(
        self,
        inner: ChangeStreamSource,
        snapshots: SnapshotSource,
        lookup: SnapshotLookup,
        done: Callable[[str], bool] = lambda token: False,
    ) -> None:
        self.inner = inner
        self.snapshots = snapshots
        self.lookup = lookup
        self.done = done
        self.ended_done = 0  # queries of partitions already done, ended at once

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        if token is None or not is_snapshot(token):
            async for batch in self.inner.query(token, start_ts, end_ts):
                yield batch
            return
        found = self.lookup(token)
        if found is None and self.done(token):
            self.ended_done += 1
            return
        if found is None:
            raise UnknownSnapshotPartition(
                f"snapshot partition {token}: no snapshot recorded in this process's sync-topic "
                "state describes it"
            )
        item, chunk_rows = found
        async for batch in self.snapshots.read_snapshot(item, chunk_rows):
            yield batch

    async def watched_tables(self) -> tuple[str, ...] | None:
        ask = getattr(self.inner, "watched_tables", None)
        if ask is None:
            return None
        tables: tuple[str, ...] | None = await ask()
        return tables
