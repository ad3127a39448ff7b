"""The output store port (runtime/lake/store.py) on a local directory and on moto's S3 server:
URIs, atomic writes, create-if-absent, listing, the start-up check naming the option, and no
credential in anything it shows."""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from runtime.lake.store import Store, StoreError, StoreUnsupported, open_store
from tests.fixtures.s3 import S3Server, s3_env, s3_server

__all__ = ["s3_env", "s3_server"]  # fixtures used by name


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "file":
        return open_store(tmp_path / "out")
    server: S3Server = request.getfixturevalue("s3_env")
    return open_store(server.uri(f"t-{uuid.uuid4().hex[:8]}/out"))


# --- URIs (no I/O) ---------------------------------------------------------------------------


def test_uris_name_kind_base_and_uri(tmp_path: Path) -> None:
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "eu-west-1"}
    local = open_store(tmp_path / "a" / ".." / "b", env=env)
    assert (local.kind, local.base, local.uri) == (
        "file",
        str(tmp_path / "b"),
        f"file://{tmp_path}/b",
    )
    assert open_store(f"file://{tmp_path}/b", env=env) == local
    s3 = open_store("s3://bucket/some/prefix/", env=env)
    assert (s3.kind, s3.base, s3.uri) == ("s3", "bucket/some/prefix", "s3://bucket/some/prefix")
    assert open_store("s3a://bucket/some/prefix", env=env) == s3
    assert s3.uri_for("t1") == "s3://bucket/some/prefix/t1"
    assert s3.child("t1").uri == "s3://bucket/some/prefix/t1"
    assert s3.storage_options() == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "eu-west-1",
    }
    assert open_store("s3://bucket", env={}).storage_options() == {}
    # AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL, as in the AWS SDKs
    env_s3 = {**env, "AWS_ENDPOINT_URL_S3": "https://s3.example:443"}
    assert open_store("s3://bucket/p", env=env_s3).endpoint == "https://s3.example:443"
    gs = open_store("gs://bucket/p", env=env)
    assert (gs.kind, gs.uri, gs.storage_options()) == ("gs", "gs://bucket/p", {})
    assert not s3.can_rename
    assert local.can_rename


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("", "is empty"),
        ("hdfs://nn/x", "scheme 'hdfs' is not supported"),
        ("s3://", "no bucket"),
        ("s3://bucket/x?endpoint_override=h", "query parameters are not supported"),
        ("file://host/x", "names no host"),
        ("s3://bucket/a/../b", "'.' and '..'"),
    ],
)
def test_bad_uris_name_the_option(uri: str, says: str) -> None:
    with pytest.raises(StoreError, match=r"^output\.where") as info:
        open_store(uri, option="output.where", env={})
    assert says in str(info.value)


def test_credentials_in_the_uri_are_refused_without_repeating_them() -> None:
    with pytest.raises(StoreError, match="credential chain") as info:
        open_store("s3://AKIDEXAMPLE:hunter2secret@bucket/x", env={})
    assert "hunter2secret" not in str(info.value)
    assert "AKIDEXAMPLE" not in str(info.value)


def test_bad_endpoint_is_refused() -> None:
    with pytest.raises(StoreError, match="AWS_ENDPOINT_URL"):
        open_store("s3://bucket/x", env={"AWS_ENDPOINT_URL": "127.0.0.1:9000"})


# --- operations ------------------------------------------------------------------------------


def test_operations(store: Store) -> None:
    store.check()
    assert store.read_bytes("a/x.json") is None
    assert not store.exists("a/x.json")
    store.write_bytes("a/x.json", b"one")
    store.write_bytes("a/x.json", b"two")  # replaces whole
    assert store.read_bytes("a/x.json") == b"two"
    assert store.exists("a/x.json")
    store.write_bytes("a/b/y.json", b"y")
    store.write_bytes("c/z.json", b"zz")
    assert [(e.path, e.size) for e in store.list_files()] == [
        ("a/b/y.json", 1),
        ("a/x.json", 3),
        ("c/z.json", 2),
    ]
    assert all(e.mtime is not None for e in store.list_files())
    assert [e.path for e in store.list_files("a", recursive=False)] == ["a/x.json"]
    assert store.list_files("nothing/here") == []
    assert [d for d in store.list_dirs() if not d.startswith("_")] == ["a", "c"]
    # the probe object of check() is gone again
    assert not store.list_files("_shoal")
    # create if absent
    assert store.supports_create_if_absent
    assert store.create_if_absent("locks/one", b"first")
    assert not store.create_if_absent("locks/one", b"second")
    assert store.read_bytes("locks/one") == b"first"
    assert store.probe_conditional_put() is True
    # no temporary files left by the atomic writes
    assert not [e.path for e in store.list_files() if e.path.rsplit("/", 1)[-1].startswith(".")]
    # parquet through an output stream
    table = pa.table({"k": [1, 2, 3]})
    with store.open_output_stream("t/part-0.parquet") as sink:
        pq.write_table(table, sink)
    with store.open_input_file("t/part-0.parquet") as source:
        assert pq.read_table(source).equals(table)
    # delete
    store.delete("a/x.json")
    store.delete("a/x.json")  # missing: nothing
    assert not store.exists("a/x.json")
    store.write_bytes("ab/k.json", b"k")  # a sibling whose name starts the same
    store.delete_tree("a")
    store.delete_tree("a")
    assert [e.path for e in store.list_files()] == [
        "ab/k.json",
        "c/z.json",
        "locks/one",
        "t/part-0.parquet",
    ]
    # a pickled store (what a Spark executor gets) works and carries no credential
    again = pickle.loads(pickle.dumps(store))
    assert again == store
    assert again.read_bytes("c/z.json") == b"zz"


