"""Spanner's RFC 3339 timestamps as integer microseconds, shared by the change-stream decoder
(``runtime/spanner/decode.py``) and the typed output (``runtime/typed.py``), so the output
needs no Spanner adapter."""

from __future__ import annotations

import datetime as _dt

__all__ = ["DecodeError", "parse_timestamp"]

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_SECONDS: dict[str, int] = {}  # "YYYY-MM-DDTHH:MM:SS" -> seconds since the epoch
_SECONDS_MAX = 65_536


class DecodeError(ValueError):
    """A change-stream row does not have the shape this decoder knows."""


def parse_timestamp(text: str) -> int:
    """RFC 3339 UTC text as Spanner sends it (``2026-11-22T14:16:53.473301Z``, 0–9 fraction
    digits; PostgreSQL-dialect change records end in ``+00:00`` instead of ``Z``) to integer
    microseconds since the epoch. Digits beyond microseconds are truncated."""
    if not text.endswith("Z"):
        if not text.endswith("+00:00"):
            return _parse_timestamp_slow(text)
        text = text[:-6] + "Z"
    if len(text) < 20 or text[10] != "T":
        return _parse_timestamp_slow(text)
    head = text[:19]
    seconds = _SECONDS.get(head)
    if seconds is None:
        seconds = _parse_seconds(head)
    if len(text) == 20:
        return seconds * 1_000_000
    if text[19] != ".":
        return _parse_timestamp_slow(text)
    frac = text[20:-1]
    if len(frac) >= 6:
        return seconds * 1_000_000 + int(frac[:6])
    return seconds * 1_000_000 + int(frac.ljust(6, "0"))


def _parse_seconds(head: str) -> int:
    when = _dt.datetime.fromisoformat(head).replace(tzinfo=_dt.UTC)
    seconds = (when - _EPOCH) // _dt.timedelta(seconds=1)
    if len(_SECONDS) >= _SECONDS_MAX:
        _SECONDS.clear()
    _SECONDS[head] = seconds
    return seconds


def _parse_timestamp_slow(text: str) -> int:
    try:
        when = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise DecodeError(f"not an RFC 3339 timestamp: {text!r}") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.UTC)
    return (when - _EPOCH) // _dt.timedelta(microseconds=1)
