"""The file-system committer of the file sinks (docs/design.md#exactly-once-output): the shell
around ``protocol.commit``, used by the parquet file sink and the Spark bridge's default output.

Layout under the output directory ``root``, for connector ``<c>``::

    _staging/<c>/<batch>/...          files of a batch being written (readers skip ``_`` names)
    _shoal/<c>/commits/<batch>.json   the manifest of a batch being applied (the commit point)
    _shoal/<c>/progress/<hash>        one partition's committed Position (JSON)
    <final paths>                     what readers see: each appeared by one rename

Each connector has its own state (``protocol.commit.state_dir``): connectors sharing an output
never read or recover each other's.

A commit (:meth:`Committer.commit`, blocking: run it in a worker thread) checks ``permit()`` (the
lease) right before the commit point, writes the manifest atomically (a temporary file, fsync,
``os.replace``), renames each staged directory into place, writes each partition's progress
file atomically and deletes the manifest. :meth:`recover` applies the manifests a killed
process left and deletes staged directories no manifest names once they are older than
``garbage_age_s``; it runs at open and before :meth:`committed` answers. :meth:`committed` reads
one progress file.

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

import contextlib
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

import msgspec

from protocol.commit import (
    LEGACY_STATE,
    CommitFences,
    DeleteManifest,
    DeleteStaged,
    FenceOutcome,
    Manifest,
    Move,
    Op,
    PartitionPosition,
    Rename,
    WriteProgress,
    apply_plan,
    commits_dir,
    decode_manifest,
    decode_position,
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
from runtime.ports import Unrecoverable

__all__ = [
    "CommitFenced",
    "CommitIncomplete",
    "CommitRefused",
    "Committer",
    "CorruptState",
    "write_atomically",
]

log = logging.getLogger("shoal.commit")


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
    """Atomic micro-batch commits into ``root``; see the module docstring. Thread-safe: one
    commit or recovery at a time."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        connector: str = "shoal",
        permit: Callable[[], bool] | None = None,
        garbage_age_s: float = 3600.0,
        fsync: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root)
        self.connector = connector
        self._staging = staging_dir(connector)
        self._commits = commits_dir(connector)
        self._progress = progress_dir(connector)
        self.permit = permit
        self.garbage_age_s = garbage_age_s
        self.fsync = fsync
        self.clock = clock
        self._lock = threading.Lock()
        self._positions: dict[str, Position | None] = {}  # cache of the progress files
        self.batches = 0  # committed by this committer
        self.recovered = 0  # manifests applied at recovery
        self.fences = CommitFences()  # guarded by _lock
        self._forgotten: deque[int] = deque()  # keys to forget at the next locked call

    def __repr__(self) -> str:
        return f"Committer({str(self.root)!r}, connector={self.connector!r})"

    # --- paths ------------------------------------------------------------------------------

    def staged(self, batch: str) -> str:
        """The staging directory of ``batch``, relative to ``root`` (moves name paths under it)."""
        return f"{self._staging}/{batch}"

    def staging(self, batch: str) -> Path:
        """The (fresh, empty) staging directory of ``batch``: whatever an earlier attempt left
        there is removed."""
        path = self.root / self.staged(batch)
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _manifest_path(self, batch: str) -> Path:
        return self.root / self._commits / manifest_name(batch)

    def _progress_path(self, token: str) -> Path:
        return self.root / self._progress / progress_name(token)

    def legacy_state(self) -> list[str]:
        """Output state of a version that did not keep it per connector (``_shoal/commits``,
        ``_shoal/progress``): it is not read (nobody knows whose it is); the caller warns."""
        return [d for d in LEGACY_STATE if (self.root / d).exists()]

    # --- reading ----------------------------------------------------------------------------

    def _read_position(self, token: str) -> Position | None:
        path = self._progress_path(token)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return decode_position(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptState(
                f"output state: progress file {path} (partition {token!r} of connector "
                f"{self.connector!r}) cannot be read ({exc}; {len(data)} bytes). Nothing was "
                "written past it. To re-read the partition from the sync topic's watermark, "
                "delete the file and start again (rows after that watermark already in the "
                "output may then appear twice); or restore it from a backup"
            ) from exc

    def committed(self, token: str) -> Position | None:
        """Blocking: partition ``token``'s committed position by this output's own record, after
        applying what a killed process left (one progress file)."""
        with self._lock:
            self._recover()
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
    ) -> Manifest:
        """Blocking: commit ``batch``, staged under :meth:`staging`. ``moves``: (staged, final)
        paths relative to ``root``; ``entries``: (partition token, records, watermark) of the
        batch, in order (all its records, also those already written: the new position covers
        them); ``fence``: the sink's keys of the batches it holds. Raises
        :class:`CommitRefused` (and drops the staged files) if ``permit()`` says the lease ran
        out, :class:`CommitFenced` if one of ``fence`` was fenced."""
        with self._lock:
            self._forget_now()
            positions: dict[str, Position] = {}
            for token, records, watermark in entries:
                base = positions.get(token) or self._current(token)
                positions[token] = next_position(base, records, watermark)
            manifest = Manifest(
                batch,
                self.staged(batch),
                tuple(Move(s, f) for s, f in moves),
                tuple(PartitionPosition(t, p) for t, p in positions.items()),
            )
            if self.permit is not None and not self.permit():
                shutil.rmtree(self.root / manifest.staging, ignore_errors=True)
                raise CommitRefused(f"{self!r}: the lease ran out before batch {batch} committed")
            fenced = self.fences.admit(fence)
            if fenced:
                shutil.rmtree(self.root / manifest.staging, ignore_errors=True)
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
            self._write_manifest(manifest)
            self.fences.passed(fence)
            try:
                self._apply(manifest, {t: self._positions.get(t) for t in positions})
            except Exception:
                log.exception("%r: applying batch %s failed; trying once more", self, batch)
                try:
                    self._apply(manifest)
                except Exception as exc:
                    raise CommitIncomplete(
                        f"{self!r}: batch {batch} is committed but not applied yet: {exc}"
                    ) from exc
            self.batches += 1
            return manifest

    def _write_manifest(self, manifest: Manifest) -> None:
        """The commit point."""
        path = self._manifest_path(manifest.batch)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._write_atomically(path, encode_manifest(manifest))

    def _write_atomically(self, path: Path, data: bytes) -> None:
        write_atomically(path, data, fsync=self.fsync)

    def _apply(self, manifest: Manifest, current: dict[str, Position | None] | None = None) -> None:
        """Apply ``manifest``; ``current``: the partitions' positions, if known (else each
        progress file is read)."""
        paths = [p for m in manifest.moves for p in (m.staged, m.final)]
        present = {p for p in paths if (self.root / p).exists()}
        if current is None:
            current = {e.token: self._read_position(e.token) for e in manifest.positions}
        for op in apply_plan(manifest, present, current):
            self._do(op)

    def _do(self, op: Op) -> None:
        """Carry out one operation (idempotently: it may race another process's recovery)."""
        log.debug("%r: %s", self, describe(op))
        match op:
            case Rename():
                final = self.root / op.final
                final.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.rename(self.root / op.staged, final)
                except OSError:
                    # done by another process in between (source gone, target there), or failed
                    if (self.root / op.staged).exists() or not final.exists():
                        raise
            case DeleteStaged():
                shutil.rmtree(self.root / op.path, ignore_errors=True)
            case WriteProgress():
                path = self._progress_path(op.token)
                path.parent.mkdir(parents=True, exist_ok=True)
                self._write_atomically(path, encode_position(op.position))
                self._positions[op.token] = op.position
            case DeleteManifest():
                self._manifest_path(op.batch).unlink(missing_ok=True)

    # --- recovery ---------------------------------------------------------------------------

    def recover(self) -> int:
        """Blocking: apply every manifest left by a killed process and delete old staged
        left-overs; the number of manifests applied."""
        with self._lock:
            return self._recover()

    def _recover(self) -> int:
        commits = self.root / self._commits
        manifests: list[Manifest] = []
        with contextlib.suppress(FileNotFoundError):
            for path in sorted(commits.iterdir()):
                if path.name.startswith("."):
                    continue  # a manifest never completed: its batch never committed
                try:
                    data = path.read_bytes()
                except FileNotFoundError:
                    continue  # applied by its own process meanwhile
                try:
                    manifests.append(decode_manifest(data))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise CorruptState(
                        f"output state: manifest {path} of connector {self.connector!r} cannot "
                        f"be read ({exc}; {len(data)} bytes): a micro-batch passed its commit "
                        "point and cannot be applied. Deleting the file drops that batch (its "
                        "partitions are read again from their progress files; tables it had "
                        "already moved into place then hold its rows twice)"
                    ) from exc
        for manifest in manifests:
            log.warning("%r: applying batch %s left by a stopped process", self, manifest.batch)
            self._apply(manifest)
        self.recovered += len(manifests)
        staged: list[tuple[str, float]] = []
        with contextlib.suppress(FileNotFoundError):
            for entry in (self.root / self._staging).iterdir():
                with contextlib.suppress(FileNotFoundError):
                    staged.append((f"{self._staging}/{entry.name}", entry.stat().st_mtime))
        for op in recovery_plan(manifests, staged, self.clock(), self.garbage_age_s):
            log.info("%r: deleting uncommitted staged files %s", self, op.path)
            self._do(op)
        return len(manifests)
