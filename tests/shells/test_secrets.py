"""Secret values are masked wherever shoal writes text it did not compose itself: every log
line (text and JSON, whoever logged it) and error messages; and the configuration it shows hides
secret options and secret-looking Spark settings. Each check has its control: the same line
without the masking, or a non-secret value, shows as it is. And the file that carries local
Spark's settings instead of its command line is private, escaped and deleted."""

from __future__ import annotations

import io
import json
import logging
import os
import shlex
import stat
from pathlib import Path

import msgspec
import pytest

from actors.cli import config as options
from runtime import logs
from runtime.spark import session
from runtime.spark.session import SparkStartError

SECRET = 'pw"with\\quotes-SECRET'  # quotes and a backslash: escaped differently inside JSON


def _log_line(json_lines: bool, secrets: tuple[str, ...]) -> str:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("aiokafka").level)
    logs.configure("debug", json_lines=json_lines, stream=stream, secrets=secrets)
    try:
        logging.getLogger("aiokafka.conn").debug("auth with %s for user u", SECRET)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("aiokafka").setLevel(saved[2])
    return stream.getvalue()


def test_log_lines_mask_secrets_in_both_forms() -> None:
    for json_lines in (False, True):
        unmasked = _log_line(json_lines, ())
        if json_lines:
            assert json.loads(unmasked)["message"] == f"auth with {SECRET} for user u"
        else:
            assert SECRET in unmasked  # control: the line does carry it
        masked = _log_line(json_lines, (SECRET,))
        assert SECRET not in masked
        assert json.dumps(SECRET)[1:-1] not in masked
        assert "auth with *** for user u" in (
            json.loads(masked)["message"] if json_lines else masked
        )


def test_secret_values_and_redacted_config() -> None:
    config = options.load(
        {
            "kafka__bootstrap_servers": "k:9093",
            "kafka__security_protocol": "SASL_SSL",
            "kafka__sasl_mechanism": "PLAIN",
            "kafka__sasl_username": "u",
        },
        environ={"SHOAL_KAFKA_SASL_PASSWORD": "p1", "SHOAL_KAFKA_SSL_KEYFILE_PASSWORD": "p2"},
    )
    assert set(options.secret_values(config)) == {"p1", "p2"}
    with_conf = msgspec.structs.replace(
        config,
        spark=options.SparkOptions(
            conf={"spark.hadoop.fs.s3a.secret.key": "s3", "spark.executor.memory": "4g"}
        ),
    )
    assert set(options.secret_values(with_conf)) == {"p1", "p2", "s3"}
    shown = options.redacted(with_conf)
    assert shown["spark"]["conf"] == {
        "spark.hadoop.fs.s3a.secret.key": "***",
        "spark.executor.memory": "4g",
    }
    assert shown["kafka"]["sasl_password"] == shown["kafka"]["ssl_keyfile_password"] == "***"
    assert logs.mask("a p1 b p2 c", options.secret_values(config)) == "a *** b *** c"


def test_secret_settings_by_name_and_by_list() -> None:
    secret = [
        "spark.hadoop.fs.s3a.secret.key",
        "spark.hadoop.fs.s3a.access.key",
        "spark.hadoop.fs.s3a.bucket.b1.secret.key",
        "spark.hadoop.fs.s3a.session.token",
        "spark.hadoop.fs.azure.account.key.acct.dfs.core.windows.net",
        "spark.hadoop.fs.azure.sas.container.acct.blob.core.windows.net",
        "spark.hadoop.fs.azure.account.oauth2.client.secret",
        "spark.hadoop.fs.gs.auth.service.account.private.key",
        "spark.ssl.keyPassword",
        "spark.authenticate.secret",
        "spark.sql.catalog.lake.token",
        "spark.sql.catalog.lake.credential",
        "spark.sql.catalog.lake.s3.secret-access-key",
        "spark.hadoop.fs.wasb.accountKey",
    ]
    plain = [
        "spark.executor.memory",
        "spark.sql.shuffle.partitions",
        "spark.io.encryption.keySizeBits",  # "key" inside a word: a size, not a key
        "spark.ssl.keyStore",  # a path
        "spark.kerberos.keytab",
        "spark.hadoop.fs.myfs.auth",
    ]
    assert [k for k in secret if not options.secret_setting(k)] == []
    assert [k for k in plain if options.secret_setting(k)] == []
    # the user's list: names or glob patterns, case-insensitive
    extra = " spark.hadoop.fs.myfs.*.AUTH , spark.custom.thing"
    assert options.secret_setting("spark.hadoop.fs.myfs.tenant1.auth", extra)
    assert options.secret_setting("Spark.Custom.Thing", extra)
    assert not options.secret_setting("spark.hadoop.fs.myfs.auth", extra)
    assert not options.secret_setting("spark.executor.memory", extra)


