"""Which change records a connector keeps: the ``--tables``, ``--exclude-tables`` and
``--mod-types`` rule, as a pure function of one record.

The rule:

1. ``tables`` (include patterns): when given, a record's table must match at least one; when
   empty, every table is included.
2. ``exclude_tables``: a record whose table matches any of these is dropped, even when an
   include pattern matches it too (exclusion wins).
3. ``mod_types``: when given, a record's mod type (INSERT, UPDATE, DELETE, or SNAPSHOT for the
   rows of a snapshot: ``protocol/snapshot.py``) must be one of them.

Patterns are shell globs (``*`` any run of characters, ``?`` one character, ``[abc]`` one of
a set), matched against the whole table name, **case-insensitively**: Spanner's GoogleSQL names
are case-insensitive (``Orders`` and ``ORDERS`` name one table) and PostgreSQL-dialect names
fold unquoted identifiers to lower case, so a pattern must not depend on how a name is spelt.

Only data-change records are filtered. What a dropped record becomes on its way to the reader
(a heartbeat at its commit timestamp, so watermarks still advance) is the business of the
source wrapper, ``runtime/filtered.py``; this module only decides.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Final, get_args

from protocol.records import DataChange, ModType

__all__ = ["MOD_TYPES", "FilterError", "RecordFilter", "parse_list"]

MOD_TYPES: Final[tuple[str, ...]] = get_args(ModType)


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


def _compile(patterns: Iterable[str]) -> re.Pattern[str] | None:
    parts = [fnmatch.translate(p) for p in patterns]
    if not parts:
        return None
    return re.compile("|".join(f"(?:{p})" for p in parts), re.IGNORECASE)


class RecordFilter:
    """The rule of the module docstring for one set of patterns and mod types."""

    __slots__ = ("_exclude", "_include", "_table_cache", "exclude_tables", "mod_types", "tables")

    def __init__(
        self,
        tables: Iterable[str] = (),
        exclude_tables: Iterable[str] = (),
        mod_types: Iterable[str] = (),
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

    @classmethod
    def parse(
        cls, tables: str | None, exclude_tables: str | None, mod_types: str | None
    ) -> RecordFilter:
        """The filter of the comma-separated settings (``None``: not given)."""
        return cls(
            parse_list(tables, "tables"),
            parse_list(exclude_tables, "exclude_tables"),
            parse_list(mod_types, "mod_types"),
        )

    @property
    def keeps_everything(self) -> bool:
        """Whether this filter keeps every record (no setting given): callers skip it then."""
        return self._include is None and self._exclude is None and not self.mod_types

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

    def keeps(self, record: DataChange) -> bool:
        """Whether ``record`` passes every rule."""
        return self.keeps_change(record.table, record.mod_type)

    def __repr__(self) -> str:
        return (
            f"RecordFilter(tables={self.tables!r}, exclude_tables={self.exclude_tables!r}, "
            f"mod_types={tuple(sorted(self.mod_types))!r})"
        )
