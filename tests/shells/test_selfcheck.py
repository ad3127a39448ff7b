"""The command line's self-check (``actors/cli/selfcheck.py``) on one seeded simulated stream:
the exact delivery passes (the control), a record lost, one committed twice, one substituted by
a record that was never produced and a partition's batches settled out of order are each told
apart; and it holds no identity per record (its memory stays flat over 55,000 records)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import msgspec

from actors.cli.selfcheck import CommitTally, Sums, expect, missing_from
from protocol.records import DataChange
from runtime.sim.stream import StreamModel, StreamParams

START = 1_700_000_000_000_000
PARAMS = StreamParams(
    seed=5, roots=3, start_ts=START, round_us=1_000_000, split_p=0.3, merge_p=0.3, move_p=0.1
)
END = START + 8_000_000


def _window() -> list[tuple[str, DataChange]]:
    return list(StreamModel(PARAMS).expected_by_partition(END))


def _batches(
    window: list[tuple[str, DataChange]], size: int = 7
) -> Iterator[tuple[str, list[DataChange]]]:
    """The window cut into batches of one partition each, in each partition's order."""
    by_token: dict[str, list[DataChange]] = {}
    for token, record in window:
        by_token.setdefault(token, []).append(record)
    for token, records in by_token.items():
        for i in range(0, len(records), size):
            yield token, records[i : i + size]


def _deliver(tally: CommitTally, batches: Iterator[tuple[str, list[DataChange]]]) -> None:
    for token, records in batches:
        tally.settled(token, tally.handed(token), records)


def test_the_model_has_partitions_with_several_batches() -> None:
    window = _window()
    tokens = {t for t, _ in window}
    assert len(tokens) >= 5
    assert len(window) >= 10 * len(tokens)


def test_the_exact_delivery_is_complete_control() -> None:
    window = _window()
    tally = CommitTally()
    _deliver(tally, _batches(window))
    expected = expect(window)
    assert tally.complete(expected)
    assert tally.duplicates == 0
    assert tally.records == len(window) == sum(s.records for s in expected.values())
    assert tally.distinct_rows == sum(len(r.mods) for _, r in window)


def test_a_lost_record_leaves_its_partition_short() -> None:
    window = _window()
    lost_token, lost = window[len(window) // 2]
    tally = CommitTally()
    _deliver(tally, _batches([(t, r) for t, r in window if r is not lost]))
    assert tally.differs(expect(window)) == [lost_token]
    assert tally.duplicates == 0
    present = {r.identity for _, r in window if r is not lost}
    assert list(missing_from(window, [lost_token], present)) == [lost.identity]


def test_a_record_committed_twice_is_a_duplicate() -> None:
    window = _window()
    tally = CommitTally()
    batches = list(_batches(window))
    _deliver(tally, iter(batches))
    token, records = batches[3]
    # its partition re-read from before its last batch (a new owner at the watermark)
    tally.settled(token, tally.handed(token), records[-2:])
    assert tally.duplicates == 2
    assert tally.records == len(window) + 2
    assert tally.complete(expect(window))  # every record is there: the double is counted


def test_a_record_never_produced_makes_the_digest_differ() -> None:
    window = _window()
    token, victim = window[5]
    forged = msgspec.structs.replace(victim, server_transaction_id="forged")
    swapped = [(t, forged if r is victim else r) for t, r in window]
    tally = CommitTally()
    _deliver(tally, _batches(swapped))
    assert tally.records == len(window)
    assert tally.differs(expect(window)) == [token]


def test_batches_settled_out_of_order_count_in_handed_order() -> None:
    window = _window()
    token = window[0][0]
    mine = [b for t, b in _batches(window) if t == token]
    assert len(mine) >= 3
    tally = CommitTally()
    numbers = [tally.handed(token) for _ in mine[:3]]
    # the second settles first, then a failed one (its records re-read later), then the first
    tally.settled(token, numbers[1], mine[1])
    assert tally.sums(token) == Sums()  # waits for the first
    tally.settled(token, numbers[2], None)
    tally.settled(token, numbers[0], mine[0])
    tally.settled(token, tally.handed(token), mine[2])  # the re-read of the failed one
    for records in mine[3:]:
        tally.settled(token, tally.handed(token), records)
    _deliver(tally, ((t, b) for t, b in _batches(window) if t != token))
    assert tally.duplicates == 0
    assert tally.complete(expect(window))
    assert tally.pending() == 0


def test_in_settled_order_the_same_story_would_count_a_double_control() -> None:
    """Without the handed order the early second batch moves the watermark past the first."""
    window = _window()
    token = window[0][0]
    first, second = [b for t, b in _batches(window) if t == token][:2]
    tally = CommitTally()
    tally.settled(token, tally.handed(token), second)
    tally.settled(token, tally.handed(token), first)
    assert tally.duplicates == len(first)


def test_its_memory_does_not_grow_with_the_records() -> None:
    params = msgspec.structs.replace(
        PARAMS, roots=4, split_p=0.0, merge_p=0.0, move_p=0.0, records_per_s=1500.0
    )
    window = list(StreamModel(params).expected_by_partition(START + 10_000_000))
    assert len(window) >= 55_000
    batches = list(_batches(window, size=500))
    tally = CommitTally()
    tracemalloc.start()
    try:
        _deliver(tally, iter(batches[:40]))
        before = tracemalloc.take_snapshot()
        _deliver(tally, iter(batches[40:]))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert tally.complete(expect(window))
    only = [tracemalloc.Filter(True, "*selfcheck.py")]
    grown = sum(
        d.size_diff
        for d in after.filter_traces(only).compare_to(before.filter_traces(only), "filename")
    )
    # some 55,000 identities more would be over 4 MB; the tally's own growth is nil
    assert grown < 64 * 1024, grown
