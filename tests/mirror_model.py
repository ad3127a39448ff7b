"""What the mirror tests share: a small model database that turns transactions into change
records the way Spanner does, the reference the mirror must equal (every change applied one by
one in version order), and the blind rule the controls show to be wrong.

Nothing here calls the rules of ``protocol.mirror`` except to feed them; the reference and the
model database are written independently of it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from protocol.mirror import MergePlan, MirrorChange, MirrorRow, RowId, mirror_changes
from protocol.records import DataChange, Mod

TABLES = ("T", "U")
COLUMNS = ("A", "B", "C")
KEY_NAMES = ("Id",)

Rows = dict[RowId, dict[str, Any]]
"""The rows that exist, by (table, key): their non-key values."""


def row_id(table: str, key: str) -> RowId:
    return (table, (("Id", key),))


def record(
    ts: int,
    mod_type: str,
    *mods: tuple[str, dict[str, Any]],
    txn: str = "tx",
    seq: str = "0",
    capture: str = "OLD_AND_NEW_VALUES",
    table: str = "T",
) -> DataChange:
    """A record of ``mods`` ((key, new values) pairs; the key is the Id column's value)."""
    return DataChange(
        commit_ts=ts,
        record_sequence=seq,
        server_transaction_id=txn,
        is_last_record_in_transaction_in_partition=True,
        table=table,
        column_types=(),
        mods=tuple(
            Mod(
                msgspec.json.encode({"Id": key}).decode(),
                msgspec.json.encode(new).decode(),
                "{}",
            )
            for key, new in mods
        ),
        mod_type=mod_type,  # type: ignore[arg-type]  # SNAPSHOT is not a change-stream ModType
        value_capture_type=capture,
    )


def reference(changes: Iterable[MirrorChange]) -> Rows:
    """Every change applied one by one in version order: a row change replaces the row, a
    delete removes it, a columns change sets its columns (making a row of just them if there
    is none). Versions of one row are distinct, so the order is the version order."""
    state: dict[RowId, dict[str, Any] | None] = {}
    for change in sorted(changes, key=lambda c: c.version):
        rid = change.row_id
        match change.kind:
            case "delete":
                state[rid] = None
            case "row":
                state[rid] = dict(change.values)
            case "columns":
                row = state.get(rid)
                row = {} if row is None else row
                row.update(change.values)
                state[rid] = row
    return {rid: row for rid, row in state.items() if row is not None}


def blind(records: Iterable[DataChange]) -> Rows:
    """The control: each mod applied in arrival order, whatever its version."""
    state: Rows = {}
    for change in mirror_changes(records):
        rid = change.row_id
        if change.kind == "delete":
            state.pop(rid, None)
        elif change.kind == "row":
            state[rid] = dict(change.values)
        else:
            state.setdefault(rid, {}).update(change.values)
    return state


def visible(store: Mapping[RowId, MirrorRow]) -> Rows:
    """What a reader of the mirror sees: the rows that exist and their values."""
    return {rid: dict(row.values) for rid, row in store.items() if row.exists}


def apply(store: dict[RowId, MirrorRow], plan: MergePlan) -> None:
    """Carry out a merge plan on an in-memory mirror (tombstones are kept as rows)."""
    for row in plan.rows:
        store[row.row_id] = row


Op = tuple[int, int, int, int, int]
"""(table index, key index, action, column mask, value): one write of a transaction."""


class Database:
    """A model database with one change stream: :meth:`commit` applies a transaction and returns
    its change records as Spanner shapes them (one record per run of mods of one table and mod
    type, record sequences counting from 0 within the transaction; an INSERT names every
    column, an UPDATE the columns it wrote or, with a ``NEW_ROW`` capture, the whole new row)."""

    def __init__(self, capture: str, keys: int = 3) -> None:
        self.capture = capture
        self.keys = [str(k + 1) for k in range(keys)]
        self.rows: Rows = {}
        self.history: list[tuple[int, Rows]] = []  # (commit ts, state after it)
        self.txns = 0

    def commit(self, ts: int, ops: Sequence[Op]) -> list[DataChange]:
        txn = f"tx{self.txns}"
        self.txns += 1
        out: list[DataChange] = []
        current: tuple[str, str] | None = None
        mods: list[tuple[str, dict[str, Any]]] = []

        def flush() -> None:
            if current is not None and mods:
                table, mod_type = current
                capture = self.capture
                out.append(
                    record(ts, mod_type, *mods, txn=txn, seq=str(len(out)), capture=capture,
                           table=table)
                )  # fmt: skip

        for t, k, action, mask, value in ops:
            table = TABLES[t % len(TABLES)]
            key = self.keys[k % len(self.keys)]
            rid = row_id(table, key)
            row = self.rows.get(rid)
            if row is None:
                mod_type = "INSERT"
                # a value of 0 stands for NULL
                new: dict[str, Any] = {
                    c: (value + i if (value + i) % 4 else None) for i, c in enumerate(COLUMNS)
                }
                self.rows[rid] = dict(new)
            elif action % 3 == 0:
                mod_type = "DELETE"
                new = {}
                del self.rows[rid]
            else:
                mod_type = "UPDATE"
                written = [c for i, c in enumerate(COLUMNS) if mask >> i & 1] or [COLUMNS[0]]
                new = {c: value * 10 + i for i, c in enumerate(written)}
                row.update(new)
                if self.capture in ("NEW_ROW", "NEW_ROW_AND_OLD_VALUES"):
                    new = dict(row)
            if current != (table, mod_type) or key in (m[0] for m in mods):
                flush()
                current = (table, mod_type)
                mods = []
            mods.append((key, new))
        flush()
        self.history.append((ts, {rid: dict(row) for rid, row in self.rows.items()}))
        return out

    def at(self, ts: int) -> Rows:
        """The rows as of ``ts`` (every transaction committed at or before it)."""
        state: Rows = {}
        for commit_ts, rows in self.history:
            if commit_ts <= ts:
                state = rows
        return state

    def snapshot(self, read_ts: int, chunk: int = 2) -> list[DataChange]:
        """Snapshot rows of every row as of ``read_ts``, ``chunk`` rows per record."""
        rows = sorted(self.at(read_ts).items())
        out = []
        for i in range(0, len(rows), chunk):
            part = rows[i : i + chunk]
            by_table: dict[str, list[tuple[str, dict[str, Any]]]] = {}
            for (table, key), values in part:
                by_table.setdefault(table, []).append((str(key[0][1]), values))
            for table, mods in by_table.items():
                out.append(record(read_ts, "SNAPSHOT", *mods, txn=f"snap{i}", seq="0", table=table))
        return out
