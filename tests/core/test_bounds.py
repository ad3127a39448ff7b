"""A bounded connector has nothing left to read only when its CIM says so (protocol/bounds.py):
the stream started, every partition finished, no offer outstanding."""

from __future__ import annotations

from protocol.bounds import empty_first_window, nothing_left
from protocol.cim import Cim
from protocol.messages import EpochMessage, Partition, Share, StateMessage, TaskState
from tests.helpers import part


def _epoch(stream_start: int, *parts: Partition, share: tuple[Share, ...] = ()) -> EpochMessage:
    return EpochMessage(
        task_id="a",
        epoch=1,
        sync_epoch="e1",
        members=("a", "b"),
        stream_start=stream_start,
        connector_state=(
            TaskState(task_id="a", state_timestamp=1, data=parts, share=share, full=True),
        ),
    )


def _state(
    task: str, ts: int, *parts: Partition, share: tuple[Share, ...] | None = None
) -> StateMessage:
    """An incremental state change (``share=None``: the share section is unchanged)."""
    return StateMessage(
        task_id=task,
        epoch=1,
        connector_state=(TaskState(task_id=task, state_timestamp=ts, data=parts, share=share),),
    )


def test_not_before_the_stream_started() -> None:
    cim = Cim()
    assert not nothing_left(cim)  # empty and not started: the roots are not known yet
    cim.apply(0, _epoch(-1))
    assert not nothing_left(cim)


def test_every_partition_finished_and_no_offer_left() -> None:
    cim = Cim()
    root = part("r1")
    offered = Share(partition=part("r2"), target="b")
    cim.apply(0, _epoch(100, root, share=(offered,)))
    assert not nothing_left(cim)  # r1 owned, r2 offered
    cim.apply(1, _state("a", 2, part("r1", status="finished")))
    assert not nothing_left(cim)  # r2 still offered to b
    cim.apply(2, _state("b", 3, part("r2")))  # b picks it up...
    cim.apply(3, _state("a", 4, share=()))  # ...and a drops its offer
    assert not nothing_left(cim)  # b reads r2
    cim.apply(4, _state("b", 5, part("r2", status="finished")))
    assert nothing_left(cim)
    # a child registered by a finishing parent is read before the end is reached
    cim.apply(5, _state("b", 6, part("r2", status="finished", children=("c",)), part("c")))
    assert not nothing_left(cim)
    cim.apply(6, _state("b", 7, part("c", status="finished")))
    assert nothing_left(cim)


def test_an_orphan_is_something_left() -> None:
    """Cim rule 5c: the epoch dropped b, whose claim of r2 landed after the plan: nothing holds
    r2 until the leader offers it, and it is still to be read."""
    cim = Cim()
    cim.apply(0, _epoch(100, part("r1", status="finished")))
    cim.apply(1, _state("b", 2, part("r2", 50)))
    cim.apply(
        2,
        EpochMessage(
            task_id="a",
            epoch=2,
            sync_epoch="e2",
            members=("a",),
            connector_state=(TaskState(task_id="a", state_timestamp=3),),
        ),
    )
    assert set(cim.orphans) == {"r2"}
    assert not nothing_left(cim)


def test_an_end_before_the_first_start_is_an_empty_window() -> None:
    # first start (nothing recorded) at 100: an end before it reads nothing, at it reads one us
    assert empty_first_window(-1, 100, 99)
    assert not empty_first_window(-1, 100, 100)
    assert not empty_first_window(-1, 100, -1)  # no end
    # a connector that started resumes from its watermarks, whatever end and now say
    assert not empty_first_window(50, 100, 60)
    assert not empty_first_window(50, 100, 10)
