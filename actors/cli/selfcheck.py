"""The command line's self-check of a bounded run over a stream it can foresee (the simulated
stream; the emulator's write load by its rows): whether the sink committed every record of the
window, once, in memory that does not grow with the backlog. Pure and synchronous.

**What was committed** (:class:`CommitTally`, fed by the run's shared sink). A partition's
records reach the sink in its order (a partition is read in commit-timestamp order, and the
reader drops re-reads and records behind its position), so what the sink committed of one
partition is summed up by its newest commit timestamp and the identities at it (the
*watermark*), a count, the rows and an order-free digest (the sum of the identities' hashes): a
record at or behind the watermark was committed already (a *duplicate*, counted and left out of
the sums), one past it is new. A sink may acknowledge one partition's batches out of order (the
Kafka sink settles a batch once each of its records is settled): batches count in the order
they were handed over, a later one waiting for the outcome of the one before it; a failed batch
counts for nothing (its records are read again).

**What was produced** (:func:`expect`): the same sums per partition, over the records the
window holds.

The window is **complete** when every partition's committed sums equal its expected ones: a
record lost leaves its partition's count short, one committed twice is a duplicate, a record
that was never produced (or one of another partition) makes a digest or a count differ.
(Holding each identity instead cost about 290 MiB per million records, twice over: the
committed ones and the expected ones.)"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import msgspec

from protocol.records import DataChange

_MASK = (1 << 64) - 1

Identity = tuple[int, str, str]


class Sums(msgspec.Struct):
    """Records, rows and the digest of a set of records of one partition."""

    records: int = 0
    rows: int = 0
    digest: int = 0

    def add(self, record: DataChange) -> None:
        self.records += 1
        self.rows += len(record.mods)
        self.digest = (self.digest + hash(record.identity)) & _MASK


def expect(records: Iterable[tuple[str, DataChange]]) -> dict[str, Sums]:
    """The sums per partition of ``records`` (partition token, record), each record once."""
    out: dict[str, Sums] = {}
    for token, record in records:
        sums = out.get(token)
        if sums is None:
            sums = out[token] = Sums()
        sums.add(record)
    return out


class _Partition:
    """What the sink committed of one partition, and its batches not counted yet."""

    __slots__ = ("at_high", "counted", "handed", "high", "settled", "sums")

    def __init__(self) -> None:
        self.sums = Sums()
        self.high = -1  # the newest commit timestamp committed
        self.at_high: set[Identity] = set()  # the identities committed at ``high``
        self.handed = 0  # batches handed to the sink
        self.counted = 0  # batches counted (or dropped as failed), in handed order
        # batches settled while one handed before them was not (by their number); None: failed
        self.settled: dict[int, Sequence[DataChange] | None] = {}


class CommitTally:
    """What the sink committed, per partition (see the module docstring)."""

    def __init__(self) -> None:
        self._partitions: dict[str, _Partition] = {}
        self.records = 0  # records committed, duplicates included
        self.rows = 0
        self.distinct_rows = 0  # rows of the records committed for the first time
        self.duplicates = 0  # records committed again

    def _partition(self, token: str) -> _Partition:
        p = self._partitions.get(token)
        if p is None:
            p = self._partitions[token] = _Partition()
        return p

    def handed(self, token: str) -> int:
        """A batch of ``token`` was handed to the sink: its number, for :meth:`settled`."""
        p = self._partition(token)
        p.handed += 1
        return p.handed - 1

    def settled(self, token: str, batch: int, records: Sequence[DataChange] | None) -> None:
        """Batch ``batch`` of ``token`` committed ``records`` (None: it failed)."""
        p = self._partition(token)
        p.settled[batch] = records
        while p.counted in p.settled:
            got = p.settled.pop(p.counted)
            p.counted += 1
            if got is not None:
                self._count(p, got)

    def _count(self, p: _Partition, records: Sequence[DataChange]) -> None:
        for r in records:
            rows = len(r.mods)
            self.records += 1
            self.rows += rows
            ts = r.commit_ts
            if ts < p.high or (ts == p.high and r.identity in p.at_high):
                self.duplicates += 1
                continue
            if ts > p.high:
                p.high = ts
                p.at_high = set()
            p.at_high.add(r.identity)
            p.sums.add(r)
            self.distinct_rows += rows

    def sums(self, token: str) -> Sums:
        p = self._partitions.get(token)
        return Sums() if p is None else p.sums

    def pending(self) -> int:
        """Batches handed and not counted yet (in flight, or behind one that is)."""
        return sum(p.handed - p.counted for p in self._partitions.values())

    def differs(self, expected: dict[str, Sums]) -> list[str]:
        """The partitions of ``expected`` whose committed sums are not the expected ones
        (partitions outside it, a snapshot's work items say, are not looked at)."""
        return sorted(t for t, want in expected.items() if self.sums(t) != want)

    def complete(self, expected: dict[str, Sums]) -> bool:
        return not self.differs(expected)


def missing_from(
    records: Iterable[tuple[str, DataChange]], tokens: Iterable[str], present: set[Identity]
) -> Iterator[Identity]:
    """The identities of ``records`` of the partitions ``tokens`` not in ``present`` (an
    output read back whole: the slow way, for the partitions whose sums differ)."""
    wanted = set(tokens)
    for token, record in records:
        if token in wanted and record.identity not in present:
            yield record.identity
