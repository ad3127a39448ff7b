"""Atomic micro-batch commits of the parquet file sink (runtime/files/commit.py,
docs/design.md#exactly-once-output): a process killed at any step of a commit leaves either
nothing visible or a manifest the next sink over the same directory applies; readers never see
staged files; ``committed(token)`` answers the batch's position; a lapsed lease commits nothing.

A kill is simulated by raising ``Killed`` at the chosen step and at every file operation of the
committer after it (a dead process does nothing more): the disk is left as the kill would leave
it, and the batch's futures fail."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from protocol.commit import STAGING_DIR, Rename, WriteProgress
from protocol.dedup import Position
from protocol.records import DataChange, Mod
from runtime.files.commit import CommitIncomplete, Committer
from runtime.files.sink import FileSink, SinkError, read_rows
from runtime.ports import SinkBatch


class Killed(Exception):
    """The process dies here."""


def rec(ts: int, seq: str = "0", key: int = 1) -> DataChange:
    mod = Mod(keys=f'{{"id": {key}}}', new_values="{}", old_values="{}")
    return DataChange(ts, seq, f"txn{ts}", False, "T", (), (mod,), "INSERT")


P_RECORDS = (rec(10), rec(20, "0"), rec(20, "1"))
Q_RECORDS = (rec(15, key=2), rec(16, key=3))
P_POSITION = Position(20, (("txn20", "0"), ("txn20", "1")))
Q_POSITION = Position(17)


def rows(directory: Path) -> list[tuple[str, int, str]]:
    return sorted(
        (r["partition_token"], r["commit_ts"], r["record_sequence"]) for r in read_rows(directory)
    )


EXPECTED = [("p", 10, "0"), ("p", 20, "0"), ("p", 20, "1"), ("q", 15, "0"), ("q", 16, "0")]


def dataset_rows(directory: Path) -> int:
    """What a plain pyarrow reader of the directory sees (it skips ``_`` and ``.`` names)."""
    return int(ds.dataset(str(directory), format="parquet").count_rows())


async def put_both(sink: FileSink) -> list[Any]:
    return [
        await sink.put(SinkBatch("p", P_RECORDS, 20)),
        await sink.put(SinkBatch("q", Q_RECORDS, 17)),
    ]


async def killed_during_commit(directory: Path, arm: Callable[[pytest.MonkeyPatch], None]) -> None:
    """Run one micro-batch through a sink whose process is killed where ``arm`` says."""
    with pytest.MonkeyPatch.context() as mp:
        arm(mp)
        async with FileSink(directory, max_age_s=0.01) as sink:
            futures = await put_both(sink)
            for future in futures:
                with pytest.raises(SinkError):
                    await future


def kill_at_op(kind: type, nth: int = 1) -> Callable[[pytest.MonkeyPatch], None]:
    """Arm a kill at the ``nth`` operation of type ``kind`` while a manifest is applied."""

    def arm(mp: pytest.MonkeyPatch) -> None:
        real = Committer._do
        seen = 0

        def do(self: Committer, op: Any) -> None:
            nonlocal seen
            if isinstance(op, kind):
                seen += 1
            if seen >= nth:
                raise Killed
            real(self, op)

        mp.setattr(Committer, "_do", do)

    return arm


def kill_before_manifest(mp: pytest.MonkeyPatch) -> None:
    def write_manifest(self: Committer, manifest: Any) -> None:
        raise Killed

    mp.setattr(Committer, "_write_manifest", write_manifest)


@pytest.mark.asyncio
async def test_killed_before_the_manifest_commits_nothing_and_leaves_nothing_visible(
    tmp_path: Path,
) -> None:
    await killed_during_commit(tmp_path, kill_before_manifest)
    assert any((tmp_path / STAGING_DIR).rglob("*.parquet"))  # staged, not committed
    assert rows(tmp_path) == []
    assert dataset_rows(tmp_path) == 0
    async with FileSink(tmp_path, max_age_s=0.01, validate=True) as sink:
        assert await sink.durable_position("p") is None
        # the partitions' owners re-read the batch: it is written once
        for future in await put_both(sink):
            await future
        assert await sink.durable_position("p") == P_POSITION
    assert rows(tmp_path) == EXPECTED


@pytest.mark.parametrize(
    ("step", "arm"),
    [
        ("after the manifest, before the moves", kill_at_op(Rename)),
        ("after the move, before the positions", kill_at_op(WriteProgress)),
        ("half-way through the positions", kill_at_op(WriteProgress, nth=2)),
    ],
)
@pytest.mark.asyncio
async def test_killed_after_the_manifest_the_next_sink_finishes_the_commit(
    tmp_path: Path, step: str, arm: Callable[[pytest.MonkeyPatch], None]
) -> None:
    await killed_during_commit(tmp_path, arm)
    assert list((tmp_path / "_shoal" / "shoal" / "commits").glob("*.json")), step
    async with FileSink(tmp_path, max_age_s=0.01) as sink:  # recovers at open
        assert sink.committer.recovered == 1
        assert not list((tmp_path / "_shoal" / "shoal" / "commits").glob("*.json"))
        assert await sink.durable_position("p") == P_POSITION
        assert await sink.durable_position("q") == Q_POSITION
        assert rows(tmp_path) == EXPECTED
        assert dataset_rows(tmp_path) == len(EXPECTED)
        # the same batch delivered again (a reader that did not ask committed()): the same
        # batch identity names the same directory, so it does not appear twice
        for future in await put_both(sink):
            await future
    assert rows(tmp_path) == EXPECTED
    assert not any(p.is_file() for p in (tmp_path / STAGING_DIR).rglob("*"))


@pytest.mark.asyncio
async def test_committed_is_recovered_before_it_is_answered(tmp_path: Path) -> None:
    """A sink already open over the directory applies a manifest another process left before
    it answers ``committed(token)`` (a take-over asks right after the old owner died)."""
    async with FileSink(tmp_path, max_age_s=0.01) as survivor:
        assert await survivor.durable_position("p") is None
        await killed_during_commit(tmp_path, kill_at_op(Rename))
        assert rows(tmp_path) == []
        assert await survivor.durable_position("p") == P_POSITION
        assert rows(tmp_path) == EXPECTED


@pytest.mark.asyncio
async def test_a_lapsed_lease_commits_nothing(tmp_path: Path) -> None:
    lease = {"valid": True}
    async with FileSink(
        tmp_path, max_age_s=0.01, permit=lambda: lease["valid"], validate=True
    ) as sink:
        await (await sink.put(SinkBatch("p", P_RECORDS[:1], 10)))
        lease["valid"] = False
        future = await sink.put(SinkBatch("p", P_RECORDS[1:], 20))
        with pytest.raises(SinkError, match="lease ran out"):
            await future
        assert await sink.durable_position("p") == Position(10, (("txn10", "0"),))
        # the lease is back (renewed): the partition's owner re-reads, the batch commits
        lease["valid"] = True
        await (await sink.put(SinkBatch("p", P_RECORDS[1:], 20)))
        assert await sink.durable_position("p") == P_POSITION
    assert rows(tmp_path) == [("p", 10, "0"), ("p", 20, "0"), ("p", 20, "1")]
    assert not any(p.is_file() for p in (tmp_path / STAGING_DIR).rglob("*"))


def test_half_way_through_the_moves_recovery_moves_the_rest(tmp_path: Path) -> None:
    """Two table directories, killed after the first rename (the Spark output's layout)."""
    committer = Committer(tmp_path, fsync=False)
    staging = committer.staging("b1")
    for table in ("A", "B"):
        d = staging / f"table={table}" / "batch=b1"
        d.mkdir(parents=True)
        (d / "part-0.parquet").write_bytes(b"x")
    moves = [(f"{committer.staged('b1')}/table={t}/batch=b1", f"table={t}/batch=b1") for t in "AB"]
    with pytest.MonkeyPatch.context() as mp:
        kill_at_op(Rename, nth=2)(mp)
        with pytest.raises(CommitIncomplete):
            committer.commit("b1", moves, [("p", P_RECORDS, 20)])
    assert (tmp_path / "table=A/batch=b1/part-0.parquet").exists()
    assert not (tmp_path / "table=B/batch=b1").exists()
    fresh = Committer(tmp_path, fsync=False)
    assert fresh.committed("p") == P_POSITION
    assert (tmp_path / "table=B/batch=b1/part-0.parquet").exists()
    assert not (tmp_path / committer.staged("b1")).exists()


def test_old_staged_left_overs_are_deleted_young_ones_kept(tmp_path: Path) -> None:
    now = [1000.0]
    committer = Committer(tmp_path, garbage_age_s=60.0, clock=lambda: now[0])
    (committer.staging("old") / "f").mkdir(parents=True)
    now[0] = 2e12  # far later than the directory's mtime
    staging = tmp_path / committer.staged("")
    (staging / "young").mkdir()
    young_mtime = (staging / "young").stat().st_mtime
    now[0] = young_mtime + 1
    committer2 = Committer(tmp_path, garbage_age_s=60.0, clock=lambda: young_mtime + 1e6)
    assert committer2.recover() == 0
    assert not (staging / "old").exists()
    assert not (staging / "young").exists()
    (staging / "young").mkdir()
    assert committer.recover() == 0  # its clock says the directory is 1 s old
    assert (staging / "young").exists()


def test_connectors_sharing_an_output_never_see_each_others_state(tmp_path: Path) -> None:
    """Progress, manifests and staged files are the connector's own: a second connector over
    the same output reads no position of the first (its partitions start from scratch), and its
    recovery leaves the first one's staged batch alone (docs/design.md, exactly-once rule 5)."""
    a = Committer(tmp_path, connector="ca", fsync=False)
    a.commit("b1", [], [("p", P_RECORDS, 20)])
    assert a.committed("p") == P_POSITION
    b = Committer(tmp_path, connector="cb", fsync=False, garbage_age_s=0.0, clock=lambda: 1e12)
    assert b.committed("p") is None  # keyed by token only, it would resume at a's position
    (a.staging("b2") / "f").mkdir(parents=True)  # a batch ca is staging right now
    assert b.recover() == 0
    assert (tmp_path / a.staged("b2") / "f").exists()
    assert Committer(tmp_path, connector="ca", fsync=False).committed("p") == P_POSITION


@pytest.mark.parametrize("content", [b"", b'{"ts": 20, "i'])
def test_an_unreadable_progress_file_stops_loudly_naming_it(tmp_path: Path, content: bytes) -> None:
    from runtime.files.commit import CorruptState
    from runtime.ports import Unrecoverable

    committer = Committer(tmp_path, connector="ca", fsync=False)
    committer.commit("b1", [], [("p", P_RECORDS, 20)])
    (progress,) = (tmp_path / "_shoal" / "ca" / "progress").iterdir()
    progress.write_bytes(content)
    with pytest.raises(CorruptState, match=re.escape(str(progress))) as caught:
        Committer(tmp_path, connector="ca", fsync=False).committed("p")
    assert isinstance(caught.value, Unrecoverable)  # the run stops (exit 1), no retry loop
    assert "delete the file" in str(caught.value)


def test_an_unreadable_manifest_stops_recovery_naming_it(tmp_path: Path) -> None:
    from runtime.files.commit import CorruptState

    commits = tmp_path / "_shoal" / "ca" / "commits"
    commits.mkdir(parents=True)
    (commits / "b1.json").write_bytes(b'{"kind": "commit-v1", "batch": "b1", "stag')
    with pytest.raises(CorruptState, match=r"b1\.json"):
        Committer(tmp_path, connector="ca", fsync=False).recover()


def test_a_commit_being_applied_holds_back_only_the_readers_of_its_partitions(
    tmp_path: Path,
) -> None:
    """Past its commit point a commit is applied outside the committer's lock: a new reader of
    another partition learns its position at once, a reader of a partition the commit holds
    waits until it is applied (and sees the new position), and recovery meanwhile does not
    apply the manifest being applied as if a killed process had left it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    committer = Committer(tmp_path, fsync=False)
    committer.commit("b0", [], [("q", Q_RECORDS, 17)])
    release = threading.Event()
    applying = threading.Event()
    do = committer._do

    def slow(op: Any) -> None:
        if isinstance(op, WriteProgress) and op.token == "p":
            applying.set()
            assert release.wait(10)
        do(op)

    committer._do = slow  # type: ignore[method-assign]
    with ThreadPoolExecutor(3) as pool:
        commit = pool.submit(committer.commit, "b1", [], [("p", P_RECORDS, 20)])
        assert applying.wait(10)
        assert pool.submit(committer.committed, "q").result(timeout=5) == Q_POSITION
        reader_of_p = pool.submit(committer.committed, "p")
        assert committer.recover() == 0  # b1's manifest is there, and it is ours
        assert not reader_of_p.done()
        release.set()
        commit.result(timeout=10)
        assert reader_of_p.result(timeout=10) == P_POSITION
    assert committer.recovered == 0
    assert Committer(tmp_path, fsync=False).committed("p") == P_POSITION
