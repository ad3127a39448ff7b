"""The documented embedding example runs: two tasks inside one application's event loop share
a simulated stream over the embedded broker, both receive records, and the blocks exit cleanly."""

from __future__ import annotations

import pytest

from examples.embed import run


@pytest.mark.asyncio
@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_embedding_example_runs() -> None:
    received = await run(seconds=4.0)
    assert set(received) == {"app-1", "app-2"}
    assert all(n > 0 for n in received.values())
