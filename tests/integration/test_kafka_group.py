"""Heartbeat-topic group membership (``runtime.kafka.KafkaMembership``) against the embedded
broker: leader election per generation, leaves, a killed member, a lost broker.

Timings with session/heartbeat 4000/500 ms on the embedded broker: a join or a leave gives a new
generation in ~2-3 s; a SIGKILLed member is gone after ~4-7 s.

The lease rule (``protocol.lease``) takes the stricter of Kafka's and the embedded broker's rules;
``test_survivors_keep_their_lease_through_a_rebalance`` checks what it assumes of the broker: a
heartbeat during a rebalance is answered ``REBALANCE_IN_PROGRESS``, a member whose JoinGroup the
broker holds (for about half the session) is kept and is in the next generation, and the
survivors' leases never lapse through a join and a kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence

import msgspec
import pytest

from protocol import trace
from protocol.membership import Assigned, HeartbeatAnswered, LoopLagged, SyncAnswered
from runtime.kafka import KafkaConfig, KafkaMembership, MembershipError, heartbeat_topic
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.synclog import KafkaSyncLog, SyncLogError
from runtime.net import free_port
from runtime.ports import GroupAssignment, GroupEvent, GroupLease, GroupLost
from tests.fixtures.kafka import (
    connector,
    kafka_broker,
    kafka_config,
    next_assignment,
    next_change,
    spawn_group_member,
)
from tests.helpers import wait_for

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name

pytestmark = [pytest.mark.kafka, pytest.mark.asyncio]


@contextlib.asynccontextmanager
async def members(
    config: KafkaConfig, connector: str, task_ids: Sequence[str]
) -> AsyncIterator[list[tuple[KafkaMembership, AsyncIterator[GroupEvent]]]]:
    started: list[KafkaMembership] = []
    try:
        for task_id in task_ids:
            membership = KafkaMembership(config, connector, task_id)
            await membership.start()
            started.append(membership)
        yield [(m, m.events()) for m in started]
    finally:
        for membership in started:
            await membership.close()


async def all_see(
    group: Sequence[tuple[KafkaMembership, AsyncIterator[GroupEvent]]],
    expected: set[str],
) -> list[GroupAssignment]:
    """Each member's first assignment whose member list is ``expected``."""
    return list(
        await asyncio.gather(
            *(next_assignment(ev, lambda a: set(a.members) == expected) for _, ev in group)
        )
    )


def assert_agree(views: Sequence[GroupAssignment]) -> GroupAssignment:
    """Every member saw the same generation, leader and members; the leader is one of them."""
    first = views[0]
    assert all(v == first for v in views), views
    assert first.leader in first.members
    return first


async def test_three_members_agree_on_one_leader(kafka_config: KafkaConfig, connector: str) -> None:
    ids = ["task-a", "task-b", "task-c"]
    async with members(kafka_config, connector, ids) as group:
        views = await all_see(group, set(ids))  # bounded; how fast is bench rebalance's business
        view = assert_agree(views)
        assert view.members == tuple(sorted(ids))
        for membership, _ in group:
            assert membership.generation == view.generation
            assert membership.current == view
            # A member's lease runs ahead of now while it heartbeats.
            assert membership.lease_valid_until() > time.monotonic()
        # Leases are renewed by heartbeats (heartbeat interval 1 s; generous for a loaded box).
        before = [m.lease_valid_until() for m, _ in group]
        await wait_for(
            lambda: all(m.lease_valid_until() > b for (m, _), b in zip(group, before, strict=True)),
            20,
            "every member's lease renewed by a heartbeat",
        )
        after = [m.lease_valid_until() for m, _ in group]
        assert all(m.statistics().heartbeats_ok >= 1 for m, _ in group)
        assert kafka_config.session_timeout_ms / 1000 > after[0] - time.monotonic() > 0


async def test_member_leaves_then_leader_leaves(kafka_config: KafkaConfig, connector: str) -> None:
    ids = ["task-a", "task-b", "task-c"]
    async with members(kafka_config, connector, ids) as group:
        first = assert_agree(await all_see(group, set(ids)))
        # A follower leaves: the others get a new generation without it, same leader.
        follower = next(i for i, (m, _) in enumerate(group) if m.task_id != first.leader)
        gone = group.pop(follower)[0]
        await gone.close()
        second = assert_agree(await all_see(group, set(ids) - {gone.task_id}))
        assert second.generation > first.generation
        # The leader leaves: the last member is the new leader.
        leader_index = next(i for i, (m, _) in enumerate(group) if m.task_id == second.leader)
        old_leader = group.pop(leader_index)[0]
        await old_leader.close()
        (third,) = await all_see(group, set(ids) - {gone.task_id, old_leader.task_id})
        assert third.generation > second.generation
        assert third.leader == group[0][0].task_id != old_leader.task_id
        # A closed membership is no member and its event stream has ended.
        assert old_leader.current is None
        assert old_leader.lease_valid_until() == -math.inf


