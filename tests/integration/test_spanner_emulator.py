"""The Spanner side against the real Cloud Spanner emulator (with partition churn) and a
fault-injecting mock Spanner server, plus the decoder on hand-built results.

Emulator tests are marked ``spanner`` and skip, with the reason printed, when the emulator binary
is absent (see ``runtime.spanner.emulator.find_emulator``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

import grpc
import msgspec
import pytest
from google.cloud.spanner_v1.types import PartialResultSet

from actors.cli.config import EMULATOR_TRAIL_S
from protocol.records import (
    ChangeRecord,
    ChildPartition,
    ChildPartitions,
    ColumnType,
    DataChange,
    Heartbeat,
    Mod,
)
from runtime.ports import ChangeStreamSource
from runtime.spanner.config import SpannerConfig
from runtime.spanner.decode import DecodeError, RecordLayout, parse_timestamp
from runtime.spanner.emulator import EMULATOR_ENV, EmulatorUnavailable, find_emulator
from runtime.spanner.loadgen import LoadGenerator, expected_from_records
from runtime.spanner.reader import PartitionQueryError, SpannerSource, walk_stream
from tests.fixtures.spanner import (
    TOP_ORDER,
    MockSpanner,
    change_record_type,
    churn_emulator,
    data_value,
    mock_spanner,
    partial,
    row_value,
)

__all__ = ["churn_emulator", "mock_spanner"]  # fixtures, imported for pytest

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _micros(text: str) -> int:
    when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (when - EPOCH) // dt.timedelta(microseconds=1)


def _now_micros() -> int:
    return (dt.datetime.now(dt.UTC) - EPOCH) // dt.timedelta(microseconds=1)


# -- pure decoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-22T14:16:53Z", _micros("2026-11-22T14:16:53Z")),
        ("2026-11-22T14:16:53.4Z", _micros("2026-11-22T14:16:53.400000Z")),
        ("2026-11-22T14:16:53.473301Z", _micros("2026-11-22T14:16:53.473301Z")),
        ("2026-11-22T14:16:53.473301999Z", _micros("2026-11-22T14:16:53.473301Z")),
        ("1970-01-01T00:00:00.000001Z", 1),
        ("2026-11-22T14:16:53.5+00:00", _micros("2026-11-22T14:16:53.500000Z")),
    ],
)
def test_parse_timestamp(text: str, expected: int) -> None:
    assert parse_timestamp(text) == expected
    assert parse_timestamp(text) == expected  # cached second prefix


def test_parse_timestamp_rejects_garbage() -> None:
    with pytest.raises(DecodeError):
        parse_timestamp("yesterday")


def _decode(values: Sequence[Any], column_type: Any) -> list[ChangeRecord]:
    layout = RecordLayout(type(column_type).pb(column_type))
    out: list[ChangeRecord] = []
    layout.decode_values([type(v).pb(v) if hasattr(type(v), "pb") else v for v in values], out)
    return out


EXPECTED = [
    DataChange(
        commit_ts=_micros("2026-11-22T10:00:00.000123Z"),
        record_sequence="00000007",
        server_transaction_id="txn-1",
        is_last_record_in_transaction_in_partition=True,
        table="Singers",
        column_types=(
            ColumnType("Id", '{"code":"INT64"}', True, 1),
            ColumnType("Name", '{"code":"STRING"}', False, 2),
        ),
        mods=(Mod('{"Id":"1"}', '{"Name":"x"}', "{}"), Mod('{"Id":"2"}', '{"Name":"x"}', "{}")),
        mod_type="INSERT",
    ),
    Heartbeat(_micros("2026-11-22T10:00:01Z")),
    ChildPartitions(
        start_ts=_micros("2026-11-22T10:00:02.5Z"),
        record_sequence="00000001",
        children=(ChildPartition("tok-a", ("tok-p",)), ChildPartition("tok-m", ("tok-p", "tok-q"))),
    ),
]


@pytest.mark.parametrize(
    ("top_order", "reverse_data"),
    [(TOP_ORDER, False), (tuple(reversed(TOP_ORDER)), True)],
)
def test_decoder_reads_fields_by_name(top_order: Sequence[str], reverse_data: bool) -> None:
    column_type = change_record_type(top_order, reverse_data=reverse_data)
    rows = [
        row_value(
            data=[
                data_value(
                    "2026-11-22T10:00:00.000123Z",
                    "00000007",
                    "txn-1",
                    "Singers",
                    ['{"Id":"1"}', '{"Id":"2"}'],
                    reverse_data=reverse_data,
                )
            ],
            top_order=top_order,
        ),
        row_value(heartbeats=["2026-11-22T10:00:01Z"], top_order=top_order),
        row_value(
            children=[
                (
                    "2026-11-22T10:00:02.5Z",
                    "00000001",
                    [("tok-a", ["tok-p"]), ("tok-m", ["tok-p", "tok-q"])],
                )
            ],
            top_order=top_order,
        ),
    ]
    assert _decode(rows, column_type) == EXPECTED


def test_decoder_refuses_an_unknown_shape() -> None:
    column_type = change_record_type(("data_change_record", "heartbeat_record"))
    with pytest.raises(DecodeError, match="child_partitions_record"):
        RecordLayout(type(column_type).pb(column_type))


def test_missing_emulator_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EMULATOR_ENV, "/nonexistent/emulator_main")
    with pytest.raises(EmulatorUnavailable, match="SHOAL_SPANNER_EMULATOR"):
        find_emulator()
    with pytest.raises(EmulatorUnavailable, match="/nope"):
        find_emulator("/nope")


# -- the mock server: errors mid-stream ----------------------------------------------------------
def _partial(row: Any, *, first: bool, resume: bytes) -> PartialResultSet:
    return partial([row], column_type=change_record_type() if first else None, resume=resume)


@pytest.mark.asyncio
async def test_mid_stream_error_surfaces_as_partition_query_error(
    mock_spanner: MockSpanner,
) -> None:
    def script(request: Any, context: Any) -> Iterator[PartialResultSet]:
        yield _partial(row_value(heartbeats=["2026-11-22T10:00:01Z"]), first=True, resume=b"r1")
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "injected: partition token expired")

    mock_spanner.servicer.script = script
    got: list[ChangeRecord] = []
    async with await SpannerSource.connect(mock_spanner.config) as source:
        with pytest.raises(PartitionQueryError) as caught:
            async for batch in source.query("tok-1", _micros("2026-11-22T10:00:00Z"), None):
                got.extend(batch)
        stats = source.statistics()
    assert got == [Heartbeat(_micros("2026-11-22T10:00:01Z"))]  # delivered before the failure
    assert caught.value.token == "tok-1"
    assert caught.value.retryable
    assert "injected" in str(caught.value)
    assert stats.queries_failed == 1
    assert stats.queries_active == 0
    sql = mock_spanner.servicer.streaming_calls[0].sql
    assert "READ_MockStream(" in sql
    assert "partition_token => @token" in sql


@pytest.mark.asyncio
async def test_unavailable_mid_stream_is_resumed_by_the_client(mock_spanner: MockSpanner) -> None:
    def script(request: Any, context: Any) -> Iterator[PartialResultSet]:
        if request.resume_token != b"r1":
            yield _partial(row_value(heartbeats=["2026-11-22T10:00:01Z"]), first=True, resume=b"r1")
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected: connection reset")
        yield _partial(row_value(heartbeats=["2026-11-22T10:00:02Z"]), first=True, resume=b"r2")

    mock_spanner.servicer.script = script
    async with await SpannerSource.connect(mock_spanner.config) as source:
        got = [r async for b in source.query("tok-1", 0, None) for r in b]
    assert got == [
        Heartbeat(_micros("2026-11-22T10:00:01Z")),
        Heartbeat(_micros("2026-11-22T10:00:02Z")),
    ]
    assert [c.resume_token for c in mock_spanner.servicer.streaming_calls] == [b"", b"r1"]


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_stopping_the_iterator_cancels_the_rpc(mock_spanner: MockSpanner, how: str) -> None:
    """Closing the iterator early or cancelling the consuming task ends the server's stream."""
    server_saw_end = threading.Event()

    def script(request: Any, context: Any) -> Iterator[PartialResultSet]:
        context.add_callback(server_saw_end.set)
        yield _partial(row_value(heartbeats=["2026-11-22T10:00:01Z"]), first=True, resume=b"r1")
        while context.is_active():  # a live partition: nothing more to say for now
            time.sleep(0.01)

    mock_spanner.servicer.script = script
    async with await SpannerSource.connect(mock_spanner.config) as source:
        it = source.query("tok-1", 0, None)
        if how == "aclose":
            assert await anext(it)
            await it.aclose()
        else:
            first = asyncio.Event()

            async def consume() -> None:
                async for _ in it:
                    first.set()

            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(consume())
                await first.wait()
                await asyncio.sleep(0.05)  # now blocked reading the stream
                task.cancel()
        assert source.statistics().queries_active == 0
        t0 = time.monotonic()
        while not server_saw_end.is_set() and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        assert server_saw_end.is_set(), "the server still streams"  # within 5 s (loaded CI)


