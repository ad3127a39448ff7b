"""The Spark sink writing Delta tables into an object store (``--sink spark --table-format
delta --output-dir s3://...``), on real parts: local PySpark and moto's S3 server on loopback,
one of each for the module.

* The bridge: each micro-batch is one Spark job whose executors write every table's data files
  straight into the Delta tables' directories, then one Delta commit per table (the micro-batch
  as an application transaction, the completeness watermark in the commit info); a column new
  in a later micro-batch merges into the table; a fenced micro-batch is refused at its commit
  point and its data files deleted.
* The default table format (parquet) on the object store: staged by the executors in the
  store, copied into place by the committer.
* A process SIGKILLed between a micro-batch's data files and its commit leaves nothing of it
  visible (its files are in the tables' directories, in no Delta log); the restart resumes from
  the progress kept in the store (the committed micro-batch handed in again is dropped) and
  commits the other exactly once.
* The command line end to end: a bounded run exits by itself with every row of its window in
  the Delta tables exactly once, read back with delta-rs (the check has its control), and no
  credential in anything it printed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import boto3
import msgspec
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from bench.procs import tree
from runtime.files.commit import Committer
from runtime.files.typed import output_identities
from runtime.lake.store import open_store
from runtime.ports import SinkBatch
from runtime.spark import BridgeError, SparkBridge, SparkConfig
from runtime.spark.session import start_session
from tests.fixtures.s3 import S3Server, s3_server
from tests.helpers import REPO, assert_catches_a_double
from tests.integration.test_cli_bounds import SIM, _exactly, _expected, _rfc3339, _window
from tests.integration.test_lake_cli import _cli, _committed_batches
from tests.integration.test_lake_cli import _rows as _cli_rows
from tests.parts import require_java
from tests.proc_spark_delta import TOKEN, config, micro_batches

__all__ = ["s3_server"]

pytestmark = [pytest.mark.spark, pytest.mark.s3, pytest.mark.slow]

TABLES = ("T0", "T1", "T2")


@pytest.fixture(scope="module")
def spark(s3_server: S3Server) -> Iterator[Any]:
    """Local Spark with the S3 server's environment, in this process (the bridge's store and
    delta-rs) and in Spark's Python workers (``spark.executorEnv``: a JVM an earlier module
    started keeps the environment it started with)."""
    require_java()
    mp = pytest.MonkeyPatch()
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        mp.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        mp.setenv(name, value)
    local_dir = tempfile.mkdtemp(prefix="shoal-spark-test-")
    session = start_session(
        master="local[2]",
        remote=None,
        app_name="shoal-spark-delta",
        conf={
            "spark.ui.showConsoleProgress": "false",
            **{f"spark.executorEnv.{k}": v for k, v in s3_server.env.items()},
        },
        local_dir=local_dir,
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    mp.undo()
    shutil.rmtree(local_dir, ignore_errors=True)


def _table(uri: str, name: str) -> DeltaTable:
    store = open_store(uri)
    return DeltaTable(store.uri_for(name), storage_options=store.storage_options())


def _ids(uri: str) -> list[str]:
    """Every committed row of the tables, as ``<table>/<commit ts>/<transaction>/<sequence>``
    (duplicates kept)."""
    out = []
    for name in TABLES:
        store = open_store(uri)
        if not DeltaTable.is_deltatable(store.uri_for(name), store.storage_options()):
            continue
        data = _table(uri, name).to_pyarrow_table(
            columns=["_commit_ts", "_server_transaction_id", "_record_sequence"]
        )
        ts = data.column("_commit_ts").cast("int64").to_pylist()
        txn = data.column("_server_transaction_id").to_pylist()
        seq = data.column("_record_sequence").to_pylist()
        out += [f"{name}/{a}/{b}/{c}" for a, b, c in zip(ts, txn, seq, strict=True)]
    return sorted(out)


def _expected_ids(batches: Sequence[SinkBatch]) -> list[str]:
    return sorted(
        f"{r.table}/{r.commit_ts}/{r.server_transaction_id}/{r.record_sequence}"
        for b in batches
        for r in b.records
    )


def _exactly_once(expected: list[str]) -> Any:
    def check(rows: list[str]) -> None:
        assert sorted(rows) == expected, (
            f"{len(rows)} rows, {len(expected)} expected; twice: "
            f"{[r for r, n in collections.Counter(rows).items() if n > 1][:3]}"
        )

    return check


def _data_files(uri: str, name: str) -> set[str]:
    """The parquet files in table ``name``'s directory, committed or not."""
    store = open_store(uri)
    return {
        e.path.rsplit("/", 1)[-1]
        for e in store.list_files(name, recursive=False)
        if e.path.endswith(".parquet")
    }


