"""Which change records a connector keeps, and which of their columns: the ``--tables``,
``--exclude-tables``, ``--mod-types``, ``--exclude-transaction-tags``,
``--exclude-system-transactions`` and ``--exclude-columns`` rules, as pure functions of one
record.

The rule:

1. ``tables`` (include patterns): when given, a record's table must match at least one; when
   empty, every table is included.
2. ``exclude_tables``: a record whose table matches any of these is dropped, even when an
   include pattern matches it too (exclusion wins).
3. ``mod_types``: when given, a record's mod type (INSERT, UPDATE, DELETE, or SNAPSHOT for the
   rows of a snapshot: ``protocol/snapshot.py``) must be one of them.
4. ``exclude_system_transactions``: a record of a system transaction (Spanner's
   ``is_system_transaction``: TTL deletes of a row deletion policy) is dropped.
5. ``exclude_transaction_tags``: a record whose transaction tag matches any of these globs is
   dropped (a pipeline's own writes, to avoid replication loops). Tags are matched
   **case-sensitively** (they are the application's strings, not names Spanner folds), and a
   record without a tag never matches: ``*`` drops every tagged transaction, not every one.
6. ``exclude_columns`` (``Table.Column`` items, both parts globs matched case-insensitively, the
   table part split at the last dot): the matching columns of a kept record are taken out of
   its ``new_values``, its ``old_values`` and its ``column_types``. A primary-key column is
   never taken out: it identifies the row (``keys``), and the output's de-duplication and
   current-state mirror need it; a pattern naming one leaves it in place. Values are rewritten
   as compact JSON in the order Spanner sent them.

Rules 1–5 decide whether a record is dropped (:meth:`RecordFilter.drop_reason` says by which
rule, for the counters); rule 6 changes a kept one (:meth:`RecordFilter.strip_columns`).
:meth:`RecordFilter.apply` does both to a batch and replaces each dropped data-change record by a
heartbeat at its commit timestamp, so the partition's watermark still advances
(``runtime/filtered.py`` says why that is safe).
Patterns are shell globs (``*`` any run of characters, ``?`` one character, ``[abc]`` one of
a set), matched against the whole table name, **case-insensitively**: Spanner's GoogleSQL names
are case-insensitive (``Orders`` and ``ORDERS`` name one table) and PostgreSQL-dialect names
fold unquoted identifiers to lower case, so a pattern must not depend on how a name is spelt.

Only data-change records are filtered; heartbeats and child-partition records pass unchanged.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from typing import Final, Literal, get_args

import msgspec

from protocol.records import ChangeRecord, ColumnType, DataChange, Heartbeat, Mod, ModType

__all__ = [
    "DROP_REASONS",
    "MOD_TYPES",
    "DropReason",
    "FilterCounts",
    "FilterError",
    "RecordFilter",
    "parse_list",
]

MOD_TYPES: Final[tuple[str, ...]] = get_args(ModType)

DropReason = Literal["table", "mod_type", "system_transaction", "transaction_tag"]
DROP_REASONS: Final[tuple[DropReason, ...]] = get_args(DropReason)


class FilterCounts(msgspec.Struct, frozen=True):
    """What :meth:`RecordFilter.apply` did to data-change records: kept, dropped by each rule,
    and kept with columns taken out."""

    kept: int = 0
    table: int = 0
    mod_type: int = 0
    system_transaction: int = 0
    transaction_tag: int = 0
    columns_stripped: int = 0

    @property
    def dropped(self) -> int:
        return self.table + self.mod_type + self.system_transaction + self.transaction_tag

    def __add__(self, other: FilterCounts) -> FilterCounts:
        return FilterCounts(
            self.kept + other.kept,
            self.table + other.table,
            self.mod_type + other.mod_type,
            self.system_transaction + other.system_transaction,
            self.transaction_tag + other.transaction_tag,
            self.columns_stripped + other.columns_stripped,
        )

    def by_reason(self) -> dict[str, int]:
        return {reason: getattr(self, reason) for reason in DROP_REASONS}


class FilterError(ValueError):
    """A filter setting that cannot be used; the message says which and why."""


def parse_list(text: str | None, what: str) -> tuple[str, ...]:
    """A comma-separated setting as its items (spaces around items ignored). ``None`` or an
    empty string: no items. An empty item (``a,,b`` or a trailing comma) is refused."""
    if text is None or not text.strip():
        return ()
    items = tuple(item.strip() for item in text.split(","))
    if any(not item for item in items):
        raise FilterError(f"{what}: empty item in {text!r}")
    return items


def _compile(patterns: Iterable[str], *, ignore_case: bool = True) -> re.Pattern[str] | None:
    parts = [fnmatch.translate(p) for p in patterns]
    if not parts:
        return None
    return re.compile("|".join(f"(?:{p})" for p in parts), re.IGNORECASE if ignore_case else 0)


def _column_patterns(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        table, dot, column = item.rpartition(".")
        if not dot or not table or not column:
            raise FilterError(
                f"exclude_columns: {item!r} is not Table.Column (a table pattern, a dot, a "
                "column pattern)"
            )
        out.append((table, column))
    return tuple(out)


_json_object = msgspec.json.Decoder(dict[str, object])
_json_encode = msgspec.json.Encoder().encode


class RecordFilter:
    """The rule of the module docstring for one set of patterns and mod types."""

    __slots__ = (
        "_column_cache",
        "_columns",
        "_exclude",
        "_include",
        "_strip_cache",
        "_table_cache",
        "_tags",
        "exclude_columns",
        "exclude_system_transactions",
        "exclude_tables",
        "exclude_transaction_tags",
        "mod_types",
        "tables",
    )

    def __init__(
        self,
        tables: Iterable[str] = (),
        exclude_tables: Iterable[str] = (),
        mod_types: Iterable[str] = (),
        *,
        exclude_transaction_tags: Iterable[str] = (),
        exclude_system_transactions: bool = False,
        exclude_columns: Iterable[str] = (),
    ) -> None:
        self.tables = tuple(tables)
        self.exclude_tables = tuple(exclude_tables)
        kinds = tuple(m.upper() for m in mod_types)
        unknown = [m for m in kinds if m not in MOD_TYPES]
        if unknown:
            raise FilterError(
                f"mod_types: unknown mod type {unknown[0]!r} (choose from {', '.join(MOD_TYPES)})"
            )
        self.mod_types = frozenset(kinds)
        self._include = _compile(self.tables)
        self._exclude = _compile(self.exclude_tables)
        # a stream has few tables and many records: decide once per table name
        self._table_cache: dict[str, bool] = {}
        self.exclude_transaction_tags = tuple(exclude_transaction_tags)
        self._tags = _compile(self.exclude_transaction_tags, ignore_case=False)
        self.exclude_system_transactions = exclude_system_transactions
        self.exclude_columns = tuple(exclude_columns)
        pairs = _column_patterns(self.exclude_columns)
        # one (table, column) regex: a NUL cannot occur in a Spanner name
        self._columns = _compile(f"{t}\0{c}" for t, c in pairs)
        self._column_cache: dict[tuple[str, str], bool] = {}
        # id(column_types) -> (that tuple, the names to take out, the tuple without them): the
        # decoders intern column_types, so one lookup by identity per record
        self._strip_cache: dict[
            int, tuple[tuple[ColumnType, ...], frozenset[str], tuple[ColumnType, ...]]
        ] = {}

    @classmethod
    def parse(
        cls,
        tables: str | None,
        exclude_tables: str | None,
        mod_types: str | None,
        *,
        exclude_transaction_tags: str | None = None,
        exclude_system_transactions: bool = False,
        exclude_columns: str | None = None,
    ) -> RecordFilter:
        """The filter of the comma-separated settings (``None``: not given)."""
        return cls(
            parse_list(tables, "tables"),
            parse_list(exclude_tables, "exclude_tables"),
            parse_list(mod_types, "mod_types"),
            exclude_transaction_tags=parse_list(
                exclude_transaction_tags, "exclude_transaction_tags"
            ),
            exclude_system_transactions=exclude_system_transactions,
            exclude_columns=parse_list(exclude_columns, "exclude_columns"),
        )

    @property
    def keeps_everything(self) -> bool:
        """Whether this filter keeps every record whole (no setting given): callers skip it."""
        return (
            self._include is None
            and self._exclude is None
            and not self.mod_types
            and self._tags is None
            and not self.exclude_system_transactions
            and self._columns is None
        )

    def keeps_table(self, table: str) -> bool:
        """Rules 1 and 2 for one table name."""
        known = self._table_cache.get(table)
        if known is not None:
            return known
        keep = (self._include is None or self._include.fullmatch(table) is not None) and (
            self._exclude is None or self._exclude.fullmatch(table) is None
        )
        if len(self._table_cache) < 10_000:  # bounded, should a stream name tables without end
            self._table_cache[table] = keep
        return keep

    def keeps_change(self, table: str, mod_type: str) -> bool:
        """Whether a change of ``mod_type`` to ``table`` passes every rule."""
        if self.mod_types and mod_type not in self.mod_types:
            return False
        return self.keeps_table(table)

    def unmatched(self, tables: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The include patterns and the exclude patterns that match none of ``tables`` (the
        stream's tables, where they are known): a typo, or a filter for another stream."""
        names = tuple(tables)

        def matches_none(pattern: str) -> bool:
            compiled = _compile((pattern,))
            return compiled is not None and not any(compiled.fullmatch(t) for t in names)

        return (
            tuple(p for p in self.tables if matches_none(p)),
            tuple(p for p in self.exclude_tables if matches_none(p)),
        )

    def keeps_no_table(self, tables: Iterable[str]) -> bool:
        """Whether rules 1 and 2 drop every one of ``tables``: a run keeps nothing."""
        return not any(self.keeps_table(t) for t in tables)

    def drop_reason(self, record: DataChange) -> DropReason | None:
        """The first of rules 1–5 that drops ``record`` (None: it is kept)."""
        if self.mod_types and record.mod_type not in self.mod_types:
            return "mod_type"
        if not self.keeps_table(record.table):
            return "table"
        if self.exclude_system_transactions and record.is_system_transaction:
            return "system_transaction"
        tags = self._tags
        if tags is not None and record.transaction_tag and tags.fullmatch(record.transaction_tag):
            return "transaction_tag"
        return None

    def keeps(self, record: DataChange) -> bool:
        """Whether ``record`` passes rules 1–5."""
        return self.drop_reason(record) is None

    def excludes_column(self, table: str, column: str) -> bool:
        """Whether rule 6 names ``column`` of ``table`` (key columns aside)."""
        pattern = self._columns
        if pattern is None:
            return False
        key = (table, column)
        known = self._column_cache.get(key)
        if known is None:
            known = pattern.fullmatch(f"{table}\0{column}") is not None
            if len(self._column_cache) < 100_000:
                self._column_cache[key] = known
        return known

    def _stripped(
        self, table: str, columns: tuple[ColumnType, ...]
    ) -> tuple[frozenset[str], tuple[ColumnType, ...]]:
        cached = self._strip_cache.get(id(columns))
        if cached is not None and cached[0] is columns:
            return cached[1], cached[2]
        names = frozenset(
            c.name for c in columns if not c.is_primary_key and self.excludes_column(table, c.name)
        )
        kept = tuple(c for c in columns if c.name not in names) if names else columns
        if len(self._strip_cache) >= 4096:
            self._strip_cache.clear()
        self._strip_cache[id(columns)] = (columns, names, kept)
        return names, kept

    def strip_columns(self, record: DataChange) -> DataChange:
        """``record`` without the columns rule 6 takes out (the same object when none)."""
        if self._columns is None:
            return record
        names, kept = self._stripped(record.table, record.column_types)
        if not names:
            return record
        mods = tuple(
            Mod(m.keys, _without(m.new_values, names), _without(m.old_values, names))
            for m in record.mods
        )
        return msgspec.structs.replace(record, column_types=kept, mods=mods)

    def apply(self, batch: Sequence[ChangeRecord]) -> tuple[list[ChangeRecord], FilterCounts]:
        """``batch`` with every rule applied: dropped data-change records replaced by a
        heartbeat at their commit timestamp (in place), kept ones stripped of excluded columns,
        everything else unchanged; and what was done."""
        out: list[ChangeRecord] = []
        append = out.append
        kept = stripped = 0
        dropped = dict.fromkeys(DROP_REASONS, 0)
        for record in batch:
            if isinstance(record, DataChange):
                reason = self.drop_reason(record)
                if reason is not None:
                    dropped[reason] += 1
                    append(Heartbeat(record.commit_ts))
                    continue
                kept += 1
                whole = self.strip_columns(record)
                if whole is not record:
                    stripped += 1
                append(whole)
            else:
                append(record)
        return out, FilterCounts(kept=kept, columns_stripped=stripped, **dropped)

    def __repr__(self) -> str:
        return (
            f"RecordFilter(tables={self.tables!r}, exclude_tables={self.exclude_tables!r}, "
            f"mod_types={tuple(sorted(self.mod_types))!r}, "
            f"exclude_transaction_tags={self.exclude_transaction_tags!r}, "
            f"exclude_system_transactions={self.exclude_system_transactions!r}, "
            f"exclude_columns={self.exclude_columns!r})"
        )


def _without(text: str, names: frozenset[str]) -> str:
    """JSON object text without the keys ``names`` (the text itself when it has none of them)."""
    if text == "{}":
        return text
    values = _json_object.decode(text)
    if not any(name in values for name in names):
        return text
    for name in names:
        values.pop(name, None)
    return _json_encode(values).decode()