def _param(request: Any, name: str) -> str:
    """A string parameter of an ``ExecuteSqlRequest`` as the mock server receives it."""
    text: str = request.params[name]  # proto-plus: a Struct's string value is a str
    return text


def _window_script(children_from: int) -> Any:
    """A partition with one record at 10:00:01 that ends (ChildPartitions at 10:00:03.5) in the
    query whose window reaches ``children_from`` (micros); earlier windows just end."""

    def script(request: Any, context: Any) -> Iterator[PartialResultSet]:
        start = parse_timestamp(_param(request, "start"))
        end = parse_timestamp(_param(request, "end"))
        rows = []
        if start <= _micros("2026-11-22T10:00:01Z") <= end:
            rows.append(row_value(data=[data_value("2026-11-22T10:00:01Z", "0", "t1", "T", ["k"])]))
        if end >= children_from:
            kids = [("child-1", ["tok-1"])]
            rows.append(row_value(children=[("2026-11-22T10:00:03.5Z", "0", kids)]))
        if not rows:
            rows.append(row_value())  # the window passed with nothing to say
        for i, row in enumerate(rows):
            yield _partial(row, first=i == 0, resume=b"")

    return script


@pytest.mark.asyncio
async def test_a_query_window_goes_on_with_the_next_window_until_the_partition_ends(
    mock_spanner: MockSpanner,
) -> None:
    """With ``query_window_s`` each query asks for one window. A window that ends without
    ChildPartitions is followed by a query from one microsecond after the newest timestamp the
    window's query vouched for (here its record at 10:00:01: the emulator was seen to leave out
    a transaction near a window's end); a window that vouched for nothing becomes a heartbeat at
    its (inclusive) end, and the next query starts one microsecond later: one unbroken stream
    for the reader."""
    t0 = _micros("2026-11-22T10:00:00Z")
    mock_spanner.servicer.script = _window_script(children_from=_micros("2026-11-22T10:00:03.5Z"))
    config = msgspec.structs.replace(mock_spanner.config, query_window_s=2.0)
    got: list[ChangeRecord] = []
    async with await SpannerSource.connect(config) as source:
        async for batch in source.query("tok-1", t0, None):
            got.extend(batch)
        stats = source.statistics()
    assert [type(r).__name__ for r in got] == ["DataChange", "Heartbeat", "ChildPartitions"]
    assert got[1] == Heartbeat(t0 + 3_000_001)  # the second window vouched for nothing
    calls = mock_spanner.servicer.streaming_calls
    ranges = [
        (parse_timestamp(_param(c, "start")), parse_timestamp(_param(c, "end"))) for c in calls
    ]
    assert ranges == [
        (t0, t0 + 2_000_000),
        (t0 + 1_000_001, t0 + 3_000_001),  # after the record, not after the window's end
        (t0 + 3_000_002, t0 + 5_000_002),
    ]
    assert stats.windows == 2
    assert stats.queries_started == 3


