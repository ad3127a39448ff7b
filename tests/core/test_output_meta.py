"""The composite output topic's durable state and its switch barrier (protocol/output_meta.py):
exact folds per rule, the barrier's due rule with acks, leaves and expired leases, and a
model check that no key's records go backwards across a switch when producers follow it."""

from __future__ import annotations

import random

import pytest

from protocol.output_meta import (
    Acked,
    Created,
    Fed,
    Joined,
    Left,
    Marker,
    MetaError,
    OutputMeta,
    Sealed,
    ShardsAcked,
    ShardsCommitted,
    ShardsPrepared,
    ShardsSet,
    StorageAdded,
    SwitchCommitted,
    SwitchPrepared,
    decode_entry,
    encode_entry,
    feed_due,
    fold,
    plan_add_storage_topic,
    plan_switch,
    shards_plan,
)
from protocol.routing import StorageTopic

CREATED = Created("out", 4, 4, 2)


def folded(*entries: object) -> OutputMeta:
    state = fold([CREATED, *entries])  # type: ignore[list-item]
    state.validate()
    return state


def test_created_first_wins_and_versions_count_configuration_changes() -> None:
    state = folded(Created("other", 8, 8, 8), Joined("a", 10.0), Marker("m"))
    assert state.composite().storage_topics == (StorageTopic("out", 4, 1),)
    assert state.version == 1
    assert state.ignored == {"created again": 1}
    assert state.rq().storage_topics == (StorageTopic("out_rq", 4, 1),)
    assert state.dlq().storage_topics == (StorageTopic("out_dlq", 2, 1),)
    assert state.target() == 0
    assert fold([StorageAdded(4)]).ignored == {"before created": 1}


def test_add_storage_topic_k_by_the_rule_and_the_warning() -> None:
    state = folded()
    plan = plan_add_storage_topic(state, 12)
    assert plan.storage == StorageTopic("out.1", 12, 3)
    assert plan.warning is None
    state.apply(plan.entry)
    assert state.composite().storage_topics[1] == StorageTopic("out.1", 12, 3)
    assert state.composite().produce_pointer == 0  # adding does not switch
    assert state.version == 2
    # 10 is not a multiple of the base 4: K = 1 and a warning says shards move.
    odd = plan_add_storage_topic(state, 10)
    assert odd.storage == StorageTopic("out.2", 10, 1)
    assert odd.warning is not None
    assert "K falls to 1" in odd.warning
    with pytest.raises(MetaError, match="positive"):
        plan_add_storage_topic(state, 0)


def test_switch_barrier_waits_for_every_producer_with_a_lease() -> None:
    state = folded(Joined("a", 100.0), Joined("b", 100.0), Joined("c", 50.0), Left("c"))
    with pytest.raises(MetaError, match="add one first"):
        plan_switch(state, 1.0)
    state.apply(StorageAdded(12))
    prep = plan_switch(state, 1.0)
    assert prep == SwitchPrepared(1, 1.0)
    state.apply(prep)
    assert state.pending is not None
    assert state.pending.ack_set == {"a", "b"}
    assert state.target() is None  # everyone holds
    with pytest.raises(MetaError, match="already pending"):
        plan_switch(state, 2.0)
    assert not state.switch_due(10.0, grace=1.0)
    state.apply(Acked("a", 1))
    state.apply(Joined("d", 100.0))  # joined after the prepare: not waited for, but holds
    assert state.waiting_for(10.0, 1.0) == ["b"]
    assert not state.switch_due(10.0, grace=1.0)
    state.apply(Acked("b", 1))
    assert state.switch_due(10.0, grace=1.0)
    state.apply(SwitchCommitted(1))
    state.apply(SwitchCommitted(1))  # a second committer's copy
    state.validate()
    assert state.composite().produce_pointer == 1
    assert state.target() == 1
    assert state.ignored["stale commit"] == 1
    assert state.unsealed() == [0]
    state.apply(Sealed(0, (5, 6, 7, 8)))
    state.apply(Sealed(0, (9, 9, 9, 9)))  # the first seal is the switch point
    assert state.sealed == {0: (5, 6, 7, 8)}
    assert state.unsealed() == []


