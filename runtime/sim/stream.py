"""A seeded, deterministic model of a Spanner change stream: partitions that split, move and
merge, and the data records each of them carries. Pure and synchronous: the embedded simulator
source (``runtime/sim/source.py``), the deterministic fault simulator and the tests all read it.

Time is cut into rounds of ``round_us``. At each round boundary every live partition may end and
hand over to children: a split (1 -> 2), a move (1 -> 1) or a merge (2 -> 1, both parents name the
same child with both parents). A child starts when its last parent ends. Records of one partition
in one round are drawn from ``Random(f"{seed}:{token}:{round}")``, so any slice of the stream can
be produced in any order and always comes out the same.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec

from protocol.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitions,
    ColumnType,
    DataChange,
    Mod,
)

_COLUMNS = (
    ColumnType("Id", '{"code":"INT64"}', True, 1),
    ColumnType("Name", '{"code":"STRING"}', False, 2),
    ColumnType("Value", '{"code":"INT64"}', False, 3),
)
_MOD_TYPES = ("INSERT", "UPDATE", "DELETE")


class StreamParams(msgspec.Struct, frozen=True):
    seed: int = 0
    roots: int = 4
    start_ts: int = 1_700_000_000_000_000
    round_us: int = 2_000_000
    split_p: float = 0.05
    move_p: float = 0.03
    merge_p: float = 0.05
    min_partitions: int = 1
    max_partitions: int = 1_000_000
    records_per_s: float = 20.0  # per partition
    tables: tuple[str, ...] = ("Singers", "Albums", "Songs")
    max_mods: int = 3
    churn_until: int | None = None  # no partition ends at a boundary after this time


class PartitionInfo(msgspec.Struct):
    token: str
    parents: tuple[str, ...]
    start_ts: int
    end_ts: int | None = None  # None: still live at the last generated round
    children: tuple[str, ...] = ()


class StreamModel:
    """The whole topology and the records of a simulated change stream."""

    def __init__(self, params: StreamParams) -> None:
        self.params = params
        self._rng = random.Random(params.seed)
        self._next = 0
        self.partitions: dict[str, PartitionInfo] = {}
        self._live: list[str] = []
        self._rounds = 0  # boundaries generated: rounds 1.._rounds
        # generated rounds, kept for re-reads; bounded in records too, so that a long backlog
        # of a fast stream does not keep every record it served (bench catchup)
        self._cache: dict[tuple[str, int], list[DataChange]] = {}
        self._cached_records = 0
        self.roots = tuple(self._new(()) for _ in range(params.roots))

    # -- topology ---------------------------------------------------------------------------
    def _new(self, parents: tuple[str, ...], start_ts: int | None = None) -> str:
        token = f"p{self._next:05d}"
        self._next += 1
        ts = self.params.start_ts if start_ts is None else start_ts
        self.partitions[token] = PartitionInfo(token, parents, ts)
        self._live.append(token)
        return token

    def _boundary(self, r: int) -> int:
        return self.params.start_ts + r * self.params.round_us

    def generate_until(self, ts: int) -> None:
        """Make sure every partition end at or before ``ts`` is known."""
        while self._boundary(self._rounds + 1) <= ts + self.params.round_us:
            self._generate_round()

    def _generate_round(self) -> None:
        self._rounds += 1
        p = self.params
        rng = self._rng
        boundary = self._boundary(self._rounds)
        if p.churn_until is not None and boundary > p.churn_until:
            return
        live = sorted(self._live)
        rng.shuffle(live)
        count = len(live)
        ended: list[str] = []
        i = 0
        while i < len(live):
            token = live[i]
            u = rng.random()
            end = boundary + rng.randrange(p.round_us // 2)
            can_merge = i + 1 < len(live) and count - 1 >= p.min_partitions
            if u < p.merge_p and can_merge:
                other = live[i + 1]
                other_end = boundary + rng.randrange(p.round_us // 2)
                self.partitions[token].end_ts = end
                self.partitions[other].end_ts = other_end
                parents = tuple(sorted((token, other)))
                child = self._new(parents, max(end, other_end))
                self.partitions[token].children = (child,)
                self.partitions[other].children = (child,)
                ended += [token, other]
                count -= 1
                i += 2
                continue
            if u < p.merge_p + p.split_p and count + 1 <= p.max_partitions:
                self.partitions[token].end_ts = end
                kids = (self._new((token,), end), self._new((token,), end))
                self.partitions[token].children = kids
                ended.append(token)
                count += 1
            elif u < p.merge_p + p.split_p + p.move_p:
                self.partitions[token].end_ts = end
                self.partitions[token].children = (self._new((token,), end),)
                ended.append(token)
            i += 1
        gone = set(ended)
        self._live = [t for t in self._live if t not in gone]

    def info(self, token: str) -> PartitionInfo:
        return self.partitions[token]

    # -- records ----------------------------------------------------------------------------
    def _round_of(self, ts: int) -> int:
        return (ts - self.params.start_ts) // self.params.round_us

    def _round_records(self, token: str, r: int) -> list[DataChange]:
        key = (token, r)
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) > 100_000 or self._cached_records > 50_000:
                self._cache.clear()
                self._cached_records = 0
            cached = self._cache[key] = self._make_round_records(token, r)
            self._cached_records += len(cached)
        return cached

    def _make_round_records(self, token: str, r: int) -> list[DataChange]:
        p = self.params
        rng = random.Random(f"{p.seed}:{token}:{r}")
        lo = self._boundary(r)
        hi = lo + p.round_us
        info = self.partitions[token]
        lo = max(lo, info.start_ts)
        if info.end_ts is not None:
            hi = min(hi, info.end_ts)
        out: list[DataChange] = []
        if hi <= lo or p.records_per_s <= 0:
            return out
        mean_gap = 1_000_000 / p.records_per_s
        ts = lo + int(rng.expovariate(1.0) * mean_gap)
        k = 0
        while ts < hi:
            table = p.tables[rng.randrange(len(p.tables))]
            mod_type = _MOD_TYPES[rng.randrange(3)]
            mods = []
            for _ in range(1 + rng.randrange(p.max_mods)):
                key = rng.randrange(1_000_000)
                new = "{}" if mod_type == "DELETE" else f'{{"Name":"n{key}","Value":{k}}}'
                old = "{}" if mod_type == "INSERT" else f'{{"Value":{k - 1}}}'
                mods.append(Mod(f'{{"Id":{key}}}', new, old))
            out.append(
                DataChange(
                    commit_ts=ts,
                    record_sequence=f"{k:08d}",
                    server_transaction_id=f"{token}.{r}.{k}",
                    is_last_record_in_transaction_in_partition=True,
                    table=table,
                    column_types=_COLUMNS,
                    mods=tuple(mods),
                    mod_type=mod_type,  # type: ignore[arg-type]
                )
            )
            k += 1
            ts += 1 + int(rng.expovariate(1.0) * mean_gap)
        return out

    def records(self, token: str, start_ts: int, until_ts: int) -> Iterator[ChangeRecord]:
        """Records of ``token`` with ``start_ts <= ts <= until_ts``, then, if the partition ended
        at or before ``until_ts``, its ``ChildPartitions`` record."""
        self.generate_until(until_ts)
        info = self.partitions[token]
        start = max(start_ts, info.start_ts)
        stop = until_ts if info.end_ts is None else min(until_ts, info.end_ts - 1)
        for r in range(self._round_of(start), self._round_of(stop) + 1):
            for rec in self._round_records(token, r):
                if start <= rec.commit_ts <= stop:
                    yield rec
        if info.end_ts is not None and info.end_ts <= until_ts:
            yield self.child_record(token)

    def child_record(self, token: str) -> ChildPartitions:
        info = self.partitions[token]
        assert info.end_ts is not None
        return ChildPartitions(
            start_ts=info.end_ts,
            record_sequence="00000000",
            children=tuple(ChildPartition(c, self.partitions[c].parents) for c in info.children),
        )

    def root_record(self) -> ChildPartitions:
        return ChildPartitions(
            start_ts=self.params.start_ts,
            record_sequence="00000000",
            children=tuple(ChildPartition(t, ()) for t in self.roots),
        )

    def expected(self, until_ts: int) -> Iterator[DataChange]:
        """Every data record committed at or before ``until_ts``, over all partitions."""
        for _, rec in self.expected_by_partition(until_ts):
            yield rec

    def expected_by_partition(self, until_ts: int) -> Iterator[tuple[str, DataChange]]:
        """:meth:`expected` with each record's partition token, a partition at a time (the
        command line's self-check sums them per partition: ``actors/cli/selfcheck.py``)."""
        self.generate_until(until_ts)
        for token in list(self.partitions):
            info = self.partitions[token]
            if info.start_ts > until_ts:
                continue
            for rec in self.records(token, info.start_ts, until_ts):
                if isinstance(rec, DataChange):
                    yield token, rec


