"""Options: precedence flags > environment > TOML file > defaults; bad input names the problem
and exits 2; the configuration reference in docs/ is the one the code generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.cli import config as options
from actors.cli.config import ConfigError
from actors.runtime import build_parser, main
from tests.helpers import REPO


def _load(argv: list[str], env: dict[str, str] | None = None) -> options.ShoalConfig:
    return options.load(build_parser().parse_args(argv), env or {})


def test_defaults_are_the_embedded_demo() -> None:
    config = _load([])
    assert options.task_count(config) == 3
    production = _load(["--kafka-bootstrap-servers", "k:9092"])
    assert options.task_count(production) == 1  # one task per process on a real Kafka
    assert config.run.source == "sim"
    assert config.kafka.bootstrap_servers is None  # the embedded broker
    assert config.run.duration is None


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    path = tmp_path / "shoal.toml"
    path.write_text(
        'tasks = 5\nconnector = "from-file"\nduration = 9\n'
        '[kafka]\nbootstrap_servers = "file:9092"\nsession_timeout_ms = 7000\n'
        '[spark.conf]\n"spark.sql.shuffle.partitions" = "4"\n'
    )
    env = {
        "SHOAL_TASKS": "4",
        "SHOAL_KAFKA_BOOTSTRAP_SERVERS": "env:9092",
        "SHOAL_LOG_JSON": "true",
    }
    config = _load(["--config", str(path), "--tasks", "2"], env)
    assert config.run.tasks == 2  # flag
    assert config.kafka.bootstrap_servers == "env:9092"  # env over file
    assert config.kafka.session_timeout_ms == 7000  # file over default
    assert config.run.connector == "from-file"
    assert config.run.duration == 9.0
    assert config.run.log_json is True
    assert config.spark.conf == {"spark.sql.shuffle.partitions": "4"}


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("tasks = 7\n")
    assert _load([], {"SHOAL_CONFIG": str(path)}).run.tasks == 7


def test_bool_flags_both_ways() -> None:
    assert _load(["--log-json"]).run.log_json is True
    assert _load(["--no-log-json"], {"SHOAL_LOG_JSON": "1"}).run.log_json is False


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--tasks", "0"], {}, "tasks (from flag --tasks)"),
        (["--tasks", "many"], {}, "tasks (from flag --tasks)"),
        ([], {"SHOAL_DURATION": "-1"}, "duration (from environment variable SHOAL_DURATION)"),
        ([], {"SHOAL_TASKZ": "1"}, "SHOAL_TASKZ (did you mean 'SHOAL_TASKS'?)"),
        (["--source", "oracle"], {}, "source (from flag --source)"),
        (["--kafka-bootstrap-servers", "nohost"], {}, "'nohost' is not 'host:port'"),
        (["--source", "spanner"], {}, "--source spanner needs spanner.project"),
        (
            ["--kafka-bootstrap-servers", "h:1", "--kafka-sasl-username", "u"],
            {},
            "security_protocol is PLAINTEXT",
        ),
        (  # the embedded broker (no bootstrap servers) takes no SASL/TLS: the option is named
            [],
            {"SHOAL_KAFKA_SASL_PASSWORD": "pw-not-shown"},
            "kafka.sasl_password (--kafka-sasl-password) given without kafka.bootstrap_servers",
        ),
        (
            ["--kafka-security-protocol", "SSL", "--kafka-ssl-cafile", "ca.pem"],
            {},
            "kafka.security_protocol (--kafka-security-protocol), kafka.ssl_cafile",
        ),
    ],
)
def test_bad_values_name_the_option(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(argv, env)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tasks = 3\ntaskz = 4\n", "unknown key 'taskz' (did you mean"),
        ("[kafka]\nbootstrap = 'x:1'\n", "unknown key 'bootstrap' in [kafka] (did you mean"),
        ("tasks = \n", "is not valid TOML"),
        ("tasks = 'x'\n", "tasks (from config file"),
        ("kafka = 3\n", "[kafka] must be a table"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        _load(["--config", str(path)])
    assert needle in str(info.value)
    assert str(path) in str(info.value) or "tasks" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        _load(["--config", str(tmp_path / "nope.toml")])


def test_main_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHOAL_CONFIG", raising=False)
    assert main(["--tasks", "-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "tasks (from flag --tasks)" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["--no-such-flag"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_secrets_are_hidden() -> None:
    config = _load(
        [
            "--kafka-bootstrap-servers",
            "h:1",
            "--kafka-security-protocol",
            "SASL_SSL",
            "--kafka-sasl-mechanism",
            "PLAIN",
            "--kafka-sasl-username",
            "u",
        ],
        {"SHOAL_KAFKA_SASL_PASSWORD": "hunter2"},
    )
    assert config.kafka.sasl_password == "hunter2"
    assert "hunter2" not in str(options.redacted(config))
    assert "hunter2" not in build_parser().format_help()


def test_help_documents_every_option_with_its_default() -> None:
    text = build_parser().format_help()
    for option in options.options():
        if option.kind == "table":
            continue
        assert option.flag in text
        assert option.env in text


def test_configuration_reference_is_current() -> None:
    """docs/configuration.md is generated: `python -m actors.runtime config --reference`."""
    current = (REPO / "docs" / "configuration.md").read_text()
    assert current == options.reference_markdown(), (
        "docs/configuration.md is stale: run "
        "`.venv/bin/python -m actors.runtime config --reference > docs/configuration.md`"
    )


def test_spark_gets_absolute_paths_and_urls_as_they_are() -> None:
    # Over Spark Connect a relative path would be the server's working directory's.
    from actors.cli.sinks import spark_config

    local = spark_config(_load(["--output-dir", "out", "--spark-checkpoint-dir", "ck"]), None)
    assert local.output_dir == str(Path("out").resolve() / "data")
    assert local.checkpoint_dir == str(Path("ck").resolve())
    remote = spark_config(
        _load(["--output-dir", "s3a://bucket/run", "--spark-checkpoint-dir", "s3a://bucket/ck"]),
        None,
    )
    assert remote.output_dir == "s3a://bucket/run/data"
    assert remote.checkpoint_dir == "s3a://bucket/ck"
    assert spark_config(_load([]), None).checkpoint_dir is None


def test_spark_timeouts_reach_the_bridge() -> None:
    from actors.cli.sinks import spark_config

    default = spark_config(_load([]), None)
    assert (default.start_timeout_s, default.job_timeout_s) == (180.0, 300.0)
    args = ["--spark-start-timeout-s", "45", "--spark-job-timeout-s", "0"]
    chosen = spark_config(_load(args), None)
    assert (chosen.start_timeout_s, chosen.job_timeout_s) == (45.0, None)  # 0: no limit


def test_reads_trail_now_against_the_emulator_only() -> None:
    spanner = _load([]).spanner
    assert options.trail(spanner, emulator=True) == 0.25
    assert options.trail(spanner, emulator=False) is None
    live = _load(["--spanner-trail-s", "0"]).spanner
    assert options.trail(live, emulator=True) is None
    chosen = _load(["--spanner-trail-s", "1.5"]).spanner
    assert options.trail(chosen, emulator=False) == 1.5


def test_query_window_defaults_to_5s_against_the_emulator_only() -> None:
    """The emulator keeps running cancelled partition queries until their end; a window bounds
    that. Against Spanner a query runs to the partition's end unless a window is set."""
    spanner = _load([]).spanner
    assert options.query_window(spanner, emulator=True) == 5.0
    assert options.query_window(spanner, emulator=False) is None
    chosen = _load(["--spanner-query-window-s", "20"]).spanner
    assert options.query_window(chosen, emulator=False) == 20.0
    assert options.query_window(chosen, emulator=True) == 20.0
    with pytest.raises(ConfigError, match="--spanner-query-window-s"):
        _load(["--spanner-query-window-s", "0"])


