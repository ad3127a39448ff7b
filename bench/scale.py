"""``python -m bench scale``: many partitions and tasks in one process.

10,000 idle partitions spread over 20 tasks (real actors and cores, in-memory group, sink and
sync log whose bytes are counted), then:

* **sync bytes per rebalance**: a 21st task joins and the partitions spread to it; the bytes
  written to the sync topic from the join until the spread is balanced again, and how many
  partitions moved. Idle partitions' watermarks stand still meanwhile (their steady traffic,
  with a heartbeat every 5 s, is reported apart), and the leader's periodic checkpoints (the
  whole CIM on a timer) are counted apart. It must grow with the partitions that moved, not
  with the total: compare the quick run (1,000 partitions) per moved partition.
* **replay**: the sync topic so far is copied into a topic on the embedded Kafka-compatible
  broker and a fresh task's replay is timed the way a starting task does it: from the latest
  checkpoint to the end, decoded and folded into a CIM.
* **RSS per idle owned partition**: one task alone in a fresh process (as in production: one
  task per process) owns and reads every partition; its resident memory minus before, divided
  by the partitions. (The 20-task process is reported too: each of its tasks holds the CIM.)
* **plan**: time for the leader to plan an epoch from this CIM after a task died (its partitions
  re-dealt) — the pure planner, median of a few runs.

Last line: ``{"scenario": "scale", "sync_bytes_per_rebalance": .., "replay_s": ..,
"rss_per_partition_kb": .., "plan_s": ..}``. Goals: replay < 2 s, < 20 KB per idle partition.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack, aclosing
from random import Random

from actors.node import TaskNode
from bench.common import MemoryCluster, rss_mb, static_stream, wait_for
from protocol import messages
from protocol.cim import Cim
from protocol.messages import CheckpointMessage
from protocol.planner import plan
from protocol.records import ChangeRecord
from runtime.ports import ChangeStreamSource
from runtime.sim.memory import MemorySyncLog
from runtime.sim.source import SimulatedSource


class QuietableSource(ChangeStreamSource):
    """The simulated source; while ``quiet``, a partition's batches come back empty (no
    heartbeat, no record), so idle partitions' watermarks stand still and the sync topic
    carries only what a rebalance writes."""

    def __init__(self, inner: SimulatedSource) -> None:
        self.inner = inner
        self.quiet = False

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        async with aclosing(self.inner.query(token, start_ts, end_ts)) as batches:
            async for batch in batches:
                yield [] if self.quiet and token is not None else batch


class CountingLog(MemorySyncLog):
    """The in-memory sync log, counting bytes written (and, apart, the leader's periodic
    checkpoints: their size is the whole CIM's, on a timer, whatever moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_written = 0
        self.checkpoint_bytes = 0

    async def append(self, payload: bytes) -> int:
        self.bytes_written += len(payload)
        if isinstance(messages.decode(payload), CheckpointMessage):
            self.checkpoint_bytes += len(payload)
        return await super().append(payload)


def replay_cim(entries: list[tuple[int, bytes]]) -> Cim:
    cim = Cim()
    for offset, payload in entries:
        try:
            cim.apply(offset, messages.decode(payload))
        except messages.SyncDecodeError as exc:
            raise RuntimeError(f"sync message at {offset} unreadable: {exc}") from exc
    return cim


async def replay_from_kafka(log: CountingLog) -> tuple[float, int, int]:
    """Copy the log into the embedded broker; time a replay from the latest checkpoint.
    Returns (seconds, messages replayed, total messages)."""
    from runtime.kafka import KafkaConfig, KafkaSyncLog
    from runtime.kafka.broker import EmbeddedBroker

    async with EmbeddedBroker() as broker:
        config = KafkaConfig.embedded(broker.bootstrap)
        async with KafkaSyncLog(config, "scale") as kafka_log:
            checkpoint = None
            for payload in log.entries:
                at = await kafka_log.append(payload)
                if isinstance(messages.decode(payload), CheckpointMessage):
                    checkpoint = at
            if checkpoint is not None:
                await kafka_log.record_checkpoint(checkpoint)
            end = len(log.entries) - 1
            t0 = time.perf_counter()
            start = await kafka_log.checkpoint_offset() or 0
            cim = Cim()
            replayed = 0
            async with aclosing(kafka_log.read(start)) as reader:
                async for offset, payload in reader:
                    cim.apply(offset, messages.decode(payload))
                    replayed += 1
                    if offset >= end:
                        break
            return time.perf_counter() - t0, replayed, len(log.entries)


async def measure(partitions: int, tasks: int) -> dict[str, object]:
    params = static_stream(5, partitions, records_per_s=0.01)
    source = QuietableSource(SimulatedSource.from_params(params, heartbeat_ms=5000, poll_s=1.0))
    log = CountingLog()
    cluster = MemoryCluster(
        source,
        params.start_ts,
        log=log,
        rebalance_delay=0.2,
        session_timeout=10.0,
    )

    def node(name: str) -> TaskNode:
        return cluster.node(
            name,
            cap=0,
            answer_timeout=1_000_000,
            publish_interval=1_000_000,
            checkpoint_interval=5_000_000,
        )

    out: dict[str, object] = {"partitions": partitions, "tasks": tasks}
    gc.collect()
    rss_before = rss_mb()
    async with AsyncExitStack() as stack:
        nodes = [node(f"t{i:02d}") for i in range(tasks)]
        t0 = time.perf_counter()
        for n in nodes:
            await stack.enter_async_context(n)

        def spread(ns: list[TaskNode]) -> bool:
            reading = [n.status().reading for n in ns]
            return sum(reading) == partitions and max(reading) - min(reading) <= 1

        if not await wait_for(lambda: spread(nodes), 300):
            raise RuntimeError(f"never spread: {[n.status().reading for n in nodes]}")
        out["start_s"] = round(time.perf_counter() - t0, 2)
        await asyncio.sleep(2.0)
        gc.collect()
        rss_full = rss_mb()
        out["rss_mb"] = round(rss_full, 1)
        # Every task in this process holds the whole CIM: this counts it once per task.
        out["rss_cluster_per_partition_kb"] = round((rss_full - rss_before) * 1000 / partitions, 2)

        # Steady state: idle partitions' watermarks advance with heartbeats (every 5 s here)
        # and each task publishes its changed watermarks: that traffic grows with the total.
        b0, s0 = log.bytes_written, time.perf_counter()
        await asyncio.sleep(5.0)
        out["steady_sync_bytes_per_s"] = round(
            (log.bytes_written - b0) / (time.perf_counter() - s0)
        )
        # For the rebalance, watermarks stand still (no heartbeats), so the bytes are the
        # rebalance's own; what little is still written while quiet is subtracted.
        source.quiet = True
        await asyncio.sleep(3.0)
        b0, s0 = log.bytes_written, time.perf_counter()
        await asyncio.sleep(2.0)
        steady_rate = (log.bytes_written - b0) / (time.perf_counter() - s0)
        out["quiet_sync_bytes_per_s"] = round(steady_rate)

        # A task joins: bytes written until the spread is balanced again.
        before_owner = {t: n.task_id for n in nodes for t in n.status().watermarks}
        bytes0, msgs0, ckpt0 = log.bytes_written, len(log.entries), log.checkpoint_bytes
        t1 = time.perf_counter()
        extra = await stack.enter_async_context(node(f"t{tasks:02d}"))
        everyone = [*nodes, extra]
        if not await wait_for(lambda: spread(everyone), 300):
            raise RuntimeError(f"never re-spread: {[n.status().reading for n in everyone]}")
        out["join_rebalance_s"] = round(time.perf_counter() - t1, 2)
        await asyncio.sleep(1.5)  # the last ownership reports land
        after_owner = {t: n.task_id for n in everyone for t in n.status().watermarks}
        moved = sum(1 for t, who in after_owner.items() if before_owner.get(t) != who)
        out["moved"] = moved
        window = time.perf_counter() - t1
        out["sync_bytes_in_window"] = log.bytes_written - bytes0
        checkpoints = log.checkpoint_bytes - ckpt0
        out["checkpoint_bytes_in_window"] = checkpoints
        rebalance_bytes = max(
            0, round(log.bytes_written - bytes0 - checkpoints - steady_rate * window)
        )
        out["sync_bytes_per_rebalance"] = rebalance_bytes
        out["sync_messages_per_rebalance"] = len(log.entries) - msgs0
        out["sync_bytes_per_moved_partition"] = round(rebalance_bytes / max(1, moved), 1)
        out["sync_topic_messages"] = len(log.entries)
        out["sync_topic_bytes"] = log.bytes_written
        leader = next(n for n in everyone if n.task and n.task.core.leader == n.task_id)
        assert leader.task is not None
        # A copy: leaving the block drains every task, and their final states change the CIM.
        cim = Cim()
        cim.apply(0, leader.task.core.cim.checkpoint(leader.task_id, 0))

    # The leader plans an epoch after a task died: its partitions are re-dealt.
    members = tuple(sorted(cim.members))
    survivors = members[1:]
    times = []
    for i in range(5):
        t = time.perf_counter()
        p = plan(cim, survivors, survivors[0], cim.epoch + 1, 0, 0, Random(i))
        times.append(time.perf_counter() - t)
    out["plan_offers"] = len(p.offers)
    out["plan_s"] = round(statistics.median(times), 4)

    # Replay the sync topic the way a starting task does, from the embedded broker.
    t = time.perf_counter()
    replay_cim(list(enumerate(log.entries)))
    out["replay_full_in_memory_s"] = round(time.perf_counter() - t, 3)
    seconds, replayed, total = await replay_from_kafka(log)
    out["sync_topic_total_messages"] = total
    out["replay_s"] = round(seconds, 3)
    out["replay_messages"] = replayed
    return out


async def measure_one_task(partitions: int) -> float:
    """RSS (KB) per idle partition owned and read by one task."""
    params = static_stream(6, partitions, records_per_s=0.01)
    source = SimulatedSource.from_params(params, heartbeat_ms=5000, poll_s=1.0)
    cluster = MemoryCluster(source, params.start_ts, session_timeout=30.0)
    gc.collect()
    before = rss_mb()
    async with cluster.node("solo", cap=0, publish_interval=1_000_000) as n:
        if not await wait_for(lambda: n.status().reading == partitions, 300):
            raise RuntimeError(f"one task read only {n.status().reading} of {partitions}")
        await asyncio.sleep(3.0)
        gc.collect()
        return (rss_mb() - before) * 1000 / partitions


def one_task_process(partitions: int) -> float:
    """Run :func:`measure_one_task` in a fresh process so nothing else is in its RSS."""
    import subprocess

    code = f"import uvloop, bench.scale as s; print(uvloop.run(s.measure_one_task({partitions})))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=900
    )
    if proc.returncode != 0:
        raise RuntimeError(f"one-task measurement failed: {proc.stderr.strip()[-500:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__)
    parser.add_argument("--partitions", type=int, default=10_000)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="1,000 partitions, 10 tasks")
    args = parser.parse_args(argv)
    if args.quick:
        args.partitions, args.tasks = 1000, 10
    if args.partitions < args.tasks or args.tasks < 2:
        parser.error("need at least 2 tasks and a partition per task")
    import uvloop

    try:
        result = uvloop.run(measure(args.partitions, args.tasks))
        result["rss_per_partition_kb"] = round(one_task_process(args.partitions), 2)
    except RuntimeError as exc:
        print(f"scale: {exc}", file=sys.stderr)
        return 1
    for key, value in result.items():
        print(f"{key:>32}: {value}")
    keys = ("sync_bytes_per_rebalance", "replay_s", "rss_per_partition_kb", "plan_s")
    figures = {k: result[k] for k in keys}
    extra = (
        "partitions",
        "tasks",
        "moved",
        "sync_bytes_per_moved_partition",
        "start_s",
        "rss_cluster_per_partition_kb",
    )
    figures.update({k: result[k] for k in extra})
    print(json.dumps({"scenario": "scale", **figures}))
    return 0