def test_a_dead_producer_is_waited_for_until_its_lease_and_the_grace_ran_out() -> None:
    state = folded(Joined("a", 100.0), Joined("dead", 20.0), StorageAdded(8), SwitchPrepared(1))
    state.apply(Acked("a", 1))
    assert state.waiting_for(20.5, grace=1.0) == ["dead"]
    assert not state.switch_due(21.0, grace=1.0)  # until + grace is not yet past
    assert state.switch_due(21.01, grace=1.0)
    # a producer that renewed in time (it read the prepare before its renewal came back) is
    # waited for again until it acks
    state.apply(Joined("dead", 40.0))
    assert not state.switch_due(21.01, grace=1.0)


def test_stale_and_bad_entries_are_ignored() -> None:
    state = folded(StorageAdded(8))
    for e in (
        SwitchPrepared(2),  # not the next one
        Acked("a", 1),  # nothing pending
        SwitchCommitted(1),
        Sealed(0, (1, 1, 1, 1)),  # 0 is still produced to
        StorageAdded(-1),
        ShardsSet(3, 4, 2),  # 3 does not divide 4
    ):
        assert not state.apply(e)
    state.validate()
    assert state.version == 2
    assert sum(state.ignored.values()) == 6


def test_shards_plan_keeps_or_grows_the_rq_dlq() -> None:
    state = folded()
    assert shards_plan(state, 2) == ShardsPrepared(1, 2, 4, 2)
    assert shards_plan(state, 3) == ShardsPrepared(1, 3, 6, 3)
    with pytest.raises(MetaError):
        shards_plan(state, 0)


def test_shard_change_is_a_barrier_then_a_feed() -> None:
    state = folded(Joined("a", 10.0), Joined("b", 10.0))
    assert state.layout() == 0
    state.apply(shards_plan(state, 3))
    state.validate()
    assert state.layout() is None  # RQ/DLQ writes hold
    assert state.shards == 1
    assert state.rq().producing.name == "out_rq"  # nothing changes before the commit
    assert state.shards_waiting_for(5.0, grace=1.0) == ["a", "b"]
    with pytest.raises(MetaError, match="already pending"):
        shards_plan(state, 2)
    assert feed_due(state) is None  # feed after the commit
    state.apply(ShardsAcked("a", 1))
    assert not state.shards_due(5.0, grace=1.0)
    assert state.shards_due(11.5, grace=1.0)  # b's lease ran out a grace ago
    state.apply(ShardsAcked("b", 1))
    assert state.shards_due(5.0, grace=1.0)
    assert state.apply(ShardsCommitted(1))
    assert not state.apply(ShardsCommitted(1))  # a second committer: ignored
    state.validate()
    assert (state.layout(), state.shards, state.shard_changes) == (1, 3, 1)
    assert [st.name for st in state.rq().storage_topics] == ["out_rq", "out_rq.1"]
    assert state.rq().producing == StorageTopic("out_rq.1", 6, 1)
    assert state.dlq().producing == StorageTopic("out_dlq.1", 3, 1)
    # the old storage topics are read until fed; no new change before
    assert state.unfed()
    with pytest.raises(MetaError, match="not fed yet"):
        shards_plan(state, 2)
    assert not state.apply(ShardsPrepared(2, 2, 6, 4))
    fed = feed_due(state)
    assert fed == Fed(1, 1, 1)
    assert state.apply(fed)
    assert not state.apply(fed)  # a feeder run twice appends twice: harmless
    state.validate()
    assert not state.unfed()
    assert [st.name for st in state.rq().storage_topics] == ["out_rq.1"]
    assert [st.name for st in state.dlq().storage_topics] == ["out_dlq.1"]
    assert feed_due(state) is None
    # 1 divides everything: a change without new storage topics, nothing to feed after it
    state.apply(shards_plan(state, 1))
    state.apply(ShardsCommitted(2))
    state.validate()
    assert (state.shards, state.layout()) == (1, 2)
    assert state.rq().producing.name == "out_rq.1"
    assert feed_due(state) is None


