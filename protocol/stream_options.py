"""A change stream's own options, as Spanner's information schema states them
(``INFORMATION_SCHEMA.CHANGE_STREAM_OPTIONS``: one row per option set explicitly), and the rules
that depend on them: how long the stream keeps its records (a ``--start-at`` older than that is
refused before the first query, with one line naming both), what each value capture type puts
in the output, and the partition mode.

An option not set in the DDL has no row; Spanner's documented default stands then:
``retention_period`` 1 day, ``value_capture_type`` ``OLD_AND_NEW_VALUES``, ``partition_mode``
``IMMUTABLE_KEY_RANGE``, every ``exclude_*`` false.

Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

import msgspec

__all__ = [
    "CAPTURE_TYPES",
    "DEFAULT_RETENTION",
    "StreamOptions",
    "StreamOptionsError",
    "parse_retention",
    "start_refusal",
    "stream_options",
]

DEFAULT_RETENTION: Final = "1d"

# What each value capture type puts in a data-change record's mods (docs/reading-output.md).
CAPTURE_TYPES: Final[dict[str, str]] = {
    "OLD_AND_NEW_VALUES": "new values of the changed columns, and their old values",
    "NEW_VALUES": "new values of the changed columns; no old values",
    "NEW_ROW": "every column of the row as it is after the change (a DELETE: none); no old values",
    "NEW_ROW_AND_OLD_VALUES": (
        "every column of the row after the change, and the old values of the changed columns"
    ),
}

_UNITS: Final = {"d": 86_400, "h": 3_600, "m": 60, "s": 1}
_RETENTION = re.compile(r"\s*(\d+)\s*([dhms])\s*", re.IGNORECASE)


class StreamOptionsError(ValueError):
    """An option value this module cannot read; the message names it."""


def parse_retention(text: str) -> int:
    """A ``retention_period`` (``7d``, ``36h``, ``90m``, ``3600s``) in microseconds."""
    match = _RETENTION.fullmatch(text)
    if match is None:
        raise StreamOptionsError(f"retention_period {text!r}: not <number><d|h|m|s>")
    return int(match.group(1)) * _UNITS[match.group(2).lower()] * 1_000_000


class StreamOptions(msgspec.Struct, frozen=True):
    """The options of one change stream, defaults filled in."""

    retention_period: str = DEFAULT_RETENTION
    value_capture_type: str = "OLD_AND_NEW_VALUES"
    partition_mode: str = "IMMUTABLE_KEY_RANGE"
    excludes: tuple[str, ...] = ()  # the exclude_* options set true (exclude_ttl_deletes, ...)
    other: tuple[tuple[str, str], ...] = ()  # any other option, as stated

    @property
    def retention_us(self) -> int:
        return parse_retention(self.retention_period)

    @property
    def mutable_key_range(self) -> bool:
        return self.partition_mode.upper() == "MUTABLE_KEY_RANGE"

    def describe(self) -> str:
        """One line: ``retention_period 1d, value_capture_type ..., partition_mode ...``."""
        parts = [
            f"retention_period {self.retention_period}",
            f"value_capture_type {self.value_capture_type}",
            f"partition_mode {self.partition_mode}",
            "excludes " + (",".join(self.excludes) if self.excludes else "none"),
        ]
        parts += [f"{name} {value}" for name, value in self.other]
        return ", ".join(parts)


def stream_options(rows: Iterable[tuple[str, str]]) -> StreamOptions:
    """The options of the information schema's ``(OPTION_NAME, OPTION_VALUE)`` rows of one
    stream (names in either case; values as text)."""
    values: dict[str, str] = {}
    excludes: list[str] = []
    other: list[tuple[str, str]] = []
    for name, value in rows:
        key = name.lower()
        text = str(value)
        if key in ("retention_period", "value_capture_type", "partition_mode"):
            values[key] = text.upper() if key != "retention_period" else text
        elif key.startswith("exclude_"):
            if text.lower() == "true":
                excludes.append(key)
        else:
            other.append((key, text))
    options = StreamOptions(
        retention_period=values.get("retention_period", DEFAULT_RETENTION),
        value_capture_type=values.get("value_capture_type", "OLD_AND_NEW_VALUES"),
        partition_mode=values.get("partition_mode", "IMMUTABLE_KEY_RANGE"),
        excludes=tuple(sorted(excludes)),
        other=tuple(sorted(other)),
    )
    options.retention_us  # noqa: B018  (refuse an unreadable retention here, not later)
    return options


def _rfc3339(micros: int) -> str:
    """Unix microseconds as RFC 3339 UTC text, by the proleptic Gregorian calendar (the days
    to a civil date as in H. Hinnant's ``civil_from_days``; protocol/ imports no clock module)."""
    seconds, fraction = divmod(micros, 1_000_000)
    days, second_of_day = divmod(seconds, 86_400)
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1_460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (month <= 2)
    hour, rest = divmod(second_of_day, 3_600)
    minute, second = divmod(rest, 60)
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}.{fraction:06d}Z"


def start_refusal(
    start_us: int, now_us: int, options: StreamOptions, *, start_at: str, stream: str
) -> str | None:
    """The one-line refusal of a first start at ``start_us`` older than the stream keeps
    records (``now_us`` minus its retention), naming both; None when the start is inside it."""
    oldest = now_us - options.retention_us
    if start_us >= oldest:
        return None
    return (
        f"start_at {start_at} (--start-at) is older than change stream {stream}'s "
        f"retention_period {options.retention_period}: the oldest start it keeps records for "
        f"is {_rfc3339(oldest)} (now); start later, or raise the stream's retention_period"
    )
