"""Current-state tables ("the mirror"): the newest row per (table, primary key), merged from
change records one micro-batch at a time. Every rule of the merge lives in this module.

**Rows.** A row is named by its table and its primary key: the mod's ``keys`` as (column,
value) pairs sorted by column, the values as Spanner's JSON has them (INT64 as its decimal
text, BYTES as base64, TIMESTAMP as RFC 3339 text). Snapshot rows must spell their keys the same
way, or they name other rows. Key columns are not kept among a row's values.

**Versions.** Every change of a row has a *version*, ``(commit_ts, server_transaction_id,
record_sequence, mod_index)``, compared in that order, ``record_sequence`` as the number its
digits spell (never as text: "10" comes after "9"; one that is not a decimal number is refused
with :class:`MirrorError`: its place is unknown). Spanner gives two transactions that write
the same row distinct commit timestamps, so for one row the commit timestamp orders
transactions; within a transaction the record sequence orders its records and the mod index
orders the mods of one record. The transaction id sits between them only to make the order
total: two transactions of one commit timestamp never write the same row, so for one row it
never decides anything, and record sequences are compared only within one transaction.

A ``SNAPSHOT`` row (the row as of read timestamp T, every column) has the version ``(T, "",
-1, -1)``: the lowest of T, below every change committed at T. The change stream starts after
T, so nothing shares T with it; if a change at T does arrive it is applied on top, which is
harmless, because the snapshot already holds that change's effect and writing it again gives
the same values.

**What a change does.** A change is one of three kinds:

==================  ================================================  =====================
kind                changes                                           writes
==================  ================================================  =====================
``row``             INSERT (any capture type); SNAPSHOT; UPDATE with  the whole row: every
                    ``NEW_ROW`` or ``NEW_ROW_AND_OLD_VALUES`` capture column (one it does
                                                                      not name is null)
``columns``         UPDATE with ``OLD_AND_NEW_VALUES`` or             only the columns in
                    ``NEW_VALUES`` capture                            its ``new_values``
``delete``          DELETE                                            the whole row: it no
                                                                      longer exists
==================  ================================================  =====================

Old values are never used: they tell a column's value before the change but not the version of
the write that set it, so no merge order could place them.

**The state this defines.** Applying a row's changes one by one in version order (starting
from "no row": a ``row`` change replaces it, a ``delete`` removes it, a ``columns`` change sets
its columns, on no row making one with just those columns) gives one final state. The mirror
holds exactly that state, whatever order and grouping the changes arrive in, because it is a
function of the *set* of changes applied so far:

* the **base** is the newest ``row`` or ``delete`` change (``None`` while there is none),
* each column's value comes from the newest change that wrote it, where the base writes every
  column (a ``delete`` writes them all away), so ``columns`` changes older than the base count
  for nothing,
* the row exists unless its newest change of all is a ``delete``.

A :class:`MirrorRow` keeps the base's version, whether the base is a delete, the values, the
**per-column versions** of only the columns written after the base (most rows: none) and the
row's **version**, the newest of all. Merging a change into it:

* ``row`` / ``delete`` at ``v``: ignored unless ``v`` is newer than the base (an equal version
  is the same change delivered again). Otherwise ``v`` becomes the base; the values become the
  change's (none for a delete), except the columns written after ``v``, which keep their value
  and version; per-column versions at or before ``v`` are dropped.
* ``columns`` at ``v``: ignored unless ``v`` is newer than the base; then each of its columns
  whose version (its own, else the base's) is older than ``v`` takes the new value and version
  ``v``.
* the row's version becomes the newer of it and ``v``.

Each step is idempotent (a change already applied, or older than what superseded it, changes
nothing), and the result does not depend on the order, so the same batch merged twice changes
nothing, and micro-batches of different partitions (a split moves a key to a child partition;
the snapshot's partitions and the stream run side by side) may commit in any order. A blind
rule — apply each change in arrival order — resurrects a deleted row when an older INSERT
arrives after the DELETE, and lets a snapshot row committed late overwrite newer changes.

**What the arrived changes do and do not determine.**

* A DELETE that arrives before older changes leaves a **tombstone** (a row with ``deleted`` and
  no columns after it) that those changes cannot get past: nothing is resurrected.
* An older ``columns`` change that arrives after a newer ``row`` change (INSERT, snapshot row,
  full-row UPDATE, DELETE) changes nothing: the newer change set every column.
* An older ``columns`` change of column A that arrives after a newer one of column B still sets
  A (if nothing newer set A).
* A newer ``columns`` change that arrives before the older INSERT (or snapshot row) it follows:
  until the INSERT arrives only the written columns are known; the row shows them and leaves
  the others null. The INSERT, when it comes, fills the others and leaves the newer columns.
  After a DELETE, such a row exists with those columns (``deleted`` stays set: its base is the
  delete; the INSERT between them has not arrived yet).
* A ``columns`` change of a row the mirror never saw whole (no snapshot, and the row existed
  before the stream's start) leaves the other columns unknown for good: only a snapshot or a
  ``NEW_ROW`` capture tells them.
* An INSERT (or snapshot row) that does not name a column — e.g. one added to the table later —
  makes it null.

**Garbage collection.** Given ``low_watermark`` — every change with a commit timestamp at or
before it has been merged into this mirror, and none of them is ever merged again (the output's
batch identities refuse a re-delivered batch) — every change still to come is newer than every
version at or before the watermark. So (:func:`collect`): a tombstone whose version's commit
timestamp is at or before ``low_watermark`` is dropped (a later change would have been applied
over it anyway), and a row whose version is at or before it forgets its per-column versions
(its base becomes its version): no change to come can be older than them. Dropping a tombstone
early, or letting a change at or before the watermark in again after it, can resurrect a row.

**Cost.** :func:`merge` reads only the rows the batch touches (:func:`row_ids`, one lookup per
distinct row) and does O(mods + columns they write) work, plus one copy of the values of each
row a change really writes (a stale change copies nothing): it grows with the batch, not the
table. Decoding the JSON of the keys and new values is about half of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Literal, NamedTuple

import msgspec

from protocol.records import DataChange

__all__ = [
    "CAPTURE_TYPES",
    "SNAPSHOT",
    "ChangeKind",
    "Current",
    "Key",
    "MergePlan",
    "MirrorChange",
    "MirrorError",
    "MirrorRow",
    "RowId",
    "Version",
    "collect",
    "merge",
    "merge_changes",
    "mirror_changes",
    "row_ids",
    "snapshot_version",
    "validate",
]

SNAPSHOT: Final = "SNAPSHOT"
"""The mod type of a snapshot row: the row as of the read timestamp (its ``commit_ts``)."""

_PARTIAL_CAPTURES: Final = frozenset({"OLD_AND_NEW_VALUES", "NEW_VALUES"})
_FULL_CAPTURES: Final = frozenset({"NEW_ROW", "NEW_ROW_AND_OLD_VALUES"})
CAPTURE_TYPES: Final = _PARTIAL_CAPTURES | _FULL_CAPTURES
"""The value capture types whose UPDATE rows the mirror knows how to merge."""

KeyValue = str | int | float | bool | None
Key = tuple[tuple[str, KeyValue], ...]
"""A row's primary key: (column, value) pairs sorted by column, values as Spanner's JSON has
them (INT64 as its decimal text, BYTES as base64, ...)."""
RowId = tuple[str, Key]
"""(table, key): one row of one mirror table."""

ChangeKind = Literal["row", "columns", "delete"]


class MirrorError(ValueError):
    """A change record the mirror cannot place: the message names the record and what is wrong."""


class Version(NamedTuple):
    """The place of one change in a row's history (compared as a tuple; see the module
    docstring)."""

    commit_ts: int
    server_transaction_id: str
    record_sequence: int
    mod_index: int


def snapshot_version(read_ts: int) -> Version:
    """The version of a snapshot row read at ``read_ts``: below every change committed then."""
    return Version(read_ts, "", -1, -1)


# ``gc=False`` (here and on MirrorRow): a batch creates one per mod and one per touched row; they
# hold only JSON values, versions and strings, never a reference back to a struct, so they
# cannot be part of a reference cycle, and the cycle collector need not scan them.
class MirrorChange(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One mod as the mirror sees it: which row, its version, its kind and the (non-key) column
    values it writes (none for a delete)."""

    table: str
    key: Key
    version: Version
    kind: ChangeKind
    values: dict[str, Any]

    @property
    def row_id(self) -> RowId:
        return (self.table, self.key)