def snapshot_records(
    seed: int, read_ts: int, partitions: int, max_chunks: int
) -> dict[str, tuple[DataChange, ...]]:
    """A seeded snapshot at ``read_ts`` of ``partitions`` partitions, each with 0 to
    ``max_chunks`` chunks: records as a snapshot partition's reader sends them
    (``protocol/snapshot.py``, rule 3: commit timestamp T, transaction id the work item's token,
    record sequence the chunk's number, ``SNAPSHOT`` rows), by work-item token."""
    from protocol.snapshot import work_token

    rng = random.Random(f"snapshot:{seed}")
    out: dict[str, tuple[DataChange, ...]] = {}
    for i in range(partitions):
        table = _SNAPSHOT_TABLES[i % len(_SNAPSHOT_TABLES)]
        token = work_token(table, i)
        chunks = []
        for k in range(rng.randint(0, max_chunks)):
            keys = [rng.randrange(1_000_000) for _ in range(1 + rng.randrange(3))]
            chunks.append(
                DataChange(
                    commit_ts=read_ts,
                    record_sequence=str(k),
                    server_transaction_id=token,
                    is_last_record_in_transaction_in_partition=False,
                    table=table,
                    column_types=_COLUMNS,
                    mods=tuple(
                        Mod(f'{{"Id":{x}}}', f'{{"Name":"s{x}","Value":0}}', "{}") for x in keys
                    ),
                    mod_type="SNAPSHOT",
                    value_capture_type="NEW_ROW",
                )
            )
        out[token] = tuple(chunks)
    return out


_SNAPSHOT_TABLES = ("Singers", "Albums", "Songs")
