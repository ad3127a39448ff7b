"""``bench chaos``'s observer: how long live partitions' watermarks stood still (its figures are
only as true as this)."""

from __future__ import annotations

import time

import pytest

from bench import chaos
from protocol import messages
from protocol.messages import EpochMessage, Partition, StateMessage, TaskState

T0 = 1_700_000_000_000_000


def _state(ts: int, wm: int) -> bytes:
    part = Partition("p1", T0, status="owned", watermark=T0 + wm)
    return messages.encode(
        StateMessage(task_id="a", epoch=0, connector_state=(TaskState("a", ts, data=(part,)),))
    )


def test_stretches_between_watermark_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])  # the observer's clock
    observer = chaos.Observer()
    observer.apply(0, messages.encode(EpochMessage(task_id="a", epoch=0, members=("a",))))
    moves = [(1.0, 1), (2.0, 2), (15.5, 3), (16.5, 3), (17.5, 4)]  # (clock, watermark)
    for offset, (at, wm) in enumerate(moves, start=1):
        clock[0] = 100.0 + at
        observer.apply(offset, _state(offset, wm))
    # first seen at 1.0; then 1.0 s, 13.5 s; the same watermark again is no move; then 2.0 s
    assert sorted(round(x, 1) for x in observer.stalls) == [1.0, 2.0, 13.5]
    assert observer.stall_summary() == {"stretches": 3, "p50_s": 2.0, "p99_s": 13.5, "over_12s": 1}
    (story,) = observer.long_stories()  # the one over 12 s, told from the sync topic
    assert story[0] == "p1: 13.5 s"
    assert any("partition: a:owned@" in line for line in story[1:]), story
    observer.measuring = False  # the run is over: nothing more counts
    clock[0] = 130.0
    observer.apply(9, _state(9, 5))
    assert len(observer.stalls) == 3
