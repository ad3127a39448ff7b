"""Epoch numbering and acceptance (``protocol.epochs``): exact values for each rule, and a model of
a group whose Kafka generations start over, in which the epochs members accept never go back."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import epochs
from protocol.epochs import NO_EPOCH, Accepted, Stale, newest, number, receive


def test_newest_is_the_largest_known_or_none() -> None:
    assert newest() == NO_EPOCH == -1
    assert newest(NO_EPOCH, NO_EPOCH) == NO_EPOCH
    assert newest(3, NO_EPOCH, 7, 5) == 7
    assert newest(0) == 0


@pytest.mark.parametrize(
    ("generation", "known", "epoch"),
    [
        (0, [], 0),  # a new group, nothing known: the epoch is the generation
        (0, [NO_EPOCH, NO_EPOCH], 0),
        (5, [4, 3], 5),  # generations go on: the epoch is the generation
        (5, [2], 5),
        (1, [7], 8),  # the group started over below a known epoch: go on from it
        (0, [7, NO_EPOCH, 3], 8),
        (7, [7], 8),  # a generation equal to a known epoch is not newer
        (9, [7], 9),
    ],
)
def test_number_is_the_generation_or_one_past_the_newest_known(
    generation: int, known: list[int], epoch: int
) -> None:
    assert number(generation, known) == epoch


def test_number_takes_any_iterable_once() -> None:
    assert number(2, iter([4, 1])) == 5


@pytest.mark.parametrize(
    ("assigned", "generation", "known", "verdict"),
    [
        (8, 1, 7, Accepted(8)),  # newer than known: taken
        (0, 0, NO_EPOCH, Accepted(0)),  # the first epoch of a new group
        (7, 1, 7, Stale(epoch=7, known=7)),  # equal to known: refused
        (3, 3, 7, Stale(epoch=3, known=7)),  # older than known: refused
        (NO_EPOCH, 4, 3, Accepted(4)),  # a leader that predates epochs: the generation
        (NO_EPOCH, 4, 4, Stale(epoch=4, known=4)),
        (-2, 6, 3, Accepted(6)),  # any negative number is "no epoch"
    ],
)
def test_receive(assigned: int, generation: int, known: int, verdict: Accepted | Stale) -> None:
    assert receive(assigned, generation, known) == verdict


def test_receive_takes_its_own_epoch_that_landed_first() -> None:
    """Rule 5: equal to the known epoch, but it is this assignment's own: taken. Never an
    older one, whatever ``own`` says."""
    assert receive(7, 7, 7, own=True) == Accepted(7)
    assert receive(7, 7, 7) == Stale(epoch=7, known=7)
    assert receive(6, 6, 7, own=True) == Stale(epoch=6, known=7)
    assert receive(8, 8, 7, own=True) == Accepted(8)


LOGGED = epochs.Logged(epoch=7, leader="a", members=("a", "b"))


@pytest.mark.parametrize(
    ("assigned", "leader", "members", "seen", "own"),
    [
        (7, "a", ("a", "b"), 6, True),  # the leader's epoch landed before b's assignment
        (7, "a", ["a", "b"], 6, True),  # any sequence of members
        (7, "a", ("a", "b"), 7, False),  # assigned to this member before: a second generation
        (7, "b", ("a", "b"), 6, False),  # another leader numbered it: the leader was behind
        (7, "a", ("a",), 6, False),  # other members: another generation's epoch
        (8, "a", ("a", "b"), 6, False),  # not the epoch in the log (and newer anyway)
        (NO_EPOCH, "a", ("a", "b"), 6, False),  # a leader that predates epochs
    ],
)
def test_landed_first_only_for_the_assignments_own_epoch(
    assigned: int, leader: str, members: tuple[str, ...], seen: int, own: bool
) -> None:
    assert epochs.landed_first(assigned, leader, members, seen, LOGGED) is own


def test_landed_first_with_nothing_logged() -> None:
    assert not epochs.landed_first(0, "a", ("a",), NO_EPOCH, epochs.Logged())


def test_a_stale_verdict_says_why() -> None:
    assert Stale(epoch=3, known=7).reason == "assigned a stale epoch 3 (epoch 7 is known here)"


# -- a group whose generations start over --------------------------------------------------------

Numbering = Callable[[int, Iterable[int]], int]


def run_group(
    rounds: list[tuple[bool, list[int]]], numbering: Numbering = number
) -> list[tuple[str, int]]:
    """Members ``a``, ``b``, ``c``; each round the group rebalances (Kafka's generation +1, or
    back to 0 when ``restart``), a member's sync-topic epoch rises to the given floor, the leader
    (``a``) numbers the epoch with ``numbering`` from what every member knows, and each member
    receives it. A refusal makes the group rebalance again at once (the member rejoins).
    Returns each member's accepted epochs in order."""
    seen = dict.fromkeys("abc", NO_EPOCH)
    floor = dict.fromkeys("abc", NO_EPOCH)
    accepted: list[tuple[str, int]] = []
    generation = -1
    for restart, floors in rounds:
        generation = 0 if restart else generation + 1
        for m, f in zip("abc", floors, strict=True):
            floor[m] = max(floor[m], f)
        for _attempt in range(3):  # a refusal is followed by one more rebalance
            known = {m: newest(seen[m], floor[m]) for m in "abc"}
            epoch = numbering(generation, known.values())
            verdicts = {m: receive(epoch, generation, known[m]) for m in "abc"}
            for m, verdict in verdicts.items():
                if isinstance(verdict, Accepted):
                    seen[m] = verdict.epoch
                    accepted.append((m, verdict.epoch))
            if all(isinstance(v, Accepted) for v in verdicts.values()):
                break
            generation += 1
    return accepted