def test_producers_joining_during_a_shard_change_are_not_waited_for() -> None:
    state = folded(Joined("a", 10.0))
    state.apply(shards_plan(state, 2))
    state.apply(Joined("late", 50.0))  # holds too (layout None) but is not in the ack set
    state.apply(Left("a"))
    assert state.shards_due(1.0, grace=1.0)


def test_stale_shard_entries_and_the_legacy_shards_set() -> None:
    state = folded()
    for e in (
        ShardsAcked("a", 1),  # nothing pending
        ShardsCommitted(1),
        ShardsPrepared(2, 2, 4, 2),  # not the next change
        ShardsPrepared(1, 3, 4, 2),  # 3 does not divide 4
        Fed(0, 0, 0),  # nothing to feed
    ):
        assert not state.apply(e)
    state.validate()
    assert state.version == 1
    # written by earlier versions: applied at once, its old storage topics fed like any other
    assert state.apply(ShardsSet(3, 6, 3))
    assert (state.shards, state.layout()) == (3, 1)
    assert feed_due(state) == Fed(1, 1, 1)


def test_entries_round_trip_with_stable_tags() -> None:
    for e in (
        CREATED,
        StorageAdded(12),
        SwitchPrepared(1, 2.5),
        Acked("p", 1),
        Marker("x"),
        ShardsPrepared(1, 3, 6, 3),
        ShardsAcked("p", 1),
        ShardsCommitted(1),
        Fed(1, 1, 1),
    ):
        assert decode_entry(encode_entry(e)) == e
    assert encode_entry(Acked("p", 1)) == b'{"m":"ack","producer":"p","target":1}'
    assert encode_entry(Fed(1, 1, 0)) == b'{"m":"fed","change":1,"rq_from":1,"dlq_from":0}'


# --- a model: producers, keys moving between them, a reader of storage topics in order ----------


def _simulate(seed: int, *, obey: bool) -> int:
    """Producers send per-key sequences; keys move between producers only after the old owner's
    sends were acknowledged (a graceful hand-off) or its lease ran out (a crash). A reader reads
    topic 0 entirely, then topic 1. Returns the number of keys whose sequence goes backwards.
    ``obey=False``: a producer switches as soon as it has acked (not waiting for the commit)."""
    rng = random.Random(seed)
    grace, ttl = 1.0, 5.0
    state = folded(StorageAdded(8))
    producers = {"a": 0, "b": 1}  # producer -> index of the topic it writes when not holding
    for p in producers:
        state.apply(Joined(p, ttl))
    owner = {k: rng.choice("ab") for k in range(6)}
    seq = dict.fromkeys(owner, 0)
    topics: list[list[tuple[int, int]]] = [[], []]
    in_flight: dict[str, list[tuple[int, int, int]]] = {"a": [], "b": []}  # (topic, key, seq)
    acked: set[str] = set()
    prepared_at = rng.randrange(5, 30)
    lag = {p: rng.randrange(0, 20) for p in producers}  # steps before a producer reads the log
    now = 0.0
    for step in range(80):
        now = step * 0.1
        if step == prepared_at:
            state.apply(SwitchPrepared(1))
        for p in producers:
            # flush some in-flight sends
            while in_flight[p] and rng.random() < 0.6:
                t, k, s = in_flight[p].pop(0)
                topics[t].append((k, s))
            sees = step >= prepared_at + lag[p]
            if state.pending is not None and sees and p not in acked and not in_flight[p]:
                acked.add(p)
                state.apply(Acked(p, 1))
        if state.switch_due(now, grace):
            state.apply(SwitchCommitted(1))
        k = rng.choice(list(owner))
        p = owner[k]
        target = state.target()
        if step < prepared_at + lag[p] and state.composite().produce_pointer == 0:
            target = 0  # it has not read the prepare yet
        elif target is None and not obey and p in acked:
            target = 1
        if target is not None:
            in_flight[p].append((target, k, seq[k]))
            seq[k] += 1
        moved = rng.choice(list(owner))  # a graceful hand-off: none of its sends in flight
        if rng.random() < 0.3 and all(m != moved for _, m, _ in in_flight[owner[moved]]):
            owner[moved] = "b" if owner[moved] == "a" else "a"
    for p in producers:
        for t, k, s in in_flight[p]:
            topics[t].append((k, s))
    last: dict[int, int] = {}
    backwards = set()
    for k, s in topics[0] + topics[1]:
        if s < last.get(k, -1):
            backwards.add(k)
        last[k] = max(last.get(k, -1), s)
    return len(backwards)