def test_task_options_become_the_core_settings_in_microseconds() -> None:
    from actors.cli.config import TaskOptions
    from protocol.task import TaskConfig

    options = TaskOptions(
        cap=7,
        answer_timeout_ms=1500,
        publish_interval_ms=120,
        negotiate_interval_ms=90,
        checkpoint_interval_s=2.5,
        stall_timeout_s=4.5,
    )
    assert options.task_config("t1") == TaskConfig(
        task_id="t1",
        cap=7,
        answer_timeout=1_500_000,
        publish_interval=120_000,
        negotiate_interval=90_000,
        checkpoint_interval=2_500_000,
        stall_timeout=4_500_000,
    )
    assert _load(["--task-stall-timeout-s", "12"]).task.stall_timeout_s == 12.0
    with pytest.raises(ConfigError, match="--task-stall-timeout-s"):
        _load(["--task-stall-timeout-s", "0"])


def test_the_stall_timeout_reaches_every_reader_the_task_starts() -> None:
    """``task.stall_timeout_s`` is the stall rule's timeout of each partition reader."""
    from typing import Any, cast

    from actors.cli.config import TaskOptions
    from actors.task import TaskActor
    from protocol.task import StartReader

    class Supervisor:
        def start_soon(self, coro: Any, **_: object) -> None:
            coro.close()  # the reader is not run: only how it was made matters here

    actor = TaskActor(
        TaskOptions(stall_timeout_s=4.5).task_config("t1"),
        sync_log=cast(Any, None),
        source=cast(Any, None),
        sink=cast(Any, None),
        supervisor=cast(Any, Supervisor()),
        stream_start=0,
    )
    actor._start_reader(StartReader(token="r1", start_ts=0, parents=()))
    assert actor.readers["r1"].core.config.stall_timeout == 4_500_000


