"""Task nodes coordinating over the embedded broker (issue 3): the real actors, the real Kafka
adapters, the simulated change stream; nothing of Kafka is mocked.

Three checkers watch every test: the nodes' own views (:meth:`Cluster.settled`), an observer
that replays the sync topic into its own CIM and checks it after every message
(:class:`SyncObserver`), and the sinks' ledger of every batch handed over, from this process and
from the subprocess task (:class:`SinkLedger`). Session timeout 3 s (the embedded broker's
settings): a join or leave settles in a few seconds, a killed task is replaced after ~5 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from protocol import epochs, messages, trace
from protocol.events import Joined
from protocol.messages import EpochMessage, Partition, StateMessage, TaskState
from runtime.kafka import KafkaConfig, KafkaMembership, KafkaSyncLog
from runtime.sim.stream import StreamModel
from tests.fixtures.kafka import connector, kafka_broker, kafka_config, next_assignment
from tests.fixtures.kafka_nodes import (
    STREAM,
    Cluster,
    Delivery,
    FailingAppends,
    SinkLedger,
    SyncObserver,
)

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name

pytestmark = [pytest.mark.kafka]

TOKENS = set(StreamModel(STREAM).roots)


@pytest_asyncio.fixture
async def observer(kafka_config: KafkaConfig, connector: str) -> AsyncIterator[SyncObserver]:
    async with SyncObserver(kafka_config, connector) as obs:
        yield obs


@pytest_asyncio.fixture
async def nodes(kafka_config: KafkaConfig, connector: str) -> AsyncIterator[Cluster]:
    async with Cluster(kafka_config, connector) as c:
        yield c


def assert_clean(cluster: Cluster, observer: SyncObserver) -> None:
    assert observer.violations == []
    assert cluster.ledger.violations(cluster.killed) == []
    assert all(len(openers) == 1 for openers in observer.epoch_openers.values()), (
        observer.epoch_openers
    )


def assert_one_leader(cluster: Cluster, observer: SyncObserver) -> str:
    views = cluster.views().values()
    leaders = {v.leader for v in views}
    assert len(leaders) == 1, leaders
    (leader,) = leaders
    epoch = next(iter(views)).epoch
    assert observer.epoch_openers[epoch] == {leader}
    assert observer.cim.leader == leader
    return leader


async def observer_caught_up(cluster: Cluster, observer: SyncObserver) -> None:
    """The observer has read up to every epoch the nodes know, and agrees on the owners."""
    async with asyncio.timeout(10):
        while True:
            views = cluster.views()
            owned = {t: [v.task] for v in views.values() for t in v.owned}
            if observer.cim.epoch >= max(v.epoch for v in views.values()) and all(
                observer.owners().get(t) == who for t, who in owned.items()
            ):
                return
            await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_tasks_share_survive_a_kill_and_spread_to_a_newcomer(
    nodes: Cluster, observer: SyncObserver
) -> None:
    for task_id in ("n0", "n1", "n2"):
        await nodes.start_node(task_id)
    await nodes.start_proc("p3")
    await nodes.wait_settled({"n0", "n1", "n2", "p3"}, TOKENS, timeout=40)
    leader = assert_one_leader(nodes, observer)
    assert leader != "p3"
    await observer_caught_up(nodes, observer)
    assert_clean(nodes, observer)
    before_kill = nodes.views()["p3"].owned
    assert before_kill

    # kill -9 the subprocess: after the session timeout its partitions are owned again, and
    # nobody read one of them while it could still have been reading.
    killed_at = time.monotonic()
    await nodes.kill_proc("p3")
    took = await nodes.wait_settled({"n0", "n1", "n2"}, TOKENS, timeout=40)
    assert took > 2.0, "re-owned faster than the group can notice a killed member"
    async with asyncio.timeout(10):  # and read: the new owners deliver them
        while not before_kill <= nodes.ledger.tokens_delivered_since(killed_at, besides="p3"):
            await asyncio.sleep(0.05)
    await observer_caught_up(nodes, observer)
    assert_clean(nodes, observer)
    assert_one_leader(nodes, observer)

    # A task joins: the sharing protocol spreads the load to it.
    await nodes.start_node("n4")
    await nodes.wait_settled({"n0", "n1", "n2", "n4"}, TOKENS, timeout=40)
    assert nodes.views()["n4"].owned
    await observer_caught_up(nodes, observer)
    assert_clean(nodes, observer)
    assert_one_leader(nodes, observer)
    assert sum(v.counters.get("picked_up", 0) for v in nodes.views().values()) > 0


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_leader_whose_epoch_append_fails_writes_it_again(
    nodes: Cluster, observer: SyncObserver
) -> None:
    """The first epoch message's append fails: without it the generation has no epoch, so
    nobody would read (the roots are offered in it) until the next rebalance. The leader sends
    the same plan again."""
    failing: list[FailingAppends] = []

    def fail_first_epoch(log: KafkaSyncLog) -> FailingAppends:
        failing.append(FailingAppends(log, EpochMessage))
        return failing[0]

    await nodes.start_node("n0", wrap_log=fail_first_epoch)
    await nodes.wait_settled({"n0"}, TOKENS, timeout=30)
    assert failing[0].failed == 1
    counters = nodes.views()["n0"].counters
    assert counters["publish_failed"] == 1
    assert counters["epoch_resent"] == 1
    await nodes.start_node("n1")
    await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=40)
    await observer_caught_up(nodes, observer)
    assert_clean(nodes, observer)
    assert assert_one_leader(nodes, observer) == "n0"


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_killed_leader_is_replaced(nodes: Cluster, observer: SyncObserver) -> None:
    proc = await nodes.start_proc("p0")
    async with asyncio.timeout(30):
        while proc.view is None or proc.view.owned != TOKENS:
            await asyncio.sleep(0.05)
    await nodes.start_node("n1")
    await nodes.start_node("n2")
    await nodes.wait_settled({"p0", "n1", "n2"}, TOKENS, timeout=40)
    assert assert_one_leader(nodes, observer) == "p0"
    first_epoch = observer.cim.epoch

    await nodes.kill_proc("p0")
    await nodes.wait_settled({"n1", "n2"}, TOKENS, timeout=40)
    new_leader = assert_one_leader(nodes, observer)
    assert new_leader in {"n1", "n2"}
    await observer_caught_up(nodes, observer)
    assert observer.cim.epoch > first_epoch
    assert "p0" not in observer.cim.members
    assert_clean(nodes, observer)


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_paused_task_stops_reading_before_its_partitions_move(
    nodes: Cluster, observer: SyncObserver
) -> None:
    """Zombie safety: a task frozen with SIGSTOP past its session timeout loses its partitions;
    when it wakes up it must not hand its sink anything more (its lease ran out) before it has
    rejoined and been given partitions again."""
    await nodes.start_node("n0")
    await nodes.start_node("n1")
    await nodes.start_proc("p2")
    await nodes.wait_settled({"n0", "n1", "p2"}, TOKENS, timeout=40)
    frozen = nodes.views()["p2"].owned
    assert frozen

    paused_at = time.monotonic()
    nodes.pause_proc("p2")
    await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=40)
    async with asyncio.timeout(10):  # the new owners read what the frozen task owned
        while not frozen <= nodes.ledger.tokens_delivered_since(paused_at, besides="p2"):
            await asyncio.sleep(0.05)

    resumed_at = time.monotonic()
    nodes.resume_proc("p2")
    await nodes.wait_settled({"n0", "n1", "p2"}, TOKENS, timeout=40)
    await observer_caught_up(nodes, observer)
    assert_clean(nodes, observer)
    # Whatever it delivered after waking up, it delivered only once it owned it again.
    rejoined = {d.token for d in nodes.ledger.deliveries if d.task == "p2" and d.at >= resumed_at}
    assert rejoined <= nodes.views()["p2"].owned
    assert nodes.views()["p2"].counters.get("membership_lost", 0) >= 1


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_garbage_on_the_sync_topic_is_skipped_and_counted(
    nodes: Cluster, observer: SyncObserver, kafka_config: KafkaConfig, connector: str
) -> None:
    await nodes.start_node("n0")
    await nodes.start_node("n1")
    await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=30)
    await observer_caught_up(nodes, observer)
    before = {t: (v.owned, v.leader, v.epoch) for t, v in nodes.views().items()}
    cim_epoch = observer.cim.epoch

    async with KafkaSyncLog(kafka_config, connector) as log:
        garbage_at = await log.append(b"\x00\xffnot a sync message{")

    async with asyncio.timeout(10):
        while not (
            observer.undecodable
            and all(v.counters.get("sync_bad.malformed", 0) for v in nodes.views().values())
        ):
            await asyncio.sleep(0.05)
    assert observer.undecodable == [garbage_at]
    await asyncio.sleep(1.0)  # long enough for a ripple to show
    assert nodes.settled({"n0", "n1"}, TOKENS) is None
    assert {t: (v.owned, v.leader, v.epoch) for t, v in nodes.views().items()} == before
    assert all(v.counters["sync_bad.malformed"] == 1 for v in nodes.views().values())
    assert observer.cim.epoch == cim_epoch
    assert_clean(nodes, observer)


def test_ledger_catches_overlap_and_regression() -> None:
    """The sink-side checker has teeth: two tasks delivering one partition at overlapping times,
    and a new owner starting below its predecessor's watermark, are both reported."""
    ledger = SinkLedger()
    for i in range(5):
        ledger.add(Delivery(10.0 + i * 0.2, "a", "p1", 100 + i, 100 + i, 1))
    ledger.add(Delivery(10.5, "b", "p1", 200, 150, 1))  # while a still delivers
    ledger.add(Delivery(20.0, "b", "p2", 300, 300, 1))
    ledger.add(Delivery(22.0, "c", "p2", 310, 250, 1))  # c starts below b's 300
    found = ledger.violations()
    assert len(found) == 2, found
    assert "p1: a delivered" in found[0]
    assert "p2: c re-delivered from 250" in found[1]
    assert ledger.violations(killed={"b"}) == found[:1]  # a killed task may not have published


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_epochs_never_go_back_when_the_group_starts_over(
    nodes: Cluster, observer: SyncObserver
) -> None:
    """Kafka's generations restart at 0 when the group is gone (a real Kafka deletes an empty
    group's metadata; the embedded broker forgets it on restart) while the sync topic keeps the
    epochs of the old generations. A new group on the same sync topic shows it: its epochs must
    still be newer than every epoch in the log, or the CIM ignores them as stale."""
    await nodes.start_node("n0")
    await nodes.start_node("n1")
    await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=30)
    await nodes.stop_node("n0")
    await nodes.wait_settled({"n1"}, TOKENS, timeout=30)
    await observer_caught_up(nodes, observer)
    old_epoch = observer.cim.epoch
    assert old_epoch >= 1
    await nodes.stop_node("n1")

    nodes.group = f"{nodes.connector}-anew"  # generation 0 again
    await nodes.start_node("n2")  # new task ids: see the next test for the same ones
    await nodes.start_node("n3")
    await nodes.wait_settled({"n2", "n3"}, TOKENS, timeout=30)
    await observer_caught_up(nodes, observer)
    assert observer.cim.epoch > old_epoch
    assert_one_leader(nodes, observer)
    assert_clean(nodes, observer)
    memberships = [n.membership for n in nodes.nodes.values()]
    assert all(isinstance(m, KafkaMembership) and m.generation > old_epoch for m in memberships)


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_whole_connector_restart_with_the_same_task_ids(
    nodes: Cluster, observer: SyncObserver
) -> None:
    """After the whole connector stopped, the last epoch still lists its members and credits
    them their partitions: a task restarted under the same id takes them over (the planner
    keeps a live member's partitions with it), or nobody reads them until the next rebalance."""
    await nodes.start_node("n0")
    await nodes.start_node("n1")
    await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=30)
    await nodes.stop_node("n0")
    await nodes.wait_settled({"n1"}, TOKENS, timeout=30)
    await nodes.stop_node("n1")
    await nodes.start_node("n0")
    await nodes.start_node("n1")
    await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=30)
    await observer_caught_up(nodes, observer)
    assert_clean(nodes, observer)
    assert sum(v.counters.get("adopted", 0) for v in nodes.views().values()) > 0