def test_model_following_the_barrier_keeps_per_key_order() -> None:
    assert sum(_simulate(seed, obey=True) for seed in range(200)) == 0


def test_model_switching_at_the_own_ack_breaks_order() -> None:
    """Teeth: the same seeds, a producer that goes to the new topic at its own ack."""
    assert sum(_simulate(seed, obey=False) for seed in range(200)) > 0


# --- a model of the RQ/DLQ shard-count change: producers' RQ writes, the barrier, the feed ------


def _shard_change(seed: int, *, ack_early: bool = False, commit_early: bool = False) -> int:
    """Two producers write RQ entries to the layout they know (each reads the log ``lag`` steps
    late; entries land a while after they are sent). A shard-count change is prepared; after its
    commit a feeder reads the old layout once, copies what it read and retires it. Returns the
    entries lost: landed in the old layout after the feeder read it. Teeth: ``ack_early`` acks
    with writes still in flight; ``commit_early`` commits at one's own ack."""
    rng = random.Random(seed)
    state = folded(Joined("a", 60.0), Joined("b", 60.0))
    lag = {p: rng.randrange(0, 15) for p in "ab"}
    prepared_at = rng.randrange(5, 30)
    committed_at: int | None = None
    layouts: list[list[int]] = [[], []]
    in_flight: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}  # (layout, entry)
    acked: set[str] = set()
    fed: set[int] | None = None
    n = 0
    for step in range(120):
        now = step * 0.01
        if step == prepared_at:
            state.apply(shards_plan(state, 3))
        for p in "ab":
            while in_flight[p] and rng.random() < 0.5:
                where, e = in_flight[p].pop(0)
                layouts[where].append(e)
            sees_prepare = step >= prepared_at + lag[p]
            old_writes = any(where == 0 for where, _ in in_flight[p])
            if sees_prepare and p not in acked and (ack_early or not old_writes):
                acked.add(p)
                state.apply(ShardsAcked(p, 1))
                if commit_early and state.apply(ShardsCommitted(1)):
                    committed_at = step
        if state.shards_due(now, grace=1.0) and state.apply(ShardsCommitted(1)):
            committed_at = step
        if fed is None and committed_at is not None and rng.random() < 0.3:
            fed = set(layouts[0])  # the feeder reads the old layout and copies it
            layouts[1].extend(fed)
            fed_entry = feed_due(state)
            assert fed_entry is not None
            state.apply(fed_entry)
        p = rng.choice("ab")
        if step < prepared_at + lag[p]:
            layout: int | None = 0  # it has not read the prepare yet
        elif committed_at is not None and step >= committed_at + lag[p]:
            layout = 1
        else:
            layout = None  # holds between the prepare and the commit it has read
        if layout is not None:
            in_flight[p].append((layout, n))
            n += 1
        state.validate()
    for p in "ab":
        for where, e in in_flight[p]:
            layouts[where].append(e)
    if fed is None:
        return 0
    return sum(1 for e in layouts[0] if e not in fed)


def test_model_the_shard_barrier_and_the_feed_lose_no_rq_entry() -> None:
    assert sum(_shard_change(seed) for seed in range(300)) == 0


def test_model_teeth_acking_with_writes_in_flight_loses_entries() -> None:
    assert sum(_shard_change(seed, ack_early=True) for seed in range(300)) > 0


def test_model_teeth_committing_at_the_own_ack_loses_entries() -> None:
    assert sum(_shard_change(seed, commit_early=True) for seed in range(300)) > 0
