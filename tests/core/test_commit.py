"""The commit core (protocol/commit.py): manifests, the idempotent apply plan, recovery and the
deterministic batch identity (docs/design.md#exactly-once-output)."""

from __future__ import annotations

import msgspec
import pytest

from protocol.commit import (
    CommitError,
    CommitFences,
    CommitTable,
    Copy,
    DataFile,
    DeleteManifest,
    DeleteStaged,
    FenceOutcome,
    Manifest,
    Move,
    PartitionPosition,
    Rename,
    TableCommit,
    WriteProgress,
    apply_plan,
    batch_identity,
    decode_manifest,
    decode_position,
    encode_manifest,
    encode_position,
    next_position,
    progress_name,
    recovery_plan,
)
from protocol.dedup import Position
from protocol.records import DataChange


def rec(ts: int, seq: str = "0", txn: str = "t") -> DataChange:
    return DataChange(ts, seq, txn, False, "T", (), (), "INSERT")


MOVES = (
    Move("_staging/b1/table=A/batch=b1", "table=A/batch=b1"),
    Move("_staging/b1/table=B/batch=b1", "table=B/batch=b1"),
)
MANIFEST = Manifest(
    "b1",
    "_staging/b1",
    MOVES,
    (
        PartitionPosition("p", Position(20, (("t", "0"), ("t", "1")))),
        PartitionPosition("q", Position(7)),
    ),
)
STAGED = {m.staged for m in MOVES}
FINAL = {m.final for m in MOVES}


def test_a_manifest_round_trips_with_a_stable_tag() -> None:
    data = encode_manifest(MANIFEST)
    assert data.startswith(b'{"kind":"commit-v1","batch":"b1"')
    assert decode_manifest(data) == MANIFEST
    with pytest.raises(msgspec.DecodeError):
        decode_manifest(data[:-5])  # a torn write is not a manifest
    assert decode_position(encode_position(Position(5, (("x", "1"),)))) == Position(
        5, (("x", "1"),)
    )


def test_a_fresh_manifest_is_applied_by_renames_then_positions_then_cleanup() -> None:
    assert apply_plan(MANIFEST, frozenset(STAGED), {}) == [
        Rename(MOVES[0].staged, MOVES[0].final),
        Rename(MOVES[1].staged, MOVES[1].final),
        WriteProgress("p", Position(20, (("t", "0"), ("t", "1")))),
        WriteProgress("q", Position(7)),
        DeleteStaged("_staging/b1"),
        DeleteManifest("b1"),
    ]


def test_applying_again_half_way_through_the_moves_redoes_only_the_rest() -> None:
    present = {MOVES[0].final, MOVES[1].staged}
    ops = apply_plan(MANIFEST, present, {"p": None, "q": Position(7)})
    assert ops == [
        Rename(MOVES[1].staged, MOVES[1].final),
        WriteProgress("p", Position(20, (("t", "0"), ("t", "1")))),
        DeleteStaged("_staging/b1"),
        DeleteManifest("b1"),
    ]
    # all moves done, progress written: only the cleanup is left
    done = {"p": MANIFEST.positions[0].position, "q": Position(7)}
    assert apply_plan(MANIFEST, FINAL, done) == [DeleteStaged("_staging/b1"), DeleteManifest("b1")]


def test_where_the_store_cannot_rename_every_staged_move_is_a_copy() -> None:
    """An object store: a move whose source is there is copied whatever its target (a copy
    cut short is finished; copying again is harmless); a move already done is left alone."""
    ops = apply_plan(MANIFEST, {MOVES[0].staged, MOVES[0].final, MOVES[1].final}, {}, rename=False)
    assert ops[:1] == [Copy(MOVES[0].staged, MOVES[0].final)]
    assert [op for op in ops if isinstance(op, Copy | Rename)] == ops[:1]
    assert ops[-2:] == [DeleteStaged("_staging/b1"), DeleteManifest("b1")]
    with pytest.raises(CommitError):
        apply_plan(MANIFEST, set(), {}, rename=False)


