"""What the tests share: the repository root, and small constructors of protocol messages for the
core tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from actors.cli.progress import PartitionEnd
from protocol.messages import EpochMessage, Partition, StateMessage, TaskState
from protocol.records import DataChange
from runtime.sim.stream import StreamModel


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


REPO = Path(__file__).resolve().parents[1]
"""The repository's root (subprocesses of the tests run from there)."""


def expected_below_watermarks(model: StreamModel, partitions: Sequence[PartitionEnd]) -> set[str]:
    """Record ids (``commit/txn/seq/mod``) a restart would not read again: every record of a
    finished partition, and those of an unfinished one strictly before its final watermark."""
    out: set[str] = set()
    if partitions:
        model.generate_until(max(p.watermark for p in partitions))
    for p in partitions:
        info = model.partitions.get(p.token)
        if info is None:
            continue
        if p.status == "finished":
            assert info.end_ts is not None
            until = info.end_ts - 1
        else:
            until = p.watermark - 1
        if until < info.start_ts:
            continue
        for rec in model.records(p.token, info.start_ts, until):
            if isinstance(rec, DataChange):
                for i in range(len(rec.mods)):
                    out.add(
                        f"{rec.commit_ts}/{rec.server_transaction_id}/{rec.record_sequence}/{i}"
                    )
    return out
