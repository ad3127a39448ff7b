"""Why a run ends (protocol/ending.py): the exact decision for each rule and their order."""

from __future__ import annotations

import msgspec

from protocol.ending import End, Facts, Fail, KeepGoing, decide

BROKER_GONE = (
    "Kafka: the embedded broker (pid 4242) exited with code 137; it kept its topics in memory, "
    "so the connector's state is gone with it"
)
UNREACHABLE = (
    "Kafka at localhost:9092: no task of this process has been a member of its group for 121s "
    "(kafka.unreachable_limit_s = 120): the broker is unreachable or the group does not answer"
)


def _replace(facts: Facts, **changes: object) -> Facts:
    return msgspec.structs.replace(facts, **changes)


def _out_of_reach(**kw: object) -> Facts:
    """Two tasks out of their group since 10.0 and 20.0; the limit is 120 s; now is 141.0."""
    return Facts(
        now=141.0,
        out_of_group_since=(10.0, 20.0),
        unreachable_limit_s=120.0,
        kafka="localhost:9092",
        **kw,  # type: ignore[arg-type]
    )


def test_nothing_holds_keep_going_with_no_timer() -> None:
    assert decide(Facts(now=5.0)) == KeepGoing(None)


def test_a_port_failed_for_good_fails_with_its_own_message() -> None:
    assert decide(Facts(now=5.0, port_failure="Spark: gone")) == Fail("Spark: gone", "port")


def test_the_embedded_broker_exiting_fails_the_run() -> None:
    facts = Facts(now=5.0, broker_pid=4242, broker_exit_code=137)
    assert decide(facts) == Fail(BROKER_GONE, "broker")


def test_the_broker_exiting_while_stopping_is_no_failure() -> None:
    facts = Facts(now=5.0, stopping=True, broker_pid=4242, broker_exit_code=0)
    assert decide(facts) == KeepGoing(None)


def test_every_task_out_of_its_group_past_the_limit_fails_naming_kafka() -> None:
    assert decide(_out_of_reach()) == Fail(UNREACHABLE, "unreachable")


def test_out_of_the_group_until_the_limit_keeps_going_and_wakes_at_it() -> None:
    # the task that left last (at 20.0) reaches the limit at 140.0; "longer than" the limit
    assert decide(_replace(_out_of_reach(), now=140.0)) == KeepGoing(140.0)
    assert decide(_replace(_out_of_reach(), now=100.0)) == KeepGoing(140.0)


def test_one_task_still_a_member_or_not_started_keeps_the_run() -> None:
    facts = _replace(_out_of_reach(), out_of_group_since=(10.0, None))
    assert decide(facts) == KeepGoing(None)


def test_no_task_or_no_limit_or_stopping_never_fails_for_kafka() -> None:
    assert decide(_replace(_out_of_reach(), out_of_group_since=())) == KeepGoing(None)
    assert decide(_replace(_out_of_reach(), unreachable_limit_s=0.0)) == KeepGoing(None)
    assert decide(_replace(_out_of_reach(), stopping=True)) == KeepGoing(None)


def test_a_stop_request_ends_with_signal() -> None:
    assert decide(Facts(now=5.0, stop_requested=True)) == End("signal")


def test_the_deadline_ends_with_duration_at_it_and_wakes_before() -> None:
    assert decide(Facts(now=10.0, deadline=10.0)) == End("duration")
    assert decide(Facts(now=9.0, deadline=10.0)) == KeepGoing(10.0)


def test_delivering_max_records_ends_with_max_records() -> None:
    assert decide(Facts(now=5.0, max_records=100, delivered=100)) == End("max-records")
    assert decide(Facts(now=5.0, max_records=100, delivered=99)) == KeepGoing(None)


def test_read_to_the_end_ends_with_end_at() -> None:
    assert decide(Facts(now=5.0, read_to_end=True)) == End("end-at")
    assert decide(Facts(now=5.0, read_to_end=False)) == KeepGoing(None)


def test_the_earliest_timer_is_the_one_to_wake_at() -> None:
    facts = _replace(_out_of_reach(), now=100.0, deadline=130.0)
    assert decide(facts) == KeepGoing(130.0)
    facts = _replace(_out_of_reach(), now=100.0, deadline=150.0)
    assert decide(facts) == KeepGoing(140.0)


def test_failures_come_in_their_order_before_any_ending() -> None:
    everything = _out_of_reach(
        port_failure="Spark: gone",
        broker_pid=4242,
        broker_exit_code=137,
        stop_requested=True,
        deadline=0.0,
        max_records=1,
        delivered=1,
        read_to_end=True,
    )
    assert decide(everything) == Fail("Spark: gone", "port")
    everything = _replace(everything, port_failure=None)
    assert decide(everything) == Fail(BROKER_GONE, "broker")
    everything = _replace(everything, broker_exit_code=None)
    assert decide(everything) == Fail(UNREACHABLE, "unreachable")


def test_endings_come_in_their_order() -> None:
    everything = Facts(
        now=5.0, stop_requested=True, deadline=0.0, max_records=1, delivered=1, read_to_end=True
    )
    assert decide(everything) == End("signal")
    everything = _replace(everything, stop_requested=False)
    assert decide(everything) == End("duration")
    everything = _replace(everything, deadline=None)
    assert decide(everything) == End("max-records")
    everything = _replace(everything, max_records=None)
    assert decide(everything) == End("end-at")
