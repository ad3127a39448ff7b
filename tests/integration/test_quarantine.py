"""A poison partition on real parts (docs/design.md#poison-partitions): three embedded tasks
(real actors, the embedded broker) read eight partitions of a simulated stream through a sink
that writes every batch through the real typed conversion; one record holds a value no INT64
holds. The quarantine rule parks its partition on the task it failed on; ``quarantine list``
shows it (partition, owner, watermark, error, record); nobody reads it while every other
partition goes on; with the conversion fixed, ``quarantine release`` has its owner read it again
from its watermark: every row written exactly once, raw (with the doubled-row control). The
scenario is ``python -m bench poison``'s; afterwards the real entry point lists none."""

from __future__ import annotations

import pytest

from bench.poison import scenario
from runtime.kafka import KafkaConfig
from runtime.sim.poison import POISON_VALUE
from tests.fixtures.kafka import kafka_broker, kafka_config
from tests.fixtures.output_runs import shoal
from tests.helpers import assert_catches_a_double, exactly

__all__ = ["kafka_broker", "kafka_config"]  # fixtures used by name


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_a_value_the_typed_conversion_cannot_hold_is_quarantined_and_released(
    kafka_config: KafkaConfig,
) -> None:
    figures = await scenario(kafka_config, partitions=8, tasks=3, quarantine_after=3)
    (listed,) = figures["listed"]
    assert figures["quarantined"] == 1
    assert listed["token"] == "p00000"
    assert listed["failures"] == 3
    assert "TypedError" in listed["error"]
    assert POISON_VALUE in listed["error"]
    assert listed["record"]  # "<commit ts> <transaction> <sequence>" of the failing batch
    assert figures["hops"] == 1  # it failed on its owner only: parked, it moved nowhere
    assert figures["read_while_parked"] == 0
    assert figures["others_advanced"] >= 1  # every other partition went on meanwhile
    assert figures["released_and_resumed"]
    assert figures["still_parked"] == 0
    assert figures["kept_as_text"] >= 1  # the fixed conversion wrote the poison row
    # raw: every row up to the horizon, the poisoned partition's before and after its bad
    # record too, exactly once, nothing de-duplicated
    check = exactly(figures["expected_rows"])
    horizon = set(figures["expected_rows"])
    written = [row for row in figures["rows"] if row in horizon]
    check(written)
    assert_catches_a_double(check, written)
    assert figures["lost"] == 0
    assert figures["duplicates"] == 0
    # the real entry point: nothing quarantined any more
    done = await shoal(
        "quarantine",
        "list",
        "--kafka-bootstrap-servers",
        kafka_config.bootstrap_servers,
        "--connector",
        figures["connector"],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("0 quarantined partition(s)"), done.stdout
    refused = await shoal(
        "quarantine",
        "release",
        "p00000",
        "--kafka-bootstrap-servers",
        kafka_config.bootstrap_servers,
        "--connector",
        figures["connector"],
    )
    assert refused.returncode == 2, refused
    assert "not quarantined: p00000" in refused.stderr