@pytest.mark.asyncio
async def test_a_query_window_stops_at_the_callers_end(mock_spanner: MockSpanner) -> None:
    """The last window ends at the caller's ``end_ts`` (no heartbeat past it)."""
    t0 = _micros("2026-11-22T10:00:00Z")
    mock_spanner.servicer.script = _window_script(children_from=_micros("2026-11-22T11:00:00Z"))
    config = msgspec.structs.replace(mock_spanner.config, query_window_s=2.0)
    got: list[ChangeRecord] = []
    async with await SpannerSource.connect(config) as source:
        async for batch in source.query("tok-1", t0, t0 + 3_000_000):
            got.extend(batch)
    assert [type(r).__name__ for r in got] == ["DataChange"]  # (nothing vouched for after it)
    calls = mock_spanner.servicer.streaming_calls
    ranges = [
        (parse_timestamp(_param(c, "start")), parse_timestamp(_param(c, "end"))) for c in calls
    ]
    assert ranges == [(t0, t0 + 2_000_000), (t0 + 1_000_001, t0 + 3_000_000)]


@pytest.mark.asyncio
async def test_a_trailing_source_asks_only_for_the_past_and_polls(
    mock_spanner: MockSpanner,
) -> None:
    """With ``trail_s`` every query ends ``trail_s`` before the (wall) clock when it is sent,
    at most a window long; each one that does not end the partition is followed by a heartbeat
    at its end (it was answered over the past: complete), and the next starts a microsecond
    later; having reached the horizon the source waits ``trail_s``."""
    t0 = _micros("2026-11-22T10:00:00Z")
    mock_spanner.servicer.script = _window_script(children_from=_micros("2026-11-22T10:00:03.5Z"))
    config = msgspec.structs.replace(mock_spanner.config, query_window_s=2.0, trail_s=0.5)
    clock = iter([3.0, 3.2, 4.5])
    got: list[ChangeRecord] = []
    async with await SpannerSource.connect(config) as source:
        source._clock = lambda: t0 / 1e6 + next(clock)  # commit time as the source sees it
        async for batch in source.query("tok-1", t0, None):
            got.extend(batch)
    assert [type(r).__name__ for r in got] == [
        "DataChange",
        "Heartbeat",
        "Heartbeat",
        "ChildPartitions",
    ]
    assert got[1:3] == [Heartbeat(t0 + 2_000_000), Heartbeat(t0 + 2_700_000)]
    calls = mock_spanner.servicer.streaming_calls
    ranges = [
        (parse_timestamp(_param(c, "start")), parse_timestamp(_param(c, "end"))) for c in calls
    ]
    assert ranges == [
        (t0, t0 + 2_000_000),  # a window, its end 1 s in the past
        (t0 + 2_000_001, t0 + 2_700_000),  # up to the horizon (now - 0.5 s) ...
        (t0 + 2_700_001, t0 + 4_000_000),  # ... then, 0.5 s later, the next one
    ]


