"""``SimulatedSource`` over the seeded stream model: determinism, exact records, clock gating,
heartbeats, batch bounds, end_ts, and the child records of splits, moves and merges."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from protocol.records import ChangeRecord, ChildPartition, ChildPartitions, DataChange, Heartbeat
from runtime.sim.source import SimulatedSource, UnknownPartition
from runtime.sim.stream import StreamModel, StreamParams
from runtime.spanner.reader import walk_stream

START = StreamParams().start_ts
SECOND = 1_000_000


class FakeClock:
    """Model time that moves only when the test says so."""

    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


async def _no_sleep(_: float) -> None:
    await asyncio.sleep(0)


def _source(params: StreamParams, clock: FakeClock, **kwargs: object) -> SimulatedSource:
    return SimulatedSource(StreamModel(params), clock=clock, sleep=_no_sleep, **kwargs)  # type: ignore[arg-type]


async def _read(
    source: SimulatedSource, token: str | None, start: int, end: int | None
) -> list[list[ChangeRecord]]:
    async with asyncio.timeout(10):
        return [list(batch) async for batch in source.query(token, start, end)]


def _flat(batches: Sequence[Sequence[ChangeRecord]]) -> list[ChangeRecord]:
    return [r for b in batches for r in b]


def _find(model: StreamModel, kind: str, until: int) -> str:
    """A partition that ended by ``kind`` (split / move / merge) before ``until``."""
    model.generate_until(until)
    for token, info in model.partitions.items():
        if info.end_ts is None or info.end_ts > until:
            continue
        kids = [model.info(c) for c in info.children]
        if kind == "split" and len(kids) == 2:
            return token
        if kind == "move" and len(kids) == 1 and len(kids[0].parents) == 1:
            return token
        if kind == "merge" and len(kids) == 1 and len(kids[0].parents) == 2:
            return token
    raise AssertionError(f"no {kind} before {until}")


CHURNY = StreamParams(seed=7, split_p=0.2, move_p=0.2, merge_p=0.2, min_partitions=2)


@pytest.mark.asyncio
async def test_root_query_lists_the_roots() -> None:
    params = StreamParams(seed=1, roots=3)
    batches = await _read(_source(params, FakeClock(START)), None, START, None)
    assert batches == [
        [
            ChildPartitions(
                start_ts=START,
                record_sequence="00000000",
                children=(
                    ChildPartition("p00000", ()),
                    ChildPartition("p00001", ()),
                    ChildPartition("p00002", ()),
                ),
            )
        ]
    ]


@pytest.mark.asyncio
async def test_slice_has_exactly_the_model_records() -> None:
    params = StreamParams(seed=11, records_per_s=50.0)
    lo, hi = START + 3 * SECOND, START + 7 * SECOND
    source = _source(params, FakeClock(hi + 60 * SECOND), heartbeat_ms=100_000)
    got = [r for r in _flat(await _read(source, "p00001", lo, hi)) if isinstance(r, DataChange)]
    expected = [
        r for r in StreamModel(params).records("p00001", lo, hi) if isinstance(r, DataChange)
    ]
    assert got == expected
    assert got, "the slice should not be empty"
    assert all(lo <= r.commit_ts <= hi for r in got)
    assert [r.commit_ts for r in got] == sorted(r.commit_ts for r in got)


@pytest.mark.asyncio
async def test_same_seed_same_records_other_seed_other_records() -> None:
    until = START + 20 * SECOND

    async def run(seed: int) -> list[DataChange]:
        params = StreamParams(seed=seed)
        source = _source(params, FakeClock(until + SECOND))
        result = await walk_stream(source, START, until)
        return sorted(result.data, key=lambda r: r.identity)

    first, again, other = await run(5), await run(5), await run(6)
    assert first == again
    assert first != other


@pytest.mark.asyncio
async def test_walk_reads_every_model_record_once() -> None:
    until = START + 40 * SECOND
    source = _source(CHURNY, FakeClock(until + SECOND))
    result = await walk_stream(source, START, until)
    expected = list(StreamModel(CHURNY).expected(until))
    assert len(result.data) == len({r.identity for r in result.data}), "duplicates"
    assert sorted(r.identity for r in result.data) == sorted(r.identity for r in expected)
    assert len(result.partitions) > CHURNY.roots  # children were followed
    assert any(len(parents) == 2 for _, parents in result.partitions.values())  # a merge


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["split", "move", "merge"])
async def test_partition_ends_with_its_child_record(kind: str) -> None:
    until = START + 60 * SECOND
    model = StreamModel(CHURNY)
    token = _find(model, kind, until)
    info = model.info(token)
    assert info.end_ts is not None
    source = _source(CHURNY, FakeClock(until + SECOND))
    records = _flat(await _read(source, token, info.start_ts, None))
    last = records[-1]
    assert last == model.child_record(token)
    assert isinstance(last, ChildPartitions)
    assert last.start_ts == info.end_ts
    assert [c.token for c in last.children] == list(info.children)
    assert all(c.parent_tokens == model.info(c.token).parents for c in last.children)
    assert all(r.commit_ts < info.end_ts for r in records if isinstance(r, DataChange))
    expected_parents = {"split": 1, "move": 1, "merge": 2}[kind]
    assert all(len(c.parent_tokens) == expected_parents for c in last.children)
    assert len(last.children) == (2 if kind == "split" else 1)


@pytest.mark.asyncio
async def test_merge_child_is_listed_by_both_parents() -> None:
    until = START + 60 * SECOND
    model = StreamModel(CHURNY)
    token = _find(model, "merge", until)
    child = model.info(token).children[0]
    parents = model.info(child).parents
    assert len(parents) == 2
    assert token in parents
    source = _source(CHURNY, FakeClock(until + SECOND))
    for parent in parents:
        last = _flat(await _read(source, parent, model.info(parent).start_ts, None))[-1]
        assert isinstance(last, ChildPartitions)
        assert last.children == (ChildPartition(child, parents),)


@pytest.mark.asyncio
async def test_records_appear_only_when_the_clock_passes_them() -> None:
    params = StreamParams(seed=2, records_per_s=40.0, split_p=0, move_p=0, merge_p=0)
    clock = FakeClock(START + 2 * SECOND)
    source = SimulatedSource(StreamModel(params), clock=clock, heartbeat_ms=500, poll_s=0.001)
    seen: list[ChangeRecord] = []
    it = source.query("p00000", START, None)
    try:
        async with asyncio.timeout(10):
            while not any(r.commit_ts > START + SECOND for r in seen if isinstance(r, DataChange)):
                seen.extend(await anext(it))
            assert all(r.commit_ts <= clock.now for r in seen if isinstance(r, DataChange))
            # nothing more until the clock moves (cancelling anext would end the generator, so
            # wait for it in a task instead)
            async with asyncio.TaskGroup() as tg:
                pending = tg.create_task(anext(it))
                await asyncio.sleep(0.05)
                assert not pending.done()
                clock.now += 3 * SECOND
            more = pending.result()
    finally:
        await it.aclose()
    assert more
    assert all(
        START + 2 * SECOND < r.commit_ts <= clock.now for r in more if isinstance(r, DataChange)
    )


@pytest.mark.asyncio
async def test_heartbeats_fill_silence_and_promise_nothing_earlier() -> None:
    params = StreamParams(seed=3, records_per_s=0.0, split_p=0, move_p=0, merge_p=0)
    until = START + 5 * SECOND
    source = _source(params, FakeClock(until + SECOND), heartbeat_ms=1000)
    records = _flat(await _read(source, "p00000", START, until))
    assert records == [Heartbeat(START - 1 + k * SECOND) for k in range(1, 6)]


@pytest.mark.asyncio
async def test_heartbeats_between_sparse_records() -> None:
    params = StreamParams(seed=4, records_per_s=0.5, split_p=0, move_p=0, merge_p=0)
    until = START + 30 * SECOND
    source = _source(params, FakeClock(until), heartbeat_ms=1000)
    records = _flat(await _read(source, "p00000", START, until))
    times = [r.commit_ts if isinstance(r, DataChange) else r.timestamp for r in records]  # type: ignore[union-attr]
    assert times == sorted(times)
    gaps = [b - a for a, b in zip([START - 1, *times], times, strict=False)]
    assert max(gaps) <= SECOND
    assert any(isinstance(r, Heartbeat) for r in records)
    assert any(isinstance(r, DataChange) for r in records)


@pytest.mark.asyncio
async def test_batches_are_bounded_and_end_ts_is_respected() -> None:
    params = StreamParams(seed=5, records_per_s=500.0, split_p=0, move_p=0, merge_p=0)
    until = START + 4 * SECOND
    source = _source(params, FakeClock(until + 100 * SECOND), max_batch=64)
    batches = await _read(source, "p00000", START, until)
    assert all(0 < len(b) <= 64 for b in batches)
    data = [r for r in _flat(batches) if isinstance(r, DataChange)]
    assert len(data) > 64 * 3
    assert max(r.commit_ts for r in data) <= until
    assert data == [
        r for r in StreamModel(params).records("p00000", START, until) if isinstance(r, DataChange)
    ]


@pytest.mark.asyncio
async def test_restart_from_a_watermark_loses_nothing() -> None:
    params = StreamParams(seed=8, records_per_s=100.0, split_p=0, move_p=0, merge_p=0)
    until = START + 6 * SECOND
    source = _source(params, FakeClock(until), max_batch=50)
    first: list[DataChange] = []
    it = source.query("p00000", START, until)
    try:
        batch = await anext(it)
        first.extend(r for r in batch if isinstance(r, DataChange))
    finally:
        await it.aclose()
    watermark = first[-1].commit_ts
    rest = [
        r
        for r in _flat(await _read(source, "p00000", watermark, until))
        if isinstance(r, DataChange)
    ]
    merged = {r.identity: r for r in [*first, *rest]}
    expected = [
        r for r in StreamModel(params).records("p00000", START, until) if isinstance(r, DataChange)
    ]
    assert sorted(merged) == sorted(r.identity for r in expected)
    assert source.statistics().queries_active == 0


@pytest.mark.asyncio
async def test_wall_clock_with_speedup_reaches_the_end() -> None:
    params = StreamParams(seed=9, records_per_s=30.0)
    until = START + 4 * SECOND
    source = SimulatedSource(StreamModel(params), speedup=100.0, poll_s=0.005)
    async with asyncio.timeout(10):
        result = await walk_stream(source, START, until)
    expected = list(StreamModel(params).expected(until))
    assert sorted(r.identity for r in result.data) == sorted(r.identity for r in expected)
    assert source.now() >= until


def test_unknown_token_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="speedup"):
        SimulatedSource(StreamModel(StreamParams()), speedup=0)
    with pytest.raises(ValueError, match="positive"):
        SimulatedSource(StreamModel(StreamParams()), max_batch=0)


@pytest.mark.asyncio
async def test_unknown_token_raises() -> None:
    source = _source(StreamParams(), FakeClock(START))
    with pytest.raises(UnknownPartition, match="'nope' is not one of this stream's"):
        await _read(source, "nope", START, None)


@pytest.mark.asyncio
async def test_a_fresh_source_serves_a_later_partition_first_asked_by_token() -> None:
    """A restarted process's source is asked first for the partitions its sync topic names
    (children made by an earlier process), never for the roots: it serves them exactly as the
    source that made them did. (Its model made partitions only as queries reached their time, so
    such a token was unknown for ever: ``KeyError: unknown partition token``.)"""
    params = StreamParams(seed=11, roots=2, split_p=0.5, move_p=0.2, merge_p=0.2)
    first = StreamModel(params)
    first.generate_until(START + 60 * SECOND)
    late = max(first.partitions, key=lambda t: first.partitions[t].start_ts)
    info = first.partitions[late]
    assert late not in first.roots
    assert info.start_ts > START + 10 * SECOND
    until = (info.end_ts or info.start_ts + 4 * SECOND) + SECOND
    clock = FakeClock(START + 70 * SECOND)
    made_it = SimulatedSource(first, clock=clock, sleep=_no_sleep)
    expected = _flat(await _read(made_it, late, info.start_ts, until))
    assert any(isinstance(r, DataChange) for r in expected)
    fresh = _source(params, clock)
    assert late not in fresh.model.partitions  # a fresh model had not made it yet
    got = _flat(await _read(fresh, late, info.start_ts, until))
    assert got == expected
