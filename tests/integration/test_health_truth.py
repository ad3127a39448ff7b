"""Health tells the truth: a process whose sink fails every batch, or whose source fails every
query, is not ready at once (``/readyz`` 503: not making progress) and not healthy once that
lasted ``health.failing_s`` (``/healthz`` 503), and the progress display says why; once the sink
or source works again both answer 200 (the control, in the same run).

The run is a real :class:`actors.cli.run.Pipeline` (embedded broker, one task, metrics server)
handed a sink and a source from the test: the in-memory sink of ``runtime/sim/memory.py`` and the
simulated stream, each wrapped so the test can make every attempt fail and then stop that."""

from __future__ import annotations

import asyncio
import io
import time
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

import pytest

from actors.cli import config as options
from actors.cli.run import Pipeline
from protocol.records import ChangeRecord
from runtime.ports import ChangeStreamSource, Sink, SinkBatch
from runtime.sim.memory import MemorySink
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams
from tests.helpers import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

FAILING_S = 3.0


class SwitchableSink(Sink):
    """:class:`MemorySink`, failing every batch while ``failing`` is set."""

    def __init__(self) -> None:
        self.inner = MemorySink()
        self.failing = True
        self.failed = 0

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        if self.failing:
            self.failed += 1
            self.inner.fail_next = 1  # the in-memory sink's own failure path
        return await self.inner.put(batch)


class SwitchableSource(ChangeStreamSource):
    """The simulated stream, failing every query (at once, or at its next batch) while
    ``failing`` is set."""

    def __init__(self, inner: SimulatedSource) -> None:
        self.inner = inner
        self.failing = False

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        if self.failing:
            raise ConnectionError("change stream unavailable (injected)")
        async for batch in self.inner.query(token, start_ts, end_ts):
            if self.failing:
                raise ConnectionError("change stream unavailable (injected)")
            yield batch


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _answer(url: str) -> tuple[int, str]:
    return await asyncio.to_thread(_get, url)


async def _wait_answer(url: str, status: int, text: str, timeout_s: float) -> str:
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code, body = await _answer(url)
        seen.append((code, body))
        if code == status and text in body:
            return body
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never answered {status} with {text!r}; last {seen[-3:]}")


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_failing_sink_then_failing_source_show_in_health(tmp_path: Path) -> None:
    config = options.load(
        {
            "run__output_dir": str(tmp_path),
            "run__tasks": "1",
            "run__metrics_port": "0",
            "run__progress": "on",
            "run__progress_interval": "0.2",
            "health__failing_s": str(FAILING_S),
        },
        environ={},
    )
    start = time.time_ns() // 1000
    model = StreamModel(StreamParams(seed=7, roots=2, start_ts=start, records_per_s=50))
    sink = SwitchableSink()
    source = SwitchableSource(SimulatedSource(model, poll_s=0.05))
    out = io.StringIO()
    stop = asyncio.Event()
    pipeline = Pipeline(config, stop=stop, out=out, sink=sink, source=source)
    async with asyncio.TaskGroup() as group:
        run = group.create_task(pipeline.run())
        await wait_for(lambda: pipeline.metrics is not None, 60, "the metrics server")
        assert pipeline.metrics is not None
        url = pipeline.metrics.url

        # The sink fails every batch: not ready at once, unhealthy after FAILING_S.
        await wait_for(lambda: sink.failed > 0, 60, "a batch handed to the sink")
        body = await _wait_answer(f"{url}/readyz", 503, "not making progress", 30)
        assert "the sink has failed every batch" in body
        assert "sink failed the batch (injected)" in body
        body = await _wait_answer(f"{url}/healthz", 503, "the sink has failed every batch", 60)
        assert "RuntimeError: sink failed the batch (injected)" in body
        metrics = (await _answer(f"{url}/metrics"))[1]
        assert "shoal_sink_failing_seconds" in metrics
        assert "NOT MAKING PROGRESS: the sink has failed every batch" in out.getvalue()

        # Control: the sink works again; health and readiness come back.
        sink.failing = False
        await _wait_answer(f"{url}/healthz", 200, "ok", 60)
        await _wait_answer(f"{url}/readyz", 200, "ready", 60)
        committed = len(sink.inner.batches)
        await wait_for(lambda: len(sink.inner.batches) > committed, 30, "batches committed")

        # The source fails every query: the same, with the source's reason.
        source.failing = True
        body = await _wait_answer(f"{url}/readyz", 503, "the source has failed every query", 30)
        assert "ConnectionError: change stream unavailable (injected)" in body
        await _wait_answer(f"{url}/healthz", 503, "the source has failed every query", 60)
        source.failing = False
        await _wait_answer(f"{url}/healthz", 200, "ok", 60)
        await _wait_answer(f"{url}/readyz", 200, "ready", 60)

        stop.set()
        summary = await run
    assert summary.drained
    assert "NOT MAKING PROGRESS: the source has failed every query" in out.getvalue()
