"""Delta Lake commits through delta-rs (runtime/lake/delta.py), on a local directory and on
moto's S3 server: one idempotent commit per micro-batch (a retry after a crash adds nothing; a
control without the application transaction adds twice), concurrent writers in separate
processes, a SIGKILL between data files and commit, schema merging, statistics, and readers
(deltalake, polars, DuckDB)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from runtime.lake.delta import (
    RETENTION_KEY,
    DeltaCommitFailed,
    DeltaCommitter,
    SchemaConflict,
    add_action,
    app_id,
    new_writer_id,
    write_data_file,
)
from runtime.lake.store import Store, StoreError, open_store
from tests.fixtures.s3 import S3Server, s3_env, s3_server
from tests.helpers import REPO
from tests.proc_delta_commit import batch_table

__all__ = ["s3_env", "s3_server"]  # fixtures used by name


@dataclass(frozen=True)
class Lake:
    store: Store
    env: dict[str, str]  # for subprocesses
    secrets: tuple[str, ...]

    def table(self, name: str) -> DeltaTable:
        return DeltaTable(self.store.uri_for(name), storage_options=self.store.storage_options())

    def files(self, name: str) -> set[str]:
        """The data files the table's log lists (relative to the table)."""
        actions = pa.table(self.table(name).get_add_actions(flatten=True))
        return set(actions.column("path").to_pylist())

    def ids(self, name: str) -> list[int]:
        return sorted(self.table(name).to_pyarrow_table(columns=["id"]).column("id").to_pylist())


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def lake(request: pytest.FixtureRequest, tmp_path: Path) -> Lake:
    if request.param == "file":
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return Lake(open_store(tmp_path / "lake"), env, ())
    return s3_lake(request.getfixturevalue("s3_env"))


def s3_lake(server: S3Server) -> Lake:
    store = open_store(server.uri(f"lake-{uuid.uuid4().hex[:8]}"))
    return Lake(store, server.child_env(PYTHONPATH=str(REPO)), server.secrets)


def ids_of(batches: range, rows: int = 5, base: int = 0) -> list[int]:
    return sorted(base + b * rows + i for b in batches for i in range(rows))


# --- in process ------------------------------------------------------------------------------


def test_commits_create_append_and_carry_identity_metadata_and_stats(lake: Lake) -> None:
    committer = DeltaCommitter(lake.store)
    assert committer.check() == []  # moto and local disks refuse to overwrite a commit
    app = app_id("conn", new_writer_id())
    results = []
    for batch in (1, 2):
        data = batch_table(batch, 5, 0, None)
        f = write_data_file(lake.store, "orders", data)
        assert f.num_records == 5
        results.append(
            committer.commit(
                "orders",
                [f],
                data.schema,
                app=app,
                version=batch,
                metadata={"shoal.batch": f"b{batch}", "shoal.low_watermark_us": 1234 + batch},
            )
        )
    assert [(r.version, r.created, r.already, r.attempts) for r in results] == [
        (0, True, False, 1),
        (1, False, False, 1),
    ]
    dt = lake.table("orders")
    assert dt.version() == 1
    assert dt.transaction_version(app) == 2
    assert dt.metadata().configuration[RETENTION_KEY] == "interval 30 days"
    assert dt.metadata().configuration["delta.checkpointInterval"] == "10"
    assert lake.ids("orders") == ids_of(range(1, 3))
    history = sorted(dt.history(), key=lambda h: h["version"])
    assert [h.get("shoal.batch") for h in history] == ["b1", "b2"]
    assert [h.get("shoal.low_watermark_us") for h in history] == [1235, 1236]
    assert all(h["shoal.app_id"] == app for h in history)
    # per-file statistics readers skip files with
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    by_min = sorted(actions, key=lambda a: a["min.id"])
    assert [(a["num_records"], a["min.id"], a["max.id"]) for a in by_min] == [
        (5, 5, 9),
        (5, 10, 14),
    ]
    assert by_min[0]["null_count.name"] == 0
    assert str(by_min[0]["min.ts"]).startswith("2026-01-01 00:00:05")
    # the same batch again: nothing
    again = committer.commit(
        "orders",
        [write_data_file(lake.store, "orders", batch_table(2, 5, 0, None))],
        data.schema,
        app=app,
        version=2,
    )
    assert (again.already, again.version) == (True, None)
    assert lake.ids("orders") == ids_of(range(1, 3))


