"""Sinks of the command-line runtime: the parquet file sink (``--sink files``, no Java needed) and
the per-task counting view every task node writes through.

``FileSink`` buffers the rows of many batches and commits them as one micro-batch once
``max_rows`` rows or ``max_age_s`` seconds have gathered, or at once when every reader of a
buffered batch waits for nothing else (``flush``, the rule of ``protocol.gather``). Its
``layout``: ``typed`` (the default) writes the typed per-table changelog (``runtime.typed``, docs/reading-output.md): each table's
rows in its own directory ``<table>/batch=<id>/``, in the table's column types; ``generic`` writes
one file per micro-batch ``batch=<id>/`` with one row per mod in the output-record shape of
``runtime.kafka.sink.output_records`` (keys and values as JSON text). A micro-batch is committed atomically with the sink's own
durable position (docs/design.md#exactly-once-output, ``runtime.files.commit``): its parquet files are
staged under ``_staging/<batch>/`` (readers skip ``_`` names), the lease (``permit``) is checked,
a manifest with every partition's new position is written (the commit point), then each staged
directory (``<table>/batch=<id>`` per table, or the generic ``batch=<id>``) is renamed into place
and each partition's progress file written. A
process killed at any step leaves either nothing visible or a manifest the next ``FileSink`` over
the same directory applies when it opens. ``<id>`` is the batch identity
(``protocol.commit.batch_identity``): the same records give the same directory, so a batch
committed twice appears once. A batch's future resolves when its micro-batch committed;
``durable_position(token)`` answers a partition's committed position from its progress file (a new
owner resumes after it). ``max_buffered_rows`` bounds what is accepted and not yet written
(``put`` waits: backpressure); its default, twice ``max_rows``, lets one micro-batch gather while
the one before it is written, so readers are paced by what the sink commits: on a backlog they
read no further ahead of it than on a live stream (ten times ``max_rows`` held 480-490 MB of
buffered changes on a 100,000-record backlog in ``bench catchup``, and the collector's pauses on
that heap stalled the event loop for seconds, lapsing leases). ``fence(batches)`` fences batches a stopping reader abandons
(docs/design.md#exactly-once-output, rule 4): the committer refuses a micro-batch holding one
at its commit point (the whole micro-batch fails; the other partitions' readers re-read theirs).
A micro-batch of the typed layout holding a value that does not fit its column type fails only
the batches of the partitions whose own records do not convert (and what is buffered of them
behind it); the others' are committed as a micro-batch of their own, so one bad record stops its
partition only and the quarantine rule can park it (docs/design.md#poison-partitions).
A micro-batch that fails otherwise (refused, or its write failed) fails what is buffered behind it too,
and a later batch of one of its partitions (a heartbeat past the failed records included) is
refused until that partition's reader re-reads from before the failed records: committing it
would move the partition's recorded position past records that were never written.

The sink also drops re-reads itself, as a defence (a reader resuming at an exact position sends
none): per partition it remembers the newest commit timestamp it wrote and the records at it
(seeded from the progress file when a partition's position is asked for), and drops (and
counts, ``duplicates_dropped``) a record it already wrote.

These rules (the dedup tails, the gaps, the failure cascade, the fence keys) are the output
ledger's (``protocol.ledger``), shared with the Spark bridge; this module is its shell.

"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import msgspec

from protocol.commit import batch_identity
from protocol.dedup import Position
from protocol.gather import Flushes
from protocol.ledger import Admit, OutputLedger
from protocol.records import DataChange
from runtime.files.commit import CommitIncomplete, CommitRefused, Committer, TableWrite
from runtime.output_record import output_records
from runtime.ports import Sink, SinkBatch

log = logging.getLogger("shoal.sink")

COLUMNS = (
    "record_id",
    "partition_token",
    "table",
    "keys",
    "mod_type",
    "commit_ts",
    "server_transaction_id",
    "record_sequence",
    "mod_index",
    "new_values",
    "old_values",
)


class SinkError(RuntimeError):
    """The sink failed or is closed; the batches it holds will not be committed by it."""


class FileSinkStats(msgspec.Struct, frozen=True):
    files: int
    rows: int  # rows written (committed)
    batches: int  # batches committed
    buffered_rows: int
    failures: int
    duplicates_dropped: int  # records already written (a re-read at a watermark)
    fenced_refused: int = 0  # micro-batches refused: they held a batch a stopped reader fenced


class FileSink(Sink):
    """``Sink`` writing parquet files to ``directory``; ``async with FileSink(...) as sink:``."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_rows: int = 50_000,
        max_age_s: float = 0.5,
        max_buffered_rows: int | None = None,
        permit: Callable[[], bool] | None = None,
        fsync: bool = True,
        layout: Literal["typed", "generic"] = "typed",
        connector: str = "shoal",
        table_format: Literal["parquet", "delta"] = "parquet",
        mark: Callable[[], int] | None = None,
        mirror: bool = False,
        validate: bool = False,
    ) -> None:
        """``directory``: a local directory or an object store's URI (``s3://``, ``gs://``,
        ``file://``; ``runtime.lake.store``). ``table_format`` ``delta``: each table of the
        typed layout is a Delta table, each micro-batch one Delta commit per table (the data
        files written straight into the table, the commit idempotent by its application
        transaction: exactly once on an object store, with no rename). ``mark``: the
        connector's completeness watermark now, recorded in each Delta commit's metadata.
        ``mirror``: also merge every micro-batch into the current-state tables under
        ``<directory>/_mirror`` (``runtime.lake.mirror``), before its commit point: a batch
        whose commit then fails is read again and merged again, which changes nothing (the
        merge is idempotent per change), so the mirror holds every committed change.
        ``validate``: check the ledger's invariants after every event (``--debug-validate``)."""
        if max_buffered_rows is None:
            max_buffered_rows = 2 * max_rows
        if max_rows < 1 or max_age_s <= 0 or max_buffered_rows < max_rows:
            raise ValueError("max_rows >= 1, max_age_s > 0 and max_buffered_rows >= max_rows")
        if table_format == "delta" and layout != "typed":
            raise ValueError("table_format delta needs the typed layout (one table per table)")
        self.layout = layout
        self.table_format = table_format
        self._mark = mark
        self._max_rows = max_rows
        self._max_age = max_age_s
        self._max_buffered = max_buffered_rows
        self._columns: dict[str, list[Any]] = {c: [] for c in COLUMNS}
        self._waiting: list[tuple[asyncio.Future[None], int]] = []
        self._entries: list[tuple[str, tuple[DataChange, ...], int]] = []
        self._fresh_entries: list[tuple[str, list[DataChange]]] = []  # what the files hold
        self._keys: list[int] = []  # the ledger's keys of the buffered batches
        self._flushes = Flushes()  # every reader of a buffered batch flushed: write now
        self._urged = False
        # what was written per partition, the gaps failed batches left, the held batches and
        # their fence keys, the failure cascade (protocol/ledger.py)
        self.ledger = OutputLedger()
        self._validate = validate
        self.committer = Committer(directory, connector=connector, permit=permit, fsync=fsync)
        self.store = self.committer.store
        self.directory = directory
        self._first_at: float | None = None
        self._buffered = 0
        self._room = asyncio.Condition()
        self._kick = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._files = 0
        self._rows = 0
        self._batches = 0
        self._failures = 0
        self._dropped = 0
        self._mirror: Any = None  # runtime.lake.mirror.MirrorWriter
        if mirror:
            if layout != "typed":
                raise ValueError("mirror needs the typed layout (one table per table)")
            from runtime.lake.mirror import MirrorWriter, mirror_store

            self._mirror = MirrorWriter(mirror_store(self.store))
        self._mirror_version = 0  # this sink's merges: application transaction versions
        self.mirror_merges = 0  # mirror-table commits (one per table and micro-batch)

    def __repr__(self) -> str:
        return f"FileSink({str(self.directory)!r})"

    async def __aenter__(self) -> Self:
        if self.store.is_local:
            await asyncio.to_thread(os.makedirs, self.store.path(), exist_ok=True)
        else:
            await asyncio.to_thread(self.store.check)  # reachable and writable: now, not later
        await asyncio.to_thread(self.committer.recover)
        for legacy in await asyncio.to_thread(self.committer.legacy_state):
            log.warning(
                "%r: %s holds output state of an earlier shoal version, not kept per connector; "
                "it is not read (connector %r resumes from its own state and the sync topic)",
                self,
                self.store.uri_for(legacy),
                self.committer.connector,
            )
        self._writer = asyncio.create_task(self._write_loop(), name="file-sink")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        self._kick.set()
        writer = self._writer
        if writer is not None:
            if exc_type is not None:
                writer.cancel()
            try:
                await writer
            except asyncio.CancelledError:
                if exc_type is None:
                    raise
        self._fail_waiting(SinkError(f"{self!r} is closed"))

    def statistics(self) -> FileSinkStats:
        return FileSinkStats(
            self._files,
            self._rows,
            self._batches,
            self._buffered,
            self._failures,
            self._dropped,
            self.committer.fenced_refused,
        )

    def waiting(self) -> list[asyncio.Future[None]]:
        """Futures of the batches buffered and not written yet."""
        return [future for future, _ in self._waiting]

    async def durable_position(self, token: str) -> Position | None:
        """Partition ``token``'s committed position by this output's own record (after
        applying what a killed process left): a new owner resumes after it. A new reader of
        the partition asks this first: a gap an earlier reader's failed batch left here is
        closed (the new one resumes from what is committed; another process may have written
        those records meanwhile)."""
        self.ledger.reader_starts(token)
        position = await asyncio.to_thread(self.committer.committed, token)
        self.ledger.seed(token, position)
        self._check()
        return position

    async def fence(self, batches: Sequence[SinkBatch]) -> list[bool]:
        """For each batch, whether it passed the commit point; those that did not never will
        (a batch no longer held is answered False: its future tells)."""
        keys = [self.ledger.key_of(id(b)) for b in batches]
        outcome = await asyncio.to_thread(self.committer.fence, [k for k in keys if k is not None])
        return [k is not None and k in outcome.committed for k in keys]

    def _check(self) -> None:
        if self._validate:
            self.ledger.validate()

    def _fresh(self, batch: SinkBatch) -> list[DataChange]:
        out = self.ledger.unseen(batch.token, batch.records)
        self._dropped += len(batch.records) - len(out)
        return out

    def _written(self, keys: list[int], fresh: list[tuple[str, list[DataChange]]]) -> None:
        self.ledger.committed(keys, fresh)
        self._check()

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        if self._closed or self._error is not None:
            raise SinkError(f"{self!r} is closed" if self._error is None else str(self._error))
        records = self._fresh(batch)
        rows = sum(len(r.mods) for r in records)
        async with self._room:
            await self._room.wait_for(
                lambda: self._buffered == 0 or self._buffered + rows <= self._max_buffered
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        admitted = self.ledger.admit(id(batch), batch.token, batch.records, batch.watermark)
        self._check()
        if not isinstance(admitted, Admit):  # it continues past a failed batch (the ledger's gap)
            future.set_exception(
                SinkError(f"an earlier batch of {batch.token} failed; re-read from before it")
            )
            future.exception()  # its reader re-reads; nobody else needs to retrieve it
            return future
        self._append_columns(batch.token, records)
        self._buffered += rows
        self._waiting.append((future, rows))
        key = admitted.key
        self._keys.append(key)
        future.add_done_callback(lambda _: self._release(key))
        self._entries.append((batch.token, batch.records, batch.watermark))
        self._flushes.added(batch.token)
        self._fresh_entries.append((batch.token, records))
        if self._first_at is None:
            self._first_at = time.monotonic()
            self._kick.set()  # the writer starts the age clock of this file
        if self._buffered >= self._max_rows:
            self._kick.set()
        return future

    async def flush(self, token: str) -> None:
        """The reader of ``token`` waits only for its batches to commit: once every reader of a
        buffered batch does, the micro-batch is written without waiting for its age."""
        if self._flushes.flushed(token):
            self._urged = True
            self._kick.set()

    def _append_columns(self, token: str, records: Sequence[DataChange]) -> None:
        """The generic layout's rows of ``records`` into the buffered columns."""
        cols = self._columns
        for change in records if self.layout == "generic" else ():
            for out in output_records(change):
                cols["record_id"].append(out.record_id)
                cols["partition_token"].append(token)
                cols["table"].append(out.table)
                cols["keys"].append(out.keys)
                cols["mod_type"].append(out.mod_type)
                cols["commit_ts"].append(out.commit_ts)
                cols["server_transaction_id"].append(out.server_transaction_id)
                cols["record_sequence"].append(out.record_sequence)
                cols["mod_index"].append(out.mod_index)
                cols["new_values"].append(out.new_values)
                cols["old_values"].append(out.old_values)

    def _fail(
        self,
        keys: list[int],
        waiting: list[tuple[asyncio.Future[None], int]],
        error: BaseException,
        behind: BaseException,
        *,
        only_their_partitions: bool = False,
    ) -> int:
        """The batches ``keys`` (their futures: ``waiting``) of a micro-batch failed: fail them
        with ``error``, and with ``behind`` every batch buffered behind them that the ledger's
        cascade fails too (protocol/ledger.py, rule 3: all of them, or with
        ``only_their_partitions`` those of the same partitions; their gaps open there). The
        rows dropped from the buffer."""
        doomed = set(self.ledger.fail(keys, only_their_partitions=only_their_partitions))
        self._check()
        for future, _ in waiting:
            if not future.done():
                future.set_exception(error)
        # a buffered batch no longer held was given up (its future cancelled): it goes too,
        # committing it could move its partition past the failed records
        idx = [i for i, key in enumerate(self._keys) if key in doomed or not self.ledger.holds(key)]
        rows = 0
        for i in reversed(idx):
            future, n = self._waiting.pop(i)
            rows += n
            del self._entries[i]
            del self._fresh_entries[i]
            del self._keys[i]
            if not future.done():
                future.set_exception(behind)
        if idx:  # the generic layout's columns hold what is left, and only that
            self._columns = {c: [] for c in COLUMNS}
            for token, records in self._fresh_entries:
                self._append_columns(token, records)
        if not self._entries:
            self._first_at = None
        return rows

    def _take_buffer(
        self,
    ) -> tuple[
        dict[str, list[Any]],
        list[tuple[asyncio.Future[None], int]],
        list[tuple[str, tuple[DataChange, ...], int]],
        list[tuple[str, list[DataChange]]],
        list[int],
    ]:
        """Hand over what is buffered (columns, waiting futures, entries, fresh entries, keys)
        and start an empty buffer; ``_buffered`` is settled by the caller."""
        taken = (self._columns, self._waiting, self._entries, self._fresh_entries, self._keys)
        self._urged = False
        self._flushes.clear()
        self._columns = {c: [] for c in COLUMNS}
        self._waiting = []
        self._entries = []
        self._fresh_entries = []
        self._keys = []
        self._first_at = None
        return taken

    def _release(self, key: int) -> None:
        """A batch's future resolved: the sink no longer holds it."""
        self.ledger.release(key)
        self._check()
        self.committer.forget((key,))

    async def _write_loop(self) -> None:
        while True:
            if self._first_at is None:
                if self._closed:
                    return
                self._kick.clear()
                await self._kick.wait()
                continue
            due = self._first_at + self._max_age - time.monotonic()
            if due > 0 and self._buffered < self._max_rows and not self._closed and not self._urged:
                self._kick.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(due):
                        await self._kick.wait()
                continue
            await self._flush()

    async def _flush(self) -> None:
        rows = self._buffered
        columns, waiting, entries, fresh, keys = self._take_buffer()
        dropped = 0
        try:
            await asyncio.to_thread(self._commit_batch, columns, entries, rows, fresh, keys)
        except CommitRefused as exc:
            self._failures += 1
            log.warning("%s; its batches will be re-read by the partitions' owners", exc)
            dropped = self._fail(
                keys,
                waiting,
                SinkError(str(exc)),
                SinkError(f"an earlier micro-batch failed: {exc}"),
            )
        except CommitIncomplete as exc:
            # committed, not visible yet: stop here; the next open applies the manifest
            self._failures += 1
            self._error = exc
            log.exception("%r: a batch is committed but not applied yet; the sink stops", self)
            for future, _ in waiting:
                if not future.done():
                    future.set_exception(SinkError(str(exc)))
        except Exception as exc:
            isolated = await self._isolate(exc, waiting, entries, fresh, keys)
            if isolated is not None:
                dropped = isolated
                async with self._room:
                    self._buffered -= rows + dropped
                    self._room.notify_all()
                return
            self._failures += 1
            log.exception("%r: committing %d rows failed", self, rows)
            dropped = self._fail(
                keys,
                waiting,
                SinkError(f"writing parquet failed: {type(exc).__name__}: {exc}"),
                SinkError(f"an earlier micro-batch failed: {exc}"),
            )
        else:
            self._written(keys, fresh)
            if rows:
                self._files += 1
            self._rows += rows
            self._batches += len(waiting)
            for future, _ in waiting:
                if not future.done():
                    future.set_result(None)
        async with self._room:
            self._buffered -= rows + dropped
            self._room.notify_all()

    async def _isolate(
        self,
        exc: Exception,
        waiting: list[tuple[asyncio.Future[None], int]],
        entries: list[tuple[str, tuple[DataChange, ...], int]],
        fresh: list[tuple[str, list[DataChange]]],
        keys: list[int],
    ) -> int | None:
        """A micro-batch of the typed layout failed because a value does not fit its column
        type: fail only the batches of the partitions whose own records do not convert (and
        what is buffered of those partitions behind them), and commit the others' as a
        micro-batch of their own. One bad record then stops its partition only, so the
        quarantine rule can tell it apart (docs/design.md#poison-partitions). Returns the rows
        dropped from the buffer, or ``None`` when this does not apply (the caller fails it all)."""
        from runtime.typed import TypedError, typed_tables

        if not isinstance(exc, TypedError) or self.layout != "typed" or len(entries) < 2:
            return None

        def bad_ones() -> set[str]:
            bad: set[str] = set()
            for token, records in fresh:
                try:
                    typed_tables([(token, records)])
                except TypedError:
                    bad.add(token)
            return bad

        bad = await asyncio.to_thread(bad_ones)
        if not bad or len(bad) == len({token for token, _, _ in entries}):
            return None
        self._failures += 1
        log.warning(
            "%r: a value does not fit its column type in the batches of %s (%s): those fail, "
            "the other partitions' batches are committed",
            self,
            ", ".join(sorted(bad)),
            exc,
        )
        error = SinkError(f"typed conversion failed: {exc}")
        keep = [i for i, (token, _, _) in enumerate(entries) if token not in bad]
        out = [i for i, (token, _, _) in enumerate(entries) if token in bad]
        dropped = self._fail(
            [keys[i] for i in out],
            [waiting[i] for i in out],
            error,
            error,
            only_their_partitions=True,
        )
        good_rows = sum(waiting[i][1] for i in keep)
        good_fresh = [fresh[i] for i in keep]
        try:
            await asyncio.to_thread(
                self._commit_batch,
                {c: [] for c in COLUMNS},
                [entries[i] for i in keep],
                good_rows,
                good_fresh,
                [keys[i] for i in keep],
            )
        except Exception as again:
            log.exception("%r: committing the other partitions' %d rows failed", self, good_rows)
            return dropped + self._fail(
                [keys[i] for i in keep],
                [waiting[i] for i in keep],
                SinkError(f"writing parquet failed: {again!r}"),
                SinkError(f"an earlier micro-batch failed: {again}"),
            )
        self._written([keys[i] for i in keep], good_fresh)
        if good_rows:
            self._files += 1
        self._rows += good_rows
        self._batches += len(keep)
        for i in keep:
            if not waiting[i][0].done():
                waiting[i][0].set_result(None)
        return dropped

    def _commit_batch(
        self,
        columns: dict[str, list[Any]],
        entries: list[tuple[str, tuple[DataChange, ...], int]],
        rows: int,
        fresh: list[tuple[str, list[DataChange]]],
        keys: list[int],
    ) -> None:
        """In a worker thread: stage the micro-batch's files (if it has rows) and commit it."""
        batch = batch_identity(
            ((token, records) for token, records, _ in entries), self.committer.connector
        )
        moves: list[tuple[str, str]] = []
        writes: list[TableWrite] = []
        if rows and self.table_format == "delta":
            from runtime.files.typed import write_delta_files
            from runtime.typed import typed_tables

            writes = list(write_delta_files(self.store, batch, typed_tables(fresh)))
        elif rows:
            staged = self.committer.prepare_staging(batch)
            try:
                if self.layout == "typed":
                    from runtime.files.typed import stage_tables, write_tables
                    from runtime.typed import typed_tables

                    tables = typed_tables(fresh)
                    if self.store.is_local:  # fewer, bigger writes (docs/benchmarks.md)
                        local = Path(self.store.path(staged))
                        moves = write_tables(local, staged, batch, tables)
                    else:
                        moves = stage_tables(self.store, staged, batch, tables)
                else:
                    self._write_file(columns, f"{staged}/batch={batch}")
                    moves.append((f"{staged}/batch={batch}", f"batch={batch}"))
            except BaseException:
                self.store.delete_tree(staged)
                raise
        metadata = None
        if writes and self._mark is not None:
            metadata = {"shoal.low_watermark_us": self._mark()}
        if rows and self._mirror is not None:
            self._merge_mirror(fresh)
        self.committer.commit(batch, moves, entries, fence=keys, tables=writes, metadata=metadata)

    def _merge_mirror(self, fresh: list[tuple[str, list[DataChange]]]) -> None:
        """In the commit's worker thread: merge the micro-batch into each table's mirror, one
        idempotent Delta commit per table (application ``<committer's app id>/mirror``, the
        version counting this sink's micro-batches)."""
        by_table: dict[str, list[DataChange]] = {}
        for _, records in fresh:
            for record in records:
                by_table.setdefault(record.table, []).append(record)
        self._mirror_version += 1
        app = f"{self.committer.app_id}/mirror"
        for table in sorted(by_table):
            self._mirror.apply_batch(table, by_table[table], app=app, version=self._mirror_version)
            self.mirror_merges += 1

    def _write_file(self, columns: dict[str, list[Any]], directory: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(
            {
                name: pa.array(values, type=pa.int64())
                if name in ("commit_ts", "mod_index")
                else pa.array(values, type=pa.string())
                for name, values in columns.items()
            }
        )
        with self.store.open_output_stream(f"{directory}/part-00000.parquet") as sink:
            pq.write_table(table, sink)

    def _fail_waiting(self, error: BaseException) -> None:
        for future, _ in self._waiting:
            if not future.done():
                future.set_exception(error)
        self._waiting = []


def read_rows(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every row the file sink (or a Spark parquet writer) committed in ``directory``: files
    under a name starting with ``.`` or ``_`` (staged, Spark's ``_temporary``, the sink's own
    records) are not output. Rows of the typed layout carry their metadata columns and the
    generic layout's row key names (``runtime.files.typed.generic_rows``: ``table``,
    ``record_id``, ``commit_ts``, ...), not their table's columns."""
    import pyarrow.parquet as pq

    from runtime.files.typed import generic_rows, table_dirs

    root = Path(directory)
    typed = {p.name for p in table_dirs(root)}
    for path in sorted(root.rglob("*.parquet")):
        parts = path.relative_to(root).parts
        if any(part.startswith((".", "_")) for part in parts) or parts[0] in typed:
            continue
        yield from pq.read_table(path).to_pylist()
    if typed:
        yield from generic_rows(root)
