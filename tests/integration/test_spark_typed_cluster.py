"""On a standalone Spark cluster (a master and two workers on loopback, from the installed
pyspark) the typed changelog's files are written by the executors: every process that wrote a
file descends from a worker daemon (the daemons are this test's children), none is this process
(the driver's Python), the driver's JVM or a process the driver's JVM started; and
the bridge's default output, committed from those files, holds each change once."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from protocol.records import ColumnType, DataChange, Mod
from runtime.files.typed import read_table, table_dirs
from runtime.ports import SinkBatch
from runtime.spark import SparkBridge, SparkConfig
from runtime.spark.datasource import write_staged_typed
from runtime.spark.session import java_executable, start_session
from runtime.spark.standalone import StandaloneCluster
from runtime.typed import typed_tables, wire_table
from tests.fixtures.typed_records import comparable
from tests.helpers import REPO

pytestmark = [
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.skipif(
        java_executable() is None,
        reason="a standalone Spark cluster needs Java 17+ (JAVA_HOME or java on PATH)",
    ),
    pytest.mark.skipif(
        not Path("/proc/self/stat").exists(), reason="needs /proc to tell which process wrote"
    ),
]


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return int(stat.rpartition(")")[2].split()[1])  # the field after the state


def _ancestors(pid: int) -> list[int]:
    out = []
    current: int | None = pid
    while current not in (None, 0, 1):
        assert current is not None
        out.append(current)
        current = _parent(current)
    return out


def _records(tables: int, rows: int) -> list[DataChange]:
    key = ColumnType("Id", '{"code":"INT64"}', True, 1)
    value = ColumnType("Amount", '{"code":"NUMERIC"}', False, 2)
    return [
        DataChange(
            1000 + i,
            "0",
            f"tx{i}",
            True,
            f"T{i % tables:02d}",
            (key, value),
            (Mod(f'{{"Id":"{i}"}}', '{"Amount":"1.25"}', "{}"),),
            "INSERT",
        )
        for i in range(rows)
    ]


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_executors_write_the_typed_files(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), *paths]))
    with StandaloneCluster(tmp_path / "cluster", workers=2) as cluster:
        workers = {pid for name, pid in cluster.pids().items() if name.startswith("worker-")}
        assert len(workers) == 2
        spark = start_session(
            master=cluster.master_url,
            remote=None,
            app_name="shoal-typed-cluster",
            conf={
                "spark.executor.memory": "512m",
                "spark.executorEnv.PYTHONPATH": str(REPO),
                "spark.ui.showConsoleProgress": "false",
            },
            local_dir=str(tmp_path / "local"),
        )
        try:
            spark.sparkContext.setLogLevel("ERROR")
            records = _records(12, 4_000)
            wire, specs = wire_table([("p", records)])
            receipt = write_staged_typed(spark, wire, str(tmp_path / "stage"), specs)
            writers = {(t.pid, t.host) for t in receipt.tasks}
            lineage = {t.pid: _ancestors(t.pid) for t in receipt.tasks}
            driver_jvm = _driver_jvm(spark)
            out = tmp_path / "data"
            config = SparkConfig(
                master=cluster.master_url, output_dir=str(out), max_rows=10_000, max_age_s=0.05
            )
            async with SparkBridge(config, spark=spark) as bridge:
                half = len(records) // 2
                await asyncio.wait_for(
                    await bridge.put(SinkBatch("p", tuple(records[:half]), 1000 + half)), 300
                )
                await asyncio.wait_for(
                    await bridge.put(SinkBatch("p", tuple(records[half:]), 9000)), 300
                )
                assert bridge.typed_write_jobs == bridge.typed_writes >= 1
        finally:
            spark.stop()
    assert receipt.spark_jobs == 1
    assert receipt.rows == 4_000
    assert len(receipt.tasks) == 2  # the cluster's two cores
    for pid, host in writers:
        assert pid != os.getpid()
        assert pid != driver_jvm
        assert host
        chain = lineage[pid]
        assert chain, f"process {pid} that wrote a file was gone before it was looked at"
        assert driver_jvm not in chain  # not the driver's own Python workers
        assert workers & set(chain), f"{pid} (ancestry {chain}) is not under a worker {workers}"
    # the control: the driver's processes are not under a worker
    assert not workers & set(_ancestors(driver_jvm))
    expected = typed_tables([("p", records)])
    assert [p.name for p in table_dirs(out)] == sorted(expected)
    for name, table in expected.items():
        got = read_table(out, name).drop_columns(["batch"]).sort_by("_commit_ts")
        assert comparable(got) == comparable(table.sort_by("_commit_ts")), name
    shutil.rmtree(tmp_path / "cluster", ignore_errors=True)


def _driver_jvm(spark: Any) -> int:
    """The process id of the driver's JVM (a child of this process)."""
    name = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    return int(name.getName().split("@")[0])
