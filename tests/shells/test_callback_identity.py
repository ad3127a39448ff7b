"""The embedding API's callback gets the deterministic batch identity when it asks for it (a
second parameter): the same batch delivered again has the same id (docs/operations.md, "Output
and duplicates"); a one-parameter callback is called as before."""

from __future__ import annotations

import pytest

from actors.embed import CallbackSink
from protocol.commit import batch_identity
from protocol.records import DataChange
from runtime.ports import SinkBatch


def rec(ts: int, seq: str = "0") -> DataChange:
    return DataChange(ts, seq, f"txn{ts}", False, "T", (), (), "INSERT")


BATCH = SinkBatch("p", (rec(1), rec(2)), 2)
OTHER = SinkBatch("p", (rec(2), rec(3)), 3)


@pytest.mark.asyncio
async def test_a_two_parameter_callback_gets_a_stable_batch_id() -> None:
    ids: list[str] = []

    async def on_batch(batch: SinkBatch, batch_id: str) -> None:
        ids.append(batch_id)

    async with CallbackSink(on_batch) as sink:
        for batch in (BATCH, OTHER, BATCH):  # the first delivered again after a failure
            await (await sink.put(batch))
    assert ids[0] == ids[2] == batch_identity([("p", BATCH.records)])
    assert ids[1] != ids[0]


@pytest.mark.asyncio
async def test_a_one_parameter_callback_gets_the_batch_only() -> None:
    got: list[SinkBatch] = []

    async def on_batch(batch: SinkBatch) -> None:
        got.append(batch)

    async with CallbackSink(on_batch) as sink:
        await (await sink.put(BATCH))
    assert got == [BATCH]