TABLE_COMMIT = TableCommit(
    "orders",
    (DataFile("part-1.parquet", 100, 5, 1_700_000_000_000, '{"numRecords":5}'),),
    '{"type":"struct","fields":[]}',
    "shoal/c/w1",
    3,
    {"shoal.batch": "b1", "shoal.low_watermark_us": 12},
    1_700_000_000_000,
)


def test_delta_commits_come_after_the_moves_and_before_the_positions() -> None:
    manifest = msgspec.structs.replace(MANIFEST, tables=(TABLE_COMMIT,))
    assert decode_manifest(encode_manifest(manifest)) == manifest
    ops = apply_plan(manifest, frozenset(STAGED), {})
    assert [type(op).__name__ for op in ops] == [
        "Rename",
        "Rename",
        "CommitTable",
        "WriteProgress",
        "WriteProgress",
        "DeleteStaged",
        "DeleteManifest",
    ]
    assert ops[2] == CommitTable(TABLE_COMMIT)
    # applied again after everything but the cleanup: the Delta commit is asked again (its
    # application transaction makes it a no-op), the positions are not written again
    done = {p.token: p.position for p in manifest.positions}
    assert apply_plan(manifest, FINAL, done) == [
        CommitTable(TABLE_COMMIT),
        DeleteStaged("_staging/b1"),
        DeleteManifest("b1"),
    ]
    # a manifest written before Delta commits existed (no "tables" key) still decodes
    old = msgspec.json.decode(encode_manifest(MANIFEST))
    del old["tables"]
    assert decode_manifest(msgspec.json.encode(old)) == MANIFEST


def test_a_position_never_moves_back() -> None:
    newer = {"p": Position(30), "q": Position(7, (("t", "9"),))}
    ops = apply_plan(MANIFEST, FINAL, newer)
    assert [op for op in ops if isinstance(op, WriteProgress)] == []
    # same timestamp, fewer identities than the batch: the batch's position is newer
    ops = apply_plan(MANIFEST, FINAL, {"p": Position(20, (("t", "0"),)), "q": Position(3)})
    assert [op for op in ops if isinstance(op, WriteProgress)] == [
        WriteProgress("p", Position(20, (("t", "0"), ("t", "1")))),
        WriteProgress("q", Position(7)),
    ]


def test_a_batch_committed_before_drops_its_staged_copy() -> None:
    present = STAGED | {MOVES[0].final}
    ops = apply_plan(MANIFEST, present, {})
    assert ops[:2] == [DeleteStaged(MOVES[0].staged), Rename(MOVES[1].staged, MOVES[1].final)]


def test_a_move_with_neither_source_nor_target_is_an_error() -> None:
    with pytest.raises(CommitError, match="neither"):
        apply_plan(MANIFEST, {MOVES[0].staged}, {})


def test_recovery_deletes_old_unnamed_staging_only() -> None:
    staged = [("_staging/b1", 0.0), ("_staging/old", 0.0), ("_staging/young", 95.0)]
    assert recovery_plan([MANIFEST], staged, now=100.0, max_age_s=60.0) == [
        DeleteStaged("_staging/old")
    ]
    assert recovery_plan([], staged, now=100.0, max_age_s=60.0) == [
        DeleteStaged("_staging/b1"),
        DeleteStaged("_staging/old"),
    ]


def test_next_position_remembers_the_identities_at_the_new_timestamp() -> None:
    assert next_position(None, [rec(10), rec(20), rec(20, "1")], 20) == Position(
        20, (("t", "0"), ("t", "1"))
    )
    # more records at the same timestamp: the earlier identities stay
    assert next_position(Position(20, (("t", "0"),)), [rec(20, "2")], 20) == Position(
        20, (("t", "0"), ("t", "2"))
    )
    # a watermark past the records: nothing at it
    assert next_position(Position(20, (("t", "0"),)), [rec(25)], 30) == Position(30)
    # a watermark behind the last record never claims less than was written
    assert next_position(None, [rec(40)], 30) == Position(40, (("t", "0"),))


