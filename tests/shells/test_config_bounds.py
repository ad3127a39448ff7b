"""The time-bound, filter and Spanner options: parsed from flags, environment and TOML alike,
and refused in one line naming the option (exit 2) when they cannot be used."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.cli import config as options
from actors.cli.config import ConfigError
from actors.runtime import build_parser, main


def _load(argv: list[str], env: dict[str, str] | None = None) -> options.ShoalConfig:
    return options.load(build_parser().parse_args(argv), env or {})


def test_defaults_start_now_with_no_end_and_no_filter() -> None:
    config = _load([])
    assert config.run.start_at == "now"
    assert options.start_micros(config.run) is None
    assert options.end_micros(config.run) is None
    assert options.record_filter(config).keeps_everything
    assert config.spanner.rpc_priority is None
    assert config.spanner.database_role is None


def test_bounds_and_filters_from_flags_env_and_file(tmp_path: Path) -> None:
    path = tmp_path / "shoal.toml"
    path.write_text(
        'start_at = "2024-05-01T12:00:00Z"\ntables = "Orders*"\n'
        '[spanner]\nrpc_priority = "LOW"\ndatabase_role = "cdc_reader"\n'
    )
    config = _load(
        [
            "--config",
            str(path),
            "--end-at",
            "2024-05-01T14:00:00.25+02:00",
            "--mod-types",
            "UPDATE",
        ],
        {"SHOAL_EXCLUDE_TABLES": "OrdersAudit"},
    )
    assert options.start_micros(config.run) == 1_714_564_800_000_000
    assert options.end_micros(config.run) == 1_714_564_800_250_000
    rule = options.record_filter(config)
    assert rule.tables == ("Orders*",)
    assert rule.exclude_tables == ("OrdersAudit",)
    assert rule.mod_types == frozenset({"UPDATE"})
    assert config.spanner.rpc_priority == "LOW"
    assert config.spanner.database_role == "cdc_reader"
    env_only = _load([], {"SHOAL_SPANNER_RPC_PRIORITY": "MEDIUM", "SHOAL_START_AT": "now"})
    assert env_only.spanner.rpc_priority == "MEDIUM"


def test_nanoseconds_are_truncated_to_spanner_microseconds() -> None:
    run = _load(["--start-at", "2024-05-01T12:00:00.123456789Z"]).run
    assert options.start_micros(run) == 1_714_564_800_123_456


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--start-at", "yesterday"], "start_at: 'yesterday' is not an RFC 3339 timestamp"),
        (["--start-at", "2024-05-01T12:00:00"], "start_at: '2024-05-01T12:00:00' is not an RFC"),
        (["--end-at", "2024-13-01T00:00:00Z"], "end_at: '2024-13-01T00:00:00Z': month"),
        (
            ["--start-at", "2024-05-02T00:00:00Z", "--end-at", "2024-05-01T00:00:00Z"],
            "end_at 2024-05-01T00:00:00Z is before start_at 2024-05-02T00:00:00Z",
        ),
        (["--mod-types", "INSERT,MERGE"], "mod_types: unknown mod type 'MERGE'"),
        (["--tables", "Orders,"], "tables: empty item in 'Orders,'"),
        (["--spanner-rpc-priority", "URGENT"], "invalid value for spanner.rpc_priority (from flag"),
    ],
)
def test_bad_values_are_refused_naming_the_option(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        _load(argv)


def test_main_refuses_a_bad_bound_in_one_line_with_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHOAL_CONFIG", raising=False)
    assert main(["--end-at", "tomorrow"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("shoal: error: end_at: 'tomorrow' is not an RFC 3339 timestamp")
