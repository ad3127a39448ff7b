"""The fault simulator with a poison partition (docs/design.md#poison-partitions): one of eight
partitions holds a record every sink batch fails on (as a value the typed conversion cannot hold
would), among three tasks with crashes, pauses, joins and leaves. The quarantine rule parks it
at its watermark, nobody reads it while it is parked, every other record reaches the sink; an
operator's release (the sink healed) has it read again from its watermark, every record exactly
once. The teeth: the same seeds with the rule off, and with a parked partition read anyway."""

from __future__ import annotations

from runtime.sim.faultsim import SimParams, run
from tests.sim.params import sim_params

SEEDS = range(3)
POISON = {
    "tasks": 3,
    "roots": 8,
    "split_p": 0.0,  # a poison partition never reaches its end: no churn
    "move_p": 0.0,
    "merge_p": 0.0,
    "poison_at_us": 5_000_000,
    "quarantine_after": 5,
}


def _params(seed: int, **overrides: object) -> SimParams:
    return sim_params(seed=seed, **{**POISON, **overrides})


def test_a_poison_partition_is_parked_and_everything_else_delivered() -> None:
    for seed in SEEDS:
        result = run(_params(seed))
        assert result.passed, f"seed {seed}: {result.violation}"
        assert result.quarantined == 1, result
        assert result.poison_failures >= 5, result
        assert 1 <= result.poison_hops <= 2, result  # a crash or pause may move it once
        assert not result.released_and_resumed


def test_a_released_partition_resumes_at_its_watermark_exactly_once() -> None:
    for seed in SEEDS:
        result = run(_params(seed, release_at_us=30_000_000))
        # (the final checks: every record, the poison's partition's too, exactly once)
        assert result.passed, f"seed {seed}: {result.violation}"
        assert result.quarantined == 1, result
        assert result.released_and_resumed, result
        assert result.duplicates == 0


def test_teeth_without_the_rule_the_poison_partition_is_retried_for_ever() -> None:
    # the same seeds as the control above
    for seed in SEEDS:
        result = run(_params(seed, quarantine_after=0))
        assert not result.passed
        assert "never quarantined" in result.violation, result.violation
        # its batch failed over and over (the count is in the violation)
        failed = int(result.violation.split("failed ")[1].split(" times")[0])
        assert failed > 50, result.violation


def test_teeth_a_quarantined_partition_read_anyway_is_caught() -> None:
    for seed in SEEDS:
        result = run(_params(seed, park_quarantined=False))
        assert not result.passed
        assert "while it is quarantined" in result.violation, result.violation