def test_sasl_password_with_the_embedded_broker_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SASL password without --kafka-bootstrap-servers is a bad option (exit 2, one line
    naming it, the password not shown), found before anything starts; it used to end as a
    ValueError from the Kafka client settings once the embedded broker ran (exit 1)."""
    monkeypatch.setenv("SHOAL_KAFKA_SASL_PASSWORD", "pw-7Yq-not-shown")
    assert main(["--sink", "files", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shoal: error: kafka.sasl_password (--kafka-sasl-password)")
    assert "pw-7Yq-not-shown" not in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--sink", "kafka", "--table-format", "delta"], "--sink files"),
        (["--sink", "files", "--table-format", "delta", "--output-layout", "generic"], "typed"),
        (["--sink", "spark", "--table-format", "delta", "--spark-dead-letter"], "dead_letter"),
        (["--sink", "spark", "--table-format", "delta", "--output-dir", "s3a://b/p"], "s3://"),
        (["--sink", "files", "--output-dir", "s3://"], "output_dir"),
        (["--spark-path", "streaming", "--output-dir", "s3://b/p"], "checkpoint_dir"),
    ],
)
def test_table_format_and_output_urls_are_checked_at_start(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _load(argv)  # loading checks the options


def test_the_streaming_path_takes_delta_tables() -> None:
    config = _load(["--sink", "spark", "--table-format", "delta", "--spark-path", "streaming"])
    assert (config.spark.path, config.run.table_format) == ("streaming", "delta")


@pytest.mark.parametrize("sink", ["files", "spark"])
def test_delta_on_an_object_store_is_accepted(sink: str) -> None:
    config = _load(["--sink", sink, "--table-format", "delta", "--output-dir", "s3://b/p"])
    assert (config.run.sink, config.run.table_format, config.run.output_dir) == (
        sink,
        "delta",
        "s3://b/p",
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--snapshot"], "--source spanner or emulator"),
        (["--source", "emulator", "--snapshot", "--mod-types", "INSERT"], "add SNAPSHOT"),
        (["--mirror"], "--sink files"),
        (["--sink", "files", "--output-layout", "generic", "--mirror"], "output_layout typed"),
    ],
)
def test_snapshot_and_mirror_are_checked_at_start(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        _load(argv)


def test_snapshot_and_mirror_from_flags_environment_and_file(tmp_path: Path) -> None:
    flags = ["--source", "emulator", "--sink", "files", "--snapshot", "--mirror"]
    config = _load([*flags, "--mod-types", "snapshot,insert", "--snapshot-chunk-rows", "500"])
    assert (config.run.snapshot, config.run.mirror, config.run.snapshot_chunk_rows) == (
        True,
        True,
        500,
    )
    env = {"SHOAL_SOURCE": "emulator", "SHOAL_SINK": "files", "SHOAL_SNAPSHOT": "true"}
    assert _load([], env).run.snapshot
    toml = tmp_path / "shoal.toml"
    toml.write_text('source = "emulator"\nsink = "files"\nmirror = true\nsnapshot = true\n')
    from_file = _load(["--config", str(toml)])
    assert (from_file.run.snapshot, from_file.run.mirror) == (True, True)


def test_the_issue_37_filters_come_from_a_flag_the_environment_or_the_file(tmp_path: Path) -> None:
    path = tmp_path / "shoal.toml"
    path.write_text(
        'exclude_transaction_tags = "from-file"\n'
        "exclude_system_transactions = true\n"
        'exclude_columns = "Users.Email"\n'
    )
    from_file = _load(["--config", str(path)])
    assert (
        from_file.run.exclude_transaction_tags,
        from_file.run.exclude_system_transactions,
        from_file.run.exclude_columns,
    ) == ("from-file", True, "Users.Email")
    env = {"SHOAL_EXCLUDE_TRANSACTION_TAGS": "from-env", "SHOAL_EXCLUDE_COLUMNS": "*.Ssn"}
    from_env = _load(["--config", str(path)], env)
    assert (from_env.run.exclude_transaction_tags, from_env.run.exclude_columns) == (
        "from-env",
        "*.Ssn",
    )
    flags = _load(
        ["--config", str(path), "--exclude-transaction-tags", "a*,b",
         "--no-exclude-system-transactions", "--exclude-columns", "T.C"],
        env,
    )  # fmt: skip
    rule = options.record_filter(flags)
    assert (
        rule.exclude_transaction_tags,
        rule.exclude_system_transactions,
        rule.exclude_columns,
    ) == (("a*", "b"), False, ("T.C",))
    with pytest.raises(options.ConfigError, match=r"exclude_columns: 'Email' is not Table.Column"):
        options.check(_load(["--exclude-columns", "Email"]))
