"""The committer of the file sinks (docs/design.md#exactly-once-output): the shell around
``protocol.commit``, used by the parquet file sink and the Spark bridge's default output. It
works over a :class:`runtime.lake.store.Store`: a local directory, or an object store
(``s3://``, ``gs://``).

Layout under the output ``root``, for connector ``<c>``::

    _staging/<c>/<batch>/...          files of a batch being written (readers skip ``_`` names)
    _shoal/<c>/commits/<batch>.json   the manifest of a batch being applied (the commit point)
    _shoal/<c>/progress/<hash>        one partition's committed Position (JSON)
    <final paths>                     what readers see: each appeared by one rename
    <table>/_delta_log/, <table>/*.parquet    a Delta table (``tables=`` of a commit)

Where the store cannot rename (object stores), a staged directory is copied into place
(server-side, file by file; copying again is harmless) and then deleted: a reader listing the
table during the copy may see part of the batch's files of that table. With Delta tables there
is nothing to rename: the data files are written straight into the table's directory (invisible
until committed), the manifest names them, and applying it is one Delta commit per table
carrying the batch's identity as an application transaction (``runtime.lake.delta``), so a
manifest applied again — by a recovery — commits nothing twice. That Delta commit is the
visibility step; it is atomic on every store.

Each connector has its own state (``protocol.commit.state_dir``): connectors sharing an output
never read or recover each other's.

A commit (:meth:`Committer.commit`, blocking: run it in a worker thread) checks ``permit()`` (the
lease) right before the commit point, writes the manifest atomically (locally a temporary file,
fsync, ``os.replace``; on an object store one PUT), renames (or copies) each staged directory
into place, commits each Delta table and writes each partition's progress file atomically (those
in parallel threads: past the commit point each is idempotent and independent of the others) and
deletes the manifest. :meth:`recover` applies the manifests a killed
process left and deletes staged directories no manifest names once they are older than
``garbage_age_s``; it runs at open and before :meth:`committed` answers (which looks for
left-over staged directories at most once a minute: on an object store that is a listing of
every staged file, and a reader of a new partition asks once per partition). :meth:`committed`
reads one progress file.

**Corrupt state stops loudly**: a progress file or manifest that cannot be decoded (truncated,
emptied, overwritten) raises :class:`CorruptState` (an ``Unrecoverable``: the run stops with exit
1) naming the file and what to do, instead of a reader retrying the partition for ever.

**Fences** (``protocol.commit.CommitFences``): a commit names the batches it holds by the sink's
keys (``fence=``); :meth:`Committer.fence` (a reader stopping with batches in flight) answers
which of them passed the commit point and makes sure the rest never do: the fence and the
commit point both run under the committer's lock, and a commit holding a fenced batch is refused
there (:class:`CommitFenced`, counted in ``fenced_refused``, logged) and its staged files
dropped. :meth:`Committer.forget` is called once the sink resolved a batch.

One writer per partition at a time is assumed (the lease gives that); a process that stalls
between its manifest and its progress files and wakes up after another process recovered its
batch and committed a newer one could write the older position back. The progress rule
(never backwards) is checked against what the file says when the manifest is applied.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, assert_never

import msgspec

from protocol.commit import (
    LEGACY_STATE,
    CommitFences,
    CommitTable,
    Copy,
    DataFile,
    DeleteManifest,
    DeleteStaged,
    FenceOutcome,
    Manifest,
    Move,
    Op,
    PartitionPosition,
    Rename,
    TableCommit,
    WriteProgress,
    apply_plan,
    commits_dir,
    decode_manifest,
    decode_position,
    delta_app_id,
    describe,
    encode_manifest,
    encode_position,
    manifest_name,
    next_position,
    progress_dir,
    progress_name,
    recovery_plan,
    staging_dir,
)
from protocol.dedup import Position
from protocol.records import DataChange
from runtime.lake.store import Store, StoreUnsupported, open_store
from runtime.ports import Unrecoverable

if TYPE_CHECKING:
    import pyarrow as pa

    from runtime.lake.delta import DeltaCommitter

# (table directory, its data files, their schema): one Delta commit of a micro-batch
TableWrite = tuple[str, Sequence[DataFile], "pa.Schema"]
Metadata = Mapping[str, str | int | float | bool]

__all__ = [
    "CommitFenced",
    "CommitIncomplete",
    "CommitRefused",
    "Committer",
    "CorruptState",
    "TableWrite",
    "write_atomically",
]

log = logging.getLogger("shoal.commit")

COLLECT_EVERY_S = 60.0  # committed() looks for staged left-overs at most this often


class CommitRefused(RuntimeError):
    """The lease ran out before the commit point: nothing of the batch was committed."""


class CommitFenced(CommitRefused):
    """The batch holds a batch its reader fenced (it stopped and its partition may be owned
    elsewhere now): nothing of the batch was committed."""


class CommitIncomplete(RuntimeError):
    """The batch passed its commit point but applying its manifest failed twice: it becomes
    visible when the manifest is applied by a later :meth:`Committer.recover` (at the latest
    when the output is opened next). The committer's user should stop committing."""