def test_schema_merge(lake: Lake) -> None:
    committer = DeltaCommitter(lake.store)
    app = app_id("conn", new_writer_id())
    old = batch_table(1, 3, 0, None)
    committer.commit("t", [write_data_file(lake.store, "t", old)], old.schema, app=app, version=1)
    new = batch_table(2, 3, 0, "price")
    result = committer.commit(
        "t", [write_data_file(lake.store, "t", new)], new.schema, app=app, version=2
    )
    assert result.columns_added == ("price",)
    dt = lake.table("t")
    assert dt.schema().to_arrow().names == ["id", "name", "ts", "price"]
    rows = {r["id"]: r["price"] for r in dt.to_pyarrow_table().to_pylist()}
    assert rows == {3: None, 4: None, 5: None, 6: 6.0, 7: 7.0, 8: 8.0}
    # one metadata commit, then the data commit holding the batch's identity
    latest = sorted(dt.history(), key=lambda h: h["version"])[-2:]
    assert [h["operation"] for h in latest] == ["ADD COLUMN", "WRITE"]
    assert "shoal.txn_version" not in latest[0]
    assert latest[1]["shoal.txn_version"] == 2
    # a column whose type differs is refused, and nothing of that batch is committed
    bad = pa.table({"id": pa.array(["x"], pa.string())})
    with pytest.raises(SchemaConflict, match="column id"):
        committer.commit(
            "t", [write_data_file(lake.store, "t", bad)], bad.schema, app=app, version=3
        )
    assert lake.table("t").transaction_version(app) == 2
    assert len(lake.ids("t")) == 6


def test_a_batch_another_committer_committed_meanwhile_is_found(lake: Lake) -> None:
    """The committer keeps each application's transaction version per table and brings it
    forward from the commit files written after it: a batch of its application committed by
    another committer meanwhile (a recovery of its manifest), with a foreign writer's commits
    in between, is found and not committed again; its own later batches still commit."""
    a = DeltaCommitter(lake.store)
    b = DeltaCommitter(lake.store)  # another process recovering a's manifest
    other = DeltaCommitter(lake.store)  # a writer of its own application
    app, foreign = app_id("conn", new_writer_id()), app_id("conn", new_writer_id())

    def commit(c: DeltaCommitter, batch: int, application: str, version: int) -> bool:
        data = batch_table(batch, 2, 0, None)
        f = write_data_file(lake.store, "t", data)
        result = c.commit("t", [f], data.schema, app=application, version=version)
        if result.already:
            c.discard("t", [f])
        return result.already

    assert not commit(a, 1, app, 1)  # creates the table
    assert not commit(a, 2, app, 2)
    assert a.committed("t", app) == 2
    assert not commit(other, 100, foreign, 1)
    assert not commit(b, 3, app, 3)  # a's batch 3, committed by the recovery
    assert not commit(other, 101, foreign, 2)
    assert commit(a, 3, app, 3)  # a's own retry of batch 3: found, nothing added
    assert not commit(a, 4, app, 4)
    assert not commit(a, 5, app, 5)  # the one commit since a's last is its own
    assert commit(b, 5, app, 5)
    expected = ids_of(range(1, 6), rows=2) + ids_of(range(100, 102), rows=2)
    assert lake.ids("t") == sorted(expected)
    assert lake.table("t").transaction_version(app) == 5
    assert (a.committed("t", app), a.committed("t", foreign)) == (5, 2)
    # control: without the application transaction the same retry adds the batch again
    data = batch_table(3, 2, 0, None)
    f = write_data_file(lake.store, "t", data)
    assert not a.commit("t", [f], data.schema, app=app, version=None).already
    assert Counter(lake.ids("t"))[6] == 2


