"""The connector's own records beside a file or Spark output (``runtime/output_state.py``): where
it first started, and its completeness mark (docs/reading-output.md). A Kafka output or an
embedding's own sink has neither (:class:`OutputRecords` with no ``state``).

* **The start.** A different explicit start than the one recorded is refused (exit 2), as the
  sync topic's record is, on any broker (:meth:`OutputRecords.open`). The first start is
  recorded at once when it is explicit (without ``--snapshot``), else once the sync topic has
  one (a start of "now" is fixed by the first leader).
* **The mark.** Written when it advanced (``protocol.completeness.mark_due``: at most once a
  second, and once more at the end), or when the quarantined partitions holding it back changed
  (``Mark.held_by``); never below one a reader may have seen (the one found at start).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable

from actors.task import wall_micros
from protocol.commit import StartRecord, start_conflict
from protocol.completeness import Mark, mark_due
from runtime.output_state import OutputState

__all__ = ["OutputRecords", "rfc3339"]

log = logging.getLogger("shoal.runtime")


class OutputRecords:
    """The start record and completeness mark of one connector's output, as this run keeps
    them (``state`` None: the output has none)."""

    def __init__(self, connector: str, count_error: Callable[[str], None]) -> None:
        self.connector = connector
        self._count_error = count_error
        self.state: OutputState | None = None
        self.start_recorded: StartRecord | None = None
        self.started_before = -1  # the output's record of a start before this run's
        self.written = -1  # the completeness watermark last written (micros)
        self._held: tuple[str, ...] = ()  # the quarantined partitions it named
        self._at = -1.0  # when (monotonic seconds)
        self._writing = asyncio.Lock()  # one mark write at a time, in the order they were due

    def mark(self) -> int:
        """The completeness mark last written (micros; -1: none), for the sink's commits."""
        return max(self.written, -1)

    @property
    def start_missing(self) -> bool:
        """The output has no start record yet: :meth:`record_start` once the sync topic has one."""
        return self.state is not None and self.start_recorded is None

    async def open(
        self, sink_dir: str, *, start_at: int | None, snapshot: bool
    ) -> StartRecord | None:
        """Read the output's records; the recorded start ``start_at`` contradicts (the run is
        refused), else None and the first explicit start is recorded (not with ``snapshot``:
        then the start is recorded once the sync topic has it, and with it the snapshot;
        recorded here, it would make another process of this connector that starts at the same
        time refuse the snapshot its leader is planning)."""
        state = self.state = OutputState(sink_dir, self.connector)
        recorded = await asyncio.to_thread(state.read_start)
        conflict = start_conflict(recorded, start_at)
        if conflict is not None:
            return conflict
        self.start_recorded = recorded
        self.started_before = -1 if recorded is None else recorded.start_us  # (not this run's)
        mark = await asyncio.to_thread(state.read_mark)
        if mark is not None:
            # never write a mark below one a reader may have seen: a restart whose sync topic is
            # new computes a low one until its partitions have caught up with their progress
            self.written = mark.low_watermark_us
        if recorded is None and start_at is not None and not snapshot:
            self.start_recorded = await asyncio.to_thread(
                state.record_start, start_at, rfc3339(start_at)
            )
        return None

    async def record_start(self, start: int) -> None:
        """Record the connector's start (micros) in the output."""
        state = self.state
        assert state is not None
        self.start_recorded = await asyncio.to_thread(state.record_start, start, rfc3339(start))

    async def record_mark(
        self, low_watermark_us: int, held: tuple[str, ...] = (), *, final: bool = False
    ) -> None:
        """Write the connector's completeness mark when due (the rules above):
        ``<data>/_shoal/<connector>/completeness.json``, one JSON line a downstream job reads
        with ``spark.read.json``. Readers of the data skip ``_shoal``. A write that fails is
        logged and counted (``completeness_write``), and tried again when next due. The write
        runs in a worker thread (on an object store it is a PUT of tens of milliseconds, which
        stalled the event loop every second), one at a time: whether a mark is due is decided
        after the write before it ended, so a late sample never overwrites a newer mark."""
        async with self._writing:
            await self._record_mark(low_watermark_us, held, final)

    async def _record_mark(self, low_watermark_us: int, held: tuple[str, ...], final: bool) -> None:
        state = self.state
        now = time.monotonic()
        changed = held != self._held and low_watermark_us >= 0
        if state is None or not (
            changed or mark_due(low_watermark_us, self.written, self._at, now, final=final)
        ):
            return
        self._at = now
        mark = Mark(
            connector=self.connector,
            low_watermark=rfc3339(low_watermark_us),
            low_watermark_us=low_watermark_us,
            written_at=rfc3339(wall_micros()),
            held_by=held,
        )
        try:
            await asyncio.to_thread(state.write_mark, mark)
        except OSError as exc:
            self._count_error("completeness_write")
            log.warning("could not write the completeness mark to %s: %r", state.mark_file, exc)
            return
        self.written = max(self.written, low_watermark_us)
        self._held = held


def rfc3339(micros: int) -> str:
    """Unix microseconds as an RFC 3339 UTC timestamp (``...Z``)."""
    moment = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(
        microseconds=micros
    )
    return moment.isoformat().replace("+00:00", "Z")
