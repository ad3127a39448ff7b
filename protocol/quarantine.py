"""Poison partitions (docs/design.md#poison-partitions) in one task: a partition whose reader
fails ``TaskConfig.quarantine_after`` times in a row without its committed position moving,
while another partition of the task advanced between the last two failures (so the source and
the sink work: a failure of everything is an outage, retried, not poison), is parked at its
watermark with a ``Quarantine``; an operator's ``release`` (CIM rule 9) clears it. Functions
over one :class:`~protocol.task.TaskCore`'s state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from protocol.events import Alert, ReaderFailed
from protocol.messages import Quarantine

if TYPE_CHECKING:
    from protocol.task import TaskCore

__all__ = ["Failing", "advanced", "apply_releases", "on_failed"]


class Failing(msgspec.Struct):
    """A partition's failures in a row (the quarantine rule): how many, the task's count of
    committed-position moves at the last one, and the last error and record."""

    count: int = 0
    advances: int = 0
    error: str = ""
    record: str = ""


def advanced(core: TaskCore, token: str) -> None:
    """``token``'s committed position moved: its failures are no longer in a row."""
    core._advances += 1
    core._failing.pop(token, None)


def on_failed(core: TaskCore, event: ReaderFailed, now: int) -> None:
    """The quarantine rule: count the failure of an owned partition not parked yet (a stalled,
    silent query is no failing record: the stall rule restarts it); park the partition at its
    watermark once it failed ``quarantine_after`` times in a row while another partition of
    this task advanced since the failure before (else nothing else advanced: an outage)."""
    core.counters["reader_failed"] += 1
    token = event.token
    part = core.mine.get(token)
    after = core.config.quarantine_after
    if event.stalled:
        return  # a silent query, not a failing record (the stall rule restarts it)
    if after <= 0 or part is None or part.status != "owned" or part.quarantine is not None:
        return
    row = core._failing.get(token)
    if row is None:
        row = core._failing[token] = Failing(advances=core._advances)
    others = core._advances > row.advances
    row.count += 1
    row.advances = core._advances
    row.error = event.error
    row.record = event.record or row.record
    if row.count < after:
        return
    if not others:
        core.counters["quarantine_withheld"] += 1  # nothing else advanced: an outage
        return
    del core._failing[token]
    quarantine = Quarantine(
        since=now,
        failures=row.count,
        error=row.error,
        position=part.watermark,
        record=row.record,
        task=core.me,
    )
    core.mine[token] = msgspec.structs.replace(part, quarantine=quarantine)
    core.counters["quarantined"] += 1
    core._alerts.append(
        Alert(
            "quarantined",
            f"partition {token} parked at its watermark {part.watermark} after "
            f"{row.count} failures in a row: {row.error}; record: {row.record or 'unknown'}",
        )
    )
    core._urgent = True


def apply_releases(core: TaskCore) -> None:
    """CIM rule 9: an operator released a quarantine of a partition this task owns: clear
    it (the partition is read again from its watermark; the next message says so)."""
    releases = core.cim.releases
    if not releases:
        return
    for token, part in list(core.mine.items()):
        quarantine = part.quarantine
        if quarantine is not None and releases.get(token, -1) >= quarantine.since:
            core.mine[token] = msgspec.structs.replace(part, quarantine=None)
            core._failing.pop(token, None)
            core.counters["quarantine_released"] += 1
            core._urgent = True