@pytest.mark.s3
def test_s3_operations_cost_one_request_each(s3_env: S3Server) -> None:
    """What a commit does on S3, in requests (counted by moto's server): reading, writing and
    deleting a small object are one request each, emptying a directory a listing and one
    batch delete, and the typed write's file system writes a small data file with one PUT.
    Control: pyarrow's own file system needs two to read and three to delete or to write
    through a multipart upload."""
    from runtime.spark.datasource import filesystem

    store = open_store(s3_env.uri(f"cost-{uuid.uuid4().hex[:8]}"))

    def cost(action: Callable[[], object]) -> list[str]:
        since = s3_env.log_offset()
        action()
        return [r.method for r in s3_env.requests(since)]

    assert cost(lambda: store.write_bytes("d/x.json", b"x")) == ["PUT"]
    store.write_bytes("d/y.json", b"y")
    assert cost(lambda: store.read_bytes("d/x.json")) == ["GET"]
    assert cost(lambda: store.read_bytes("d/missing.json")) == ["GET"]
    assert cost(lambda: store.delete("d/x.json")) == ["DELETE"]
    assert store.read_bytes("d/x.json") is None
    store.write_bytes("d/e/z.json", b"z")
    assert cost(lambda: store.delete_tree("d")) == ["GET", "POST"]  # list, delete both
    assert store.list_files() == []
    fs, base = filesystem(store.uri_for("data"))

    def put() -> None:
        with fs.open_output_stream(f"{base}/part-0.parquet") as out:
            out.write(b"p" * 1000)

    assert cost(put) == ["PUT"]
    # control: pyarrow's file system without the delayed open, and its read and delete
    plain, path = pafs.FileSystem.from_uri(store.uri_for("plain"))

    def plain_put() -> None:
        with plain.open_output_stream(f"{path}/f") as out:
            out.write(b"p")

    def plain_read() -> None:
        with plain.open_input_stream(f"{path}/f") as f:
            f.read()

    assert cost(plain_put) == ["POST", "PUT", "POST"]
    assert cost(plain_read) == ["HEAD", "GET"]
    assert cost(lambda: plain.delete_file(f"{path}/f")) == ["HEAD", "DELETE", "PUT"]


def test_rename_only_where_atomic(store: Store) -> None:
    store.write_bytes("s/one", b"1")
    if store.can_rename:
        store.rename("s", "final/s")
        assert store.read_bytes("final/s/one") == b"1"
    else:
        with pytest.raises(StoreUnsupported, match="cannot rename"):
            store.rename("s", "final/s")


def test_local_check_names_the_option(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError, match=r"^run\.output_dir .*cannot write"):
        open_store(tmp_path / "file" / "below").check()


@pytest.mark.s3
def test_missing_bucket_is_found_at_check(s3_env: S3Server) -> None:
    store = open_store("s3://no-such-bucket-here/prefix", option="run.output_dir")
    with pytest.raises(StoreError, match=r"^run\.output_dir \(s3://no-such-bucket-here") as info:
        store.check()
    assert "cannot write" in str(info.value)
    for secret in s3_env.secrets:
        assert secret not in str(info.value)


@pytest.mark.s3
def test_wrong_credentials_are_found_at_check(
    s3_env: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto accepts any credentials unless its authentication is switched on (then it knows
    no key of ours): the refusal is found at check, and the message shows neither key."""
    import urllib.request

    def authenticate(after: bytes) -> None:  # moto: authenticate requests after this many
        req = urllib.request.Request(
            s3_env.endpoint + "/moto-api/reset-auth",
            data=after,
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(req, timeout=10):
            pass

    authenticate(b"0")
    try:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + s3_env.secrets[1])
        store = open_store(s3_env.uri("x"))
        with pytest.raises(StoreError, match=r"^run\.output_dir") as info:
            store.check()
        text = str(info.value)
        assert s3_env.secrets[1] not in text
        assert s3_env.secrets[0] not in text
    finally:
        authenticate(b"inf")


@pytest.mark.s3
def test_unreachable_server_is_found_at_check(
    s3_env: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(StoreError, match=r"^run\.output_dir .*cannot write"):
        open_store(s3_env.uri("x")).check()


@pytest.mark.s3
def test_nothing_shown_holds_a_credential(s3_env: S3Server) -> None:
    store = open_store(s3_env.uri("p"))
    shown = [
        store.describe(),
        repr(store),
        str(store.storage_options()),
        pickle.dumps(store).decode("latin-1"),
    ]
    for secret in s3_env.secrets:
        assert all(secret not in text for text in shown)
    assert "endpoint http://127.0.0.1" in store.describe()
    assert "credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY" in store.describe()
    assert set(s3_env.secrets) <= set(Store.secret_values())
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == s3_env.secrets[1]
