"""Structured logs: one line per record on stderr, human-readable or JSON (``--log-json``).

Human form: ``2026-11-22T18:43:34.123Z WARNING shoal.reader reader p00003: ... key=value``.
JSON form: one object per line with ``ts``, ``level``, ``logger``, ``message``, ``process``,
``task`` where known, ``exc`` with the traceback, and every ``extra={...}`` field of the call.

Secret values handed to :func:`configure` (passwords from the configuration) are replaced by
``***`` in every line, in both forms, whatever logged them (shoal, the Kafka client, Google's
libraries at debug level): shoal's own messages never show them, and this catches a third-party
one that would.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import sys
from typing import Any, Final, TextIO

__all__ = ["JsonFormatter", "TextFormatter", "configure", "mask"]

# Attributes every LogRecord has; anything else came from ``extra=`` and is logged as a field.
_STANDARD: Final = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys() | {"message", "asctime", "taskName"}
)


def _ts(record: logging.LogRecord) -> str:
    when = _dt.datetime.fromtimestamp(record.created, tz=_dt.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _ts(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": os.getpid(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def mask(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every value of ``secrets`` (also as escaped inside a JSON string) replaced
    by ``***``; the longest first, so a secret containing another is masked whole."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, "***")
        quoted = json.dumps(secret)[1:-1]
        if quoted != secret:
            text = text.replace(quoted, "***")
    return text


class _Masking(logging.Formatter):
    """Formats with ``inner``, then replaces every secret value by ``***``."""

    def __init__(self, inner: logging.Formatter, secrets: tuple[str, ...]) -> None:
        super().__init__()
        self._inner = inner
        self._secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return mask(self._inner.format(record), self._secrets)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{_ts(record)} {record.levelname:<7} {record.name} {record.getMessage()}"
        if extra:
            line = f"{line} {extra}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def configure(
    level: str = "warning",
    *,
    json_lines: bool = False,
    stream: TextIO | None = None,
    secrets: tuple[str, ...] = (),
) -> None:
    """Route every logger to ``stream`` (stderr) at ``level``; replaces earlier handlers. Every
    value in ``secrets`` is shown as ``***``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    formatter: logging.Formatter = JsonFormatter() if json_lines else TextFormatter()
    if secrets:
        formatter = _Masking(formatter, secrets)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # The Kafka client is chatty at INFO about every connection; keep it at WARNING unless
    # debugging (then it follows the root again, also after an earlier configure).
    if level.lower() != "debug":
        logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
    else:
        logging.getLogger("aiokafka").setLevel(logging.NOTSET)
