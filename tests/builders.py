"""Small constructors shared by the core tests."""

from __future__ import annotations

from protocol.messages import EpochMessage, Partition, StateMessage, TaskState


def part(token: str, watermark: int = 0, **kw: object) -> Partition:
    return Partition(token, start_ts=0, watermark=watermark, **kw)  # type: ignore[arg-type]


def state(task: str, ts: int, *parts: Partition, epoch: int = 1, full: bool = True) -> StateMessage:
    return StateMessage(
        task_id=task,
        epoch=epoch,
        connector_state=(TaskState(task_id=task, state_timestamp=ts, data=parts, full=full),),
    )


def epoch(leader: str, n: int, *members: str) -> EpochMessage:
    return EpochMessage(task_id=leader, epoch=n, sync_epoch=f"e{n}", members=members)
