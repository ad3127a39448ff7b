"""Embedding shoal in an asyncio application.

An application that already runs an event loop runs shoal tasks inside it with
``actors.runtime.open_task``: an async context manager that replays the connector's sync topic,
joins the task group, reads the partitions it is given and hands their records, in batches, to
a callback. Returning from the callback commits the batch (the task's watermark for that
partition moves past it); raising makes the task read the batch again. Leaving the block stops
the task gracefully: no new reads, in-flight batches commit, the final watermarks are published,
the task leaves the group (the others take its partitions over).

This example is self-contained: it starts the embedded Kafka-compatible broker and a simulated
change stream, runs two tasks of one connector for a few seconds, and prints what each received.
Against real systems, pass a real ``KafkaConfig`` (``KafkaConfig.from_env()`` reads
``SHOAL_KAFKA_*``) and a ``SpannerSource`` (``runtime.spanner.reader``).

Run it with ``.venv/bin/python -m examples.embed`` (from the repository root).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from actors.runtime import open_task
from runtime.kafka import KafkaConfig
from runtime.kafka.broker import EmbeddedBroker
from runtime.ports import SinkBatch
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams


async def run(seconds: float = 6.0) -> Counter[str]:
    """Two tasks share a simulated stream for ``seconds``; returns records received per task."""
    received: Counter[str] = Counter()
    start = time.time_ns() // 1000
    source = SimulatedSource(StreamModel(StreamParams(seed=3, roots=4, start_ts=start)))

    def callback(task_id: str) -> Callable[[SinkBatch], Awaitable[None]]:
        async def on_batch(batch: SinkBatch) -> None:
            # Your application's write goes here; return once it is durable.
            received[task_id] += len(batch.records)

        return on_batch

    async with EmbeddedBroker() as broker:
        kafka = KafkaConfig.embedded(broker.bootstrap)
        async with (
            open_task(
                kafka,
                connector="embedded-example",
                task_id="app-1",
                source=source,
                on_batch=callback("app-1"),
                stream_start=start,
            ) as first,
            open_task(
                kafka,
                connector="embedded-example",
                task_id="app-2",
                source=source,
                on_batch=callback("app-2"),
                stream_start=start,
            ) as second,
        ):
            await asyncio.gather(first.ready.wait(), second.ready.wait())
            await asyncio.sleep(seconds)
            for node in (first, second):
                status = node.status()
                print(
                    f"{status.task_id}: epoch {status.epoch}, leader {status.leader}, "
                    f"{status.owned} partitions, {received[status.task_id]} records so far"
                )
    return received


def main() -> int:
    received = asyncio.run(run())
    print(f"received {sum(received.values())} records: {dict(received)}")
    return 0 if sum(received.values()) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