@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_sync_messages_over_the_record_limit_are_cut_and_read_whole(
    kafka_config: KafkaConfig, connector: str, observer: SyncObserver
) -> None:
    """With a 1 KiB record limit every state, epoch and checkpoint message here is cut into
    fragments that other tasks' messages fall between: the tasks still agree, a restarted task
    replays its way back (from the checkpoint when there is one), and the observer's CIM,
    built from the same topic, matches theirs."""
    async with Cluster(kafka_config, connector, max_message_bytes=1024) as nodes:
        await nodes.start_node("n0")
        await nodes.start_node("n1")
        await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=30)
        await asyncio.sleep(6)  # a checkpoint (every 5 s) is written
        await nodes.stop_node("n0")
        await nodes.wait_settled({"n1"}, TOKENS, timeout=30)
        await nodes.start_node("n0")
        await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=30)
        await observer_caught_up(nodes, observer)
        assert_clean(nodes, observer)
        stats = [log.statistics() for log in nodes.sync_logs.values()]
        assert sum(s.fragmented for s in stats) > 0
        assert sum(s.fragments_dropped for s in stats) == 0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_group_epochs_stay_above_what_members_know(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """The leader's assignor makes a generation's epoch newer than any epoch a member knows;
    a member that learns of a newer one between its JoinGroup and the assignment refuses the
    assignment and rejoins, and the next leader learns it from its subscription."""
    calls = 0

    def late_floor() -> int:  # -1 in the first JoinGroup, 20 from then on
        nonlocal calls
        calls += 1
        return -1 if calls == 1 else 20

    first = KafkaMembership(kafka_config, connector, "a", epoch_floor=lambda: 5)
    second = KafkaMembership(kafka_config, connector, "b", epoch_floor=late_floor)
    async with first:
        events_a = first.events()
        view = await next_assignment(events_a)
        assert view.generation == 6  # generation 0 on a fresh group, but epoch 5 is known
        async with second:
            events_b = second.events()
            got_b = await next_assignment(events_b, lambda a: set(a.members) == {"a", "b"})
            got_a = await next_assignment(events_a, lambda a: a.generation == got_b.generation)
            assert got_a == got_b
            assert got_b.generation == 21
            assert second.statistics().stale_epochs == 1
            assert first.statistics().stale_epochs == 0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_follower_takes_its_own_epoch_that_landed_first(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """protocol/epochs.py rule 5 on the real broker: the follower's CIM already holds the epoch
    its assignment announces (the leader planned before the follower's answer came: the
    embedded broker answers followers' joins up to seconds after the leader's). The follower
    takes it instead of rejoining; before, each such follower started another generation, and
    the group rebalanced every 3 s for ever (a full chaos run, 2026-11-27)."""
    second: KafkaMembership

    def landed() -> epochs.Logged:
        # b's CIM holds a's epoch for the generation b is being assigned (nothing else is
        # known, so a numbers it as the generation itself)
        return epochs.Logged(second._coordinator_generation(), "a", ("a", "b"))

    first = KafkaMembership(kafka_config, connector, "a")
    second = KafkaMembership(kafka_config, connector, "b", logged_epoch=landed)
    async with first:
        await next_assignment(first.events())
        async with second:
            got_b = await next_assignment(second.events(), lambda a: set(a.members) == {"a", "b"})
            assert got_b.leader == "a"
            stats = second.statistics()
            assert (stats.landed_first, stats.stale_epochs, stats.losses) == (1, 0, 0), stats
            await asyncio.sleep(3 * kafka_config.heartbeat_interval_ms / 1000)
            assert second.statistics().generation == got_b.generation  # no rebalance since


def test_observer_catches_double_owner_regression_and_two_leaders() -> None:
    """The sync-topic observer has teeth (fed by hand: it never connects here)."""
    observer = SyncObserver(KafkaConfig(bootstrap_servers="127.0.0.1:9"), "teeth")

    def state(task: str, ts: int, *parts: Partition) -> bytes:
        return messages.encode(
            StateMessage(
                task_id=task,
                epoch=0,
                connector_state=(TaskState(task_id=task, state_timestamp=ts, data=parts),),
            )
        )

    observer.observe(0, messages.encode(EpochMessage(task_id="a", epoch=0, members=("a", "b"))))
    observer.observe(1, state("a", 1, Partition("p1", 0, watermark=10)))
    assert observer.violations == []
    observer.observe(2, state("b", 1, Partition("p1", 0, watermark=12)))
    assert len(observer.violations) == 1
    assert "p1 owned by both a and b" in observer.violations[0]
    observer.observe(3, state("a", 2, Partition("p1", 0, watermark=5)))
    assert any("watermark of p1 went back from 12 to 5" in v for v in observer.violations)
    observer.observe(4, messages.encode(EpochMessage(task_id="b", epoch=0, members=("a", "b"))))
    assert any("epoch 0 opened by ['a', 'b']" in v for v in observer.violations)
    observer.observe(5, b"garbage")
    assert observer.undecodable == [5]


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_recorded_trace_of_a_real_run_replays_to_the_same_commands(
    nodes: Cluster, tmp_path: Path
) -> None:
    """Two tasks on the embedded broker record every input of their cores (``trace_dir``, with
    the cores' invariants checked after every event); a task joins and one leaves on the way.
    Each trace, fed through fresh cores (the task's and its readers'), gives back exactly the
    commands the run carried out; a trace with an event left out does not."""
    traces = tmp_path / "traces"
    await nodes.start_node("n0", trace_dir=str(traces))
    await nodes.wait_settled({"n0"}, TOKENS, timeout=30)
    await nodes.start_node("n1", trace_dir=str(traces))
    await nodes.wait_settled({"n0", "n1"}, TOKENS, timeout=40)
    await nodes.stop_node("n1")
    await nodes.wait_settled({"n0"}, TOKENS, timeout=40)
    await nodes.stop_node("n0")

    ticked: set[str] = set()
    for task_id in ("n0", "n1"):
        with (traces / f"{task_id}.trace.jsonl").open("rb") as f:
            lines = list(trace.decode(f))
        steps = [line for line in lines if isinstance(line, trace.TraceStep)]
        events = {type(s.event).__name__ for s in steps}
        commands = {type(c).__name__ for s in steps for c in s.commands}
        assert {"SyncRead", "Joined", "Lease", "Drain"} <= events, events
        if "TaskTick" in events:  # ticks come only at deadlines: a short-lived task may have none
            ticked.add(task_id)
        assert {"Publish", "StartReader", "StopReader"} <= commands, commands
        # its readers' cores are in the same trace, and replay too (mismatches covers them)
        started = [line for line in lines if isinstance(line, trace.ReaderStart)]
        reads = [line for line in lines if isinstance(line, trace.ReaderStep)]
        assert started, task_id
        assert {"PutBatch", "Done"} <= {type(c).__name__ for s in reads for c in s.commands}
        assert trace.mismatches(lines) == [], task_id

        assert isinstance(lines[0], trace.TraceStart)
        joined = next(
            i
            for i, s in enumerate(lines)
            if isinstance(s, trace.TraceStep) and isinstance(s.event, Joined)
        )
        skipped = [*lines[:joined], *lines[joined + 1 :]]
        assert trace.mismatches(skipped), "a trace without its Joined replays the same"
    assert "n0" in ticked  # the leader's checkpoints are timer-driven