def write_atomically(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` in one step (a temporary file, fsync, ``os.replace``):
    a reader sees the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class CorruptState(Unrecoverable):
    """A file of the output's own state (a progress file or a manifest) cannot be read: the
    message names it and what to do. Retrying cannot mend it, so the run stops."""


class Committer:
    """Atomic micro-batch commits into ``root`` (a directory, a URI or a :class:`Store`); see
    the module docstring. Thread-safe: one commit at a time, and one recovery at a time.

    A commit holds the committer's state lock only up to its commit point (the manifest
    written): applying the manifest (Delta commits, progress files) runs outside it, so a new
    partition's reader asking :meth:`committed` does not wait for a commit that does not hold
    its partition (one that does: it waits for it to be applied), and recovery never applies a
    manifest of this committer's still being applied.

    Delta commits (``tables=`` of :meth:`commit`) go through ``delta`` (default: a
    :class:`runtime.lake.delta.DeltaCommitter` over the same store, made on first use) as
    application ``app_id`` = ``shoal/<connector>/<writer>`` (``writer``: random per committer
    unless given), version 1, 2, ... per committed micro-batch with tables."""

    def __init__(
        self,
        root: str | os.PathLike[str] | Store,
        *,
        connector: str = "shoal",
        permit: Callable[[], bool] | None = None,
        garbage_age_s: float = 3600.0,
        fsync: bool = True,
        clock: Callable[[], float] = time.time,
        delta: DeltaCommitter | None = None,
        writer: str | None = None,
        apply_threads: int = 8,
    ) -> None:
        self.store = root if isinstance(root, Store) else open_store(root)
        self.connector = connector
        self._staging = staging_dir(connector)
        self._commits = commits_dir(connector)
        self._progress = progress_dir(connector)
        self.permit = permit
        self.garbage_age_s = garbage_age_s
        self.fsync = fsync
        self.clock = clock
        self._delta = delta
        self.writer = writer or uuid.uuid4().hex[:16]
        self.app_id = delta_app_id(connector, self.writer)
        self._txn_version = 0  # the last application-transaction version given out
        self.apply_threads = apply_threads
        self._lock = threading.Lock()  # fences, the commit point, recovery, the positions
        self._commit_lock = threading.Lock()  # one commit at a time
        # the batches of this committer past their commit point and not yet applied, and the
        # partitions they hold (how many of them): committed() waits for those partitions
        self._applying: set[str] = set()
        self._applying_tokens: dict[str, int] = {}
        self._applied = threading.Condition(self._lock)
        self._positions: dict[str, Position | None] = {}  # cache of the progress files
        self.batches = 0  # committed by this committer
        self.recovered = 0  # manifests applied at recovery
        self.fences = CommitFences()  # guarded by _lock
        self._forgotten: deque[int] = deque()  # keys to forget at the next locked call
        self._next_collect = float("-inf")  # committed() looks for staged left-overs from then
        # seconds this committer's commits spent in each step (a run's summary shows them):
        # before the commit point, the manifest, applying it, its clean-up (staging, manifest)
        self.phase_s: dict[str, float] = {"check": 0.0, "manifest": 0.0, "apply": 0.0, "clean": 0.0}

    def __repr__(self) -> str:
        return f"Committer({self.store.uri_for()!r}, connector={self.connector!r})"

    @property
    def root(self) -> Path:
        """The output directory (a local store only)."""
        if not self.store.is_local:
            raise StoreUnsupported(f"{self!r}: an object store has no local directory")
        return Path(self.store.path())

    @property
    def delta(self) -> DeltaCommitter:
        """The Delta committer (made on first use: importing delta-rs costs time)."""
        if self._delta is None:
            from runtime.lake.delta import DeltaCommitter

            # the version each commit got is not needed here: two requests per table saved
            self._delta = DeltaCommitter(self.store, find_versions=False)
        return self._delta

    # --- paths ------------------------------------------------------------------------------

    def staged(self, batch: str) -> str:
        """The staging directory of ``batch``, relative to ``root`` (moves name paths under it)."""
        return f"{self._staging}/{batch}"

    def prepare_staging(self, batch: str) -> str:
        """:meth:`staged`, emptied of whatever an earlier attempt left there (any store)."""
        rel = self.staged(batch)
        self.store.delete_tree(rel)
        if self.store.is_local:
            os.makedirs(os.path.dirname(self.store.path(rel)), exist_ok=True)
        return rel

    def staging(self, batch: str) -> Path:
        """The (fresh, empty) local staging directory of ``batch``: whatever an earlier attempt
        left there is removed. A local store only (elsewhere: :meth:`prepare_staging`, and write
        through :attr:`store`)."""
        if not self.store.is_local:
            raise StoreUnsupported(
                f"{self!r}: an object store has no local staging directory; write the files "
                "through the store under prepare_staging(batch)"
            )
        return Path(self.store.path(self.prepare_staging(batch)))

    def _manifest_rel(self, batch: str) -> str:
        return f"{self._commits}/{manifest_name(batch)}"

    def _progress_rel(self, token: str) -> str:
        return f"{self._progress}/{progress_name(token)}"

    def legacy_state(self) -> list[str]:
        """Output state of a version that did not keep it per connector (``_shoal/commits``,
        ``_shoal/progress``): it is not read (nobody knows whose it is); the caller warns."""
        return [d for d in LEGACY_STATE if self.store.exists(d)]

    # --- reading ----------------------------------------------------------------------------

    def _read_position(self, token: str) -> Position | None:
        rel = self._progress_rel(token)
        data = self.store.read_bytes(rel)
        if data is None:
            return None
        try:
            return decode_position(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptState(
                f"output state: progress file {self.store.uri_for(rel)} (partition {token!r} "
                f"of connector {self.connector!r}) cannot be read ({exc}; {len(data)} bytes). "
                "Nothing was written past it. To re-read the partition from the sync topic's "
                "watermark, delete the file and start again (rows after that watermark already "
                "in the output may then appear twice); or restore it from a backup"
            ) from exc

    def committed(self, token: str) -> Position | None:
        """Blocking: partition ``token``'s committed position by this output's own record, after
        applying what a killed process left (one progress file)."""
        with self._lock:
            self._applied.wait_for(lambda: token not in self._applying_tokens)
            now = self.clock()
            collect = now >= self._next_collect
            if collect:
                self._next_collect = now + COLLECT_EVERY_S
            self._recover(collect=collect)
            position = self._positions[token] = self._read_position(token)
            return position

    def _current(self, token: str) -> Position | None:
        if token not in self._positions:
            self._positions[token] = self._read_position(token)
        return self._positions[token]

    # --- committing -------------------------------------------------------------------------

    @property
    def fenced_refused(self) -> int:
        """Commits refused because they held a fenced batch."""
        return self.fences.refused

    def fence(self, keys: Iterable[int]) -> FenceOutcome:
        """Blocking: fence the sink's batches ``keys`` (see the module docstring): which passed
        the commit point; the others never will."""
        with self._lock:
            self._forget_now()
            return self.fences.fence(keys)

    def forget(self, keys: Iterable[int]) -> None:
        """The sink resolved these batches (any thread; applied at the next locked call)."""
        self._forgotten.extend(keys)

    def _forget_now(self) -> None:
        keys = []
        while self._forgotten:
            keys.append(self._forgotten.popleft())
        self.fences.forget(keys)

    def commit(
        self,
        batch: str,
        moves: Sequence[tuple[str, str]],
        entries: Sequence[tuple[str, Sequence[DataChange], int]],
        fence: Collection[int] = (),
        *,
        tables: Sequence[TableWrite] = (),
        metadata: Metadata | None = None,
    ) -> Manifest:
        """Blocking: commit ``batch``, staged under :meth:`staged`. ``moves``: (staged, final)
        paths relative to ``root``; ``entries``: (partition token, records, watermark) of the
        batch, in order (all its records, also those already written: the new position covers
        them); ``fence``: the sink's keys of the batches it holds; ``tables``: (table directory,
        data files written into it, their schema) to commit as one Delta transaction each, with
        ``metadata`` (and ``shoal.batch``, ``shoal.connector``) in its commit info. Raises
        :class:`CommitRefused` (and drops the staged and data files) if ``permit()`` says the
        lease ran out, :class:`CommitFenced` if one of ``fence`` was fenced,
        ``runtime.lake.delta.SchemaConflict`` if a table's column changed type."""
        with self._commit_lock:
            manifest = self._commit_point(batch, moves, entries, fence, tables, metadata)
            t2 = time.monotonic()
            try:
                self._apply(
                    manifest, {p.token: self._positions.get(p.token) for p in manifest.positions}
                )
            except Exception:
                log.exception("%r: applying batch %s failed; trying once more", self, batch)
                try:
                    self._apply(manifest)
                except Exception as exc:
                    raise CommitIncomplete(
                        f"{self!r}: batch {batch} is committed but not applied yet: {exc}"
                    ) from exc
            finally:
                self._applied_now(manifest)
            self.phase_s["apply"] += time.monotonic() - t2
            self.batches += 1
            return manifest

    def _applied_now(self, manifest: Manifest) -> None:
        """``manifest`` (this committer's) is applied, or failed to be: its partitions' readers
        may read their positions (after a failure, recovery applies it: it is no longer ours)."""
        with self._lock:
            self._applying.discard(manifest.batch)
            for p in manifest.positions:
                left = self._applying_tokens.pop(p.token, 1) - 1
                if left:
                    self._applying_tokens[p.token] = left
            self._applied.notify_all()

    def _commit_point(
        self,
        batch: str,
        moves: Sequence[tuple[str, str]],
        entries: Sequence[tuple[str, Sequence[DataChange], int]],
        fence: Collection[int],
        tables: Sequence[TableWrite],
        metadata: Metadata | None,
    ) -> Manifest:
        """Under the state lock: everything up to the commit point (the manifest written); the
        manifest's partitions are then being applied (``_applying``)."""
        with self._lock:
            t0 = time.monotonic()
            self._forget_now()
            positions: dict[str, Position] = {}
            for token, records, watermark in entries:
                base = positions.get(token) or self._current(token)
                positions[token] = next_position(base, records, watermark)
            if not self.store.can_rename:
                # a copy cannot tell an earlier commit's files from its own: leave out what
                # is there already (the same batch committed before), as a rename would
                moves = [(s, f) for s, f in moves if not self.store.exists(f)]
            try:
                commits = self._table_commits(batch, tables, metadata)
            except Exception:
                self._drop(self.staged(batch), tables)
                raise
            manifest = Manifest(
                batch,
                self.staged(batch),
                tuple(Move(s, f) for s, f in moves),
                tuple(PartitionPosition(t, p) for t, p in positions.items()),
                commits,
            )
            if self.permit is not None and not self.permit():
                self._drop(manifest.staging, tables)
                raise CommitRefused(f"{self!r}: the lease ran out before batch {batch} committed")
            fenced = self.fences.admit(fence)
            if fenced:
                self._drop(manifest.staging, tables)
                log.warning(
                    "%r: batch %s refused at its commit point: it holds %d batches fenced by "
                    "readers that stopped (refused so far: %d)",
                    self,
                    batch,
                    len(fenced),
                    self.fences.refused,
                )
                raise CommitFenced(
                    f"{self!r}: batch {batch} holds {len(fenced)} batches fenced by readers "
                    "that stopped; nothing of it was committed"
                )
            t1 = time.monotonic()
            self._write_manifest(manifest)
            self.fences.passed(fence)
            self._applying.add(batch)
            for token in positions:
                self._applying_tokens[token] = self._applying_tokens.get(token, 0) + 1
            self.phase_s["check"] += t1 - t0
            self.phase_s["manifest"] += time.monotonic() - t1
            return manifest

    def _table_commits(
        self, batch: str, tables: Sequence[TableWrite], metadata: Metadata | None
    ) -> tuple[TableCommit, ...]:
        """The Delta commits of ``batch`` (one application-transaction version for all);
        checks each schema against its table first (before the commit point)."""
        if not tables:
            return ()
        from runtime.lake.delta import delta_schema

        delta = self.delta
        if len(tables) > 1 and self.apply_threads > 1:
            # a table never seen is loaded from the store: the tables in parallel threads
            with ThreadPoolExecutor(min(self.apply_threads, len(tables))) as pool:
                for future in [pool.submit(delta.check_schema, t, s) for t, _, s in tables]:
                    future.result()
        else:
            for table, _, schema in tables:
                delta.check_schema(table, schema)
        self._txn_version += 1
        info: dict[str, str | int | float | bool] = {
            "shoal.batch": batch,
            "shoal.connector": self.connector,
            **(metadata or {}),
        }
        now_ms = int(self.clock() * 1000)
        return tuple(
            TableCommit(
                table,
                tuple(files),
                delta_schema(schema).to_json(),
                self.app_id,
                self._txn_version,
                info,
                now_ms,
            )
            for table, files, schema in tables
        )

    def discard(self, batch: str, tables: Sequence[TableWrite] = ()) -> None:
        """Blocking: delete what ``batch`` staged (its staging directory and the Delta data
        files of ``tables``), for a batch that will not be committed. Nothing of it is
        visible: only a commit makes it so."""
        self._drop(self.staged(batch), tables)

    def _drop(self, staging: str, tables: Sequence[TableWrite]) -> None:
        """Delete what a refused batch wrote: its staging directory and its data files."""
        self.store.delete_tree(staging)
        for table, files, _ in tables:
            for f in files:
                self.store.delete(f"{table}/{f.path}")

    def _write_manifest(self, manifest: Manifest) -> None:
        """The commit point."""
        self.store.write_bytes(
            self._manifest_rel(manifest.batch), encode_manifest(manifest), fsync=self.fsync
        )

    def _apply(self, manifest: Manifest, current: dict[str, Position | None] | None = None) -> None:
        """Apply ``manifest``; ``current``: the partitions' positions, if known (else each
        progress file is read). Consecutive Delta commits and progress writes run in parallel
        threads: past the commit point they are independent (each idempotent, and a process
        killed half-way leaves the manifest, which recovery applies again before any position
        is read); so does the staging directory's removal when the manifest moves nothing (its
        files, e.g. a Spark write's receipt, are not needed past the commit point), otherwise
        it goes after all of them; the manifest goes last."""
        paths = [p for m in manifest.moves for p in (m.staged, m.final)]
        present = {p for p in paths if self.store.exists(p)}
        if current is None:
            current = {e.token: self._read_position(e.token) for e in manifest.positions}
        ops = apply_plan(manifest, present, current, rename=self.store.can_rename)
        group: list[Op] = []
        for op in [*ops, None]:
            if isinstance(op, CommitTable | WriteProgress) or (
                isinstance(op, DeleteStaged) and not manifest.moves and group
            ):
                group.append(op)
                continue
            if len(group) > 1 and self.apply_threads > 1:
                with ThreadPoolExecutor(min(self.apply_threads, len(group))) as pool:
                    for future in [pool.submit(self._do, g) for g in group]:
                        future.result()
            else:
                for g in group:
                    self._do(g)
            group = []
            if op is not None:
                t0 = time.monotonic()
                self._do(op)
                if isinstance(op, DeleteStaged | DeleteManifest):
                    self.phase_s["clean"] += time.monotonic() - t0

    def _do(self, op: Op) -> None:
        """Carry out one operation (idempotently: it may race another process's recovery)."""
        log.debug("%r: %s", self, describe(op))
        match op:
            case Rename():
                try:
                    self.store.rename(op.staged, op.final)
                except OSError:
                    # done by another process in between (source gone, target there), or failed
                    if self.store.exists(op.staged) or not self.store.exists(op.final):
                        raise
            case Copy():
                self.store.copy_tree(op.staged, op.final)
            case CommitTable(commit=c):
                from deltalake import Schema as DeltaSchema

                self.delta.commit(
                    c.table,
                    c.files,
                    DeltaSchema.from_json(c.schema),
                    app=c.app_id,
                    version=c.version,
                    metadata=c.metadata,
                    first_attempt_ms=c.created_ms,
                )
            case DeleteStaged():
                self.store.delete_tree(op.path)
            case WriteProgress():
                self.store.write_bytes(
                    self._progress_rel(op.token), encode_position(op.position), fsync=self.fsync
                )
                self._positions[op.token] = op.position
            case DeleteManifest():
                self.store.delete(self._manifest_rel(op.batch))
            case _:
                assert_never(op)

    # --- recovery ---------------------------------------------------------------------------

    def recover(self) -> int:
        """Blocking: apply every manifest left by a killed process and delete old staged
        left-overs; the number of manifests applied."""
        with self._lock:
            return self._recover()

    def _recover(self, *, collect: bool = True) -> int:
        """Apply the manifests left behind; ``collect``: also delete old staged left-overs."""
        manifests: list[Manifest] = []
        for entry in self.store.list_files(self._commits, recursive=False):
            name = entry.path.rsplit("/", 1)[-1]
            if name.startswith("."):
                continue  # a manifest never completed: its batch never committed
            if any(name == manifest_name(b) for b in self._applying):
                continue  # this committer's, being applied right now
            data = self.store.read_bytes(entry.path)
            if data is None:
                continue  # applied by its own process meanwhile
            try:
                manifests.append(decode_manifest(data))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise CorruptState(
                    f"output state: manifest {self.store.uri_for(entry.path)} of connector "
                    f"{self.connector!r} cannot be read ({exc}; {len(data)} bytes): a "
                    "micro-batch passed its commit point and cannot be applied. Deleting the "
                    "file drops that batch (its partitions are read again from their progress "
                    "files; tables it had already moved into place then hold its rows twice)"
                ) from exc
        for manifest in manifests:
            log.warning("%r: applying batch %s left by a stopped process", self, manifest.batch)
            self._apply(manifest)
        self.recovered += len(manifests)
        if not collect:
            return len(manifests)
        staged = [
            (f"{self._staging}/{name}", mtime)
            for name, mtime in self.store.dir_mtimes(self._staging)
        ]
        for op in recovery_plan(manifests, staged, self.clock(), self.garbage_age_s):
            log.info("%r: deleting uncommitted staged files %s", self, op.path)
            self._do(op)
        return len(manifests)
