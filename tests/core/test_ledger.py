"""The output ledger (protocol/ledger.py): the exact decisions of each rule for given events.
The state machine over readers, a sink and failures is tests/stateful/test_ledger_stateful.py."""

from __future__ import annotations

import pytest

from protocol.commit import next_position
from protocol.dedup import Position
from protocol.ledger import Admit, OutputLedger, Refuse, retry_delay
from protocol.records import DataChange


def rec(ts: int, seq: str = "0", txn: str = "t") -> DataChange:
    return DataChange(ts, seq, txn, False, "T", (), (), "INSERT")


def recs(*ts: int) -> tuple[DataChange, ...]:
    return tuple(rec(t) for t in ts)


def checked(ledger: OutputLedger) -> OutputLedger:
    ledger.validate()
    return ledger


# --- rule 4: admission, keys, release ------------------------------------------------------


def test_every_admitted_batch_gets_the_next_key_and_is_held_until_released() -> None:
    ledger = OutputLedger()
    assert ledger.admit(100, "p", recs(1), 1) == Admit(0)
    assert ledger.admit(101, "q", (), 5) == Admit(1)
    assert ledger.admit(102, "p", recs(2), 2) == Admit(2)
    assert [ledger.key_of(r) for r in (100, 101, 102, 103)] == [0, 1, 2, None]
    ledger.release(1)
    assert ledger.key_of(101) is None
    assert not ledger.holds(1)
    assert ledger.holds(0)
    checked(ledger)


def test_a_reused_reference_keeps_the_newer_batch_key() -> None:
    """The shell names batches by ``id()``; a new batch may reuse the id of one still held.
    Releasing the older one must not forget the newer one's key."""
    ledger = OutputLedger()
    assert ledger.admit(7, "p", recs(1), 1) == Admit(0)
    assert ledger.admit(7, "p", recs(2), 2) == Admit(1)
    ledger.release(0)
    assert ledger.key_of(7) == 1
    checked(ledger)
    assert ledger.release_all() == [1]
    assert ledger.key_of(7) is None
    checked(ledger)


# --- rule 2: gaps ----------------------------------------------------------------------------


def failed_at_10_and_20() -> OutputLedger:
    """Partition p's batch of records 10 and 20 failed (and one of q with it)."""
    ledger = OutputLedger()
    assert ledger.admit(1, "p", recs(10, 20), 20) == Admit(0)
    assert ledger.admit(2, "q", recs(15), 15) == Admit(1)
    assert ledger.fail([0]) == [0, 1]
    ledger.release(0)
    ledger.release(1)
    return checked(ledger)


def test_a_continuation_past_a_failed_batch_is_refused_until_the_re_read() -> None:
    ledger = failed_at_10_and_20()
    assert ledger.gap("p") == 10
    assert ledger.admit(3, "p", recs(30), 30) == Refuse(10)  # later batch of the same reader
    assert ledger.admit(4, "r", recs(30), 30) == Admit(0 + 2)  # another partition
    assert ledger.admit(5, "p", recs(10, 20), 20) == Admit(3)  # the re-read closes the gap
    assert ledger.gap("p") is None
    assert ledger.admit(6, "p", recs(30), 30) == Admit(4)
    assert ledger.refused == 1
    checked(ledger)


def test_a_re_read_starting_before_the_gap_closes_it_too() -> None:
    ledger = failed_at_10_and_20()
    assert ledger.admit(3, "p", recs(5, 10, 20), 20) == Admit(2)
    assert ledger.gap("p") is None


def test_a_heartbeat_past_the_gap_is_refused_and_one_at_or_before_it_is_admitted() -> None:
    """Both sides of the empty-batch rule: a heartbeat (no records) whose watermark is past the
    gap is refused; one at or before it is admitted and leaves the gap open."""
    ledger = failed_at_10_and_20()
    assert ledger.admit(3, "p", (), 25) == Refuse(10)
    assert ledger.admit(4, "p", (), 11) == Refuse(10)
    assert ledger.admit(5, "p", (), 10) == Admit(2)
    assert ledger.admit(6, "p", (), 9) == Admit(3)
    assert ledger.gap("p") == 10  # a heartbeat is no re-read
    assert ledger.admit(7, "p", recs(30), 30) == Refuse(10)
    checked(ledger)


