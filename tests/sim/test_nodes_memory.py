"""Several task nodes (the real actors around the real cores) over the in-memory ports: the
partitions spread, every record reaches the sink exactly once (``MemorySink.rows`` counts every
commit of a record: a record committed twice fails), a node that leaves hands its partitions
over. Each exactly-once check has its control: the same check fails when one record is in the
sink twice (a doubled record in the read-back, and a sink that really commits one twice)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from contextlib import AsyncExitStack

import msgspec
import pytest

from actors.node import NodeConfig, TaskNode
from protocol.records import ChangeRecord, DataChange, Heartbeat
from protocol.task import TaskConfig
from runtime.ports import ChangeStreamSource, Membership, SinkBatch
from runtime.sim.memory import MemoryGroup, MemoryMembership, MemorySink, MemorySyncLog
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams
from tests.helpers import assert_catches_a_double

Identity = tuple[int, str, str]


async def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


def _exactly_once(committed: Collection[Identity], expected: Collection[Identity]) -> None:
    """``committed`` (every record the sink committed, one entry per commit) holds each of
    ``expected`` and no record twice."""
    counts = Counter(committed)
    twice = [identity for identity, n in counts.items() if n > 1]
    assert not twice, f"{len(twice)} records committed twice: {twice[:3]}"
    missing = set(expected) - counts.keys()
    assert not missing, f"{len(missing)} records never committed: {sorted(missing)[:3]}"


class DoublingSink(MemorySink):
    """A sink that commits the first record of its first batch twice: the control's fault."""

    def __init__(self, commit_delay: float) -> None:
        super().__init__(commit_delay=commit_delay)
        self.doubled = False

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        if not self.doubled and batch.records:
            self.doubled = True
            batch = msgspec.structs.replace(batch, records=(batch.records[0], *batch.records))
        return await super().put(batch)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_three_nodes_share_and_hand_over() -> None:
    params = StreamParams(
        seed=7,
        roots=9,
        round_us=2_000_000,
        split_p=0.1,
        merge_p=0.1,
        move_p=0.05,
        records_per_s=20,
    )
    model = StreamModel(params)
    source = SimulatedSource(model, speedup=4.0, heartbeat_ms=250)
    log = MemorySyncLog()
    group = MemoryGroup(rebalance_delay=0.1, session_timeout=2.0)
    sink = MemorySink(commit_delay=0.01)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    def node(name: str) -> TaskNode:
        config = NodeConfig(
            task=TaskConfig(task_id=name, answer_timeout=500_000, publish_interval=100_000),
            stream_start=params.start_ts,
        )
        return TaskNode(config, sync_log=log, join=join, source=source, sink=sink)

    nodes = [node(f"n{i}") for i in range(3)]
    async with AsyncExitStack() as stack:
        for n in nodes:
            await stack.enter_async_context(n)

        def balanced() -> bool:
            owned = [n.status().owned for n in nodes]
            readers = [set(n.task.readers) if n.task else set() for n in nodes]
            union = set().union(*readers)
            return (
                sum(owned) > 0
                and max(owned) - min(owned) <= 1
                and (sum(len(r) for r in readers) == len(union))
            )

        await _wait_for(balanced, 20)
        assert all(n.status().epoch >= 0 for n in nodes)
        leaders = {n.status().leader for n in nodes}
        assert len(leaders) == 1

        # n0 leaves: its partitions are handed to the others.
        survivors = nodes[1:]
        await nodes[0].__aexit__(None, None, None)  # leaves the group
        await _wait_for(
            lambda: all("n0" not in n.task.core.cim.members for n in survivors if n.task), 10
        )
        await asyncio.sleep(1.0)
        horizon = source.now() - 2_000_000
        expected = {r.identity for r in model.expected(horizon)}
        await _wait_for(lambda: expected <= sink.rows.keys(), 20)
        owners: dict[str, str] = {}
        for n in survivors:
            assert n.task is not None
            for token in n.task.core.owned_unfinished():
                assert token not in owners, f"{token} owned twice"
                owners[token] = n.task_id
        live = {t for t, i in model.partitions.items() if i.end_ts is None and i.start_ts < horizon}
        assert live <= set(owners)
        assert len(sink.rows) > 50
        assert any(n.status().counters.get("picked_up", 0) for n in survivors)

        # n1 is expelled (a session timeout) and, in memory, never rejoins: its time out of
        # the group grows (what the CLI's /healthz watches); n2 is back in at once.
        assert all(n.status().out_of_group_s == 0.0 for n in survivors)
        group.expel("n1")
        await _wait_for(lambda: not nodes[1].status().member, 5)
        first = nodes[1].status().out_of_group_s
        await asyncio.sleep(0.3)
        assert nodes[1].status().out_of_group_s >= first + 0.3
        await _wait_for(lambda: nodes[2].status().out_of_group_s == 0.0, 5)
    # Once stopped, every record the sink committed (hand-overs, a leave and an expel included):
    committed = list(sink.rows.elements())
    _exactly_once(committed, expected)
    assert_catches_a_double(lambda rows: _exactly_once(rows, expected), committed)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("doubling", [False, True], ids=["exact", "control-sink-doubles-a-record"])
