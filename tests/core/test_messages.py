"""Wire protocol: round trips, stable tags, and typed errors for bad input."""

from __future__ import annotations

import pytest

from protocol import messages as m


def _state(task: str = "t1") -> m.StateMessage:
    part = m.Partition("tok", 10, parents=("a", "b"), watermark=12)
    return m.StateMessage(
        task_id=task,
        message_timestamp=5,
        epoch=3,
        connector_state=(m.TaskState(task_id=task, state_timestamp=5, data=(part,)),),
    )


def test_round_trip_every_kind() -> None:
    msgs: list[m.SyncMessage] = [
        _state(),
        m.EpochMessage(task_id="L", epoch=4, members=("L", "t1"), sync_epoch="u"),
        m.CheckpointMessage(task_id="L", epoch=4, as_of=17, leader="L"),
        m.MarkerMessage(task_id="t1", marker="x"),
    ]
    for msg in msgs:
        assert m.decode(m.encode(msg)) == msg


def test_wire_names_follow_the_seed() -> None:
    raw = m.encode(_state())
    for name in (b'"kind":"state"', b'"taskID"', b'"messageTimestamp"', b'"connectorState"'):
        assert name in raw
    assert b'"stateTimestamp"' in raw


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x00garbage", "malformed"),
        (b'{"kind":"nope","taskID":"a"}', "malformed"),
        (b'{"kind":"state"}', "malformed"),
        (b'{"kind":"state","taskID":"a","v":99}', "newer-schema"),
    ],
)
def test_bad_payloads_are_typed_errors(payload: bytes, reason: str) -> None:
    with pytest.raises(m.SyncDecodeError) as info:
        m.decode(payload)
    assert info.value.reason == reason
