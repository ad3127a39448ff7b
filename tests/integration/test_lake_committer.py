"""The committer (runtime/files/commit.py) over a store: on a local directory and on moto's S3 server,
with Delta tables (the Delta commit is the visibility step, applied idempotently from the
manifest) and with parquet directories (copied into place where the store cannot rename);
processes SIGKILLed at each step of a commit, and the next committer finishing the batch
exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from protocol.dedup import Position
from runtime.files.commit import CommitRefused, Committer
from runtime.lake.delta import SchemaConflict, write_data_file
from runtime.lake.store import Store, StoreUnsupported, open_store
from tests.fixtures.s3 import S3Server, s3_env, s3_server
from tests.helpers import REPO, assert_catches_a_double, assert_no_row_twice, exactly
from tests.proc_lake_commit import TABLES, records, rows

__all__ = ["s3_env", "s3_server"]  # fixtures used by name


@dataclass(frozen=True)
class Output:
    store: Store
    env: dict[str, str]  # for subprocesses

    def delta_ids(self, table: str) -> list[int]:
        dt = DeltaTable(self.store.uri_for(table), storage_options=self.store.storage_options())
        return sorted(dt.to_pyarrow_table(columns=["id"]).column("id").to_pylist())

    def parquet_ids(self, table: str) -> list[int]:
        """What a reader of the directory sees (pyarrow skips ``_`` and ``.`` names)."""
        files = [e.path for e in self.store.list_files(table) if e.path.endswith(".parquet")]
        ids: list[int] = []
        for f in files:
            with self.store.open_input_file(f) as source:
                ids += pq.read_table(source, columns=["id"]).column("id").to_pylist()
        return sorted(ids)


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def output(request: pytest.FixtureRequest, tmp_path: Path) -> Output:
    if request.param == "file":
        return Output(open_store(tmp_path / "out"), {**os.environ, "PYTHONPATH": str(REPO)})
    server: S3Server = request.getfixturevalue("s3_env")
    store = open_store(server.uri(f"out-{uuid.uuid4().hex[:8]}"))
    return Output(store, server.child_env(PYTHONPATH=str(REPO)))


def batch_ids(*batches: int) -> list[int]:
    return sorted(i for b in batches for i in range(b * 10, b * 10 + 10))


def position(batch: int) -> Position:
    return Position(batch * 10 + 9, ((f"t{batch}-9", "0"),))


def delta_commit(
    committer: Committer, batch: int, metadata: dict[str, str | int | float | bool] | None = None
) -> None:
    tables = []
    for table in TABLES:
        data = rows(batch, table)
        tables.append((table, [write_data_file(committer.store, table, data)], data.schema))
    entries = [("p", records(batch), batch * 10 + 9)]
    committer.commit(f"b{batch}", [], entries, tables=tables, metadata=metadata)


# --- in process ------------------------------------------------------------------------------


def test_delta_batches_commit_once_each_with_the_position(output: Output) -> None:
    committer = Committer(output.store, connector="lake", fsync=False)
    delta_commit(committer, 1, metadata={"shoal.low_watermark_us": 19})
    delta_commit(committer, 2)
    assert committer.committed("p") == position(2)
    for table in TABLES:
        assert output.delta_ids(table) == batch_ids(1, 2)
    dt = DeltaTable(output.store.uri_for("A"), storage_options=output.store.storage_options())
    history = sorted(dt.history(), key=lambda h: h["version"])
    assert [(h["shoal.batch"], h["shoal.txn_version"]) for h in history] == [("b1", 1), ("b2", 2)]
    assert history[0]["shoal.connector"] == "lake"
    assert history[0]["shoal.low_watermark_us"] == 19
    assert dt.transaction_version(committer.app_id) == 2
    # nothing left behind: no manifest, no staging
    assert not output.store.list_files("_shoal/lake/commits")
    assert not output.store.list_files("_staging")
    # another committer (a restart) answers the same position
    assert Committer(output.store, connector="lake").committed("p") == position(2)


def test_a_refused_delta_batch_leaves_no_data_file(output: Output) -> None:
    lease = {"valid": True}
    committer = Committer(output.store, connector="lake", permit=lambda: lease["valid"])
    delta_commit(committer, 1)
    lease["valid"] = False
    with pytest.raises(CommitRefused):
        delta_commit(committer, 2)
    assert output.delta_ids("A") == batch_ids(1)
    parquet = [e.path for e in output.store.list_files("A") if e.path.endswith(".parquet")]
    assert len(parquet) == 1  # batch 2's data file was deleted with the refusal
    # a column whose type changed is refused before the commit point: nothing to recover
    lease["valid"] = True
    bad = pa.table({"id": pa.array(["x"], pa.string())})
    f = write_data_file(output.store, "A", bad)
    with pytest.raises(SchemaConflict, match="column id"):
        committer.commit("b3", [], [("p", records(3), 39)], tables=[("A", [f], bad.schema)])
    assert not output.store.exists(f"A/{f.path}")
    assert not output.store.list_files("_shoal/lake/commits")
    assert committer.committed("p") == position(1)


def test_parquet_directories_on_any_store(output: Output) -> None:
    """The parquet layout: renamed into place locally, copied on an object store; the same
    batch delivered again (a reader that did not ask committed()) appears once."""
    committer = Committer(output.store, connector="lake", fsync=False)
    for _ in range(2):  # the second time: the same batch, staged again
        staged = committer.prepare_staging("b1")
        moves = []
        for table in TABLES:
            rel = f"{staged}/{table}/batch=b1"
            with output.store.open_output_stream(f"{rel}/part-{uuid.uuid4().hex}.parquet") as s:
                pq.write_table(rows(1, table), s)
            moves.append((rel, f"{table}/batch=b1"))
        manifest = committer.commit("b1", moves, [("p", records(1), 19)])
    if output.store.can_rename:
        assert len(manifest.moves) == 2  # the staged copy is dropped at apply: targets exist
    else:
        assert manifest.moves == ()  # left out: a copy would add its files beside the first
    for table in TABLES:
        assert output.parquet_ids(table) == batch_ids(1)
    assert not output.store.list_files("_staging")
    assert committer.committed("p") == position(1)
    if output.store.is_local:  # pyarrow's own reader of the directory agrees
        assert pads.dataset(str(committer.root / "A"), format="parquet").count_rows() == 10
    else:
        with pytest.raises(StoreUnsupported):
            committer.staging("b2")


# --- SIGKILLed mid-commit --------------------------------------------------------------------


def run(
    output: Output, layout: str, batch: int, kill_at: str = ""
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "tests.proc_lake_commit", output.store.uri, layout, str(batch)]
    if kill_at:
        args += ["--kill-at", kill_at]
    return subprocess.run(
        args, capture_output=True, text=True, cwd=REPO, env=output.env, timeout=240, check=False
    )


@pytest.mark.parametrize("kill_at", ["manifest", "CommitTable-2", "WriteProgress"])
def test_delta_commit_killed_mid_way_is_finished_once_by_the_next_process(
    output: Output, kill_at: str
) -> None:
    """SIGKILL right after the commit point, between the two tables' Delta commits, and after
    both before the positions: the next process's committer applies the manifest at open (the
    Delta commits it finds done add nothing) and every row is there once."""
    assert run(output, "delta", 1).returncode == 0
    killed = run(output, "delta", 2, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert output.store.list_files("_shoal/lake/commits")  # the manifest is there
    for table in TABLES:  # never a row twice, while the commit is half done
        assert_no_row_twice(output.delta_ids(table))
    done = run(output, "delta", 3)  # recovers batch 2 at open, then commits batch 3
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"committed": 3}
    for table in TABLES:
        exactly(batch_ids(1, 2, 3))(output.delta_ids(table))
        assert_catches_a_double(exactly(batch_ids(1, 2, 3)), output.delta_ids(table))
    assert Committer(output.store, connector="lake").committed("p") == position(3)


@pytest.mark.parametrize("kill_at", ["manifest", "Copy-2", "WriteProgress"])
def test_parquet_commit_killed_mid_way_is_finished_once(output: Output, kill_at: str) -> None:
    if output.store.can_rename:
        kill_at = kill_at.replace("Copy", "Rename")
    killed = run(output, "parquet", 1, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = run(output, "parquet", 2)
    assert done.returncode == 0, done.stderr
    for table in TABLES:
        exactly(batch_ids(1, 2))(output.parquet_ids(table))
        assert_catches_a_double(exactly(batch_ids(1, 2)), output.parquet_ids(table))
    assert not output.store.list_files("_staging")
    assert Committer(output.store, connector="lake").committed("p") == position(2)


@pytest.mark.s3
def test_a_new_partitions_position_costs_a_listing_and_a_read(s3_env: S3Server) -> None:
    """A reader of each new partition asks the committer for its position: on S3 that is a
    listing of the manifests left behind and one read of the progress file; the look for
    staged left-overs (a listing of every staged file) comes with the first question and then
    at most once a minute. A staged left-over older than ``garbage_age_s`` is deleted by it."""
    now = [1e12]
    store = open_store(s3_env.uri(f"pos-{uuid.uuid4().hex[:8]}"))
    committer = Committer(store, garbage_age_s=0.0, clock=lambda: now[0])

    def asked(token: str) -> list[str]:
        since = s3_env.log_offset()
        assert committer.committed(token) is None
        kinds = []
        for r in s3_env.requests(since):
            places = ("commits", "_staging", "progress")
            where = next((k for k in places if f"/{k}/" in r.key), "bucket")
            kinds.append(f"{'list' if r.listing else r.method} {where}")
        return kinds

    assert asked("p0") == ["list commits", "list _staging", "GET progress"]
    store.write_bytes(f"{committer.staged('left')}/t/part-0.parquet", b"x")
    assert asked("p1") == ["list commits", "GET progress"]
    assert store.list_files(committer.staged("left"))  # not looked for yet
    now[0] += 61
    assert asked("p2") == [
        "list commits",
        "list _staging",
        "list _staging",  # deleting it
        "POST bucket",  # a batch delete
        "GET progress",
    ]
    assert not store.list_files(committer.staged("left"))
