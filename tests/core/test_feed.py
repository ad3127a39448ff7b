"""Feeding the old RQ/DLQ storage topics to the new ones after a shard-count change
(protocol/retry.py, ``feed_plan``; docs/design.md#retry-and-dead-letter-queues): exact plans per
rule, and a model of a queue writing to the old layout, then the new one, with a feeder that
crashes half-way and is run again: each held record is copied once, per key in order, and the
new storage topics alone then rebuild exactly the state of all of them."""

from __future__ import annotations

import random

import pytest

from protocol.retry import (
    Deliver,
    DeliveryFailed,
    DeliveryOk,
    Discarded,
    FeedCopy,
    LogEntry,
    ParkInRetry,
    Released,
    ReplayDlq,
    RetryCore,
    RetryPolicy,
    SendToDlq,
    SendToSink,
    Tick,
    feed_plan,
    from_log,
)

OLD, NEW = False, True


def test_held_records_are_copied_with_their_newest_entry_per_key_in_order() -> None:
    entries: list[tuple[LogEntry, bool]] = [
        (ParkInRetry("b2", "k:b", 7, 8, 0, 1.0), OLD),
        (ParkInRetry("a1", "k:a", 1, 2, 1, 1.0, "e"), OLD),
        (ParkInRetry("a1", "k:a", 1, 5, 2, 2.0, "e"), OLD),  # re-parked: the newest wins
        (ParkInRetry("a3", "k:a", 3, 4, 0, 1.0), OLD),
        (SendToDlq("b1", "k:b", 6, 9, 5, "boom"), OLD),
        (ParkInRetry("b1", "k:b", 6, 6, 4, 1.0), OLD),
    ]
    plan = feed_plan(entries, {"a1": b"A1", "a3": b"A3", "b1": b"B1", "b2": b"B2"})
    assert plan.copies == (
        FeedCopy(ParkInRetry("a1", "k:a", 1, 5, 2, 2.0, "e"), b"A1"),
        FeedCopy(ParkInRetry("a3", "k:a", 3, 4, 0, 1.0), b"A3"),
        FeedCopy(SendToDlq("b1", "k:b", 6, 9, 5, "boom"), b"B1"),  # to the DLQ
        FeedCopy(ParkInRetry("b2", "k:b", 7, 8, 0, 1.0), b"B2"),
    )
    assert (plan.held, plan.present, plan.missing_payloads) == (4, 0, 0)


def test_settled_records_and_records_already_in_the_new_topics_are_not_copied() -> None:
    entries: list[tuple[LogEntry, bool]] = [
        (ParkInRetry("r", "k", 1, 1, 1, 0.0), OLD),
        (Released("r", "k", 3), NEW),  # delivered after the commit: written to the new layout
        (SendToDlq("d", "k", 2, 2, 5, "x"), OLD),
        (Discarded("d", "k", 4), OLD),  # discarded before the commit
        (ParkInRetry("n", "k", 5, 5, 0, 0.0), NEW),  # parked after the commit
        (ParkInRetry("c", "k", 6, 6, 0, 0.0), OLD),
        (ParkInRetry("c", "k", 6, 6, 0, 0.0), NEW),  # copied by an earlier (crashed) feed
        (ParkInRetry("m", "k", 7, 7, 0, 0.0), OLD),
    ]
    plan = feed_plan(entries, {})
    assert [c.entry.record_id for c in plan.copies] == ["m"]
    assert plan.copies[0].payload is None
    assert (plan.held, plan.present, plan.missing_payloads) == (3, 2, 1)


def test_an_older_entry_in_the_new_topics_does_not_count_as_copied() -> None:
    entries: list[tuple[LogEntry, bool]] = [
        (ParkInRetry("r", "k", 1, 1, 0, 0.0), NEW),
        (ParkInRetry("r", "k", 1, 3, 1, 0.0), OLD),  # a late write of the old layout, newer
    ]
    assert [c.entry.version for c in feed_plan(entries, {"r": b""}).copies] == [3]