@pytest.mark.s3
def test_a_commit_costs_the_same_few_requests_however_long_the_log(s3_env: S3Server) -> None:
    """A micro-batch's commit to a table it committed to before costs a fixed number of S3
    requests (bring the snapshot up to date, write the commit), not one more per commit file
    since the last checkpoint, as delta-rs's own transaction lookup does (control: it reads
    every commit file of the log tail)."""
    lake = s3_lake(s3_env)
    committer = DeltaCommitter(lake.store, find_versions=False)
    app = app_id("conn", new_writer_id())
    counts = []
    for batch in range(1, 10):  # versions 0-8: no checkpoint (every 10)
        data = batch_table(batch, 2, 0, None)
        f = write_data_file(lake.store, "t", data)
        since = s3_env.log_offset()
        committer.commit("t", [f], data.schema, app=app, version=batch)
        counts.append(len(s3_env.requests(since)))
    assert len(set(counts[2:])) == 1, counts  # the second loads the table
    assert counts[-1] <= 8, counts
    # control: delta-rs's lookup of the same answer reads the log's eight commit files after
    # version 0 (and the table's first commit)
    dt = lake.table("t")
    since = s3_env.log_offset()
    assert dt.transaction_version(app) == 9
    logs = [r for r in s3_env.requests(since) if r.key.endswith(".json") and r.method == "GET"]
    assert len(logs) >= 8


def test_delta_rs_append_alone_drops_a_new_column(tmp_path: Path) -> None:
    """Why the committer adds columns in a metadata commit first: delta-rs 1.6's append of
    external files ignores the schema it is given (if this starts failing, delta-rs learned
    to merge and the extra commit can go)."""
    store = open_store(tmp_path)
    committer = DeltaCommitter(store)
    old = batch_table(1, 2, 0, None)
    committer.commit("t", [write_data_file(store, "t", old)], old.schema, app="a", version=1)
    new = batch_table(2, 2, 0, "price")
    f = write_data_file(store, "t", new)
    dt = DeltaTable(store.uri_for("t"))
    dt.create_write_transaction([add_action(f)], "append", new.schema)
    assert "price" not in DeltaTable(store.uri_for("t")).schema().to_arrow().names