def test_secret_conf_option_masks_listed_settings() -> None:
    conf = {"spark.hadoop.fs.myfs.tenant1.auth": "a1", "spark.executor.memory": "4g"}
    plain = msgspec.structs.replace(options.load({}), spark=options.SparkOptions(conf=conf))
    assert options.secret_values(plain) == ()  # control: not secret by its name
    listed = options.load({"spark__secret_conf": "spark.hadoop.fs.myfs.*.auth"})
    listed = msgspec.structs.replace(listed, spark=msgspec.structs.replace(listed.spark, conf=conf))
    assert options.secret_values(listed) == ("a1",)
    shown = options.redacted(listed)["spark"]["conf"]
    assert shown == {"spark.hadoop.fs.myfs.tenant1.auth": "***", "spark.executor.memory": "4g"}


def test_settings_file_is_private_escaped_and_deleted(tmp_path: Path) -> None:
    value = "a=b:c#d\\e f\né😀"
    with session.settings_file({"spark.x.secret": value, "k=1": "v"}, str(tmp_path)) as path:
        assert Path(path).parent == tmp_path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        text = Path(path).read_text(encoding="ascii")
        assert len(text.splitlines()) == 2  # one line per setting: the newline is escaped
        assert "spark.x.secret=a\\u003db\\u003ac\\u0023d\\u005ce\\u0020f\\u000a\\u00e9" in text
        assert "\\ud83d\\ude00" in text  # outside the BMP: two UTF-16 units
        assert "k\\u003d1=v" in text
    assert not Path(path).exists()
    with (
        pytest.raises(SparkStartError, match=r"spark\.x\.secret has white space"),
        session.settings_file({"spark.x.secret": "pw "}, str(tmp_path)),
    ):
        pass
    assert list(tmp_path.iterdir()) == []


def test_submit_args_name_the_file_and_are_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(session.SUBMIT_ARGS_ENV, raising=False)
    with session.submit_args("/run/x y.properties"):
        assert shlex.split(os.environ[session.SUBMIT_ARGS_ENV]) == [
            "--properties-file", "/run/x y.properties", "--load-spark-defaults", "pyspark-shell",
        ]  # fmt: skip
    assert session.SUBMIT_ARGS_ENV not in os.environ
    monkeypatch.setenv(session.SUBMIT_ARGS_ENV, "--driver-memory 2g pyspark-shell")
    with session.submit_args("/p"):
        assert os.environ[session.SUBMIT_ARGS_ENV] == (
            "--properties-file /p --load-spark-defaults --driver-memory 2g pyspark-shell"
        )
    assert os.environ[session.SUBMIT_ARGS_ENV] == "--driver-memory 2g pyspark-shell"
    monkeypatch.setenv(session.SUBMIT_ARGS_ENV, "--properties-file=/mine pyspark-shell")
    with (
        pytest.raises(SparkStartError, match="PYSPARK_SUBMIT_ARGS names a --properties-file"),
        session.submit_args("/p"),
    ):
        pass
    assert os.environ[session.SUBMIT_ARGS_ENV] == "--properties-file=/mine pyspark-shell"