async def test_drain_stops_reading_for_good_and_publishes_the_final_watermarks(
    doubling: bool,
) -> None:
    """Drained, the node reads nothing more and its final watermarks are in the log; every
    record below them was committed once. The control runs the same with a sink that commits
    one record twice: the exactly-once check fails."""
    params = StreamParams(seed=3, roots=4, split_p=0.0, merge_p=0.0, move_p=0.0, records_per_s=20)
    model = StreamModel(params)
    source = SimulatedSource(model, speedup=4.0, heartbeat_ms=250)
    log = MemorySyncLog()
    group = MemoryGroup(rebalance_delay=0.1, session_timeout=2.0)
    sink = DoublingSink(commit_delay=0.01) if doubling else MemorySink(commit_delay=0.01)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    config = NodeConfig(
        task=TaskConfig(task_id="solo", answer_timeout=300_000, publish_interval=500_000),
        stream_start=params.start_ts,
    )
    async with TaskNode(config, sync_log=log, join=join, source=source, sink=sink) as node:
        await _wait_for(lambda: node.status().reading == 4, 10)
        await asyncio.sleep(1.0)
        assert await node.drain(timeout=10)
        assert node.task is not None
        core = node.task.core
        assert core.reading == {}
        final = dict(node.status().watermarks)
        await asyncio.sleep(0.5)
        assert core.reading == {}  # nothing restarted
        assert core.cim.view("solo").partitions == core.mine  # the final state is in the log
    expected = {
        r.identity
        for token, watermark in final.items()
        for r in model.records(token, params.start_ts, watermark - 1)
        if isinstance(r, DataChange)
    }
    assert expected, "nothing was read"
    committed = list(sink.rows.elements())
    if doubling:
        with pytest.raises(AssertionError, match="1 records committed twice"):
            _exactly_once(committed, expected)
    else:
        _exactly_once(committed, expected)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("formed", [False, True], ids=["never-formed", "control-expelled"])
async def test_a_task_whose_group_never_formed_drains_cleanly(formed: bool) -> None:
    """A short run on a slow broker may stop before the group forms: the task held nothing and
    read nothing, so its drain is clean (a CLI run with ``--duration`` exits 0). The control: a
    task expelled while it reads is not clean (its partitions are the group's to settle)."""
    params = StreamParams(seed=4, roots=3, split_p=0.0, merge_p=0.0, move_p=0.0, records_per_s=20)
    source = SimulatedSource(StreamModel(params), speedup=4.0, heartbeat_ms=250)
    group = MemoryGroup(rebalance_delay=0.1 if formed else 3600.0, session_timeout=2.0)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    config = NodeConfig(task=TaskConfig(task_id="solo"), stream_start=params.start_ts)
    sink = MemorySink(commit_delay=0.01)
    async with TaskNode(
        config, sync_log=MemorySyncLog(), join=join, source=source, sink=sink
    ) as node:
        if formed:
            await _wait_for(lambda: node.status().reading == 3, 10)
            group.expel("solo")
            await _wait_for(lambda: not node.status().member, 5)
        else:
            await asyncio.sleep(0.5)
            assert node.status().generation == -1
        assert await node.drain(timeout=5) is not formed


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_readers_stopped_by_a_lapsed_lease_start_again_when_it_is_renewed() -> None:
    """The lease lapses (heartbeats late) without the task leaving the group: every reader stops
    at once; once heartbeats come back every partition is read again. (A reader used to report
    its stop while it was still alive; the restart the core asked for was then dropped as
    'still running' and the partition was never read again.)"""
    params = StreamParams(seed=5, roots=12, split_p=0.0, merge_p=0.0, move_p=0.0, records_per_s=20)
    model = StreamModel(params)
    source = SimulatedSource(model, speedup=4.0, heartbeat_ms=250)
    log = MemorySyncLog()
    group = MemoryGroup(rebalance_delay=0.1, session_timeout=1.0)
    sink = MemorySink(commit_delay=0.01)
    memberships: list[MemoryMembership] = []

    async def join(task_id: str) -> Membership:
        membership = group.join(task_id)
        memberships.append(membership)
        return membership

    config = NodeConfig(
        task=TaskConfig(task_id="solo", answer_timeout=300_000, publish_interval=200_000),
        stream_start=params.start_ts,
    )
    async with TaskNode(config, sync_log=log, join=join, source=source, sink=sink) as node:
        assert node.task is not None
        task = node.task
        await _wait_for(lambda: node.status().reading == 12, 10)
        for lapse in range(5):
            memberships[0].heartbeats = False
            # The first readers see the lease expired; renewed at once, while others stop.
            await _wait_for(lambda: len(task.readers) < 12, 5)
            memberships[0].heartbeats = True
            await _wait_for(lambda: node.status().reading == 12 and len(task.readers) == 12, 5)
            assert node.status().member, lapse
        before = dict(node.status().watermarks)
        await asyncio.sleep(1.5)
        after = node.status().watermarks
        assert all(after[token] > before[token] for token in before)  # every one is read