def test_the_batch_identity_depends_on_the_records_only() -> None:
    a = [("p", [rec(1), rec(2), rec(3)]), ("q", [rec(5)])]
    ident = batch_identity(a)
    assert ident.startswith("b")
    assert len(ident) == 17
    # the same records in another order of partitions, or split into two entries: same id
    assert batch_identity([("q", [rec(5)]), ("p", [rec(1), rec(2), rec(3)])]) == ident
    assert batch_identity([("p", [rec(1)]), ("q", [rec(5)]), ("p", [rec(2), rec(3)])]) == ident
    # other records: another id
    assert batch_identity([("p", [rec(1), rec(2), rec(4)]), ("q", [rec(5)])]) != ident
    assert batch_identity([("p", [rec(1), rec(3)]), ("q", [rec(5)])]) != ident
    assert batch_identity([("p", [rec(1), rec(2), rec(3)])]) != ident
    assert batch_identity([("p", [rec(1), rec(2), rec(3)]), ("r", [rec(5)])]) != ident


def test_progress_names_are_fixed_length_hashes() -> None:
    assert progress_name("a/b") == progress_name("a/b")
    assert progress_name("a/b") != progress_name("a/c")
    assert len(progress_name("x" * 500)) == 32


# --- fences (rule 4 of docs/design.md#exactly-once-output) -----------------------------------


def test_a_fence_answers_what_passed_and_refuses_the_rest_at_the_commit_point() -> None:
    fences = CommitFences()
    assert fences.admit({1, 2}) == frozenset()
    fences.passed({1, 2})  # the commit of batches 1 and 2 passed its point
    assert fences.fence({2, 3, 4}) == FenceOutcome(frozenset({2}), frozenset({3, 4}))
    assert fences.admit({3, 5}) == frozenset({3})  # a commit holding 3: refused, whole
    assert fences.admit({3, 5}) == frozenset({3})  # and again, if it is retried
    assert fences.admit({5, 6}) == frozenset()  # others pass
    assert fences.refused == 2


def test_forgotten_keys_leave_no_trace() -> None:
    fences = CommitFences()
    fences.passed({1})
    fences.fence({2})
    fences.forget({1, 2})
    assert (fences.passed_keys, fences.fenced_keys) == (set(), set())
    # a key forgotten after it passed is answered fenced: the shell's future says committed
    assert fences.fence({1}) == FenceOutcome(frozenset(), frozenset({1}))


def test_each_connector_has_its_own_state_and_identities() -> None:
    from protocol.commit import commits_dir, progress_dir, staging_dir, state_dir

    assert state_dir("ca") == "_shoal/ca" != state_dir("cb")
    assert commits_dir("ca") == "_shoal/ca/commits"
    assert progress_dir("ca") == "_shoal/ca/progress"
    assert staging_dir("ca") == "_staging/ca"
    for bad in ("", ".", "..", "a/b"):
        with pytest.raises(ValueError, match="connector"):
            state_dir(bad)
    entries = [("p", [rec(1), rec(2)])]
    assert batch_identity(entries, "ca") != batch_identity(entries, "cb")
    assert batch_identity(entries, "ca") == batch_identity(entries, "ca")
    assert batch_identity(entries) != batch_identity(entries, "ca")


def test_an_explicit_start_that_differs_from_the_recorded_one_conflicts() -> None:
    from protocol.commit import StartRecord, decode_start, encode_start, start_conflict

    recorded = StartRecord("ca", 1_000, "1970-01-01T00:00:00.001Z")
    assert decode_start(encode_start(recorded)) == recorded
    assert start_conflict(recorded, 2_000) == recorded
    assert start_conflict(recorded, 1_000) is None  # the same start resumes
    assert start_conflict(recorded, None) is None  # "now": resume
    assert start_conflict(None, 2_000) is None  # never started: nothing to contradict
    with pytest.raises(msgspec.DecodeError):
        decode_start(b'{"connector": "ca", "sta')
