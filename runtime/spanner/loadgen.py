"""Write-load generator for the emulator tables, recording exactly what it committed.

Every transaction touches one table with one mod type (INSERT of new keys, UPDATE or DELETE of
keys it inserted before), so the change stream shows it as one data change record per partition
holding those keys. ``committed`` lists each transaction with its commit timestamp (int micros),
table, mod type and keys; ``expected_mods()`` flattens that into the multiset a reader must
reproduce: ``(commit_ts, table, mod_type, key)``.

``bulk()`` writes fast for benchmarks: each transaction inserts, updates and deletes in every
table, which the change stream shows as up to ``3 × tables`` records per commit.

Seeded: the sequence of mutations is deterministic per seed (commit timestamps are not).
Tables have the columns of ``runtime.spanner.emulator.table_ddl``.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.records import ModType
from runtime import compat
from runtime.spanner.config import SpannerConfig

__all__ = ["Committed", "LoadGenerator", "expected_from_records"]

log = logging.getLogger(__name__)

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_COLUMNS = ("Id", "Name", "Value")
_MOD_TYPES: tuple[ModType, ...] = ("INSERT", "UPDATE", "DELETE")


class Committed(msgspec.Struct, frozen=True):
    commit_ts: int
    table: str
    mod_type: ModType
    keys: tuple[int, ...]


def _micros(when: _dt.datetime) -> int:
    return (when - _EPOCH) // _dt.timedelta(microseconds=1)


def expected_from_records(records: Sequence[Any]) -> Counter[tuple[int, str, str, int]]:
    """The ``(commit_ts, table, mod_type, key)`` multiset of decoded ``DataChange`` records whose
    key is ``{"Id": "<int>"}`` (the shape of the generated tables)."""
    import json

    out: Counter[tuple[int, str, str, int]] = Counter()
    for rec in records:
        for mod in rec.mods:
            out[(rec.commit_ts, rec.table, rec.mod_type, int(json.loads(mod.keys)["Id"]))] += 1
    return out


class LoadGenerator:
    """Writes to ``tables`` of an async ``Database``; see the module docstring."""

    def __init__(
        self,
        database: Any,
        tables: Sequence[str],
        *,
        seed: int = 0,
        max_keys: int = 3,
        first_key: int | None = None,
        on_close: Any = None,
    ) -> None:
        if not tables:
            raise ValueError("no tables")
        self._db = database
        self.tables = tuple(tables)
        self._rng = random.Random(seed)
        self._max_keys = max_keys
        self._live: dict[str, list[int]] = {t: [] for t in self.tables}
        # generators with different seeds can share tables: their key ranges do not overlap
        self._next_key = seed * 1_000_000_000 + 1 if first_key is None else first_key
        self._version = 0
        self._on_close = on_close
        self.committed: list[Committed] = []

    @classmethod
    async def connect(
        cls, config: SpannerConfig, tables: Sequence[str], *, seed: int = 0
    ) -> LoadGenerator:
        compat.disable_grpc_fork_support()
        from google.cloud.spanner_v1 import AsyncClient

        from runtime.spanner.reader import close_async_database

        client: Any = AsyncClient(**config.client_kwargs())
        database = await client.instance(config.instance).database(config.database)

        async def close() -> None:
            await close_async_database(database)
            client.close()  # its HTTP session, if any (the gRPC channel closed above)

        return cls(database, tables, seed=seed, on_close=close)

    async def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            await on_close()

    # -- planning (pure, seeded) ----------------------------------------------------------------
    def _new_keys(self, n: int) -> list[int]:
        keys = list(range(self._next_key, self._next_key + n))
        self._next_key += n
        return keys

    def _plan(self) -> tuple[str, ModType, list[int]]:
        rng = self._rng
        table = self.tables[rng.randrange(len(self.tables))]
        live = self._live[table]
        n = 1 + rng.randrange(self._max_keys)
        mod_type = _MOD_TYPES[rng.randrange(3)] if len(live) >= n else "INSERT"
        if mod_type == "INSERT":
            return table, mod_type, self._new_keys(n)
        picked = rng.sample(range(len(live)), n)
        return table, mod_type, [live[i] for i in picked]

    def _apply(self, batch: Any, table: str, mod_type: ModType, keys: list[int]) -> None:
        self._version += 1
        v = self._version
        if mod_type == "INSERT":
            batch.insert(table, _COLUMNS, [(k, f"n{k}", v) for k in keys])
        elif mod_type == "UPDATE":
            batch.update(table, ("Id", "Value"), [(k, v) for k in keys])
        else:
            from google.cloud import spanner_v1

            key_set: Any = spanner_v1.KeySet
            batch.delete(table, key_set(keys=[[k] for k in keys]))

    def _record(self, ts: int, table: str, mod_type: ModType, keys: list[int]) -> Committed:
        live = self._live[table]
        if mod_type == "INSERT":
            live.extend(keys)
        elif mod_type == "DELETE":
            gone = set(keys)
            live[:] = [k for k in live if k not in gone]
        done = Committed(ts, table, mod_type, tuple(keys))
        self.committed.append(done)
        return done

    # -- writing --------------------------------------------------------------------------------
    async def commit_one(self) -> Committed:
        """One transaction: one table, one mod type, 1..max_keys keys."""
        table, mod_type, keys = self._plan()
        async with self._db.batch() as batch:
            self._apply(batch, table, mod_type, keys)
        return self._record(_micros(batch.committed), table, mod_type, keys)

    async def run(
        self, rate_per_s: float, *, count: int | None = None, duration_s: float | None = None
    ) -> int:
        """Commit at ``rate_per_s`` until ``count`` transactions or ``duration_s`` seconds;
        return how many were committed. Falls behind (never bursts) when commits are slow."""
        if count is None and duration_s is None:
            raise ValueError("give count or duration_s")
        interval = 1.0 / rate_per_s
        start = time.monotonic()
        next_at = start
        n = 0
        while (count is None or n < count) and (
            duration_s is None or time.monotonic() - start < duration_s
        ):
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.commit_one()
            n += 1
            next_at = max(next_at + interval, time.monotonic() - interval)
        return n

    async def bulk(self, commits: int, *, keys_per_mod: int = 1) -> int:
        """Fast pre-load: each transaction inserts new keys into every table and, where it can,
        updates and deletes earlier ones. Returns the number of change records it should make
        per partition-less count (one per table and mod type)."""
        records = 0
        for _ in range(commits):
            plan: list[tuple[str, ModType, list[int]]] = []
            for table in self.tables:
                live = self._live[table]
                plan.append((table, "INSERT", self._new_keys(keys_per_mod)))
                if len(live) >= 2 * keys_per_mod:
                    plan.append((table, "UPDATE", live[-keys_per_mod:]))
                    plan.append((table, "DELETE", live[:keys_per_mod]))
            async with self._db.batch() as batch:
                for table, mod_type, keys in plan:
                    self._apply(batch, table, mod_type, keys)
            ts = _micros(batch.committed)
            for table, mod_type, keys in plan:
                self._record(ts, table, mod_type, keys)
            records += len(plan)
        return records

    def expected_mods(self) -> Counter[tuple[int, str, str, int]]:
        out: Counter[tuple[int, str, str, int]] = Counter()
        for c in self.committed:
            for k in c.keys:
                out[(c.commit_ts, c.table, c.mod_type, k)] += 1
        return out
