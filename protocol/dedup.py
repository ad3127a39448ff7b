"""Re-reads dropped by identity: one rule for the partition reader and every sink
(docs/design.md#reading-a-partition).

A partition is re-read from a watermark *inclusive* (after a query error, a failed batch, a
restart or a hand-off), so records at exactly that commit timestamp may come again. A record's
identity is (commit timestamp, server transaction id, record sequence); within one partition it
names one record.

The rule, per partition: keep the **tail** — the newest commit timestamp accepted and the
identities accepted at it. A record is a re-read when its commit timestamp is older than the
tail's, or equal to it with an identity already accepted; otherwise it is new, and accepting it
moves the tail. A watermark without records at it (a heartbeat) moves the tail too, with no
identities. Records older than the tail are never new again: a partition's records are read in
commit-timestamp order, so only the tail's own timestamp can hold records not seen yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from protocol.records import DataChange

Identity = tuple[int, str, str]
"""(commit timestamp, server transaction id, record sequence)."""


class Position(msgspec.Struct, frozen=True, array_like=True):
    """An exact read position in one partition, as it travels between tasks and sinks: every
    record with a commit timestamp before ``ts`` is committed, and at ``ts`` exactly the records
    whose (server transaction id, record sequence) are in ``ids``. A reader that starts at a
    position reads from ``ts`` inclusive and skips ``ids``: nothing committed comes twice and
    nothing is skipped (docs/design.md#exactly-once-output)."""

    ts: int
    ids: tuple[tuple[str, str], ...] = ()

    def tail(self) -> PartitionTail:
        """The de-duplication tail a reader starting here begins with."""
        return PartitionTail(self.ts, ((self.ts, txn, seq) for txn, seq in self.ids))

    def newer(self, other: Position | None) -> Position:
        """The later of two positions of one partition (the resume rule: a take-over starts at
        the newer of the sync topic's position and the sink's own durable one). At one
        timestamp, the one that has committed more identities (positions of one partition at
        one timestamp only ever grow)."""
        if other is None or other.ts < self.ts:
            return self
        if other.ts > self.ts:
            return other
        return self if len(self.ids) >= len(other.ids) else other


class PartitionTail:
    """The tail of one partition: ``ts`` (-1: nothing yet) and the identities accepted at it."""

    __slots__ = ("ids", "ts")

    def __init__(self, ts: int = -1, ids: Iterable[Identity] = ()) -> None:
        self.ts = ts
        self.ids: set[Identity] = set(ids)

    def __repr__(self) -> str:
        return f"PartitionTail({self.ts}, {len(self.ids)} ids)"

    def seen(self, commit_ts: int, identity: Identity) -> bool:
        """Whether a record with this commit timestamp and identity is a re-read."""
        return commit_ts < self.ts or (commit_ts == self.ts and identity in self.ids)

    def accept(self, identity: Identity) -> None:
        """Take a record as read (its identity's first element is its commit timestamp)."""
        ts = identity[0]
        if ts > self.ts:
            self.ts = ts
            self.ids = {identity}
        elif ts == self.ts:
            self.ids.add(identity)

    def accept_all(self, records: Sequence[DataChange]) -> None:
        """:meth:`accept` each of ``records`` (any order), with one pass over their timestamps:
        only the identities at the newest can stay in the tail."""
        if not records:
            return
        newest = max(r.commit_ts for r in records)
        if newest < self.ts:
            return
        if newest > self.ts:
            self.ts = newest
            self.ids = set()
        self.ids.update(r.identity for r in records if r.commit_ts == newest)

    def advance(self, watermark: int) -> None:
        """Everything up to ``watermark`` is read (a watermark past the last record: there is
        nothing at it to remember)."""
        if watermark > self.ts:
            self.ts = watermark
            self.ids = set()

    def commit(self, watermark: int, records: Iterable[DataChange]) -> None:
        """A batch up to ``watermark`` is committed: the tail moves there and remembers the
        batch's records at exactly that timestamp."""
        self.advance(watermark)
        for record in records:
            if record.commit_ts == self.ts:
                self.ids.add(record.identity)

    def fresh(self, records: Iterable[DataChange]) -> list[DataChange]:
        """The records that are not re-reads, in order; they are accepted."""
        out = []
        for record in records:
            identity = record.identity
            if not self.seen(record.commit_ts, identity):
                self.accept(identity)
                out.append(record)
        return out

    def copy(self) -> PartitionTail:
        return PartitionTail(self.ts, self.ids)

    def position(self) -> Position:
        """This tail as a :class:`Position` (identities sorted: the same tail, the same bytes)."""
        return Position(self.ts, tuple(sorted((txn, seq) for _, txn, seq in self.ids)))


class Tails:
    """The tails of many partitions, by partition token (a sink's view of what it wrote)."""

    __slots__ = ("_tails",)

    def __init__(self) -> None:
        self._tails: dict[str, PartitionTail] = {}

    def __len__(self) -> int:
        return len(self._tails)

    def get(self, token: str) -> PartitionTail | None:
        return self._tails.get(token)

    def seen(self, token: str, record: DataChange) -> bool:
        tail = self._tails.get(token)
        return tail is not None and tail.seen(record.commit_ts, record.identity)

    def accept(self, token: str, identity: Identity) -> None:
        tail = self._tails.get(token)
        if tail is None:
            self._tails[token] = PartitionTail(identity[0], (identity,))
        else:
            tail.accept(identity)

    def accept_all(self, token: str, records: Sequence[DataChange]) -> None:
        """:meth:`accept` the identity of each of ``records`` (:meth:`PartitionTail.accept_all`)."""
        if not records:
            return
        tail = self._tails.get(token)
        if tail is None:
            tail = self._tails[token] = PartitionTail()
        tail.accept_all(records)

    def fresh(self, token: str, records: Iterable[DataChange]) -> list[DataChange]:
        """The records of ``token`` that are not re-reads, in order; they are accepted."""
        tail = self._tails.get(token)
        if tail is None:
            tail = self._tails[token] = PartitionTail()
        return tail.fresh(records)

    def resume(self, token: str, position: Position) -> None:
        """Start ``token``'s tail at ``position`` unless it already has a tail (a sink learning
        what an earlier process committed)."""
        if token not in self._tails:
            self._tails[token] = position.tail()

    def copy(self) -> Tails:
        other = Tails()
        other._tails = {token: tail.copy() for token, tail in self._tails.items()}
        return other
