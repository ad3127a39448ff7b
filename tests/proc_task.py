"""One shoal task in its own process, for tests that SIGKILL a task.

Usage: ``python -m tests.proc_task BOOTSTRAP CONNECTOR TASK_ID ORIGIN`` (``ORIGIN``: the
``time.time()`` the test's stream clock starts at, so every process reads the same model time).

Runs a :class:`actors.node.TaskNode` over the embedded broker with the simulated stream of
``tests.fixtures.kafka_nodes``; prints one JSON line per batch its sink takes
(``{"delivery": [...]}``, a :class:`~tests.fixtures.kafka_nodes.Delivery`) and its status every
50 ms (``{"status": {...}}``). It leaves the group and exits when its stdin closes.
"""

from __future__ import annotations

import asyncio
import sys

import msgspec

from actors.node import TaskNode
from runtime.kafka import KafkaConfig, KafkaSyncLog
from tests.fixtures.kafka_nodes import (
    Delivery,
    RecordingSink,
    View,
    joiner,
    make_source,
    node_config,
    offers_of,
)

_encoder = msgspec.json.Encoder()


def emit(item: dict[str, object]) -> None:
    sys.stdout.buffer.write(_encoder.encode(item) + b"\n")
    sys.stdout.flush()


def deliver(delivery: Delivery) -> None:
    emit({"delivery": delivery})


async def status_loop(node: TaskNode) -> None:
    while True:
        task = node.task
        if task is not None and node.ready.is_set():
            status = node.status()
            emit(
                {
                    "status": View(
                        task=node.task_id,
                        member=status.member,
                        leader=status.leader,
                        generation=status.generation,
                        epoch=status.epoch,
                        owned=frozenset(task.core.owned_unfinished()),
                        reading=frozenset(task.readers),
                        counters=status.counters,
                        offers=offers_of(task.core),
                    )
                }
            )
        await asyncio.sleep(0.05)


async def stdin_closed() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()


async def main(bootstrap: str, connector: str, task_id: str, origin: float) -> None:
    config = KafkaConfig.embedded(bootstrap)
    async with KafkaSyncLog(config, connector, fetch_max_wait_ms=20) as sync_log:
        node = TaskNode(
            node_config(task_id),
            sync_log=sync_log,
            join=joiner(config, connector),
            source=make_source(origin),
            sink=RecordingSink(task_id, deliver),
        )
        async with node, asyncio.TaskGroup() as group:
            status = group.create_task(status_loop(node))
            await stdin_closed()
            status.cancel()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