def test_why_heartbeats_past_the_gap_are_refused() -> None:
    """Committing a batch records its partition's position at its watermark: a heartbeat past
    the failed records would record them as committed (they were never written), and an owner
    resuming from that position would skip them. A heartbeat at the gap records nothing past
    them. This is what the Spark bridge's old rule (empty batches never refused) got wrong."""
    before = Position(5, (("t", "0"),))  # committed up to the record at 5
    past = next_position(before, (), 25)
    assert past.ts == 25
    assert past.tail().seen(10, rec(10).identity)  # 10 counts as read: a resume skips it
    at_gap = next_position(before, (), 10)
    assert not at_gap.tail().seen(10, rec(10).identity)  # 10 is read again on resume
    assert at_gap.tail().seen(5, rec(5).identity)


def test_a_new_reader_closes_the_gap() -> None:
    ledger = failed_at_10_and_20()
    ledger.reader_starts("p")
    assert ledger.gap("p") is None
    assert ledger.admit(3, "p", recs(30), 30) == Admit(2)
    ledger.reader_starts("never-seen")  # nothing to close
    checked(ledger)


def test_a_failed_empty_batch_opens_no_gap_and_the_lowest_failure_wins() -> None:
    ledger = OutputLedger()
    assert ledger.admit(1, "p", (), 50) == Admit(0)
    assert ledger.admit(2, "q", recs(40, 41), 41) == Admit(1)
    assert ledger.fail([0]) == [0, 1]
    assert ledger.gap("p") is None
    assert ledger.gap("q") == 40
    ledger.release(0)
    ledger.release(1)
    assert ledger.admit(3, "q", recs(38), 38) == Admit(2)  # re-read from before the gap
    assert ledger.admit(4, "q", recs(45), 45) == Admit(3)
    assert ledger.fail([3]) == [2, 3]  # 2 is held and not committed: it fails too
    assert ledger.gap("q") == 38
    checked(ledger)


# --- rule 3: the cascade ------------------------------------------------------------------


def test_a_failure_fails_every_held_batch_not_past_its_commit_point_in_admission_order() -> None:
    ledger = OutputLedger()
    for ref, token, ts in [(1, "p", 1), (2, "q", 2), (3, "p", 3), (4, "r", 4)]:
        ledger.admit(ref, token, recs(ts), ts)
    ledger.committed([0], [("p", recs(1))])  # past its commit point, resolving (e.g. RQ rows)
    assert ledger.generation == 0
    assert ledger.fail([2]) == [1, 2, 3]
    assert ledger.generation == 1
    assert not ledger.current(0)
    assert ledger.current(1)
    assert (ledger.gap("p"), ledger.gap("q"), ledger.gap("r")) == (3, 2, 4)
    assert ledger.failed == 3
    checked(ledger)


def test_a_failure_confined_to_partitions_fails_only_their_held_batches() -> None:
    ledger = OutputLedger()
    for ref, token, ts in [(1, "p", 1), (2, "q", 2), (3, "p", 3), (4, "q", 4)]:
        ledger.admit(ref, token, recs(ts), ts)
    assert ledger.fail([0], only_their_partitions=True) == [0, 2]
    assert (ledger.gap("p"), ledger.gap("q")) == (1, None)
    checked(ledger)


def test_failing_keys_no_longer_held_fails_what_is_held() -> None:
    ledger = OutputLedger()
    ledger.admit(1, "p", recs(1), 1)
    assert ledger.fail([42]) == [0]
    checked(ledger)


# --- rule 1: tails ----------------------------------------------------------------------------