def test_a_query_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="query_window_s"):
        SpannerConfig(project="p", instance="i", database="d", change_stream="s", query_window_s=0)


@pytest.mark.asyncio
async def test_undecodable_stream_is_a_non_retryable_error(mock_spanner: MockSpanner) -> None:
    def script(request: Any, context: Any) -> Iterator[PartialResultSet]:
        bad = change_record_type(("data_change_record", "heartbeat_record"))
        yield partial([row_value()], column_type=bad)

    mock_spanner.servicer.script = script
    async with await SpannerSource.connect(mock_spanner.config) as source:
        with pytest.raises(PartitionQueryError) as caught:
            async for _ in source.query("tok-1", 0, None):
                pass
    assert not caught.value.retryable
    assert isinstance(caught.value.__cause__, DecodeError)


@pytest.mark.asyncio
async def test_a_slow_or_missing_first_answer_is_logged(
    mock_spanner: MockSpanner, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a query waited: a first answer later than ``slow_first_s``, or none before the
    query ended, is logged with the token, its start and the time spent."""
    silent = threading.Event()

    def script(request: Any, context: Any) -> Iterator[PartialResultSet]:
        if silent.is_set():
            time.sleep(0.5)
            return
        time.sleep(0.3)
        yield partial(
            [row_value(heartbeats=["2024-01-01T00:00:01Z"])], column_type=change_record_type()
        )

    mock_spanner.servicer.script = script
    caplog.set_level("INFO", logger="runtime.spanner.reader")
    async with await SpannerSource.connect(mock_spanner.config) as source:
        source.slow_first_s = 0.1
        async for _ in source.query("tok-slow", 7, None):
            pass
        silent.set()
        async for _ in source.query("tok-silent", 8, None):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        line.startswith("query of tok-slow from 7: first response after") for line in lines
    ), lines
    assert any(
        line.startswith("query of tok-silent from 8: ended after")
        and "without any response" in line
        for line in lines
    ), lines


# -- the real emulator ---------------------------------------------------------------------------
class RecordingSource(ChangeStreamSource):
    """Wraps a source and logs when each partition query starts and finishes."""

    def __init__(self, inner: SpannerSource) -> None:
        self.inner = inner
        self.events: list[tuple[str, str]] = []

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        if token is not None:
            self.events.append(("start", token))
        async for batch in self.inner.query(token, start_ts, end_ts):
            yield batch
        if token is not None:
            self.events.append(("end", token))


@pytest.mark.spanner
@pytest.mark.asyncio
@pytest.mark.parametrize("window", [None, 0.7])
async def test_churning_stream_delivers_every_mutation_exactly_once(
    churn_emulator: Any, window: float | None
) -> None:
    """Also with query windows shorter than a partition's life: each partition is then read
    by several queries, one after the other, and still every mutation arrives once (every
    record read counts: one read twice is an extra mod; the control doubles one).

    Read trailing, as shoal reads the emulator (``actors.cli.config.trail``): the emulator's live
    queries miss a commit that falls exactly on one of their scan steps' ends (see "Trailing"
    in runtime/spanner/reader.py), which a loaded CI machine hit (2 mods of one transaction)."""
    config = msgspec.structs.replace(
        churn_emulator.config, query_window_s=window, trail_s=EMULATOR_TRAIL_S
    )
    # a seed of its own: the emulator is the module's, and rows of another seed may be there
    seed = 42 if window is None else 43
    loader = await LoadGenerator.connect(config, churn_emulator.tables, seed=seed)
    source = await SpannerSource.connect(config)
    recording = RecordingSource(source)
    try:
        start = _now_micros()
        # partitions churn at ~2 s, ~6 s, ~10 s after creation (alive 2 s); the second round
        # usually includes a merge. The end leaves 4 s after the load for its last commits (a
        # busy CI machine's emulator committed past a 1 s margin)
        end = start + 12_000_000
        async with asyncio.TaskGroup() as tg:
            walking = tg.create_task(walk_stream(recording, start, end))
            await loader.run(40.0, duration_s=8.0)
        result = walking.result()
    finally:
        await source.close()
        await loader.close()
    assert loader.committed
    late = [c.commit_ts - end for c in loader.committed if c.commit_ts > end]
    assert not late, f"{len(late)} commits after the read's end (by up to {max(late)} us)"
    expected = loader.expected_mods()
    assert expected_from_records(result.data) == expected
    doubled = [*result.data, result.data[len(result.data) // 2]]
    assert expected_from_records(doubled) != expected, "the control: a record read twice"
    # partitions churned: children (splits / moves / merges) were read
    assert any(parents for _, parents in result.partitions.values())
    # every partition read once; a child only after all its parents finished
    starts = [tok for kind, tok in recording.events if kind == "start"]
    assert len(starts) == len(set(starts))
    position = {(kind, tok): i for i, (kind, tok) in enumerate(recording.events)}
    for token, (_, parents) in result.partitions.items():
        for parent in parents:
            assert position[("end", parent)] < position[("start", token)]
    merges = sum(1 for _, parents in result.partitions.values() if len(parents) > 1)
    windows = source.statistics().windows
    print(f"partitions read: {len(result.partitions)}, merged children: {merges}, {windows=}")
    if window is not None:
        assert windows > 0  # partitions outlived a window: read by more than one query


@pytest.mark.spanner
@pytest.mark.asyncio
async def test_restart_from_watermark_loses_nothing(churn_emulator: Any) -> None:
    """A partition's query stopped after its first batch and started again from its watermark
    (the last commit timestamp read) re-delivers the records at that timestamp — the restart is
    inclusive, which is why ``first`` and ``rest`` are merged by identity here (the reader drops
    those at its watermark) — and loses nothing; the whole walk is exactly the load."""
    config = churn_emulator.config
    loader = await LoadGenerator.connect(config, churn_emulator.tables, seed=7)
    source = await SpannerSource.connect(config, max_batch=25)
    try:
        await loader.bulk(60)
        start, end = loader.committed[0].commit_ts, loader.committed[-1].commit_ts
        full = await walk_stream(source, start, end)
        # read a partition again, stop after its first batch, restart from the watermark
        first: list[DataChange] = []
        rest: list[DataChange] = []
        whole: list[DataChange] = []
        restarted = None
        for token in full.partitions:
            begin = full.partitions[token][0]
            it = source.query(token, begin, end)
            batch = await anext(it, None)
            await it.aclose()
            data = [r for r in batch or () if isinstance(r, DataChange)]
            if len(data) < 5:
                continue
            watermark = data[-1].commit_ts
            first = data
            rest = [
                r
                for b in [b async for b in source.query(token, watermark, end)]
                for r in b
                if isinstance(r, DataChange)
            ]
            whole = [
                r
                for b in [b async for b in source.query(token, begin, end)]
                for r in b
                if isinstance(r, DataChange)
            ]
            restarted = token
            break
        assert restarted is not None, "no partition with a full first batch"
        assert source.statistics().queries_active == 0
    finally:
        await source.close()
        await loader.close()
    merged = {r.identity: r for r in [*first, *rest]}
    assert first[-1].identity in {r.identity for r in rest}  # the watermark is inclusive
    assert sorted(merged) == sorted({r.identity for r in whole})
    # and the whole range is exactly what was committed, every record read counted
    assert expected_from_records(full.data) == loader.expected_mods()


@pytest.mark.spanner
@pytest.mark.asyncio
async def test_lazy_decoder_equals_client_default_decoding(churn_emulator: Any) -> None:
    from runtime.spanner.decode import records_from_default_row

    config = churn_emulator.config
    loader = await LoadGenerator.connect(config, churn_emulator.tables, seed=3)
    source = await SpannerSource.connect(config)
    try:
        await loader.run(500.0, count=40)
        start, end = loader.committed[0].commit_ts, loader.committed[-1].commit_ts
        roots = [r async for b in source.query(None, start, end) for r in b]
        tokens = [
            c.token for rec in roots if isinstance(rec, ChildPartitions) for c in rec.children
        ]
        assert tokens
        for token in tokens:
            fast = [r async for b in source.query(token, start, end) for r in b]
            params, types = source._params(token, start, end)
            slow: list[ChangeRecord] = []
            async with source._db.snapshot() as snapshot:
                rs = await snapshot.execute_sql(source._sql, params=params, param_types=types)
                async for row in rs:
                    slow.extend(records_from_default_row(row))
            assert fast == slow
    finally:
        await source.close()
        await loader.close()


@pytest.mark.spanner
@pytest.mark.asyncio
async def test_cancelling_a_live_query_stops_it_promptly(churn_emulator: Any) -> None:
    threads_before = threading.active_count()
    source = await SpannerSource.connect(churn_emulator.config)
    try:
        roots = [r async for b in source.query(None, _now_micros(), None) for r in b]
        root = roots[0]
        assert isinstance(root, ChildPartitions)
        token = root.children[0].token
        got_heartbeat = asyncio.Event()

        async def tail() -> None:
            # The emulator churns partitions: when the one being read ends, follow a child, so
            # the query being cancelled is a live one however long the module has run.
            current, start = token, root.start_ts
            while True:
                child: tuple[str, int] | None = None
                async for batch in source.query(current, start, None):
                    for record in batch:
                        if isinstance(record, Heartbeat):
                            got_heartbeat.set()
                        elif isinstance(record, ChildPartitions) and record.children:
                            child = (record.children[0].token, record.start_ts)
                assert child is not None, "a partition ended without child partitions"
                current, start = child

        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(tail())
            async with asyncio.timeout(10):
                await got_heartbeat.wait()
            t0 = time.monotonic()
            task.cancel()
        assert task.cancelled()
        assert time.monotonic() - t0 < 5.0  # the cancel is not held up by a blocked read
        assert source.statistics().queries_active == 0
    finally:
        await source.close()
    assert threading.active_count() <= threads_before + 1  # grpc may keep one poller thread
