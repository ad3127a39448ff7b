"""The typed Spark write to an object store: ``write_staged_typed`` with an ``s3://`` staging
location against moto's S3 server on loopback. Spark's Python workers write the files and the
driver's commit writes the receipt through pyarrow's S3 file system; this process reads the
receipt back from the store and the files hold what ``typed_tables`` builds. Credentials are
moto's dummies, from the environment (and ``spark.executorEnv``, for Spark's workers)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runtime.spark.datasource import RECEIPT, filesystem, write_staged_typed
from runtime.spark.session import java_executable, start_session
from runtime.typed import typed_tables, wire_table
from tests.fixtures.typed_records import all_types_entries, comparable

pytestmark = [pytest.mark.spark, pytest.mark.slow]

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "shoal-test",
    "AWS_SECRET_ACCESS_KEY": "shoal-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[str, Any]]:
    """moto's S3 server on 127.0.0.1: its address and a boto3 client of it."""
    server_module = pytest.importorskip("moto.server", reason="needs moto[server]")
    boto3 = pytest.importorskip("boto3")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        client = boto3.client(
            "s3",
            endpoint_url=f"http://{host}:{port}",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )
        client.create_bucket(Bucket="lake")
        yield f"{host}:{port}", client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    if java_executable() is None:
        pytest.skip("local Spark needs Java (JAVA_HOME or java on PATH)")
    local_dir = tempfile.mkdtemp(prefix="shoal-spark-test-")
    mp = pytest.MonkeyPatch()
    for key, value in CREDENTIALS.items():
        mp.setenv(key, value)
    session = start_session(
        master="local[2]",
        remote=None,
        app_name="shoal-typed-s3",
        conf={
            "spark.ui.showConsoleProgress": "false",
            **{f"spark.executorEnv.{k}": v for k, v in CREDENTIALS.items()},
        },
        local_dir=local_dir,
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    mp.undo()
    shutil.rmtree(local_dir, ignore_errors=True)


@pytest.mark.timeout(300)
def test_executors_write_the_typed_files_to_s3(spark: Any, s3: tuple[str, Any]) -> None:
    endpoint, client = s3
    entries = all_types_entries(copies=20)
    wire, specs = wire_table(entries)
    uri = f"s3://lake/out/_staging/b1?endpoint_override={endpoint}&scheme=http"
    receipt = write_staged_typed(spark, wire, uri, specs)
    assert receipt.spark_jobs == 1
    assert receipt.rows == wire.num_rows
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="lake")["Contents"])
    assert keys == sorted(
        [*(f.path.removeprefix("lake/") for f in receipt.files), f"out/_staging/b1/{RECEIPT}"]
    )
    fs, _ = filesystem(uri)
    expected = typed_tables(entries)
    for name, table in expected.items():
        parts = [pq.read_table(f.path, filesystem=fs) for f in receipt.files if f.table == name]
        assert comparable(pa.concat_tables(parts)) == comparable(table), name
