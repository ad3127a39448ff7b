"""The command line against a real standalone Spark cluster (a master and two workers on
loopback, from the installed pyspark) that loses its master and then its executors: the run
stops naming Spark in a bounded time, and what it wrote is part of the stream, once; no secret
Spark setting is on any process's command line meanwhile. (A module apart from
test_spark_cluster.py so that the test runs spread the two over workers.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cluster import REPO, params, sim_args
from runtime.sim.stream import StreamModel
from runtime.spark.standalone import StandaloneCluster
from tests.helpers import (
    assert_catches_a_double,
    assert_no_row_twice,
    command_lines,
    ps_lines,
    stream_rows,
    wait_until,
)
from tests.integration.test_cli import _ids
from tests.parts import require_java

pytestmark = [
    pytest.mark.spark,
    pytest.mark.kafka,
    pytest.mark.slow,
]

CLUSTER_SECRET = "cluster-s3a-secret-Jq4-SECRET"


@pytest.fixture(autouse=True)
def _java() -> None:
    require_java("a standalone Spark cluster")


def _committed_batches(out: Path) -> int:
    """Micro-batches committed into the generic layout (``table=<t>/batch=<id>``)."""
    return len({p.parent.name for p in out.glob("table=*/batch=*/*.parquet")})


@pytest.mark.timeout(600)
def test_a_cluster_that_loses_its_master_and_executors_stops_the_run_naming_spark(
    tmp_path: Path,
) -> None:
    """The master is killed under a run: running jobs go on on the executors the application
    has. Then the workers (and with them the executors) are killed: no job can run any more.
    The micro-batch in flight runs past ``--spark-job-timeout-s``, is cancelled, the new
    session cannot register with the missing master, and the run stops with exit 1 and one line
    naming Spark and the cause, in a bounded time (docs/operations.md, "When the parts around
    shoal fail"). What was written is part of the stream, once.

    While the executors run, a secret Spark setting of the run is on no process's command line
    (the driver's, the daemons', the executors' the workers started): only the driver got it,
    in a file, and executors get it from the driver."""
    out = tmp_path / "out"
    p = params(seed=13, start_ts=time.time_ns() // 1000)
    with StandaloneCluster(tmp_path / "cluster", workers=2) as cluster:
        config = tmp_path / "shoal.toml"
        config.write_text(
            '[spark.conf]\n"spark.executor.memory" = "512m"\n'
            f'"spark.hadoop.fs.s3a.secret.key" = "{CLUSTER_SECRET}"\n'
        )
        env = {k: v for k, v in cluster.env().items() if not k.startswith("SHOAL_")}
        env["PYTHONPATH"] = str(REPO)
        args = [
            *(sys.executable, "-m", "actors.runtime", "--config", str(config)),
            *("--spark-master", cluster.master_url, "--output-layout", "generic"),
            *("--spark-job-timeout-s", "20", "--spark-restarts", "1"),
            *sim_args(p),
            *("--output-dir", str(out)),
        ]
        with (tmp_path / "run.err").open("wb") as log:
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_until(
                lambda: _committed_batches(out / "data") > 0 or proc.poll() is not None,
                300,
                "a first committed micro-batch",
            )
            assert proc.poll() is None, (tmp_path / "run.err").read_text()[-3000:]
            running = command_lines().values()
            executors = [line for line in running if "CoarseGrainedExecutorBackend" in line]
            assert executors, "no executor runs: the scan would prove nothing"
            assert not [line for line in running if CLUSTER_SECRET in line]
            assert not [line for line in ps_lines() if CLUSTER_SECRET in line]
            cluster.kill(master=True)
            before = _committed_batches(out / "data")
            wait_until(
                lambda: _committed_batches(out / "data") > before or proc.poll() is not None,
                60,
                "a micro-batch committed after the master was lost",
            )
            assert proc.poll() is None, (tmp_path / "run.err").read_text()[-3000:]
            cluster.kill(workers=True)
            killed = time.monotonic()
            try:
                code = proc.wait(400)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    "the run did not stop: " + (tmp_path / "run.err").read_text()[-3000:]
                ) from None
            took = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = (tmp_path / "run.err").read_text()
    assert code == 1, err[-3000:]
    assert CLUSTER_SECRET not in err
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(
        f"shoal: error: Spark ({cluster.master_url}): a Spark job ran past "
        "spark.job_timeout_s (20s) and was cancelled"
    ), lines[0]
    # the job timeout, its cancel, Spark's registration retries of the new session (3 x 20 s)
    assert took < 20 + 30 + 120, f"took {took:.0f}s to stop after the executors were lost"
    ids = _ids(out / "data")
    assert ids, "nothing was written: the check would prove nothing"
    assert_no_row_twice(ids)
    assert_catches_a_double(assert_no_row_twice, ids)  # the check sees a doubled row
    assert set(ids) <= stream_rows(StreamModel(p), time.time_ns() // 1000).keys()
