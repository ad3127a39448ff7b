"""``FilteredSource``: a ``ChangeStreamSource`` that keeps only the records a
:class:`protocol.filters.RecordFilter` keeps (``--tables``, ``--exclude-tables``,
``--mod-types``, ``--exclude-transaction-tags``, ``--exclude-system-transactions``), and those
without the columns it excludes (``--exclude-columns``), so the partition reader stays
unchanged. The rules, and the replacement below, are the core's
(:meth:`protocol.filters.RecordFilter.apply`); this wrapper runs it on each batch and counts.

A data-change record the filter drops is replaced by a ``Heartbeat`` at its commit timestamp,
never simply left out. Why that is safe, and needed:

* **Watermarks advance.** A partition whose records are all filtered out would otherwise look
  silent: its committed watermark would stand still (lag grows, the stuck-partition watch fires,
  and a restart would re-read everything since). The reader moves its position to a heartbeat's
  timestamp exactly as to a record's, and commits it with an empty batch.
* **Nothing kept is skipped.** A heartbeat at ``t`` moves the reader's committed watermark to
  ``t`` with *no* identities at ``t`` (``PartitionTail.advance`` in ``protocol/dedup.py``). A
  restart or a new owner reads from the watermark *inclusive* and skips only the identities the
  tail holds, so a kept record of the same transaction at the same ``t`` (another table of one
  commit, say), whether it comes before or after the replaced one, is still delivered once: a
  heartbeat never adds an identity, and one at a timestamp the tail already holds changes
  nothing (``advance`` only moves forward; the reader puts nothing when the position did not
  pass its watermark).
* **Order is kept.** The heartbeat takes the dropped record's place in the batch, and records of
  a partition come in commit-timestamp order, so positions still only grow.
* **Re-reads are filtered alike.** The rule is a pure function of the record, so a record read
  again after a restart is dropped again (and counted again: ``records_filtered`` counts what
  the filter saw, re-reads included).

Heartbeats and child-partition records pass unchanged: they are the partition's lifecycle.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import msgspec

from protocol.filters import FilterCounts, RecordFilter
from protocol.records import ChangeRecord
from runtime.ports import ChangeStreamSource

__all__ = ["FilterStats", "FilteredSource"]


class FilterStats(msgspec.Struct, frozen=True):
    records_kept: int  # data-change records passed on
    records_filtered: int  # data-change records replaced by a heartbeat
    filtered_by: dict[str, int] = {}  # records_filtered by the rule that dropped them
    columns_stripped: int = 0  # kept records with columns taken out (--exclude-columns)


class FilteredSource(ChangeStreamSource):
    """``inner`` with the data-change records ``rule`` drops replaced by heartbeats."""

    def __init__(self, inner: ChangeStreamSource, rule: RecordFilter) -> None:
        self.inner = inner
        self.rule = rule
        self._counts = FilterCounts()

    def statistics(self) -> FilterStats:
        c = self._counts
        return FilterStats(c.kept, c.dropped, c.by_reason(), c.columns_stripped)

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        apply = self.rule.apply
        async for batch in self.inner.query(token, start_ts, end_ts):
            out, counts = apply(batch)
            self._counts += counts
            yield out