@pytest.mark.s3
def test_check_refuses_a_log_store_unsafe_for_concurrent_writers(
    s3_env: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    committer = DeltaCommitter(open_store(s3_env.uri("x")))
    assert committer.check() == []
    monkeypatch.setenv("AWS_S3_ALLOW_UNSAFE_RENAME", "true")
    with pytest.raises(StoreError, match=r"^run\.output_dir .*AWS_S3_ALLOW_UNSAFE_RENAME"):
        committer.check()
    assert committer.check(concurrent=False) == []  # one writer: nothing to race


# --- subprocesses ----------------------------------------------------------------------------


def writer(
    lake: Lake, table: str, app: str, first: int, count: int, *args: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.proc_delta_commit",
            lake.store.uri,
            table,
            app,
            str(first),
            str(count),
            *args,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=lake.env,
    )


def lines(stream: IO[str] | None) -> Iterator[dict[str, Any]]:
    assert stream is not None
    for line in stream:
        yield json.loads(line)


def finish(proc: subprocess.Popen[str], expect_rc: int = 0) -> tuple[list[dict[str, Any]], str]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == expect_rc, err
    return [json.loads(line) for line in out.splitlines()], err


def test_a_commit_retried_after_a_crash_adds_nothing(lake: Lake) -> None:
    """A writer SIGKILLed right after its batch 2 committed, before it could say so; the retry
    (a new process, as a recovery would) commits batch 2 again with the same identity: nothing
    is added. Control: the same without the application transaction adds batch 2 twice."""
    app = app_id("conn", new_writer_id())
    out, _ = finish(writer(lake, "t", app, 1, 3, "--kill-after-commit", "2"), -signal.SIGKILL)
    assert [o["batch"] for o in out if "batch" in o] == [1]  # batch 2 never confirmed
    assert lake.ids("t") == ids_of(range(1, 3))  # ... but it is committed
    out, _ = finish(writer(lake, "t", app, 2, 2))
    assert [(o["batch"], o["already"]) for o in out if "batch" in o] == [(2, True), (3, False)]
    assert lake.ids("t") == ids_of(range(1, 4))  # every row once
    assert lake.table("t").transaction_version(app) == 3
    # the retry's own data files of batch 2 were discarded: only committed files remain
    present = {e.path for e in lake.store.list_files("t") if e.path.endswith(".parquet")}
    assert present == {f"t/{p}" for p in lake.files("t")}

    # control: no application transaction
    finish(writer(lake, "c", app, 1, 3, "--no-txn", "--kill-after-commit", "2"), -signal.SIGKILL)
    finish(writer(lake, "c", app, 2, 2, "--no-txn"))
    counts = Counter(lake.ids("c"))
    assert sorted(i for i, n in counts.items() if n == 2) == ids_of(range(2, 3))
    assert len(lake.ids("c")) == 20


def test_two_processes_commit_to_one_table_concurrently(lake: Lake) -> None:
    """Two writers (separate processes, own app ids) commit 12 batches each to one table at the
    same time, each adding its own column half-way (concurrent metadata changes conflict):
    every row is there exactly once, both columns are in the schema."""
    apps = [app_id("conn", f"w{i}") for i in range(2)]
    procs = [
        writer(
            lake, "t", app, 0, 12, "--wait-stdin", "--id-base", str(i * 10_000), "--extra-from", "6"
        )
        for i, app in enumerate(apps)
    ]
    for proc in procs:  # both started and loaded: go together
        assert next(lines(proc.stdout)) == {"ready": True}
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = [finish(proc)[0] for proc in procs]
    expected = sorted(ids_of(range(12)) + ids_of(range(12), base=10_000))
    assert lake.ids("t") == expected
    dt = lake.table("t")
    assert {"extra_w0", "extra_w1"} <= set(dt.schema().to_arrow().names)
    assert [dt.transaction_version(a) for a in apps] == [11, 11]
    # one commit per batch, at the version it reported (the table's history says which)
    history = lake.table("t").history()
    truth = {(h["shoal.app_id"], h.get("shoal.txn_version")): h["version"] for h in history}
    reported = {
        (a, o["batch"]): o["version"]
        for a, out in zip(apps, outs, strict=True)
        for o in out
        if "batch" in o
    }
    assert reported == {k: v for k, v in truth.items() if k[1] is not None}
    assert len(set(reported.values())) == 24


def test_sigkill_between_data_files_and_commit_leaves_nothing_visible(lake: Lake) -> None:
    app = app_id("conn", new_writer_id())
    proc = writer(lake, "t", app, 1, 3, "--hang-before-commit", "2")
    seen = []
    for o in lines(proc.stdout):
        seen.append(o)
        if o.get("written") == 2:
            break
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc, -signal.SIGKILL)
    orphan = f"t/{seen[-1]['files'][0]}"
    assert lake.store.exists(orphan)  # the data file is there ...
    dt = lake.table("t")
    assert lake.ids("t") == ids_of(range(1, 2))  # ... but only batch 1 is visible
    assert orphan.removeprefix("t/") not in lake.files("t")
    assert dt.transaction_version(app) == 1
    # it is garbage to vacuum
    garbage = dt.vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=True, full=True
    )
    assert any(g.endswith(orphan.removeprefix("t/")) for g in garbage)
    # the batch's retry commits it once
    finish(writer(lake, "t", app, 2, 2))
    assert lake.ids("t") == ids_of(range(1, 4))


