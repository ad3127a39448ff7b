"""``SnapshotRouting``: snapshot work items are read from the snapshot source (what they need
from the consolidated state), every other query goes to the change stream; an unknown snapshot
partition is an error the reader retries, and one the state records done ends at once, empty."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

import pytest

from protocol.messages import SnapshotItem
from protocol.records import ChangeRecord, ChildPartitions, DataChange
from protocol.snapshot import work_token
from runtime.ports import ChangeStreamSource
from runtime.sim.memory import MemorySnapshots
from runtime.snapshot_routing import SnapshotRouting, UnknownSnapshotPartition

T = 1_000


class Stream(ChangeStreamSource):
    """The change stream: remembers what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str | None, int, int | None]] = []

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        self.asked.append((token, start_ts, end_ts))
        yield (ChildPartitions(start_ts, "0", ()),)


async def _all(source: SnapshotRouting, token: str | None) -> list[ChangeRecord]:
    return [r async for batch in source.query(token, T, None) for r in batch]


@pytest.mark.asyncio
async def test_snapshot_items_to_the_snapshot_source_the_rest_to_the_stream() -> None:
    snapshots = MemorySnapshots(seed=1, partitions=2, max_chunks=5)
    plan = await snapshots.plan_snapshot(T)
    items = {item.token: item for item in plan.items}
    done = {work_token("Albums", 1)}

    def lookup(token: str) -> tuple[SnapshotItem, int] | None:
        item = items.get(token)
        return None if item is None or token in done else (item, plan.chunk_rows)

    stream = Stream()
    source = SnapshotRouting(stream, snapshots, lookup, lambda token: token in done)
    first = work_token("Singers", 0)
    got = await _all(source, first)
    assert got == list(snapshots.records[first])
    assert all(isinstance(r, DataChange) and r.mod_type == "SNAPSHOT" for r in got)
    assert stream.asked == []
    assert await _all(source, "AbC==") == [ChildPartitions(T, "0", ())]
    assert await _all(source, None) == [ChildPartitions(T, "0", ())]
    assert stream.asked == [("AbC==", T, None), (None, T, None)]
    # done: ends at once, nothing read
    assert await _all(source, work_token("Albums", 1)) == []
    assert snapshots.reads[work_token("Albums", 1)] == 0
    assert source.ended_done == 1
    with pytest.raises(UnknownSnapshotPartition):
        await _all(source, work_token("Songs", 9))
