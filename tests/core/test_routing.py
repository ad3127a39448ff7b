"""Routing (docs/design.md#routing): the router formula, K on scale-up, shard assignment, and the properties
that make them worth having (shard consistency, even spread)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.routing import (
    CompositeTopic,
    StorageTopic,
    key_hash,
    partitions_for_shard,
    recommended_partition_count,
    router,
    shard_of_partition,
)

hashes = st.integers(min_value=0, max_value=2**64 - 1)


@st.composite
def scaled(draw: st.DrawFn) -> tuple[int, int, int]:
    """(base partition count B, scale K, shard count S dividing B)."""
    base = draw(st.integers(1, 24))
    k = draw(st.integers(1, 12))
    divisors = [s for s in range(1, base + 1) if base % s == 0]
    return base, k, draw(st.sampled_from(divisors))


def test_router_formula_examples() -> None:
    # K = 1 is plain modulo.
    assert [router(h, 4, 1) for h in range(6)] == [0, 1, 2, 3, 0, 1]
    # P = 10, K = 5 (a 2-partition topic scaled by 5): h % 2 picks the block of five.
    assert router(0, 10, 5) == 0
    assert router(1, 10, 5) == 5
    assert router(10, 10, 5) == 1  # (10 // 10) % 5 = 1 within block 0
    assert router(23, 10, 5) == 5 + 2
    with pytest.raises(ValueError, match="must divide"):
        router(1, 10, 3)
    with pytest.raises(ValueError, match="unsigned"):
        router(-1, 10, 5)


@given(hashes, st.integers(1, 64), st.integers(1, 16))
def test_router_stays_in_range(h: int, base: int, k: int) -> None:
    assert 0 <= router(h, base * k, k) < base * k


@given(hashes, scaled(), st.integers(1, 12))
def test_router_is_shard_consistent(h: int, params: tuple[int, int, int], k2: int) -> None:
    """Under the old topic (B partitions) the key's partition belongs to shard s; under the
    scaled topic (B*K partitions) its partition is inside shard s's new range."""
    base, k, shards = params
    old = router(h, base, 1)
    sid = shard_of_partition(old, base, shards)
    new = router(h, base * k, k)
    assert new in partitions_for_shard(sid, base * k, shards)
    # and between any two scalings of the same base
    assert shard_of_partition(router(h, base * k2, k2), base * k2, shards) == sid


@given(st.lists(hashes, min_size=1, max_size=20), st.integers(1, 12), st.data())
def test_composite_topic_scale_up_chain_is_shard_consistent(
    keys: list[int], p0: int, data: st.DataObject
) -> None:
    topic = CompositeTopic.create("out", p0)
    for _ in range(data.draw(st.integers(1, 4))):
        topic = topic.add_storage_topic(
            topic.storage_topics[-1].base * data.draw(st.integers(1, 6))
        )
    shards = data.draw(st.sampled_from([s for s in range(1, p0 + 1) if p0 % s == 0]))
    for h in keys:
        owners = set()
        for idx, stt in enumerate(topic.storage_topics):
            t = topic
            for _ in range(idx):
                t = t.switch_produce()
            at_idx, part = t.route(h)
            assert at_idx == idx
            assert part == stt.route(h)
            owners.add(shard_of_partition(part, stt.partitions, shards))
        assert len(owners) == 1


@cache
def _pool() -> tuple[int, ...]:
    return tuple(key_hash("Singers", json.dumps({"SingerId": i})) for i in range(400 * 48))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4))
def test_router_spreads_keys_evenly(base: int, k: int) -> None:
    partitions = base * k
    n = 400 * partitions
    counts = Counter(router(h, partitions, k) for h in _pool()[:n])
    assert set(counts) == set(range(partitions))
    # mean 400, sd ~20: +-30% is > 6 sd
    assert min(counts.values()) > 280
    assert max(counts.values()) < 520


def test_add_storage_topic_k_follows_the_seed() -> None:
    t = CompositeTopic.create("out", 2)
    assert t.storage_topics == (StorageTopic("out", 2, 1),)
    t = t.add_storage_topic(10)  # multiple of 2/1 -> K = 5
    assert t.storage_topics[1] == StorageTopic("out.1", 10, 5)
    t = t.add_storage_topic(20)  # multiple of 10/5 = 2 -> K = 10
    assert t.storage_topics[2].k == 10
    t = t.add_storage_topic(7)  # not a multiple of 20/10 -> K = 1
    assert t.storage_topics[3].k == 1
    t = t.add_storage_topic(14)  # multiple of 7/1 -> K = 2
    assert t.storage_topics[4].k == 2
    assert t.produce_pointer == 0


def test_switch_produce_stops_at_the_last() -> None:
    t = CompositeTopic.create("out", 4).add_storage_topic(8)
    assert t.produce_pointer == 0
    t = t.switch_produce()
    assert t.produce_pointer == 1
    assert t.switch_produce().produce_pointer == 1


def test_bad_composite_topics_are_refused() -> None:
    with pytest.raises(ValueError, match="needs a storage topic"):
        CompositeTopic("x", ())
    with pytest.raises(ValueError, match="bad storage topic"):
        CompositeTopic("x", (StorageTopic("x", 10, 3),))
    with pytest.raises(ValueError, match="out of range"):
        CompositeTopic("x", (StorageTopic("x", 10, 1),), produce_pointer=1)


def test_shard_assignment_examples() -> None:
    assert list(partitions_for_shard(0, 12, 3)) == [0, 1, 2, 3]
    assert list(partitions_for_shard(2, 12, 3)) == [8, 9, 10, 11]
    t = CompositeTopic.create("out", 4).add_storage_topic(8)
    a = t.shard_assignment(1, 2)
    assert [(x.topic_name, x.storage_topic_idx, x.assigned_partitions) for x in a] == [
        ("out", 0, (2, 3)),
        ("out", 1, (4, 5, 6, 7)),
    ]


@given(st.integers(1, 200), st.integers(1, 50))
def test_shard_ranges_cover_every_partition_once(partitions: int, shards: int) -> None:
    seen: list[int] = []
    for sid in range(shards):
        r = partitions_for_shard(sid, partitions, shards)
        seen.extend(r)
        for p in r:
            assert shard_of_partition(p, partitions, shards) == sid
    assert seen == list(range(partitions))


def test_key_hash_is_stable_and_unsigned() -> None:
    h = key_hash("Singers", '{"SingerId":"1"}')
    assert h == key_hash("Singers", '{"SingerId":"1"}')
    assert 0 <= h < 2**64
    assert h != key_hash("Albums", '{"SingerId":"1"}')
    # table and keys are separated: moving a character across the boundary changes the hash
    assert key_hash("ab", "c") != key_hash("a", "bc")
    # pinned so a change of hash function (which would re-route every key) fails loudly
    assert key_hash("t", "{}") == int.from_bytes(
        hashlib.blake2b(b"t\x00{}", digest_size=8).digest(), "big"
    )


def test_recommended_partition_counts() -> None:
    assert [n for n in range(1, 25) if recommended_partition_count(n)] == [
        1, 2, 3, 4, 6, 8, 12, 16, 18, 20, 24,
    ]  # fmt: skip