def test_the_committed_tail_drops_what_was_committed_and_nothing_else() -> None:
    ledger = OutputLedger()
    a, b, c = rec(10, "1"), rec(10, "2"), rec(20, "3")
    assert ledger.unseen("p", [a, b]) == [a, b]  # nothing committed yet, nothing accepted
    assert ledger.unseen("p", [a, b]) == [a, b]
    ledger.committed([], [("p", [a, b])])
    assert ledger.unseen("p", [a, b, c]) == [c]  # a re-read from the watermark
    assert ledger.unseen("q", [a]) == [a]  # another partition
    same_ts = rec(20, "4")
    ledger.committed([], [("p", [c])])
    assert ledger.unseen("p", [c, same_ts]) == [same_ts]
    assert ledger.partitions() == 1
    checked(ledger)


def test_the_pending_tail_runs_ahead_and_restarts_from_the_committed_one_after_a_failure() -> None:
    ledger = OutputLedger(ahead=True)
    a, b, c = rec(10), rec(20), rec(30)
    assert ledger.begin_cut() == 0
    assert ledger.take_fresh("p", [a]) == [a]
    ledger.admit(1, "p", (a,), 10)
    ledger.committed([0], [("p", [a])])
    ledger.release(0)
    assert ledger.begin_cut() == 0
    assert ledger.take_fresh("p", [a, b]) == [b]  # b is taken: the next cut drops it
    assert ledger.take_fresh("p", [b, c]) == [c]
    checked(ledger)
    ledger.admit(2, "p", (b, c), 30)
    ledger.fail([1])  # the micro-batch with b and c failed: never committed
    assert ledger.take_fresh("p", [b]) == []  # same cut generation: still taken
    assert ledger.begin_cut() == 1
    assert ledger.take_fresh("p", [a, b, c]) == [b, c]  # re-read: written this time
    checked(ledger)


def test_a_sink_without_a_pending_tail_refuses_to_take_ahead() -> None:
    ledger = OutputLedger()
    with pytest.raises(AssertionError, match="ahead=True"):
        ledger.take_fresh("p", [rec(1)])
    with pytest.raises(AssertionError, match="ahead=True"):
        ledger.begin_cut()


def test_seeds_start_both_tails_once() -> None:
    ledger = OutputLedger(ahead=True)
    assert ledger.unseeded(["p", "q", "p"]) == ["p", "q"]
    ledger.seed("p", Position(20, (("t", "0"),)))
    ledger.seed("q", None)
    assert ledger.unseeded(["p", "q", "r"]) == ["r"]
    assert ledger.unseen("p", [rec(10), rec(20), rec(20, "1")]) == [rec(20, "1")]
    assert ledger.take_fresh("p", [rec(20), rec(21)]) == [rec(21)]
    ledger.seed("p", Position(5))  # a tail is kept once it exists
    assert ledger.unseen("p", [rec(10)]) == []
    ledger.seed_identity("r", (7, "t", "0"))
    assert ledger.unseen("r", [rec(7), rec(8)]) == [rec(8)]
    assert ledger.partitions() == 2  # q's position was unknown: no tail
    checked(ledger)


# --- rule 5: attempts -----------------------------------------------------------------------


def test_a_failed_job_runs_again_after_a_doubling_backoff_then_fails() -> None:
    assert [retry_delay(n, 3, 0.5) for n in (1, 2, 3)] == [0.5, 1.0, None]
    assert [retry_delay(n, 5, 0.1) for n in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.8, None]
    assert retry_delay(1, 1, 0.5) is None
    assert retry_delay(7, 3, 0.5) is None
    with pytest.raises(ValueError, match="must be >= 1"):
        retry_delay(0, 3, 0.5)


# --- validate() has teeth --------------------------------------------------------------------


def test_validate_catches_a_broken_ledger() -> None:
    ledger = OutputLedger()
    ledger.admit(1, "p", recs(1), 1)
    ledger.validate()
    ledger._keys[1] = 99  # a reference naming a key nobody holds
    with pytest.raises(AssertionError):
        ledger.validate()
    ahead = OutputLedger(ahead=True)
    ahead.committed([], [("p", recs(5))])  # committed what the pending tail never took
    with pytest.raises(AssertionError):
        ahead.validate()