@pytest.mark.s3
def test_no_credential_in_output_or_logs(s3_env: S3Server) -> None:
    """A writer logging everything at DEBUG (boto3's requests, delta-rs's commits, shoal's own
    lines) with the runtime's masking of the credentials in its environment: neither key in
    its output, its log, the table's history, describe() or an error. Control: without the
    masking, the DEBUG log does show the access key id (boto3 logs its signed requests)."""
    lake = s3_lake(s3_env)
    out, err = finish(writer(lake, "t", app_id("conn", "w"), 1, 2, "--log-debug"))
    assert "shoal.delta" in err  # it did log
    committer = DeltaCommitter(lake.store)
    text = "\n".join(
        [
            json.dumps(out),
            err,
            repr(committer),
            lake.store.describe(),
            str(lake.store.storage_options()),
        ]
    )
    table = lake.table("t")
    meta = repr((table.history(), table.metadata().configuration))
    for secret in lake.secrets:
        assert secret not in text
        assert secret not in meta
    # also when the commit fails: a bucket that does not exist
    bad = DeltaCommitter(open_store("s3://no-such-bucket-x/p"), retries=2, backoff_s=0.01)
    data = batch_table(1, 1, 0, None)
    with pytest.raises(DeltaCommitFailed, match="failed after 2 attempts") as info:
        bad.commit("t", [], data.schema, app="a", version=1)
    for secret in lake.secrets:
        assert secret not in str(info.value)
        assert secret not in repr(info.value.__cause__)
    # control: the same run unmasked
    _, unmasked = finish(writer(lake, "u", app_id("conn", "w"), 1, 1, "--log-unmasked"))
    assert lake.secrets[0] in unmasked


# --- readers ---------------------------------------------------------------------------------


def test_readers(lake: Lake) -> None:
    import duckdb
    import polars as pl

    committer = DeltaCommitter(lake.store)
    for batch in range(3):
        data = batch_table(batch, 4, 0, "price" if batch == 2 else None)
        f = write_data_file(lake.store, "t", data)
        committer.commit("t", [f], data.schema, app="a", version=batch + 1)
    uri, options = lake.store.uri_for("t"), lake.store.storage_options()
    expected = ids_of(range(3), rows=4)
    # deltalake
    assert lake.ids("t") == expected
    # polars
    frame = pl.read_delta(uri, storage_options=options)
    assert sorted(frame["id"].to_list()) == expected
    assert frame.filter(pl.col("price").is_not_null()).height == 4
    # DuckDB: its delta extension is downloaded at run time; where it cannot be, DuckDB reads
    # the table through the Arrow dataset delta-rs builds from the log (the same files)
    con = duckdb.connect()
    try:
        con.execute("LOAD delta")
        if lake.store.kind != "file":
            raise duckdb.Error("DuckDB's S3 needs httpfs too")
        rows = con.execute(f"SELECT id FROM delta_scan('{uri}')").fetchall()
    except duckdb.Error:
        dataset = DeltaTable(uri, storage_options=options).to_pyarrow_dataset()  # noqa: F841
        rows = con.execute("SELECT id FROM dataset").fetchall()
        # count(price), not "WHERE price IS NOT NULL": pyarrow's dataset (26) answers that filter
        # wrongly for files written before the column existed (it keeps their rows)
        priced = con.execute("SELECT count(price) FROM dataset").fetchall()
        assert priced == [(4,)]
    assert sorted(r[0] for r in rows) == expected
    if lake.store.kind == "file":  # the parquet files the log lists, read by DuckDB itself
        files = DeltaTable(uri).file_uris()
        listed = con.execute(
            "SELECT id FROM read_parquet($files, union_by_name = true)", {"files": files}
        ).fetchall()
        assert sorted(r[0] for r in listed) == expected
