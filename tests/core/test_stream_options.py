"""A change stream's own options (protocol/stream_options.py): defaults for options the DDL did
not set, the retention period's forms, the one-line description, and the refusal of a first
start older than the stream keeps records."""

from __future__ import annotations

import pytest

from protocol.stream_options import (
    StreamOptions,
    StreamOptionsError,
    parse_retention,
    start_refusal,
    stream_options,
)

HOUR_US = 3_600_000_000
NOW = 1_795_000_000_000_000  # 2026-11-18T11:06:40Z


def test_options_not_set_take_spanners_defaults() -> None:
    assert stream_options([]) == StreamOptions("1d", "OLD_AND_NEW_VALUES", "IMMUTABLE_KEY_RANGE")
    assert stream_options([]).retention_us == 24 * HOUR_US


def test_rows_of_the_information_schema_become_options() -> None:
    options = stream_options(
        [
            ("retention_period", "36h"),
            ("value_capture_type", "new_row"),
            ("exclude_ttl_deletes", "true"),
            ("exclude_insert", "false"),
            ("PARTITION_MODE", "MUTABLE_KEY_RANGE"),
            ("allow_txn_exclusion", "true"),
        ]
    )
    assert options == StreamOptions(
        retention_period="36h",
        value_capture_type="NEW_ROW",
        partition_mode="MUTABLE_KEY_RANGE",
        excludes=("exclude_ttl_deletes",),
        other=(("allow_txn_exclusion", "true"),),
    )
    assert options.mutable_key_range
    assert options.describe() == (
        "retention_period 36h, value_capture_type NEW_ROW, partition_mode MUTABLE_KEY_RANGE, "
        "excludes exclude_ttl_deletes, allow_txn_exclusion true"
    )


@pytest.mark.parametrize(
    ("text", "micros"),
    [("7d", 7 * 24 * HOUR_US), ("36h", 36 * HOUR_US), ("90m", 90 * 60_000_000), ("3600s", HOUR_US)],
)
def test_retention_forms(text: str, micros: int) -> None:
    assert parse_retention(text) == micros


def test_an_unreadable_retention_is_refused_naming_it() -> None:
    with pytest.raises(StreamOptionsError, match=r"retention_period '1 week'"):
        stream_options([("retention_period", "1 week")])


def test_a_start_older_than_the_retention_is_refused_in_one_line_naming_both() -> None:
    options = StreamOptions(retention_period="1h")
    inside = NOW - HOUR_US + 1
    assert start_refusal(inside, NOW, options, start_at="x", stream="S") is None
    assert start_refusal(NOW - HOUR_US, NOW, options, start_at="x", stream="S") is None
    refusal = start_refusal(
        NOW - 2 * HOUR_US, NOW, options, start_at="2026-11-18T09:06:40Z", stream="Orders"
    )
    assert refusal == (
        "start_at 2026-11-18T09:06:40Z (--start-at) is older than change stream Orders's "
        "retention_period 1h: the oldest start it keeps records for is "
        "2026-11-18T10:06:40.000000Z (now); start later, or raise the stream's retention_period"
    )


def test_the_oldest_start_is_shown_as_the_calendar_says() -> None:
    import datetime

    from protocol.stream_options import _rfc3339

    for micros in (0, 951_782_400_123_456, 1_795_000_000_000_000, 4_107_542_399_999_999):
        moment = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(
            microseconds=micros
        )
        assert _rfc3339(micros) == moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), micros