def _committed_files(uri: str, name: str) -> set[str]:
    return {u.rsplit("/", 1)[-1] for u in _table(uri, name).file_uris()}


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_each_micro_batch_is_one_job_and_one_delta_commit_per_table(
    spark: Any, s3_server: S3Server
) -> None:
    uri = s3_server.uri("bridge/data")
    first, second = micro_batches()
    async with SparkBridge(config(uri), spark=spark, mark=lambda: 1_750) as bridge:
        assert bridge.layout == "typed"
        assert bridge.committer is not None
        assert not bridge.committer.store.is_local
        app = bridge.committer.app_id
        await (await bridge.put(first))
        await (await bridge.put(second))
        assert bridge.typed_writes == 2
        assert bridge.typed_write_jobs == 2  # one Spark job per micro-batch, three tables each
        position = await bridge.durable_position(TOKEN)
    assert position is not None
    assert position.ts == second.watermark
    check = _exactly_once(_expected_ids([first, second]))
    check(_ids(uri))
    assert_catches_a_double(check, _ids(uri))
    for name in TABLES:
        table = _table(uri, name)
        assert table.transaction_version(app) == 2  # micro-batch 2's application transaction
        info = table.history(1)[0]
        assert (info["shoal.app_id"], info["shoal.txn_version"]) == (app, 2)
        assert info["shoal.low_watermark_us"] == 1_750
        assert _data_files(uri, name) == _committed_files(uri, name)  # nothing left over
        adds = pa.table(table.get_add_actions(flatten=True))  # the executors' statistics
        assert sum(adds.column("num_records").to_pylist()) == 20
        assert None not in adds.column("min._commit_ts").to_pylist()
    t0 = _table(uri, "T0").to_pyarrow_table(columns=["_commit_ts", "Note"])
    stamps = t0.column("_commit_ts").cast("int64").to_pylist()
    notes = dict(zip(stamps, t0.column("Note").to_pylist(), strict=True))
    assert notes == {
        r.commit_ts: (f"n{r.commit_ts}" if r.commit_ts >= 2_000 else None)
        for b in (first, second)
        for r in b.records
        if r.table == "T0"
    }  # the new column merged; older rows hold null
    assert "Note" not in _table(uri, "T1").schema().to_arrow().names


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_the_streaming_path_commits_delta_tables_on_s3(
    spark: Any, s3_server: S3Server, tmp_path: Path
) -> None:
    """``path="streaming"``: the streaming query's executors write the Delta data files into
    the store, the bridge commits each micro-batch once (one Delta commit per table, the
    completeness watermark in it); the spool and Spark's checkpoint are local."""
    uri = s3_server.uri("streaming/data")
    first, second = micro_batches()
    settings = msgspec.structs.asdict(config(uri))
    settings.update(
        path="streaming",
        spool_dir=str(tmp_path / "spool"),
        checkpoint_dir=str(tmp_path / "checkpoint"),
        trigger_interval_s=0.2,
        ack_poll_s=0.05,
    )
    async with SparkBridge(SparkConfig(**settings), spark=spark, mark=lambda: 1_750) as bridge:
        assert bridge.layout == "typed"
        assert bridge.committer is not None
        app = bridge.committer.app_id
        await (await bridge.put(first))
        await (await bridge.put(second))
        position = await bridge.durable_position(TOKEN)
    assert position is not None
    assert position.ts == second.watermark
    check = _exactly_once(_expected_ids([first, second]))
    check(_ids(uri))
    assert_catches_a_double(check, _ids(uri))
    for name in TABLES:
        table = _table(uri, name)
        assert table.transaction_version(app) == 2
        assert table.history(1)[0]["shoal.low_watermark_us"] == 1_750
        assert _data_files(uri, name) == _committed_files(uri, name)  # nothing left over


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_a_fenced_micro_batch_is_refused_and_its_data_files_deleted(
    spark: Any, s3_server: S3Server
) -> None:
    """A batch its reader fenced before the commit point: the executors wrote its files, the
    committer refuses it and deletes them; nothing of it is visible."""
    uri = s3_server.uri("fence/data")
    _, second = micro_batches()
    held = msgspec.structs.replace(config(uri), max_age_s=600.0)  # cut only at the close
    async with SparkBridge(held, spark=spark) as bridge:
        future = await bridge.put(second)
        assert await bridge.fence([second]) == [False]  # held: not past its commit point
    with pytest.raises(BridgeError, match="fenced"):
        await future
    assert bridge.typed_writes == 1  # the executors wrote its files...
    assert bridge.stats().fenced_refused == 1
    assert all(not _data_files(uri, name) for name in TABLES)  # ...and they were deleted
    assert _ids(uri) == []