@pytest.mark.asyncio
async def test_reader_reports_never_overflow_a_busy_task_mailbox() -> None:
    """At 10,000 partitions the readers' commit reports filled the task's mailbox and a full
    mailbox failed the reader (MailboxFull). Commits are now merged per partition outside the
    mailbox and handed to the core in one event; other reports queue in order."""
    from actors.kernel import Supervisor
    from actors.task import FlushReports, TaskActor
    from protocol.task import ReaderCommitted, ReaderStopped, TaskTick

    model = StreamModel(StreamParams(seed=1, roots=2))
    task = TaskActor(
        TaskConfig(task_id="t"),
        sync_log=MemorySyncLog(),
        source=SimulatedSource(model),
        sink=MemorySink(),
        supervisor=Supervisor(),
        stream_start=model.params.start_ts,
        mailbox=2,
    )
    task.tell_nowait(TaskTick())
    task.tell_nowait(TaskTick())  # the mailbox is full: the task is busy
    for n in range(1, 5001):
        task.report(ReaderCommitted(f"p{n % 1000}", n))
    task.report(ReaderStopped("p7", 5000))
    assert task.statistics().depth == 2  # no slot taken per report
    await task.receive(TaskTick())  # the task handles a message, then what readers reported
    handled = [name for _, name in task.core.log]
    assert handled == ["TaskTick", "ReaderStopped", "ReadersCommitted"]
    task.report(ReaderCommitted("p1", 5001))  # an idle task is woken by one flush message
    await task.receive(FlushReports())
    assert [name for _, name in task.core.log][-1] == "ReadersCommitted"


class FrozenHeartbeats(ChangeStreamSource):
    """The simulated stream, except that ``frozen``'s query sends heartbeats that never
    advance (the source talks, the partition is not read)."""

    def __init__(self, inner: SimulatedSource, frozen: str) -> None:
        self.inner = inner
        self.frozen = frozen

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[Sequence[ChangeRecord], None]:
        if token != self.frozen:
            async for batch in self.inner.query(token, start_ts, end_ts):
                yield batch
            return
        while True:
            yield [Heartbeat(start_ts)]
            await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_partition_that_talks_but_does_not_advance_is_reported_stuck(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The task's watch names an owned partition whose committed watermark stands still
    although its reader runs, with what the reader last heard from the source; the partitions
    that advance are not named."""
    params = StreamParams(seed=3, roots=3, records_per_s=20)
    model = StreamModel(params)
    roots = [c.token for c in model.root_record().children]
    source = FrozenHeartbeats(SimulatedSource(model, speedup=4.0, heartbeat_ms=100), roots[0])
    group = MemoryGroup(rebalance_delay=0.05, session_timeout=2.0)

    async def join(task_id: str) -> Membership:
        return group.join(task_id)

    config = NodeConfig(
        task=TaskConfig(task_id="n0", answer_timeout=200_000, publish_interval=50_000),
        stream_start=params.start_ts,
        stuck_after=1.0,
    )
    caplog.set_level(logging.WARNING, logger="shoal")
    node = TaskNode(config, sync_log=MemorySyncLog(), join=join, source=source, sink=MemorySink())
    async with node:
        await _wait_for(lambda: node.status().stuck > 0, 20)
        await asyncio.sleep(0.6)  # a few more watches: the others keep advancing
        assert node.status().stuck == 1
    stuck = [r.getMessage() for r in caplog.records if "not read for" in r.getMessage()]
    assert stuck, "the watch logged nothing"
    assert f"{roots[0][:16]} at {params.start_ts}" in stuck[-1]
    assert "last from source Heartbeat 0s ago" in stuck[-1]
    assert all(t[:16] not in stuck[-1] for t in roots[1:])