async def test_new_member_joins_existing_group(kafka_config: KafkaConfig, connector: str) -> None:
    """A joining member is listed as fresh (never assigned a generation: the leader may deal out
    what the sync log credits to its task id, protocol/planner.py) in its first generation only;
    so is a member restarted under the same task id."""
    async with members(kafka_config, connector, ["task-a", "task-b"]) as group:
        first = assert_agree(await all_see(group, {"task-a", "task-b"}))
        async with members(kafka_config, connector, ["task-c"]) as newcomer:
            both = group + newcomer
            second = assert_agree(await all_see(both, {"task-a", "task-b", "task-c"}))
            assert second.generation > first.generation
            assert second.fresh == ("task-c",)
        await all_see(group, {"task-a", "task-b"})
        async with members(kafka_config, connector, ["task-c"]) as restarted:
            third = assert_agree(await all_see(group + restarted, {"task-a", "task-b", "task-c"}))
            assert third.fresh == ("task-c",)


async def test_a_member_whose_task_has_read_nothing_is_listed_fresh_at_every_join(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """The adapter asks its task at each JoinGroup whether it has read nothing
    (``set_epoch_floor``'s ``unread``: ``TaskActor.joining``) and says so in its metadata: a
    member whose task has read nothing is listed fresh in its second generation too (a first
    generation that came to nothing), and not once its task has read. Each question gets the
    newest epoch the member knows."""
    reading = {"task-c": False}
    asked: list[int] = []

    def unread(known: int) -> bool:
        asked.append(known)
        return not reading["task-c"]

    async with members(kafka_config, connector, ["task-a", "task-b"]) as group:
        await all_see(group, {"task-a", "task-b"})
        async with members(kafka_config, connector, ["task-c"]) as newcomer:
            newcomer[0][0].set_epoch_floor(lambda: -1, unread=unread)
            both = group + newcomer
            second = assert_agree(await all_see(both, {"task-a", "task-b", "task-c"}))
            assert second.fresh == ("task-c",)
            async with members(kafka_config, connector, ["task-d"]) as more:
                third = assert_agree(
                    await all_see(both + more, {"task-a", "task-b", "task-c", "task-d"})
                )
                assert third.fresh == ("task-c", "task-d")  # c was assigned, but read nothing
                assert asked[-1] >= second.generation
                reading["task-c"] = True
            fourth = assert_agree(await all_see(both, {"task-a", "task-b", "task-c"}))
            assert fourth.generation > third.generation
            assert fourth.fresh == ()


async def test_killed_member_is_removed_after_session_timeout(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, connector: str
) -> None:
    process = await spawn_group_member(kafka_broker.bootstrap, connector, "task-victim")
    try:
        async with members(kafka_config, connector, ["task-a", "task-b"]) as group:
            ids = {"task-a", "task-b", "task-victim"}
            before = assert_agree(await all_see(group, ids))
            # The subprocess saw the same generation.
            assert process.stdout is not None
            async with asyncio.timeout(10):
                while True:
                    line = await process.stdout.readline()
                    assert line, "the member process ended"
                    seen = msgspec.json.decode(line)
                    if set(seen.get("members", ())) == ids:
                        break
            assert seen["generation"] == before.generation
            assert seen["leader"] == before.leader
            killed = time.monotonic()
            process.send_signal(signal.SIGKILL)
            after = assert_agree(await all_see(group, {"task-a", "task-b"}))
            removed_s = time.monotonic() - killed
            assert after.generation > before.generation
            # Session timeout 4 s: not removed before the broker could notice (a loaded
            # machine only makes this later; all_see bounds how much later).
            assert removed_s > 3.0, removed_s
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def settled(group: Sequence[tuple[KafkaMembership, object]], within_s: float = 15) -> None:
    """Every member of ``group`` had a heartbeat sent from now on answered with no rebalance
    (its lease proven in the generation it is in): the group has settled, and a watch running
    meanwhile saw at least one heartbeat interval of it."""
    since = int(time.monotonic() * 1_000_000)
    await wait_for(
        lambda: all((m.lease_facts.stable or 0) > since for m, _ in group),
        within_s,
        "a heartbeat of every member answered with no rebalance",
    )


class LeaseWatch:
    """Samples members' leases and lease facts every 10 ms."""

    def __init__(self, group: Sequence[KafkaMembership]) -> None:
        self.group = group
        self.lapsed: dict[str, float] = {m.task_id: 0.0 for m in group}
        self.told_rebalancing: set[str] = set()
        self.longest_join: dict[str, float] = {m.task_id: 0.0 for m in group}

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            for m in self.group:
                if m.lease_valid_until() <= now:
                    self.lapsed[m.task_id] += 0.01
                facts = m.lease_facts
                alive, stable = facts.alive, facts.stable
                if alive is not None and stable is not None and alive > stable:
                    # only a heartbeat answered REBALANCE_IN_PROGRESS moves alive past stable
                    self.told_rebalancing.add(m.task_id)
                if facts.join_sent is not None:
                    held = now - facts.join_sent / 1_000_000
                    self.longest_join[m.task_id] = max(self.longest_join[m.task_id], held)
            await asyncio.sleep(0.01)


async def test_survivors_keep_their_lease_through_a_rebalance(
    kafka_broker: EmbeddedBroker, kafka_config: KafkaConfig, connector: str
) -> None:
    process = await spawn_group_member(kafka_broker.bootstrap, connector, "task-victim")
    try:
        async with members(kafka_config, connector, ["task-a", "task-b"]) as group:
            everyone = {"task-a", "task-b", "task-victim"}
            assert_agree(await all_see(group, everyone))
            watch = LeaseWatch([m for m, _ in group])
            async with asyncio.TaskGroup() as tasks:
                watcher = tasks.create_task(watch.run())
                async with members(kafka_config, connector, ["task-c"]):
                    assert_agree(await all_see(group, everyone | {"task-c"}))
                    await settled(group)  # task-c leaves on exit
                assert_agree(await all_see(group, everyone))
                await settled(group)
                process.send_signal(signal.SIGKILL)
                assert_agree(await all_see(group, {"task-a", "task-b"}))
                await settled(group)
                watcher.cancel()
            # Heartbeats during a rebalance are answered REBALANCE_IN_PROGRESS ...
            assert watch.told_rebalancing == {"task-a", "task-b"}
            # ... the broker held JoinGroups for a second or more and kept their members, which
            # are in the next generation (all_see above) ...
            assert max(watch.longest_join.values()) > 1.0, watch.longest_join
            # ... and no survivor's lease lapsed in a join, a leave and a kill.
            assert watch.lapsed == {"task-a": 0.0, "task-b": 0.0}, watch.lapsed
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_group_lost_when_the_broker_dies(connector: str) -> None:
    broker = EmbeddedBroker()
    await broker.astart()
    try:
        config = KafkaConfig.embedded(broker.bootstrap)
        async with members(config, connector, ["task-a"]) as group:
            membership, events = group[0]
            await next_assignment(events)
            lease = membership.lease_valid_until()
            broker.kill()
            killed = time.monotonic()
            async with asyncio.timeout(10):
                event = await next_change(events)
            lost_after = time.monotonic() - killed
            assert isinstance(event, GroupLost), event
            assert "unreachable" in event.reason
            assert membership.current is None
            assert membership.lease_valid_until() == -math.inf
            # The lease had run out before the loss was declared.
            assert lease < time.monotonic()
            assert lost_after < 5.0, lost_after
            assert membership.statistics().losses == 1
    finally:
        await broker.astop()


async def test_the_member_pushes_its_lease_and_its_core_replays_from_a_trace(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """A member's events carry its lease renewals (``GroupLease``, each later than the last,
    as heartbeats are answered); its member core's trace (with its invariants checked after
    every event) replays to the same commands, and not with the assignment left out."""
    recorded = io.BytesIO()
    membership = KafkaMembership(kafka_config, connector, "task-a", trace=recorded, validate=True)
    await membership.start()
    try:
        events = membership.events()
        await next_assignment(events)
        leases: list[float] = []
        async with asyncio.timeout(20):
            async for event in events:
                if isinstance(event, GroupLease):
                    leases.append(event.until)
                    if len(leases) == 2:
                        break
        assert leases[0] < leases[1] <= membership.lease_valid_until()
    finally:
        await membership.close()
    lines = list(trace.decode(recorded.getvalue().splitlines()))
    assert isinstance(lines[0], trace.MemberStart)
    steps = [line for line in lines if isinstance(line, trace.MemberStep)]
    kinds = {type(s.event).__name__ for s in steps}
    assert {"JoinSent", "JoinAnswered", "SyncAnswered", "Assigned", "HeartbeatAnswered"} <= kinds
    assert trace.mismatches(lines) == []
    assigned = next(
        i for i, s in enumerate(lines) if isinstance(getattr(s, "event", None), Assigned)
    )
    again = [*lines[:assigned], lines[assigned], *lines[assigned:]]  # assigned twice: refused
    assert trace.mismatches(again)


async def test_the_loops_lag_shortens_the_leases_it_pushes(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """With ``loop_lag`` (how late the event loop has lately run), the lease the member pushes
    ends that much earlier than its heartbeats alone would give (``lease.margin_under_lag``),
    and the lag is a traced event its core replays."""
    lag = [0.0]
    recorded = io.BytesIO()
    membership = KafkaMembership(
        kafka_config, connector, "task-a", trace=recorded, validate=True, loop_lag=lambda: lag[0]
    )
    await membership.start()
    try:
        events = membership.events()
        await next_assignment(events)
        lag[0] = 0.7  # from now on, as if the loop had lately stalled for 0.7 s
        async with asyncio.timeout(20):
            async for event in events:
                if isinstance(event, GroupLease):
                    break
        pushed = membership.lease_valid_until()
        read_at = time.monotonic() * 1e6
    finally:
        await membership.close()
    lines = list(trace.decode(recorded.getvalue().splitlines()))
    assert trace.mismatches(lines) == []
    steps = [line for line in lines if isinstance(line, trace.MemberStep)]
    lagged = [s.event for s in steps if isinstance(s.event, LoopLagged)]
    assert lagged == [LoopLagged(700_000)]
    start = lines[0]
    assert isinstance(start, trace.MemberStart)
    timing = start.timing
    newest = max(
        s.event.sent
        for s in steps
        if isinstance(s.event, HeartbeatAnswered | SyncAnswered) and s.now <= read_at
    )
    # the lease from the newest heartbeat, less the configured margin and the 0.7 s
    assert abs(pushed * 1e6 - (newest + timing.session - timing.margin - 700_000)) < 1


async def test_events_has_one_reader_and_ends_on_close(
    kafka_config: KafkaConfig, connector: str
) -> None:
    membership = KafkaMembership(kafka_config, connector, "task-a")
    assert membership.lease_valid_until() == -math.inf
    await membership.start()
    try:
        events = membership.events()
        with pytest.raises(MembershipError, match="one reader"):
            membership.events()
        assignment = await next_assignment(events)
        assert assignment.members == ("task-a",)
        assert assignment.leader == "task-a"
        assert membership.topic == heartbeat_topic(connector) == f"{connector}_heartbeat"
        assert membership.group_id == connector
    finally:
        await membership.close()
    assert [event async for event in events] == []


async def test_unreachable_kafka_is_a_clear_error(connector: str) -> None:
    config = KafkaConfig.embedded(f"127.0.0.1:{free_port()}")  # nothing listens there
    membership = KafkaMembership(config, connector, "task-a")
    with pytest.raises(MembershipError, match="cannot start"):
        await membership.start()
    await membership.close()


async def test_closed_members_leave_at_once(kafka_config: KafkaConfig, connector: str) -> None:
    """Members closed right after the group formed (generation 0 on the embedded broker, or a
    join still in flight) leave the group: a new group does not carry them until they expire."""
    async with members(kafka_config, connector, ["old-a", "old-b"]) as group:
        await next_assignment(group[0][1], lambda a: len(a.members) == 2)
    async with members(kafka_config, connector, ["new-c", "new-d"]) as group:
        view = await next_assignment(group[0][1], lambda a: {"new-c", "new-d"} <= set(a.members))
        assert view.members == ("new-c", "new-d")


@pytest.mark.parametrize("heartbeat_while_rebalancing", [True, False])
async def test_a_rebalance_held_for_a_dead_leader_keeps_the_lease_of_a_heartbeating_member(
    kafka_broker: EmbeddedBroker,
    kafka_config: KafkaConfig,
    connector: str,
    heartbeat_while_rebalancing: bool,
) -> None:
    """The group's leader is killed and a member joins at once: the broker holds the survivors'
    JoinGroups and SyncGroups (it waits for the dead leader) longer than a lease can be proven
    from the last heartbeat before them. Heartbeats on a second connection during the rebalance
    are answered as the member's and keep the lease; without them it lapses for seconds."""
    process = await spawn_group_member(kafka_broker.bootstrap, connector, "task-victim")
    try:
        assert process.stdout is not None
        async with asyncio.timeout(20):  # the victim leads a group of its own first
            while True:
                line = await process.stdout.readline()
                assert line, "the member process ended"
                if msgspec.json.decode(line).get("members") == ["task-victim"]:
                    break
        async with contextlib.AsyncExitStack() as stack:
            group = []
            for task_id in ("task-a", "task-b"):
                m = KafkaMembership(
                    kafka_config,
                    connector,
                    task_id,
                    heartbeat_while_rebalancing=heartbeat_while_rebalancing,
                )
                await stack.enter_async_context(m)
                group.append((m, m.events()))
            first = assert_agree(await all_see(group, {"task-a", "task-b", "task-victim"}))
            assert first.leader == "task-victim"  # the broker keeps its first member as leader
            watch = LeaseWatch([m for m, _ in group])
            async with asyncio.TaskGroup() as tasks:
                watcher = tasks.create_task(watch.run())
                await settled(group)
                process.send_signal(signal.SIGKILL)
                async with members(kafka_config, connector, ["task-c"]):
                    assert_agree(await all_see(group, {"task-a", "task-b", "task-c"}))
                    await settled(group)
                    watcher.cancel()
            stats = [m.statistics() for m, _ in group]
            if heartbeat_while_rebalancing:
                assert all(s.probes_counted > 0 for s in stats), stats
                assert watch.lapsed == {"task-a": 0.0, "task-b": 0.0}, watch.lapsed
                assert all(s.lease_lapses == 0 for s in stats), stats
            else:
                assert all(s.probes == 0 for s in stats), stats
                assert min(watch.lapsed.values()) > 1.0, watch.lapsed
                assert all(s.lease_lapses > 0 for s in stats), stats
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


@pytest.mark.parametrize("outage", ["killed", "frozen"])
async def test_leaving_an_unreachable_broker_takes_no_rebalance_wait(
    connector: str, outage: str
) -> None:
    """A member whose broker went away (killed, or frozen with SIGSTOP so that nothing answers)
    leaves at once on close: it does not wait for a rebalance that cannot finish (twice the
    rebalance timeout) and each request it still sends is bounded by the request timeout.
    And the sync log, whose producer has an append in flight to that broker, closes within its
    ``close_timeout_s`` (1 s), not the request timeout its producer's own stop waits out (8 s
    with the broker frozen, before): the append fails, naming the sync log."""
    broker = EmbeddedBroker()
    await broker.astart()
    try:
        config = KafkaConfig.embedded(broker.bootstrap)
        membership = KafkaMembership(config, connector, "task-a")
        sync_log = KafkaSyncLog(config, connector)
        await sync_log.start()
        await sync_log.append(b"before the outage")
        await membership.start()
        in_flight: asyncio.Task[int] | None = None
        try:
            events = membership.events()
            await next_assignment(events)
            if outage == "killed":
                broker.kill()
            else:
                os.kill(broker.pid, signal.SIGSTOP)
            in_flight = asyncio.create_task(sync_log.append(b"in flight"))
            async with asyncio.timeout(20):
                event = await next_change(events)
            assert isinstance(event, GroupLost), event
            assert not in_flight.done()  # the producer retries it until its request timeout
        finally:
            closing = time.monotonic()
            await membership.close()
            took = time.monotonic() - closing
            closing = time.monotonic()
            await sync_log.close()
            log_took = time.monotonic() - closing
        print(f"{outage} broker: close took {took:.1f} s, the sync log's {log_took:.1f} s")
        bound = config.request_timeout_ms / 1000 + 2.0
        assert took < bound, f"close took {took:.1f} s (bound {bound:.1f} s)"
        assert log_took < 2.5, f"the sync log's close took {log_took:.1f} s"
        assert in_flight is not None
        with pytest.raises(SyncLogError, match="closed before its ack"):
            await in_flight
    finally:
        if outage == "frozen":
            with contextlib.suppress(ProcessLookupError):
                os.kill(broker.pid, signal.SIGCONT)
        await broker.astop()