@pytest.mark.asyncio
@pytest.mark.timeout(300)
@pytest.mark.parametrize("first_commits", [True, False], ids=["committed", "refused"])
async def test_the_next_micro_batch_is_written_while_one_commits_and_waits_for_it(
    spark: Any, s3_server: S3Server, first_commits: bool
) -> None:
    """Pipelined micro-batches: Spark writes micro-batch 2 while micro-batch 1 is still before
    its commit (the committer holds 1 until 2's files are written), and 2 is committed only
    after 1. If 1 is refused at its commit point, 2 commits nothing either: its data files,
    already written, are deleted and its batch fails to be re-read."""
    uri = s3_server.uri(f"pipelined-{first_commits}/data")
    first, second = micro_batches()
    each = msgspec.structs.replace(config(uri), max_rows=len(first.records))  # a cut per put
    async with SparkBridge(each, spark=spark) as bridge:
        committer = bridge.committer
        assert committer is not None
        real = committer.commit
        seen: list[tuple[str, int]] = []  # (batch identity, Spark writes done) per commit

        def commit(batch: str, *args: Any, **kwargs: Any) -> Any:
            if not seen:  # micro-batch 1: hold it until micro-batch 2 is written
                for _ in range(1200):
                    if bridge.typed_writes >= 2:
                        break
                    time.sleep(0.05)
            seen.append((batch, bridge.typed_writes))
            if not first_commits:
                committer.permit = lambda: False  # the lease ran out: refused, files dropped
            return real(batch, *args, **kwargs)

        committer.commit = commit  # type: ignore[method-assign]
        one = await bridge.put(first)
        two = await bridge.put(second)
        outcomes = await asyncio.gather(one, two, return_exceptions=True)
    assert bridge.typed_writes == 2  # both written by Spark (one job each)...
    assert seen[0][1] == 2  # ...the second while the first had not committed yet
    if first_commits:
        assert list(outcomes) == [None, None]
        assert len(seen) == 2  # in order: 1, then 2
        check = _exactly_once(_expected_ids([first, second]))
        check(_ids(uri))
        assert_catches_a_double(check, _ids(uri))
        for name in TABLES:
            assert _data_files(uri, name) == _committed_files(uri, name)
        return
    assert isinstance(outcomes[0], BridgeError)
    assert "lease ran out" in str(outcomes[0])
    assert bridge.committer is not None
    assert bridge.committer.fenced_refused == 0  # refused by the lease, not by a fence
    assert isinstance(outcomes[1], BridgeError)
    assert "earlier micro-batch failed" in str(outcomes[1])
    assert len(seen) == 1  # micro-batch 2 never reached the committer
    assert _ids(uri) == []
    assert all(not _data_files(uri, name) for name in TABLES)  # 2's files were deleted too


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    below = list(tree(proc.pid))
    proc.send_signal(signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):  # it ended with its parent
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_parquet_tables_on_s3_are_committed_by_copy(spark: Any, s3_server: S3Server) -> None:
    """The default table format on an object store: staged by the executors in the store,
    copied into ``<table>/batch=<id>/`` by the committer; nothing left staged."""
    uri = s3_server.uri("parquet/data")
    first, _ = micro_batches()
    settings = msgspec.structs.replace(config(uri), table_format="parquet")
    async with SparkBridge(settings, spark=spark) as bridge:
        assert bridge.layout == "typed"
        assert bridge.committer is not None
        await (await bridge.put(first))
    expected = {(r.commit_ts, r.server_transaction_id, r.record_sequence) for r in first.records}
    assert output_identities(uri) == expected
    store = open_store(uri)
    assert [e.path for e in store.list_files("_staging")] == []
    assert {d for d in store.list_dirs() if not d.startswith("_")} == set(TABLES)
    for name in TABLES:
        (batch,) = store.list_dirs(name)  # one micro-batch: one batch=<identity> per table
        assert batch.startswith("batch=b")