# --- a model ---------------------------------------------------------------------------------


def _run_queue(seed: int) -> tuple[list[tuple[LogEntry, bool]], dict[str, bytes]]:
    """A single-owner queue over 6 keys with failing deliveries; its log entries go to the old
    layout until a random step, to the new one after (the barrier: nothing in flight between)."""
    rng = random.Random(seed)
    core = RetryCore(RetryPolicy(max_attempts=3, base_backoff=0.0, jitter=0.0), seed)
    written: list[tuple[LogEntry, bool]] = []
    payloads: dict[str, bytes] = {}
    in_flight: list[str] = []
    switch_at = rng.randrange(10, 60)
    now = 0.0
    n = 0
    for step in range(90):
        now += 0.01
        new = step >= switch_at
        r = rng.random()
        if r < 0.45:
            rid = f"r{n}"
            n += 1
            payloads[rid] = rid.encode()
            cmds = core.handle(Deliver(rid, f"t:{rng.randrange(6)}"), now)
        elif r < 0.8 and in_flight:
            rid = in_flight.pop(rng.randrange(len(in_flight)))
            ok = rng.random() < 0.5
            cmds = core.handle(DeliveryOk(rid) if ok else DeliveryFailed(rid, "x"), now)
        elif r < 0.85 and core.dlq_records():
            cmds = core.handle(ReplayDlq(rng.choice(core.dlq_records()).record_id), now)
        else:
            cmds = core.handle(Tick(), now)
        for c in cmds:
            if isinstance(c, SendToSink):
                in_flight.append(c.record_id)
            elif isinstance(c, ParkInRetry | Released | SendToDlq | Discarded):
                written.append((c, new))
        core.validate()
    return written, payloads


def _feed(
    written: list[tuple[LogEntry, bool]], payloads: dict[str, bytes], crash_after: int | None
) -> list[FeedCopy]:
    plan = feed_plan(written, payloads)
    copies = list(plan.copies if crash_after is None else plan.copies[:crash_after])
    written.extend((c.entry, NEW) for c in copies)
    return copies


@pytest.mark.parametrize("seed", range(300))
def test_model_a_crashed_feed_run_again_copies_each_record_once(seed: int) -> None:
    written, payloads = _run_queue(seed)
    everything = from_log([e for e, _ in written]).durable_state()
    rng = random.Random(seed)
    first = _feed(written, payloads, crash_after=rng.randrange(0, 4))  # the feeder dies
    second = _feed(written, payloads, crash_after=None)  # run again
    third = _feed(written, payloads, crash_after=None)  # and once more: nothing left
    assert third == []
    copied = [(c.entry.record_id, c.entry.version) for c in first + second]
    assert len(copied) == len(set(copied)), "a record copied twice"
    # the new storage topics alone rebuild the state of all of them: the old ones can go
    assert from_log([e for e, new in written if new]).durable_state() == everything
    # per key in sequence order, in each run
    for run in (first, second):
        seqs: dict[str, list[int]] = {}
        for c in run:
            seqs.setdefault(c.entry.key, []).append(c.entry.seq)
        assert all(s == sorted(s) for s in seqs.values())
    assert all(c.payload is not None for c in first + second)


def test_model_teeth_feeding_by_the_oldest_entry_loses_state() -> None:
    """Teeth: copying a record's first entry instead of its newest makes the new topics say
    something else than all of them on the same seeds."""
    broken = 0
    for seed in range(300):
        written, _ = _run_queue(seed)
        everything = from_log([e for e, _ in written]).durable_state()
        first: dict[str, LogEntry] = {}
        for e, _ in written:
            first.setdefault(e.record_id, e)
        held = {e.record_id for e in everything}
        new = [e for e, n in written if n] + [first[r] for r in held]
        broken += from_log(new).durable_state() != everything
    assert broken > 0
