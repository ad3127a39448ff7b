"""The Spark bridge's keyed path: the retry queue and dead-letter queue
(docs/design.md#retry-and-dead-letter-queues, opt-in: ``SparkConfig.dead_letter``, embedded path
only).

A micro-batch that still fails after ``max_attempts`` is not failed back: :class:`KeyedPath`
isolates the failing rows by **bisecting the micro-batch by ordering key** (table and primary key;
``runtime.spark.keyed.halves``), each half run once as its own Spark batch with a fresh batch id
(so a ``foreach_batch`` idempotent per id never overwrites one half with the other; it must write
nothing when it raises), down to single keys; a ``foreach_batch`` that raises ``RowsFailed(keys)``
names them at once. What succeeds is committed; the rows of keys that fail alone go to the retry
queue of ``runtime.kafka.retry_queue.RetryQueue`` (the Kafka sink's shell and topic format, here
``<name>_rq`` / ``<name>_dlq``), retried with backoff as small Spark batches (one row per key at a
time), dead-lettered after ``policy.max_attempts``. **Per key order**: every later row of a key
the queue holds (``RetryQueue.blocks``) is taken out of its micro-batch and parked behind, other
keys flow on. A ``SinkBatch``'s future resolves once each of its rows is committed in Spark or
durably in the RQ/DLQ, so watermarks never pass a lost row; the RQ/DLQ state lives in Kafka and a
new bridge over the same topics resumes it. Spark jobs (micro-batches, halves, retries) run one
at a time (``runtime.spark.batch.SparkJobs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from protocol.commit import records_identity
from protocol.records import DataChange
from runtime.kafka.retry_queue import PendingSend, RetryQueue, RetryQueueError
from runtime.spark.batch import error_text
from runtime.spark.config import BridgeError
from runtime.spark.dead_letter import SparkDlqRecord
from runtime.spark.keyed import (
    RowsFailed,
    SparkRecord,
    decode_record,
    encode_record,
    halves,
    record_keys,
    records_table,
    spark_records,
)
from runtime.spark.rows import Cut
from runtime.spark.supervisor import SparkLost

if TYPE_CHECKING:
    from runtime.spark.bridge import SparkBridge

__all__ = ["KeyedPath"]

log = logging.getLogger("shoal.spark")


class KeyedPath:
    """A bridge's retry queue (``rq``, entered and left by the bridge) and the commits that
    keep each ordering key's rows in order around it."""

    def __init__(self, bridge: SparkBridge) -> None:
        dead_letter = bridge.config.dead_letter
        assert dead_letter is not None
        self.bridge = bridge
        self.rq = RetryQueue(
            dead_letter.kafka,
            dead_letter.queue_config(),
            self._send_retry,
            name=dead_letter.name,
            driver=bridge._rq_driver,
            takeover_grace_s=dead_letter.takeover_grace_s,
        )
        self._sends: list[PendingSend] = []
        self._kick = asyncio.Event()
        self.rows_parked = self.rows_retried = self.isolation_runs = 0

    def check_alive(self) -> None:
        """Raise ``BridgeError`` if the RQ failed (the bridge then takes no more batches)."""
        try:
            self.rq.check_alive()
        except RetryQueueError as exc:
            raise BridgeError(f"{self.bridge!r}: the retry queue failed: {exc}") from exc

    async def commit(
        self, cut: Cut, table: Any, fresh: list[tuple[str, list[DataChange]]], rows: int
    ) -> None:
        """Commit ``cut`` with the RQ (see the module docstring); a failed RQ breaks the bridge,
        a lost session fails the cut."""
        b = self.bridge
        try:
            await self._commit_keyed(cut, table, fresh, rows)
        except RetryQueueError as exc:
            b._broken = BridgeError(f"the retry queue failed: {exc}")
            b._fail_permanently([cut], b._broken)
        except SparkLost as lost:
            b._fail_permanently([cut], lost)

    async def _commit_keyed(
        self,
        cut: Cut,
        table: Any,
        fresh: list[tuple[str, list[DataChange]]],
        rows: int,
    ) -> None:
        """Commit ``cut`` with the RQ: rows of keys the RQ holds are parked behind them; if
        Spark keeps failing the rest, the failing rows are isolated and parked."""
        b, rq = self.bridge, self.rq
        by_entry: list[list[SparkRecord]] | None = None
        parked: dict[int, list[asyncio.Future[None]]] = {}
        direct_rows = rows
        if rows and rq.busy():
            keys = await asyncio.to_thread(ordering_keys, fresh)
            blocked = {k for k in keys if rq.blocks(k)}  # on the loop: consistent with the RQ
            if blocked:
                by_entry = await asyncio.to_thread(_records_by_entry, fresh)
                for i, records in enumerate(by_entry):
                    behind = [r for r in records if r.key in blocked]
                    if behind:
                        parked.setdefault(i, []).append(await self._park(behind, None))
                    by_entry[i] = [r for r in records if r.key not in blocked]
                direct = [r for records in by_entry for r in records]
                direct_rows = len(direct)
                table = await asyncio.to_thread(records_table, direct)
        committed = direct_rows
        error = None
        if direct_rows or b.foreach_batch is not None:
            identity = None
            if by_entry is not None:  # rows parked: the identity of the rows written
                identity = records_identity(r.record_id for rs in by_entry for r in rs)
            error = await b._batch.attempts(
                cut.batch_id, table, direct_rows, cut, identity=identity
            )
        if error is not None:
            if by_entry is None:
                by_entry = await asyncio.to_thread(_records_by_entry, fresh)
            entry_of = {r.record_id: i for i, records in enumerate(by_entry) for r in records}
            direct = [r for records in by_entry for r in records]
            ok, failed = await self._write_isolating(direct, error)
            committed = len(ok)
            groups: dict[tuple[int, str], list[SparkRecord]] = {}
            for record, text in failed:
                groups.setdefault((entry_of[record.record_id], text), []).append(record)
            # entry order: a key's rows are in one group per entry, and must reach the RQ in order
            for (i, text), records in sorted(groups.items(), key=lambda g: g[0][0]):
                parked.setdefault(i, []).append(await self._park(records, text))
            log.warning(
                "%r: micro-batch %d failed %d times: %d rows committed in parts, %d parked in "
                "the retry queue (%d keys)",
                b,
                cut.batch_id,
                b.config.max_attempts,
                len(ok),
                len(failed),
                len(record_keys(r for r, _ in failed)),
            )
        b._succeed(cut, fresh, committed, parked)

    async def _park(self, records: list[SparkRecord], failed: str | None) -> asyncio.Future[None]:
        self.rows_parked += len(records)
        return await self.rq.submit(
            [(r.record_id, r.key, encode_record(r)) for r in records], failed=failed
        )

    async def _write_isolating(
        self, records: list[SparkRecord], error: Exception | None
    ) -> tuple[list[SparkRecord], list[tuple[SparkRecord, str]]]:
        """Write ``records`` to Spark (they failed already with ``error``, if given), bisecting
        by ordering key on failure: (committed, failed alone with their error)."""
        committed: list[SparkRecord] = []
        failed: list[tuple[SparkRecord, str]] = []
        todo: list[tuple[list[SparkRecord], Exception | None]] = [(records, error)]
        while todo:
            group, err = todo.pop()
            if not group:
                continue
            if err is None:
                err = await self._write_once(group)
                if err is None:
                    committed += group
                    continue
            if isinstance(err, SparkLost):  # not the rows' fault: nothing to isolate
                raise err
            if isinstance(err, RowsFailed):
                named = [r for r in group if r.key in err.keys]
                if named:
                    failed += [(r, error_text(err)) for r in named]
                    todo.append(([r for r in group if r.key not in err.keys], None))
                    continue
            if len(record_keys(group)) == 1:
                failed += [(r, error_text(err)) for r in group]
                continue
            left, right = halves(group)
            todo += [(right, None), (left, None)]
        return committed, failed

    async def _write_once(self, records: list[SparkRecord]) -> Exception | None:
        """One Spark batch of ``records`` under a fresh batch id: None, or why it failed."""
        b = self.bridge
        jobs = b._jobs
        batch_id = b._batcher.take_id()
        self.isolation_runs += 1
        table = await asyncio.to_thread(records_table, records)
        identity = records_identity(r.record_id for r in records)
        try:
            async with jobs.lock:
                await jobs.run(table, b._batch.run_batch, batch_id, table, identity)
        except Exception as exc:
            try:
                if await jobs.session_replaced(exc):
                    return await self._write_once(records)
            except SparkLost as lost:
                return lost
            b._attempts_failed += 1
            log.info("%r: batch %d (%d rows) failed: %r", b, batch_id, len(records), exc)
            return exc
        jobs.succeeded()
        return None

    async def _send_retry(self, send: PendingSend) -> None:
        """The RQ's delivery port: gather sends for the retry loop's next Spark batch."""
        self._sends.append(send)
        self._kick.set()

    async def retry_loop(self) -> None:
        """Deliver what the RQ sends (at most one row per key), one Spark batch at a time, and
        answer each send; ends once the bridge closes and the RQ has nothing unsettled."""
        b, rq, kick = self.bridge, self.rq, self._kick
        while True:
            if b._closing and b._committer_done and rq.statistics().unsettled == 0:
                return
            if not self._sends:
                kick.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await kick.wait()
                continue
            sends, self._sends = self._sends, []
            records: list[SparkRecord] = []
            for send in sends:
                try:
                    records.append(decode_record(send.payload))
                except msgspec.DecodeError as exc:
                    log.exception("%r: RQ payload of %s undecodable", b, send.record_id)
                    rq.failed(send.record_id, f"undecodable payload: {exc}")
            try:
                ok, failed = await self._write_isolating(records, None)
            except SparkLost:
                log.exception("%r: the retry queue stops with Spark", b)
                return
            self.rows_retried += len(ok)
            b._rows_committed += len(ok)
            for record in ok:
                rq.delivered(record.record_id)
            for record, text in failed:
                rq.failed(record.record_id, text)

    # --- operator actions -----------------------------------------------------------------

    def dlq_records(self) -> list[SparkDlqRecord]:
        """The rows in the DLQ."""
        out = []
        for e, raw in self.rq.dlq_records():
            record = None
            if raw is not None:
                try:
                    record = decode_record(raw)
                except msgspec.DecodeError:
                    log.exception("%r: DLQ payload of %s undecodable", self.bridge, e.record_id)
            out.append(SparkDlqRecord(e.record_id, e.key, e.attempts, e.error, record))
        return out

    def replay_dlq(self, record_ids: Iterable[str] | None = None) -> list[str]:
        return self.rq.replay_dlq(record_ids)

    def discard_dlq(self, record_ids: Iterable[str]) -> list[str]:
        return self.rq.discard_dlq(record_ids)

    async def wait_replayed(self, record_ids: Sequence[str]) -> None:
        await self.rq.wait_replayed(record_ids)

    async def wait_idle(self) -> None:
        await self.rq.wait_idle()


def _records_by_entry(fresh: list[tuple[str, list[DataChange]]]) -> list[list[SparkRecord]]:
    return [spark_records(token, records) for token, records in fresh]


def ordering_keys(fresh: list[tuple[str, list[DataChange]]]) -> set[str]:
    """The ordering keys of the rows (as ``SparkRecord.key``), without building the rows."""
    return {f"{c.table}:{m.keys}" for _, records in fresh for c in records for m in c.mods}
