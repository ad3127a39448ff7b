"""The fault simulator over a MUTABLE_KEY_RANGE stream (``SimParams(partition_mode="mutable")``,
``runtime/sim/mutable.py``): keys moving between live partitions, partitions announced and
ended, with crashes, zombies and hand-offs; besides the simulator's invariants, no write of a
key reaches the sink after a later write of that key. Teeth: with the move-in hold ignored
(``move_in_holds=False``) the same seeds fail that check."""

from __future__ import annotations

import pytest

from protocol.task import Rules
from runtime.sim.faultsim import SimParams, run

SEEDS = (0, 1, 2, 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_fault_simulator_over_a_mutable_stream(seed: int) -> None:
    result = run(SimParams(seed=seed, partition_mode="mutable"))
    assert result.passed, f"seed {seed}: {result.violation}"
    assert result.holds_passed > 0  # destinations waited at move-ins and went on
    assert result.crashes + result.pauses > 0 or result.rebalances > 1
    assert result.records > 0
    assert result.duplicates == 0


def test_teeth_without_the_move_in_hold_the_same_seeds_break_key_order() -> None:
    for seed in SEEDS:
        result = run(
            SimParams(seed=seed, partition_mode="mutable", rules=Rules(move_in_holds=False))
        )
        assert not result.passed, seed
        assert "out of timestamp order" in result.violation, result.violation
