"""Atomic micro-batch commits with the sink's own durable position
(docs/design.md#exactly-once-output, rules 2 and 3).

A sink that writes files commits a micro-batch in four steps, and this core says which:

1. Its files are **staged** under ``_staging/<connector>/<batch>/`` of the output, where no
   reader looks (readers skip names starting with ``_``).
2. The lease is checked, then the **manifest** is written atomically: the batch id, the moves
   (staged directory → final directory, one per table) and the new :class:`Position` of every
   partition in the batch. Writing it is the commit point.
3. The manifest is **applied**: each move is one rename, then each partition's position is
   written to its progress file (``_shoal/<connector>/progress/<progress_name(token)>``), then the manifest
   is deleted. :func:`apply_plan` gives these operations; it is idempotent: a move whose source
   is gone and whose target exists is done, so a manifest can be applied again by whoever finds
   it after a crash.
4. **Recovery** (:func:`recovery_plan`): at open, and before a sink answers ``durable_position(token)``,
   every manifest found is applied; a staged directory that no manifest names was never
   committed and is garbage, deleted once older than a bound (a younger one may belong to a
   batch another process is staging right now).

A position only moves forward: a progress file is rewritten only with a newer position
(:meth:`Position.newer`), so applying an old manifest late never moves a partition back.

**Stores that cannot rename** (object stores): a move is a :class:`Copy` of every staged file
to its final path instead (``apply_plan(..., rename=False)``); copying again is harmless, so a
manifest can still be applied any number of times. The shell leaves out of the manifest the
moves whose final directory already exists (the same batch committed before), as a rename
would have dropped the staged copy. Readers may see a table's files of the batch appear one by
one while they are copied.

**Delta tables**: a manifest may instead (or also) name :class:`TableCommit` s: data files
already written into a Delta table's directory, committed as one Delta transaction per table
that carries the batch's identity (an application transaction: ``app_id``, ``version``), so
committing it again adds nothing. There is nothing to rename: the Delta commit is the
visibility step (:class:`CommitTable`, before the positions move).

**Per connector.** Every connector keeps its own state under the output (:func:`state_dir`:
manifests, progress files, its start and its completeness mark) and stages under its own
:func:`staging_dir`; its batch identities include its name. Several connectors may write to
one output (say, one per set of tables, or a reset under a new name): none resumes from, or
recovers, another's state.

The **batch identity** (:func:`batch_identity`) is computed from the batch's contents only: its
partitions and, per partition, the number of records and the identities of the first and last
ones. The same records cut the same way give the same id in any process and after any restart,
so a user's write keyed on it (or the final directory named by it) is idempotent.

**Fences** (:class:`CommitFences`, rule 4 of docs/design.md#exactly-once-output). A reader that
stops with batches still in flight (a hand-off whose drain timed out) must know, before its task
releases the partition, that none of them can commit later: a batch committed after the new
owner looked up its position would be written twice. So the reader *fences* them: the sink
answers which of them passed the commit point already and guarantees the rest never will. The
fence and the commit point exclude each other (the shell runs both under one lock): a commit
whose batch holds a fenced entry is refused at its commit point, whole (its other entries fail
and are re-read by their readers, as after a refusal for the lease). Keys are the sink's names
for the batches it was handed, unique while it holds them.

No I/O here: the shell observes the file system (which paths exist, the manifests, the current
positions) and passes what it saw in; the core returns the operations to carry out, in order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import assert_never

import msgspec

from protocol.dedup import Identity, PartitionTail, Position
from protocol.records import DataChange

__all__ = [
    "LEGACY_STATE",
    "STAGING_DIR",
    "STATE_DIR",
    "CommitError",
    "CommitFences",
    "CommitTable",
    "Copy",
    "DataFile",
    "DeleteManifest",
    "DeleteStaged",
    "FenceOutcome",
    "Manifest",
    "Move",
    "Op",
    "PartitionPosition",
    "Rename",
    "StartRecord",
    "TableCommit",
    "WriteProgress",
    "apply_plan",
    "batch_identity",
    "commits_dir",
    "completeness_path",
    "decode_manifest",
    "decode_position",
    "decode_start",
    "delta_app_id",
    "encode_manifest",
    "encode_position",
    "encode_start",
    "manifest_name",
    "next_position",
    "progress_dir",
    "progress_name",
    "records_identity",
    "recovery_plan",
    "staging_dir",
    "start_conflict",
    "start_path",
    "state_dir",
]

STAGING_DIR = "_staging"  # <output>/_staging/<connector>/<batch>/...
STATE_DIR = "_shoal"  # <output>/_shoal/<connector>/...: each connector's own output state
LEGACY_STATE = ("_shoal/commits", "_shoal/progress")  # before the state was per connector


def state_dir(connector: str) -> str:
    """Connector ``connector``'s own state under the output (relative path): its manifests
    (``commits/``), progress files (``progress/``), start record and completeness mark. Every
    connector writing to one output keeps its own: one never resumes from another's progress
    (docs/design.md#exactly-once-output, rule 5)."""
    if not connector or "/" in connector or connector in (".", ".."):
        raise ValueError(f"not a connector name: {connector!r}")
    return f"{STATE_DIR}/{connector}"


def commits_dir(connector: str) -> str:
    """``<output>/<commits_dir>/<manifest_name(batch)>``: the connector's manifests."""
    return f"{state_dir(connector)}/commits"


def progress_dir(connector: str) -> str:
    """``<output>/<progress_dir>/<progress_name(token)>``: the connector's progress files."""
    return f"{state_dir(connector)}/progress"


def start_path(connector: str) -> str:
    """The connector's start record (:class:`StartRecord`), relative to the output."""
    return f"{state_dir(connector)}/start.json"


def completeness_path(connector: str) -> str:
    """The connector's completeness mark (``protocol.completeness``), relative to the output."""
    return f"{state_dir(connector)}/completeness.json"


class StartRecord(msgspec.Struct, frozen=True):
    """Where connector ``connector`` started reading, as the output itself remembers it (so a
    restart that lost its sync topic — an embedded broker's is in memory — still knows it):
    ``start_us`` in Unix microseconds, ``start`` the same as RFC 3339 text for people."""

    connector: str
    start_us: int
    start: str


_start_decoder = msgspec.json.Decoder(StartRecord)


def encode_start(record: StartRecord) -> bytes:
    return _manifest_encoder.encode(record) + b"\n"


def decode_start(data: bytes) -> StartRecord:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on anything that is not a record."""
    return _start_decoder.decode(data)


def start_conflict(recorded: StartRecord | None, explicit: int | None) -> StartRecord | None:
    """The recorded start an explicit start (``explicit``, None for "now") contradicts, if any:
    a connector that already started somewhere resumes from its state, and reading from
    another start would silently skip (or repeat) a window. Applied the same way to the sync
    topic's record and to the output's, so every broker refuses it alike."""
    if recorded is None or explicit is None or recorded.start_us == explicit:
        return None
    return recorded


def delta_app_id(connector: str, writer: str) -> str:
    """The Delta application id of one committing instance (``writer``) of ``connector``: a
    :class:`TableCommit`'s ``app_id``. Versions count that writer's micro-batches up."""
    return f"shoal/{connector}/{writer}"


def staging_dir(connector: str) -> str:
    """The connector's staging area (relative path); one batch's files under
    ``<staging_dir>/<batch>/``. Per connector, so that one connector's recovery never deletes
    what another one staged."""
    state_dir(connector)  # checks the name
    return f"{STAGING_DIR}/{connector}"


class CommitError(RuntimeError):
    """A manifest that cannot be applied (a move with neither its source nor its target)."""


class Move(msgspec.Struct, frozen=True, array_like=True):
    """One rename, paths relative to the output directory."""

    staged: str
    final: str


class PartitionPosition(msgspec.Struct, frozen=True, array_like=True):
    token: str
    position: Position


class DataFile(msgspec.Struct, frozen=True):
    """A parquet file written into a Delta table's directory and not committed yet: what a
    writer (a Spark executor, the file sink) hands to the committer."""

    path: str  # relative to the table's directory, '/'-separated
    size: int  # bytes
    num_records: int
    modification_time_ms: int
    stats: str  # the Delta statistics JSON of its add action


class TableCommit(msgspec.Struct, frozen=True):
    """One Delta commit of a micro-batch: ``files`` into the table at ``table`` (relative to
    the output), of columns ``schema`` (Delta schema JSON, the union of the files'), as
    application transaction (``app_id``, ``version``), with ``metadata`` in its commit info;
    ``created_ms``: when the batch reached its commit point (Unix ms)."""

    table: str
    files: tuple[DataFile, ...]
    schema: str
    app_id: str
    version: int
    metadata: dict[str, str | int | float | bool]
    created_ms: int


class Manifest(msgspec.Struct, frozen=True, tag="commit-v1", tag_field="kind"):
    """The commit record of one micro-batch (see the module docstring). ``staging`` is the
    batch's staging directory, relative to the output (removed once the moves are done);
    ``tables``: its Delta commits."""

    batch: str
    staging: str
    moves: tuple[Move, ...]
    positions: tuple[PartitionPosition, ...]
    tables: tuple[TableCommit, ...] = ()


_manifest_encoder = msgspec.json.Encoder()
_manifest_decoder = msgspec.json.Decoder(Manifest)
_position_decoder = msgspec.json.Decoder(Position)


def encode_manifest(manifest: Manifest) -> bytes:
    return _manifest_encoder.encode(manifest)


def decode_manifest(data: bytes) -> Manifest:
    """Raises ``msgspec.DecodeError`` on anything that is not a complete manifest."""
    return _manifest_decoder.decode(data)


def encode_position(position: Position) -> bytes:
    return _manifest_encoder.encode(position)


def decode_position(data: bytes) -> Position:
    return _position_decoder.decode(data)


def manifest_name(batch: str) -> str:
    """The manifest's file name under :func:`commits_dir`."""
    return f"{batch}.json"


def progress_name(token: str) -> str:
    """The progress file's name of partition ``token`` under :func:`progress_dir`: a hash (a
    token is long and may hold any character); collisions are impossible in practice."""
    return hashlib.blake2b(token.encode(), digest_size=16).hexdigest()


# --- operations ------------------------------------------------------------------------------


class Rename(msgspec.Struct, frozen=True):
    """Rename ``staged`` to ``final`` (create ``final``'s parent first). If, when it is carried
    out, ``staged`` is gone and ``final`` exists, another process did it: that is success."""

    staged: str
    final: str


class Copy(msgspec.Struct, frozen=True):
    """Copy every file under ``staged`` to the same path under ``final``, replacing any there
    (a store that cannot rename; idempotent)."""

    staged: str
    final: str


class CommitTable(msgspec.Struct, frozen=True):
    """Commit ``commit`` to its Delta table, unless its application transaction is there."""

    commit: TableCommit


class DeleteStaged(msgspec.Struct, frozen=True):
    """Delete a staged directory (recursively): a left-over, or already in place."""

    path: str


class WriteProgress(msgspec.Struct, frozen=True):
    """Write ``position`` to partition ``token``'s progress file, atomically."""

    token: str
    position: Position


class DeleteManifest(msgspec.Struct, frozen=True):
    batch: str


Op = Rename | Copy | CommitTable | DeleteStaged | WriteProgress | DeleteManifest


def apply_plan(
    manifest: Manifest,
    present: frozenset[str] | set[str],
    current: Mapping[str, Position | None],
    *,
    rename: bool = True,
) -> list[Op]:
    """The operations that apply ``manifest``, in order. ``present``: which of the moves'
    ``staged`` and ``final`` paths exist now; ``current``: each partition's recorded position
    (None: none yet), as read from its progress file; ``rename``: whether the store renames.

    A move whose source exists is a :class:`Rename` (if its target exists too, the same batch
    was committed before — same id, same records — and the staged copy is dropped instead); a
    move whose source is gone and target exists is done; a move with neither is a
    :class:`CommitError` (the batch's files are lost). Where the store cannot rename, a move
    whose source exists is a :class:`Copy` whatever its target (a copy interrupted half-way
    is finished; the shell never puts a move whose target existed before into a manifest).
    Then each Delta commit (:class:`CommitTable`), the positions that move a partition
    forward, the staging directory's removal and the manifest's deletion."""
    ops: list[Op] = []
    for move in manifest.moves:
        if move.staged in present:
            if not rename:
                ops.append(Copy(move.staged, move.final))
            elif move.final in present:
                ops.append(DeleteStaged(move.staged))
            else:
                ops.append(Rename(move.staged, move.final))
        elif move.final not in present:
            raise CommitError(
                f"batch {manifest.batch}: neither {move.staged} nor {move.final} exists"
            )
    ops.extend(CommitTable(commit) for commit in manifest.tables)
    ops.extend(
        WriteProgress(entry.token, entry.position)
        for entry in manifest.positions
        if _moves_forward(entry.position, current.get(entry.token))
    )
    ops.append(DeleteStaged(manifest.staging))
    ops.append(DeleteManifest(manifest.batch))
    return ops


def _moves_forward(new: Position, old: Position | None) -> bool:
    return old is None or (new != old and new.newer(old) is new)


def recovery_plan(
    manifests: Sequence[Manifest],
    staged: Iterable[tuple[str, float]],
    now: float,
    max_age_s: float,
) -> list[DeleteStaged]:
    """The staged directories to delete at recovery, after every manifest in ``manifests`` was
    applied (with :func:`apply_plan`, each in turn). ``staged``: each directory found under
    :func:`staging_dir` (relative to the output) with its modification time, in float seconds on
    the clock of ``now`` (the file system's wall clock). A directory a manifest names is the
    manifest's; any other one older than ``max_age_s`` was never committed (its process died
    before the commit point) and goes; a younger one may be a batch being staged right now, and
    stays."""
    named = {m.staging for m in manifests}
    return [
        DeleteStaged(path)
        for path, mtime in sorted(staged)
        if path not in named and now - mtime > max_age_s
    ]


def describe(op: Op) -> str:
    """One line for the log."""
    match op:
        case Rename():
            return f"rename {op.staged} -> {op.final}"
        case Copy():
            return f"copy {op.staged} -> {op.final}"
        case CommitTable():
            c = op.commit
            return f"delta commit {c.table} ({len(c.files)} files) as {c.app_id} v{c.version}"
        case DeleteStaged():
            return f"delete {op.path}"
        case WriteProgress():
            return f"progress {op.token} = {op.position.ts} (+{len(op.position.ids)} ids)"
        case DeleteManifest():
            return f"delete manifest {op.batch}"
        case _:
            assert_never(op)


def next_position(
    previous: Position | None, records: Sequence[DataChange], watermark: int
) -> Position:
    """A partition's position after a batch of ``records`` read up to ``watermark`` was
    committed on top of ``previous`` (its position before the batch): the tail moves to the
    watermark (or the last record, if later) and remembers the identities at exactly that
    timestamp, those of ``previous`` included when the timestamp did not move."""
    tail = previous.tail() if previous is not None else PartitionTail()
    last = max((r.commit_ts for r in records), default=watermark)
    tail.commit(max(watermark, last), records)
    return tail.position()


# --- batch identity --------------------------------------------------------------------------


def batch_identity(entries: Iterable[tuple[str, Sequence[DataChange]]], connector: str = "") -> str:
    """The deterministic identity of a micro-batch (see the module docstring): ``b`` and 16 hex
    digits. ``entries``: (partition token, records) in the batch's order; several entries of
    one partition count as one run of records. Partitions without records count by token.
    ``connector``: the connector that wrote the batch (its identities never meet another
    connector's in a shared output; "" for a batch handed to a user's callback, which knows
    its connector)."""
    parts: dict[str, tuple[Identity | None, Identity | None, int]] = {}
    for token, records in entries:
        first, last, count = parts.get(token, (None, None, 0))
        if records:
            if first is None:
                first = records[0].identity
            last = records[-1].identity
            count += len(records)
        parts[token] = (first, last, count)
    h = hashlib.blake2b(digest_size=8)
    if connector:
        h.update(msgspec.json.encode(("connector", connector)))
        h.update(b"\n")
    for token in sorted(parts):
        first, last, count = parts[token]
        h.update(msgspec.json.encode((token, count, first, last)))
        h.update(b"\n")
    # a letter first: Spark would infer a partition value of digits (or "1e5...") as a number
    return "b" + h.hexdigest()


def records_identity(record_ids: Iterable[str]) -> str:
    """The identity of a batch that is a set of output rows rather than partition runs (the
    Spark bridge's isolation halves and retries): the same rows, the same id, in any order."""
    h = hashlib.blake2b(digest_size=8)
    for record_id in sorted(record_ids):
        h.update(record_id.encode())
        h.update(b"\n")
    return "r" + h.hexdigest()


# --- fences ----------------------------------------------------------------------------------


class FenceOutcome(msgspec.Struct, frozen=True):
    """The fate of the batches a reader fenced: ``committed`` passed the commit point before
    the fence; ``fenced`` never will."""

    committed: frozenset[int]
    fenced: frozenset[int]


class CommitFences:
    """The fence rule (see the module docstring) over the keys of the batches a sink holds.

    The shell calls :meth:`admit` right before a commit point and :meth:`passed` right after
    it, and :meth:`fence` for a stopping reader, all under the lock that makes them exclusive;
    :meth:`forget` once it resolved a batch (its reader learns the outcome from the batch's
    future from then on). A key is in at most one of ``passed`` and ``fenced``."""

    def __init__(self) -> None:
        self.passed_keys: set[int] = set()  # passed their commit point, not forgotten yet
        self.fenced_keys: set[int] = set()  # fenced before their commit point
        self.refused = 0  # commits refused because they held a fenced batch

    def fence(self, keys: Iterable[int]) -> FenceOutcome:
        """Fence ``keys``: those that passed their commit point are committed; the others may
        never pass it."""
        keys = set(keys)
        committed = keys & self.passed_keys
        fenced = keys - committed
        self.fenced_keys |= fenced
        return FenceOutcome(frozenset(committed), frozenset(fenced))

    def admit(self, keys: Iterable[int]) -> frozenset[int]:
        """The fenced keys among a commit's ``keys``: if any, the commit is refused (whole;
        a retry of it is refused again until the sink forgets the keys)."""
        refused = frozenset(self.fenced_keys.intersection(keys))
        if refused:
            self.refused += 1
        return refused

    def passed(self, keys: Iterable[int]) -> None:
        """A commit holding ``keys`` passed its commit point (it was admitted)."""
        self.passed_keys.update(keys)

    def forget(self, keys: Iterable[int]) -> None:
        """The sink resolved these batches (their futures say the outcome now)."""
        for key in keys:
            self.passed_keys.discard(key)
            self.fenced_keys.discard(key)