def _killed_before_commit(uri: str, s3: S3Server, tmp_path: Path) -> dict[str, Any]:
    """Run ``tests.proc_spark_delta`` until its second micro-batch's data files are written and
    SIGKILL it (and its JVM) there; what it said it wrote."""
    env = {k: v for k, v in s3.child_env().items() if not k.startswith("SHOAL_")}
    env.update(PYTHONPATH=str(REPO), PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    err = tmp_path / "proc.err"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.proc_spark_delta", uri],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            event: dict[str, Any] = json.loads(line)
            if "staged" in event:
                return event
    finally:
        _kill_tree(proc)
        proc.stdout.close()
    raise AssertionError(f"the writer ended before its second commit: {err.read_text()[-3000:]}")


@pytest.mark.asyncio
@pytest.mark.timeout(400)
async def test_sigkill_between_data_files_and_commit_leaves_nothing_visible(
    spark: Any, s3_server: S3Server, tmp_path: Path
) -> None:
    uri = s3_server.uri("kill/data")
    staged = await asyncio.to_thread(_killed_before_commit, uri, s3_server, tmp_path)
    first, second = micro_batches()
    orphans = {f.split("/")[0]: f.split("/")[1] for f in staged["files"]}
    assert set(orphans) == set(TABLES)  # the executors wrote every table's file of batch 2
    for name, file in orphans.items():
        assert file in _data_files(uri, name)  # there, in the table's directory...
        assert file not in _committed_files(uri, name)  # ...and in no Delta log
    check = _exactly_once(_expected_ids([first]))
    check(_ids(uri))  # nothing of the killed micro-batch is visible
    assert_catches_a_double(check, _ids(uri))
    committer = Committer(uri)  # the object store's committer, as the next process opens it
    assert committer.recover() == 0  # no manifest: it died before the commit point
    recorded = committer.committed(TOKEN)
    assert recorded is not None
    assert recorded.ts == first.watermark

    # the restart: a reader re-sends from its partition's start; batch 1 is dropped by the
    # progress in the store, batch 2 committed once
    async with SparkBridge(config(uri), spark=spark) as again:
        position = await again.durable_position(TOKEN)
        assert position is not None
        assert position.ts == first.watermark
        for batch in (first, second):
            await (await again.put(batch))
        assert again.stats().rows_deduplicated == len(first.records)
    _exactly_once(_expected_ids([first, second]))(_ids(uri))
    for name, file in orphans.items():
        assert file not in _committed_files(uri, name)  # the orphans stay invisible


@pytest.mark.kafka
@pytest.mark.timeout(400)
def test_cli_spark_sink_writes_delta_on_s3_exactly_once(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """``--sink spark --table-format delta --output-dir s3://...`` end to end: a bounded run
    ends by itself, every row of its window in the Delta tables once, the completeness mark in
    the store and in the commits, no credential in its output."""
    s3 = s3_server
    start, end = _window(ago_s=60, length_s=20)
    output = s3.uri("cli")
    args = [
        *SIM,
        *("--sink", "spark", "--table-format", "delta", "--progress", "off"),
        *("--output-dir", output, "--start-at", _rfc3339(start), "--end-at", _rfc3339(end)),
        *("--sim-start-ts", str(start)),
    ]
    log = tmp_path / "run.log"
    run = _cli(args, s3, log)
    assert run.wait(timeout=360) == 0, log.read_text()[-5000:]
    counts = _cli_rows(s3, f"{output}/data")
    check = _exactly(_expected(start, end))
    check(list(counts.elements()))
    assert_catches_a_double(check, list(counts.elements()))
    assert _committed_batches(s3, "cli/data/Albums/_delta_log/") >= 1
    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=s3.secrets[0],
        aws_secret_access_key=s3.secrets[1],
        region_name=s3.env["AWS_REGION"],
    )
    body = client.get_object(Bucket=s3.bucket, Key="cli/data/_shoal/shoal/completeness.json")
    assert json.loads(body["Body"].read())["low_watermark_us"] >= end
    store = open_store(f"{output}/data")
    history = DeltaTable(store.uri_for("Albums"), storage_options=store.storage_options())
    assert "shoal.low_watermark_us" in history.history(1)[0]
    text = log.read_text()
    for secret in s3.secrets:
        assert secret not in text