class MirrorRow(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The state of one row of a mirror table (see the module docstring).

    ``values``: the non-key columns known (a column not here is null). ``version``: the newest
    change applied. ``base``: the newest ``row`` or ``delete`` change (``None``: only
    ``columns`` changes so far). ``deleted``: the base is a delete. ``columns``: the version of
    each column written after the base (a column not here has the base's version)."""

    table: str
    key: Key
    values: dict[str, Any]
    version: Version
    base: Version | None = None
    deleted: bool = False
    columns: dict[str, Version] = msgspec.field(default_factory=dict)

    @property
    def row_id(self) -> RowId:
        return (self.table, self.key)

    @property
    def exists(self) -> bool:
        """Whether the row exists: its newest change is not a delete."""
        return not self.deleted or self.version != self.base

    @property
    def tombstone(self) -> bool:
        """A deleted row kept only so that older changes arriving later cannot resurrect it."""
        return not self.exists


class MergePlan(msgspec.Struct, frozen=True):
    """What merging one batch does to the mirror: ``rows`` — the new state of every row the
    batch changed, live rows (upsert them) and tombstones (remove the row from what readers see,
    keep its tombstone), in the order the batch first touched them. ``mods``: mods in the batch;
    ``stale``: those that changed nothing (delivered before, or older than what superseded
    them)."""

    rows: tuple[MirrorRow, ...] = ()
    mods: int = 0
    stale: int = 0

    @property
    def upserts(self) -> tuple[MirrorRow, ...]:
        return tuple(r for r in self.rows if r.exists)

    @property
    def tombstones(self) -> tuple[MirrorRow, ...]:
        return tuple(r for r in self.rows if not r.exists)


Current = Mapping[RowId, MirrorRow] | Callable[[RowId], MirrorRow | None]
"""The mirror's current rows: a mapping holding (at least) the rows a batch touches, or a
lookup returning ``None`` for a row the mirror does not hold."""

_decoder = msgspec.json.Decoder()


def _object(text: str, what: str, change: DataChange) -> dict[str, Any]:
    try:
        value = _decoder.decode(text)
    except msgspec.DecodeError as exc:
        raise MirrorError(f"{_where(change)}: {what} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise MirrorError(f"{_where(change)}: {what} is not a JSON object: {text!r}")
    return value


def _where(change: DataChange) -> str:
    return (
        f"record {change.commit_ts}/{change.server_transaction_id}/{change.record_sequence}"
        f" of table {change.table!r}"
    )


def _sequence(change: DataChange) -> int:
    seq = change.record_sequence
    if not (seq.isascii() and seq.isdigit()):
        raise MirrorError(
            f"{_where(change)}: record_sequence {seq!r} is not a decimal number, so its place"
            " among the transaction's records is unknown"
        )
    return int(seq)


def _kind(change: DataChange) -> ChangeKind:
    mod_type: str = change.mod_type
    if mod_type in ("INSERT", SNAPSHOT):
        return "row"
    if mod_type == "DELETE":
        return "delete"
    if mod_type == "UPDATE":
        if change.value_capture_type in _PARTIAL_CAPTURES:
            return "columns"
        if change.value_capture_type in _FULL_CAPTURES:
            return "row"
        raise MirrorError(
            f"{_where(change)}: value_capture_type {change.value_capture_type!r} is not one of"
            f" {sorted(CAPTURE_TYPES)}"
        )
    raise MirrorError(
        f"{_where(change)}: mod_type {mod_type!r} is not INSERT, UPDATE, DELETE or {SNAPSHOT}"
    )


_SCALARS: Final = frozenset({str, int, float, bool})


def _key(keys: dict[str, Any], change: DataChange) -> Key:
    for name, value in keys.items():
        if value is not None and type(value) not in _SCALARS:
            raise MirrorError(f"{_where(change)}: key column {name!r} is not a scalar: {value!r}")
    return tuple(sorted(keys.items()))


def mirror_changes(records: Iterable[DataChange]) -> list[MirrorChange]:
    """The mods of ``records`` as :class:`MirrorChange` s, in order. Raises :class:`MirrorError`
    for a record the mirror cannot place (an unknown mod type or capture type, a record sequence
    that is not a number, keys or values that are not JSON objects)."""
    out: list[MirrorChange] = []
    decode = _decoder.decode
    new_version = tuple.__new__
    for change in records:
        kind = _kind(change)
        delete = kind == "delete"
        mod_type: str = change.mod_type  # SNAPSHOT is not a ModType of the change stream
        snapshot = mod_type == SNAPSHOT
        seq = -1 if snapshot else _sequence(change)
        ts, txn, table = change.commit_ts, change.server_transaction_id, change.table
        for index, mod in enumerate(change.mods):
            try:
                keys = decode(mod.keys)
                values = {} if delete else decode(mod.new_values)
            except msgspec.DecodeError:
                keys = values = None  # _object says which is not JSON
            if type(keys) is not dict or type(values) is not dict:
                keys = _object(mod.keys, "keys", change)
                values = {} if delete else _object(mod.new_values, "new_values", change)
            for name in keys:
                values.pop(name, None)
            if snapshot:
                version = snapshot_version(ts)
            else:
                version = new_version(Version, (ts, txn, seq, index))  # as Version(...), faster
            out.append(MirrorChange(table, _key(keys, change), version, kind, values))
    return out


def row_ids(changes: Iterable[MirrorChange]) -> list[RowId]:
    """The distinct rows ``changes`` touch, in the order first touched: the rows the shell
    reads from the mirror before :func:`merge_changes`."""
    return list(dict.fromkeys(c.row_id for c in changes))


class _Work:
    """One row's state while a batch is merged into it. Its values and column versions are the
    current row's own dicts until the first write copies them (a stale change copies nothing)."""

    __slots__ = ("base", "columns", "deleted", "dirty", "owned", "values", "version")

    def __init__(self, row: MirrorRow | None) -> None:
        self.dirty = False  # something changed: the plan has this row
        if row is None:
            self.owned = True
            self.values: dict[str, Any] = {}
            self.version: Version | None = None
            self.base: Version | None = None
            self.deleted = False
            self.columns: dict[str, Version] = {}
        else:
            self.owned = False
            self.values = row.values
            self.version = row.version
            self.base = row.base
            self.deleted = row.deleted
            self.columns = row.columns

    def apply(self, change: MirrorChange) -> bool:
        """Merge ``change``; whether it changed anything."""
        v = change.version
        base = self.base
        if base is not None and v <= base:
            return False  # the base (newer, or this very change) wrote every column
        changed = False
        if change.kind == "columns":
            columns = self.columns
            values = self.values
            for name, value in change.values.items():
                seen = columns.get(name)
                if seen is None or v > seen:  # no own version: the base's, older than v
                    if not self.owned:
                        columns = self.columns = dict(columns)
                        values = self.values = dict(values)
                        self.owned = True
                    values[name] = value
                    columns[name] = v
                    changed = True
        else:
            kept = {name: cv for name, cv in self.columns.items() if cv > v}
            values = {} if change.kind == "delete" else dict(change.values)
            for name in kept:
                values[name] = self.values[name]
            self.values = values
            self.columns = kept
            self.owned = True
            self.base = v
            self.deleted = change.kind == "delete"
            changed = True
        if self.version is None or v > self.version:
            self.version = v
            changed = True
        self.dirty |= changed
        return changed

    def row(self, row_id: RowId) -> MirrorRow:
        assert self.version is not None
        return MirrorRow(
            row_id[0], row_id[1], self.values, self.version, self.base, self.deleted, self.columns
        )


def merge_changes(current: Current, changes: Iterable[MirrorChange]) -> MergePlan:
    """Merge ``changes`` (one batch, any order) into the mirror whose rows ``current`` holds
    (see :data:`Current`; only the rows the batch touches are looked up, once each)."""
    get = current.get if isinstance(current, Mapping) else current
    work: dict[RowId, _Work] = {}
    mods = stale = 0
    for change in changes:
        mods += 1
        row_id = (change.table, change.key)
        state = work.get(row_id)
        if state is None:
            old = get(row_id)
            if old is not None and (old.table, old.key) != row_id:
                raise MirrorError(f"the lookup for {row_id!r} returned the row of {old.row_id!r}")
            state = work[row_id] = _Work(old)
        if not state.apply(change):
            stale += 1
    rows = tuple(state.row(row_id) for row_id, state in work.items() if state.dirty)
    return MergePlan(rows, mods, stale)


def merge(current: Current, records: Iterable[DataChange]) -> MergePlan:
    """:func:`merge_changes` of the mods of ``records`` (:func:`mirror_changes`)."""
    return merge_changes(current, mirror_changes(records))


def collect(row: MirrorRow, low_watermark: int) -> MirrorRow | None:
    """``row`` after garbage collection at ``low_watermark`` (see the module docstring):
    ``None`` for a tombstone at or before it (drop it), the row without per-column versions
    when its version is at or before it, else ``row`` itself."""
    if row.version.commit_ts > low_watermark:
        return row
    if not row.exists:
        return None
    if row.base == row.version and not row.deleted and not row.columns:
        return row
    return MirrorRow(row.table, row.key, row.values, row.version, row.version)


def validate(row: MirrorRow) -> None:
    """Check the invariants of ``row``; raise ``AssertionError`` naming the one broken."""
    rid = row.row_id
    if row.base is not None:
        assert row.version >= row.base, f"{rid}: version {row.version} older than its base"
    else:
        assert not row.deleted, f"{rid}: deleted without a base"
        assert set(row.values) == set(row.columns), f"{rid}: values without a version"
    for name, v in row.columns.items():
        assert row.base is None or v > row.base, f"{rid}: column {name} not newer than the base"
        assert v <= row.version, f"{rid}: column {name} newer than the row"
        assert name in row.values, f"{rid}: column {name} has a version but no value"
    if row.deleted:
        assert set(row.values) == set(row.columns), f"{rid}: deleted base but values before it"
