"""One shoal task in its own process writing parquet through the file sink, killed with SIGKILL
right after its sink durably committed a batch, before the reader hears of it (so that batch's
position never reaches the sync topic): the case docs/design.md#exactly-once-output, rule 2,
covers.

Usage: ``python -m tests.proc_commit_kill BOOTSTRAP CONNECTOR TASK_ID ORIGIN OUTPUT KILL_AFTER
DURABLE``. ``KILL_AFTER``: after how many committed batches with records the process kills
itself (0: never). ``DURABLE``: ``1`` lets readers ask the sink for its durable position at
take-over (the rule), ``0`` hides it (the control: a take-over then resumes from the sync topic's
position only). It drains and exits when its stdin closes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from actors.embed import GatedSource, drain_node
from actors.node import TaskNode
from protocol.dedup import Position
from runtime.files.sink import FileSink
from runtime.kafka import KafkaConfig, KafkaSyncLog
from runtime.ports import Sink, SinkBatch
from tests.fixtures.kafka_nodes import joiner, make_source, node_config


class KillAfterCommits(Sink):
    """The file sink, and a SIGKILL of this process the moment its ``kill_after``-th batch with
    records is durably committed: the callback runs before the reader's (it is registered first),
    so the reader never reports that batch and its watermark is never published."""

    def __init__(self, inner: FileSink, kill_after: int, durable: bool) -> None:
        self.inner = inner
        self.kill_after = kill_after
        self.durable = durable
        self.commits = 0

    async def prepare(self, token: str) -> None:
        await self.inner.prepare(token)

    async def durable_position(self, token: str) -> Position | None:
        return await self.inner.durable_position(token) if self.durable else None

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        future = await self.inner.put(batch)
        if self.kill_after and batch.records:

            def committed(f: asyncio.Future[None]) -> None:
                if f.cancelled() or f.exception() is not None:
                    return
                self.commits += 1
                if self.commits >= self.kill_after:
                    sys.stdout.write("killing myself after a durable commit\n")
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)

            future.add_done_callback(committed)
        return future


async def stdin_closed() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()


async def main(argv: list[str]) -> None:
    bootstrap, connector, task_id, origin, output, kill_after, durable = argv
    config = KafkaConfig.embedded(bootstrap)
    async with (
        KafkaSyncLog(config, connector, fetch_max_wait_ms=20) as sync_log,
        FileSink(output, max_age_s=0.2) as files,
    ):
        gate = GatedSource(make_source(float(origin)))
        node = TaskNode(
            node_config(task_id),
            sync_log=sync_log,
            join=joiner(config, connector),
            source=gate,
            sink=KillAfterCommits(files, int(kill_after), durable == "1"),
        )
        async with node:
            sys.stdout.write("started\n")
            sys.stdout.flush()
            await stdin_closed()
            drained = await drain_node(node, gate)
            sys.stdout.write(f"drained {drained}\n")
            sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
