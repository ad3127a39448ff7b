"""A seeded model of a ``MUTABLE_KEY_RANGE`` change stream and of its readers, to check the
lifecycle core (``protocol/mutable.py``) against its promise: every key's changes come out in
commit-timestamp order, none lost or doubled, while key ranges move between live partitions and
readers run at unrelated speeds.

The stream (:func:`stream`): ``partitions`` partitions announced by the root query's partition
start, each owning some of ``keys`` keys. At each timestamp one thing happens: a write to a key
(a data change in the partition that owns the key then), or a move of one key from its owner to
another partition (a move-out record in the source and a move-in record in the destination, at
the same timestamp). Partitions end after the last timestamp.

The readers (:func:`run`): at each step a seeded scheduler picks one partition with something
left to read and not held, and reads its next record: a data change is delivered; lifecycle
records go to the core, whose commands are carried out (``Hold`` stops the partition after its
move-in until ``Release``); every record read is then reported as progress. With
``honour_holds=False`` the holds are ignored: the control whose failures show the checks bite.

Deterministic for a seed (``random.Random(seed)``); no I/O, no clock.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from typing import Any

import msgspec

from protocol.mutable import (
    Hold,
    MutableLifecycle,
    PartitionEnd,
    PartitionEvent,
    PartitionStart,
    Progress,
    Release,
    Schedule,
)
from protocol.records import ChangeRecord, ColumnType, DataChange, Heartbeat, Mod
from runtime.ports import ChangeStreamSource

__all__ = [
    "MutableRun",
    "MutableSource",
    "MutableStreamModel",
    "MutableStreamParams",
    "Write",
    "key_order_violations",
    "run",
    "stream",
    "write_key",
]

Record = tuple[int, int] | PartitionEvent | PartitionEnd  # (key, ts) stands for a data change


class Write(msgspec.Struct, frozen=True):
    key: int
    ts: int


class MutableRun(msgspec.Struct, frozen=True):
    seed: int
    writes: int
    moves: int
    holds: int
    delivered: tuple[Write, ...]
    out_of_order: tuple[tuple[Write, Write], ...]  # (earlier delivered, later delivered)
    lost: int
    doubled: int


def stream(
    seed: int, *, partitions: int = 4, keys: int = 6, steps: int = 60, move_p: float = 0.3
) -> tuple[PartitionStart, dict[str, list[Record]], list[Write], int]:
    """The root's partition start, each partition's records in order, every write, and the
    number of moves."""
    rng = random.Random(seed)
    tokens = [f"p{i}" for i in range(partitions)]
    owner = {k: tokens[k % partitions] for k in range(keys)}
    records: dict[str, list[Record]] = {t: [] for t in tokens}
    writes: list[Write] = []
    moves = 0
    for ts in range(1, steps + 1):
        key = rng.randrange(keys)
        if rng.random() < move_p:
            source = owner[key]
            destination = rng.choice([t for t in tokens if t != source])
            records[source].append(PartitionEvent(ts, "0", source, move_out_to=(destination,)))
            records[destination].append(
                PartitionEvent(ts, "0", destination, move_in_from=(source,))
            )
            owner[key] = destination
            moves += 1
        else:
            records[owner[key]].append((key, ts))
            writes.append(Write(key, ts))
    for t in tokens:
        records[t].append(PartitionEnd(steps + 1, "0", t))
    return PartitionStart(0, "0", tuple(tokens)), records, writes, moves


def run(seed: int, *, honour_holds: bool = True, **params: float) -> MutableRun:
    """Read the stream of ``seed`` with the core deciding when each partition may go on."""
    start, records, writes, moves = stream(seed, **params)  # type: ignore[arg-type]
    rng = random.Random(seed * 7919 + 1)
    core = MutableLifecycle()
    position: dict[str, int] = {}
    held: set[str] = set()
    holds = 0
    for command in core.on_record(None, start):
        assert isinstance(command, Schedule)
        position[command.token] = 0
    delivered: list[Write] = []
    while True:
        ready = [
            t
            for t, i in sorted(position.items())
            if i < len(records[t]) and (t not in held or not honour_holds)
        ]
        if not ready:
            break
        token = rng.choice(ready)
        record = records[token][position[token]]
        position[token] += 1
        if isinstance(record, tuple):
            delivered.append(Write(*record))
            ts = record[1]
            commands = core.on_progress(Progress(token, ts))
        else:
            commands = core.on_record(token, record)
            ts = record.commit_ts if isinstance(record, PartitionEvent) else record.end_ts
            if not any(isinstance(c, Hold) and c.token == token for c in commands):
                commands += core.on_progress(Progress(token, ts))
        for command in commands:
            if isinstance(command, Hold):
                held.add(command.token)
                holds += 1
            elif isinstance(command, Release):
                held.discard(command.token)
                commands += core.on_progress(Progress(command.token, command.ts))
        core.validate()
    newest: dict[int, Write] = {}
    wrong: list[tuple[Write, Write]] = []
    seen: defaultdict[Write, int] = defaultdict(int)
    for w in delivered:
        seen[w] += 1
        before = newest.get(w.key)
        if before is not None and before.ts > w.ts:
            wrong.append((before, w))
        if before is None or w.ts > before.ts:
            newest[w.key] = w
    return MutableRun(
        seed=seed,
        writes=len(writes),
        moves=moves,
        holds=holds,
        delivered=tuple(delivered),
        out_of_order=tuple(wrong),
        lost=sum(1 for w in writes if w not in seen),
        doubled=sum(n - 1 for n in seen.values() if n > 1),
    )


# -- the fault simulator's stream of this mode ------------------------------------------------
class MutableStreamParams(msgspec.Struct, frozen=True):
    seed: int = 0
    roots: int = 4
    keys: int = 12
    start_ts: int = 1_700_000_000_000_000
    round_us: int = 2_000_000
    moves_per_round: float = 1.5  # keys moving between live partitions, on average
    new_p: float = 0.25  # per round: a live partition announces a new one, which gets a key
    # ... and a second live partition announces it too, at the same timestamp (the readers of
    # both may find it unknown at once: protocol/mutable.py, rule 8)
    twice_p: float = 0.5
    end_p: float = 0.15  # per round: a live partition moves its keys out and ends
    min_partitions: int = 2
    max_partitions: int = 12
    writes_per_s: float = 2.0  # per key
    churn_until: int | None = None  # no move, start or end after this time


class _Info(msgspec.Struct):
    """What the fault simulator asks of a partition (as of ``runtime/sim/stream.py``)."""

    token: str
    start_ts: int
    parents: tuple[str, ...] = ()  # none in this mode: holds order the partitions instead
    end_ts: int | None = None


_TABLE_COLUMNS = (
    ColumnType("Id", '{"code":"STRING"}', True, 1),
    ColumnType("Value", '{"code":"INT64"}', False, 2),
)


class MutableStreamModel:
    """A MUTABLE_KEY_RANGE change stream for the fault simulator, with the interface it reads
    (``roots``, ``partitions``, ``info``, ``records``, ``expected``, ``root_record``): ``keys``
    keys, each owned by one live partition at a time and written ``writes_per_s`` times a
    second (a write at ``T`` of a key moving at ``T`` is still the source's); per round of
    ``round_us``, seeded: keys moving between live partitions (a move-out event in the source,
    a move-in event in the destination, at one timestamp), a live partition announcing a new
    one (a partition start record) that a key moves into at once, and a partition moving all
    its keys out and ending (its partition end record at the moves' timestamp). Every
    partition's records are in timestamp order, and in the order they happened at one
    timestamp; generated round by round as they are asked for, so the same for a seed."""

    def __init__(self, params: MutableStreamParams) -> None:
        self.params = params
        self.roots = tuple(f"m{i:04d}" for i in range(params.roots))
        self._next = params.roots
        self.partitions: dict[str, _Info] = {t: _Info(t, params.start_ts) for t in self.roots}
        self._live = list(self.roots)
        self._owner = {k: self.roots[k % params.roots] for k in range(params.keys)}
        self._records: dict[
            str, list[ChangeRecord | PartitionEvent | PartitionEnd | PartitionStart]
        ] = {t: [] for t in self.roots}
        self._times: dict[str, list[int]] = {t: [] for t in self.roots}
        self._seq: dict[str, int] = dict.fromkeys(self.roots, 0)
        self._rounds = 0
        self.moves = 0
        self.announced_twice = 0

    def root_record(self) -> PartitionStart:
        return PartitionStart(self.params.start_ts, "0", self.roots)

    def info(self, token: str) -> _Info:
        return self.partitions[token]

    def generate_until(self, ts: int) -> None:
        p = self.params
        while p.start_ts + self._rounds * p.round_us <= ts:
            self._round()

    def _add(self, token: str, ts: int, record: object) -> None:
        self._records[token].append(record)  # type: ignore[arg-type]
        self._times[token].append(ts)

    def _sequence(self, token: str) -> str:
        self._seq[token] += 1
        return str(self._seq[token])

    def _move(self, key: int, destination: str, ts: int) -> None:
        source = self._owner[key]
        self._add(
            source,
            ts,
            PartitionEvent(ts, self._sequence(source), source, move_out_to=(destination,)),
        )
        self._add(
            destination,
            ts,
            PartitionEvent(ts, self._sequence(destination), destination, move_in_from=(source,)),
        )
        self._owner[key] = destination
        self.moves += 1

    def _round(self) -> None:
        p = self.params
        r = self._rounds
        self._rounds += 1
        lo = p.start_ts + r * p.round_us
        hi = lo + p.round_us
        rng = random.Random(f"mutable:{p.seed}:{r}")
        events: list[tuple[int, int, str, int]] = []  # (ts, 0 write / 1 lifecycle, kind, key)
        gap = 1_000_000 / p.writes_per_s if p.writes_per_s > 0 else 0.0
        for key in range(p.keys):
            ts = lo + int(rng.expovariate(1.0) * gap) if gap else hi
            while ts < hi:
                events.append((ts, 0, "write", key))
                ts += 1 + int(rng.expovariate(1.0) * gap)
        churn = p.churn_until is None or hi <= p.churn_until
        if churn:
            moves = int(p.moves_per_round) + (rng.random() < p.moves_per_round % 1)
            events += [
                (rng.randrange(lo + 1, hi), 1, "move", rng.randrange(p.keys)) for _ in range(moves)
            ]
            if rng.random() < p.new_p:
                events.append((rng.randrange(lo + 1, hi), 1, "new", rng.randrange(p.keys)))
            if rng.random() < p.end_p:
                events.append((rng.randrange(lo + 1, hi), 1, "end", 0))
        events.sort()
        written: set[tuple[int, int]] = set()
        for ts, _, kind, key in events:
            if kind == "write":
                if (ts, key) in written:
                    continue
                written.add((ts, key))
                owner = self._owner[key]
                self._add(owner, ts, _write(key, ts))
            elif kind == "move":
                others = [t for t in self._live if t != self._owner[key]]
                if others:
                    self._move(key, rng.choice(others), ts)
            elif kind == "new" and len(self._live) < p.max_partitions:
                token = f"m{self._next:04d}"
                self._next += 1
                announcer = rng.choice(self._live)
                self.partitions[token] = _Info(token, ts)
                self._records[token], self._times[token], self._seq[token] = [], [], 0
                self._add(announcer, ts, PartitionStart(ts, self._sequence(announcer), (token,)))
                # (a separate stream of chances: the histories without it stay as they were)
                twice = random.Random(f"mutable-twice:{p.seed}:{r}:{token}")
                others = [t for t in self._live if t != announcer]
                if others and twice.random() < p.twice_p:
                    second = twice.choice(others)
                    self._add(second, ts, PartitionStart(ts, self._sequence(second), (token,)))
                    self.announced_twice += 1
                self._live.append(token)
                self._move(key, token, ts)
            elif kind == "end" and len(self._live) > p.min_partitions:
                token = rng.choice(self._live)
                others = [t for t in self._live if t != token]
                for k in sorted(k for k, o in self._owner.items() if o == token):
                    self._move(k, rng.choice(others), ts)
                self._add(token, ts, PartitionEnd(ts, self._sequence(token), token))
                self.partitions[token].end_ts = ts
                self._live.remove(token)

    def records(
        self, token: str, start_ts: int, until_ts: int
    ) -> Iterator[ChangeRecord | PartitionEvent | PartitionEnd | PartitionStart]:
        """Records of ``token`` with ``start_ts <= ts <= until_ts``, in order (its partition
        end among them once it ended)."""
        self.generate_until(until_ts)
        times = self._times[token]
        records = self._records[token]
        for i in range(bisect.bisect_left(times, start_ts), bisect.bisect_right(times, until_ts)):
            yield records[i]

    def expected(self, until_ts: int) -> Iterator[DataChange]:
        """Every write committed at or before ``until_ts``."""
        self.generate_until(until_ts)
        for token in list(self.partitions):
            for record in self.records(token, 0, until_ts):
                if isinstance(record, DataChange):
                    yield record


def _write(key: int, ts: int) -> DataChange:
    return DataChange(
        commit_ts=ts,
        record_sequence="0",
        server_transaction_id=f"w{ts}k{key}",
        is_last_record_in_transaction_in_partition=True,
        table="Keys",
        column_types=_TABLE_COLUMNS,
        mods=(Mod(f'{{"Id":"k{key}"}}', f'{{"Value":{ts}}}', "{}"),),
        mod_type="UPDATE",
    )


def write_key(record: DataChange) -> str:
    """The key a write of :class:`MutableStreamModel` is to (its per-key order is checked)."""
    return record.mods[0].keys


class MutableSource(ChangeStreamSource):
    """A ``ChangeStreamSource`` over a :class:`MutableStreamModel` for the actors' tests: the
    root query answers the model's partition start; a partition query sends what the model
    holds up to the clock (model-time micros; by default the monotonic clock from the model's
    start, ``speedup`` times faster), each answer closed by a heartbeat at its end, every
    ``poll_s``; it ends after the partition end record, or at ``end_ts``."""

    def __init__(
        self, model: MutableStreamModel, *, speedup: float = 1.0, poll_s: float = 0.05
    ) -> None:
        self.model = model
        self._poll_s = poll_s
        origin_ns = time.monotonic_ns()
        start = model.params.start_ts
        self._clock: Callable[[], int] = lambda: (
            start + int((time.monotonic_ns() - origin_ns) / 1000 * speedup)
        )

    def now(self) -> int:
        return self._clock()

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[Any], None]:
        if token is None:
            yield [self.model.root_record()]
            return
        position = start_ts
        while True:
            now = self._clock()
            stop = now if end_ts is None else min(now, end_ts)
            if stop >= position:
                batch: list[Any] = list(self.model.records(token, position, stop))
                ended = any(isinstance(r, PartitionEnd) for r in batch)
                if not ended:
                    batch.append(Heartbeat(stop))
                yield batch
                if ended or (end_ts is not None and stop >= end_ts):
                    return
                position = stop + 1
            await asyncio.sleep(self._poll_s)


def key_order_violations(batches: Iterable[Iterable[DataChange]]) -> list[tuple[str, int, int]]:
    """``(key, ts, newer ts before it)`` for every write of :class:`MutableStreamModel` that
    reached a sink (``batches`` in commit order; a write counted at its first commit) after a
    later write of its key."""
    newest: dict[str, int] = {}
    seen: set[tuple[int, str, str]] = set()
    out: list[tuple[str, int, int]] = []
    for batch in batches:
        for record in batch:
            if record.identity in seen:
                continue
            seen.add(record.identity)
            key = write_key(record)
            if record.commit_ts < newest.get(key, -1):
                out.append((key, record.commit_ts, newest[key]))
            newest[key] = max(newest.get(key, -1), record.commit_ts)
    return out