def increasing_per_member(accepted: list[tuple[str, int]]) -> bool:
    return all(
        all(x < y for x, y in pairwise(mine))
        for mine in ([e for m, e in accepted if m == who] for who in "abc")
    )


def test_after_a_restart_the_epochs_go_on_from_the_newest_known() -> None:
    rounds = [(False, [NO_EPOCH] * 3), (False, [0, 0, 0]), (True, [1, 1, 1]), (False, [2, 2, 2])]
    assert run_group(rounds) == [
        ("a", 0), ("b", 0), ("c", 0),
        ("a", 1), ("b", 1), ("c", 1),
        ("a", 2), ("b", 2), ("c", 2),  # generation 0 again: epoch 2
        ("a", 3), ("b", 3), ("c", 3),
    ]  # fmt: skip


@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(-1, 12), min_size=3, max_size=3)),
        min_size=1,
        max_size=12,
    )
)
def test_accepted_epochs_never_go_back(rounds: list[tuple[bool, list[int]]]) -> None:
    accepted = run_group(rounds)
    assert increasing_per_member(accepted)
    assert len(accepted) == 3 * len(rounds)  # every round's first epoch is taken by all


def test_teeth_taking_the_generation_as_the_epoch_is_caught() -> None:
    """Control and broken rule on the same rounds: the group starts over below a known epoch."""
    rounds = [(False, [NO_EPOCH] * 3), (False, [1, 1, 1]), (True, [1, 1, 1]), (True, [1, 1, 1])]
    control = run_group(rounds)
    assert increasing_per_member(control)
    assert len(control) == 3 * len(rounds)

    def generation_only(generation: int, known: Iterable[int]) -> int:
        return generation

    broken = run_group(rounds, generation_only)
    # Members refuse the stale epochs, so no epoch goes back, but the group never settles:
    # after the restart no round ends with an epoch every member took.
    assert increasing_per_member(broken)
    assert broken == control[:6]


def test_a_task_is_rebalancing_while_its_group_says_so_or_its_generation_has_no_epoch() -> None:
    assert epochs.rebalancing(True, True, 5, 5)
    assert epochs.rebalancing(False, True, 4, 5)  # a member of generation 5, no epoch 5 yet
    assert not epochs.rebalancing(False, True, 5, 5)
    assert not epochs.rebalancing(False, True, 6, 5)  # epochs may run ahead of generations
    assert not epochs.rebalancing(False, False, 4, 5)  # not a member: nothing to wait for


def test_a_task_is_fresh_only_when_every_member_with_its_id_is() -> None:
    """A restarted task whose earlier life's member is still in the group is not fresh: that
    life may still read (protocol/planner.py resets only fresh tasks)."""
    said = [("a", True), ("b", True), ("b", False), ("c", False), ("d", True)]
    assert epochs.fresh_tasks(iter(said)) == ("a", "d")
