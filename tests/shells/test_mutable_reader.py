"""A MUTABLE_KEY_RANGE partition read end to end through the pure parts: result sets built from
the documented protobuf types (``google.cloud.spanner_v1.types.ChangeStreamRecord`` rows, as
``READ_<stream>`` sends them), decoded by ``runtime/spanner/mutable_decode.py`` and read by the
reader core (``protocol/reader.py``, rule 13): the partition start reported, the move-in held
until the task releases it, the next reader passing it and finishing at the partition end."""

from __future__ import annotations

from google.cloud.spanner_v1.types import ChangeStreamRecord

from protocol.dedup import Position
from protocol.events import PartitionsAnnounced
from protocol.messages import MoveInHold
from protocol.reader import (
    BatchCommitted,
    CancelQuery,
    Chunk,
    Done,
    FlushBatches,
    PutBatch,
    QueryEnded,
    ReaderConfig,
    ReaderCore,
    Report,
    Start,
    StartQuery,
)
from protocol.records import DataChange
from protocol.task import ReaderCommitted, ReaderFinished, ReaderStopped
from tests.shells.test_mutable_decode import T_S, _decode, _result_set, _ts, _update

CSR = ChangeStreamRecord
US = 1_000_000
MOVE_IN_TS = (T_S + 2) * US


def _p1_rows() -> list[CSR]:
    """What partition p1 answers: the start of p1 and p2, a write, a heartbeat, a move-in from
    p2 and p3, a write after it, its end."""
    return [
        CSR(partition_start_record=CSR.PartitionStartRecord(
            start_timestamp=_ts(T_S), record_sequence="0", partition_tokens=["p1", "p2"])),
        _update(T_S),
        CSR(heartbeat_record=CSR.HeartbeatRecord(timestamp=_ts(T_S + 1, 5_000))),
        CSR(partition_event_record=CSR.PartitionEventRecord(
            commit_timestamp=_ts(T_S + 2), record_sequence="3", partition_token="p1",
            move_in_events=[CSR.PartitionEventRecord.MoveInEvent(source_partition_token="p2"),
                            CSR.PartitionEventRecord.MoveInEvent(source_partition_token="p3")])),
        _update(T_S + 3, 0),
        CSR(partition_end_record=CSR.PartitionEndRecord(
            end_timestamp=_ts(T_S + 4), record_sequence="9", partition_token="p1")),
    ]  # fmt: skip


def _reader(start: int, hold: MoveInHold | None = None) -> ReaderCore:
    core = ReaderCore(ReaderConfig("p1", mutable=True), Position(start), hold)
    assert core.handle(Start(), now=0) == [StartQuery(1, start)]
    return core


def test_a_mutable_partition_read_from_protobuf_rows_holds_then_passes_its_move_in() -> None:
    records = tuple(_decode(_result_set(_p1_rows())))
    first, after = (r for r in records if isinstance(r, DataChange))
    reader = _reader(T_S * US)
    out = reader.handle(Chunk(1, records), now=1)
    assert out == [
        Report(PartitionsAnnounced("p1", T_S * US, ("p1", "p2"))),
        PutBatch(1, (first,), MOVE_IN_TS),
        CancelQuery(1),
        FlushBatches(),  # it waits only for the batch before the event to commit
    ]
    hold = MoveInHold(MOVE_IN_TS, ("p2", "p3"), ("3",))
    assert reader.handle(BatchCommitted(1), now=2) == [
        Report(ReaderCommitted("p1", MOVE_IN_TS)),
        Done(ReaderStopped("p1", MOVE_IN_TS, (), hold)),
    ]
    # the task released the hold: the next reader starts at the event, and passes it
    again = tuple(r for r in records if not isinstance(r, DataChange) or r is after)
    reader = _reader(MOVE_IN_TS, hold)
    out = reader.handle(Chunk(1, again[2:]), now=3)
    assert out == [PutBatch(1, (after,), (T_S + 4) * US)]
    reader.handle(BatchCommitted(1), now=4)
    end = (T_S + 4) * US
    assert reader.handle(QueryEnded(1), now=5) == [
        Done(ReaderFinished("p1", end, (), MOVE_IN_TS, ()))
    ]
