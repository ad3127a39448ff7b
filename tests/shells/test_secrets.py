"""Secret values are masked wherever shoal writes text it did not compose itself: every log
line (text and JSON, whoever logged it) and error messages; and the configuration it shows hides
secret options and secret-looking Spark settings. Each check has its control: the same line
without the masking, or a non-secret value, shows as it is."""

from __future__ import annotations

import io
import json
import logging

import msgspec

from runtime import config as options
from runtime import logs

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
