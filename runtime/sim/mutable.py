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

import random
from collections import defaultdict

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

__all__ = ["MutableRun", "Write", "run", "stream"]

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
