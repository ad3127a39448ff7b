"""The command line against a real standalone Spark cluster (a master and two workers on
loopback, from the installed pyspark): a bounded run writes exactly the rows the stream produced
up to the instant it closed the stream, with Spark's executors (not a local driver) writing the
parquet files. What the output must hold comes from the seeded stream model alone
(``tests.helpers.stream_rows``), never from what the run reports."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.cluster import params, run_cli
from runtime.sim.stream import StreamModel
from runtime.spark.standalone import StandaloneCluster
from tests.helpers import assert_catches_a_double, assert_no_row_twice, stream_rows
from tests.integration.test_cli import _ids
from tests.parts import require_java

pytestmark = [
    pytest.mark.spark,
    pytest.mark.kafka,
    pytest.mark.slow,
]


@pytest.fixture(autouse=True)
def _java() -> None:
    require_java("a standalone Spark cluster")


@pytest.mark.timeout(600)
def test_bounded_run_on_a_standalone_cluster_writes_the_stream(tmp_path: Path) -> None:
    with StandaloneCluster(tmp_path / "cluster", workers=2) as cluster:
        status = cluster.statistics()
        assert status.alive_workers == 2
        assert status.cores == 2
        p = params(seed=11, start_ts=time.time_ns() // 1000)
        code, summary, tail = run_cli(cluster, p, 8.0, tmp_path, timeout_s=400)
        # the application ran on the cluster: its executors came from the workers
        executors = [d for w in (tmp_path / "cluster").glob("worker-*") for d in w.rglob("*/*")]
    assert code == 0, tail
    assert summary is not None, tail
    assert summary.caught_up, tail
    assert summary.stream_end is not None
    assert executors, "no worker started an executor: the run did not use the cluster"
    ids = _ids(tmp_path / "out" / "data")
    assert_no_row_twice(ids)
    assert_catches_a_double(assert_no_row_twice, ids)  # the check sees a doubled row
    expected = stream_rows(StreamModel(p), summary.stream_end).keys()
    assert expected, "the stream produced nothing: the check would prove nothing"
    assert set(ids) == expected
    assert summary.rows_written == len(expected)
