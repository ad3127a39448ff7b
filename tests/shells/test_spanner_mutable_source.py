"""The Spanner source over a MUTABLE_KEY_RANGE stream, without a database
(``runtime/spanner/reader.py``): partial result sets of the documented protobuf types, whose one
column is ``PROTO<google.spanner.v1.ChangeStreamRecord>``, are decoded by the mode's decoder
(chosen by the column's type); every query, the root's too, ends at most 30 minutes after its
start and the next goes on from there until the partition end record."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest
from google.cloud.spanner_v1.types import PartialResultSet, ResultSet

from protocol.mutable import MAX_QUERY_SPAN_US, PartitionEnd, PartitionStart
from protocol.records import ChangeRecord, DataChange, Heartbeat
from runtime.spanner.reader import SpannerSource
from tests.shells.test_mutable_decode import T_S, _records, _result_set


class _ResultSet:
    """What ``execute_sql(..., lazy_decode=True)`` returns, as far as the source reads it."""

    def __init__(self, responses: list[PartialResultSet]) -> None:
        async def stream() -> AsyncGenerator[PartialResultSet, None]:
            for response in responses:
                yield response

        self._response_iterator = stream()


@pytest.mark.asyncio
async def test_proto_rows_decode_into_the_modes_records() -> None:
    raw = ResultSet.pb(_result_set(_records()))
    values = [row.values[0] for row in raw.rows]
    first, rest = PartialResultSet.pb(PartialResultSet()), PartialResultSet.pb(PartialResultSet())
    first.metadata.CopyFrom(raw.metadata)
    first.values.extend(values[:2])
    rest.values.extend(values[2:])
    source = SpannerSource(None, "Stream", mutable=True)
    responses = [PartialResultSet.wrap(first), PartialResultSet.wrap(rest)]
    got: list[object] = [
        r async for b in source.decode_result_set(_ResultSet(responses)) for r in b
    ]
    kinds = [type(r).__name__ for r in got]
    assert kinds == [
        "PartitionStart",
        "DataChange",
        "Heartbeat",
        "PartitionEvent",
        "PartitionEvent",
        "PartitionEnd",
    ]
    assert got[0] == PartitionStart(T_S * 1_000_000, "0", ("p1", "p2"))


@pytest.mark.asyncio
async def test_every_query_ends_at_most_30_minutes_out_and_the_next_goes_on() -> None:
    source = SpannerSource(None, "Stream", mutable=True)
    asked: list[tuple[str | None, int, int | None]] = []
    start = T_S * 1_000_000

    async def once(
        token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        asked.append((token, start_ts, end_ts))
        if token is None:
            yield [PartitionStart(start_ts, "0", ("p1",))]  # type: ignore[list-item]
        elif len(asked) < 4:
            assert end_ts is not None
            yield [Heartbeat(end_ts)]
        else:
            yield [PartitionEnd(start_ts + 5, "1", "p1")]  # type: ignore[list-item]

    source._query_once = once  # type: ignore[method-assign]
    # (the port is typed with the other mode's records; this mode's travel the same way)
    roots: list[object] = [r async for b in source.query(None, start, None) for r in b]
    assert roots == [PartitionStart(start, "0", ("p1",))]
    records: list[object] = [r async for b in source.query("p1", start, None) for r in b]
    span = MAX_QUERY_SPAN_US
    assert asked == [
        (None, start, start + span),
        ("p1", start, start + span),
        ("p1", start + span + 1, start + 2 * span + 1),
        ("p1", start + 2 * span + 2, start + 3 * span + 2),
    ]
    assert records[-1] == PartitionEnd(start + 2 * span + 7, "1", "p1")
    assert not any(isinstance(r, DataChange) for r in records)


@pytest.mark.asyncio
async def test_an_immutable_stream_s_queries_keep_their_ends() -> None:
    source = SpannerSource(None, "Stream")
    asked: list[tuple[str | None, int, int | None]] = []

    async def once(
        token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        asked.append((token, start_ts, end_ts))
        yield [Heartbeat(start_ts)]

    source._query_once = once  # type: ignore[method-assign]
    [r async for b in source.query(None, 5, None) for r in b]
    [r async for b in source.query("p1", 5, None) for r in b]
    assert asked == [(None, 5, None), ("p1", 5, None)]
