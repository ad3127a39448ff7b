"""The parts around shoal fail (docs/operations.md, "When the parts around shoal fail"): the
local Spark JVM is killed under a run, the embedded broker or the Spanner emulator is frozen
past the timeouts that notice it. A run recovers and loses nothing, or stops with exit 1 and
one line naming the part and the cause, within a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from bench.procs import children, cmdline
from runtime.kafka.broker import EmbeddedBroker
from runtime.kafka.config import KafkaConfig
from runtime.kafka.synclog import KafkaSyncLog, SyncLogError, SyncTopicLost
from runtime.net import free_port
from runtime.ports import Unrecoverable
from runtime.spanner.emulator import SpannerEmulator
from runtime.spanner.reader import FATAL_CODES, ChangeStreamUnreadable, SpannerSource
from tests.fixtures.spanner import churn_emulator
from tests.helpers import (
    assert_catches_a_double,
    assert_no_row_twice,
    assert_one_cut,
    stream_rows,
    wait_for,
    wait_until,
)
from tests.integration.test_cli import (
    FILES,
    SIM,
    _cli,
    _finish,
    _ids,
    _logs,
    _model,
    _now_us,
    _summary,
)
from tests.integration.test_faults_spark import first_commit

__all__ = ["churn_emulator"]  # a module-scoped fixture


# -- Spanner ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.spanner
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("change", "code"),
    [({"database": "no-such-db"}, "NOT_FOUND"), ({"change_stream": "DroppedStream"}, None)],
    ids=["wrong-database", "no-such-change-stream"],
)
async def test_wrong_database_or_change_stream_is_unrecoverable(
    churn_emulator: SpannerEmulator, change: dict[str, str], code: str | None
) -> None:
    """A query of a database or change stream that does not exist fails with a fatal status
    (not retried): ``ChangeStreamUnreadable`` names Spanner and the code. Control: the right
    names read the root partitions."""
    good = churn_emulator.config
    async with contextlib.AsyncExitStack() as stack:
        source = await SpannerSource.connect(good)
        stack.push_async_callback(source.close)
        roots = [b async for b in source.query(None, _now_us(), None)]
        assert roots, "the control query read nothing"
        bad = await SpannerSource.connect(msgspec.structs.replace(good, **change))
        stack.push_async_callback(bad.close)
        with pytest.raises(ChangeStreamUnreadable) as caught:
            _ = [b async for b in bad.query(None, _now_us(), None)]
    assert caught.value.code in FATAL_CODES
    if code is not None:
        assert caught.value.code == code
    assert str(caught.value).startswith(
        f"Spanner: the change-stream query failed with {caught.value.code}"
    )
    assert isinstance(caught.value, Unrecoverable)


@pytest.mark.spanner
@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_run_against_a_dropped_change_stream_stops_naming_spanner(
    churn_emulator: SpannerEmulator, tmp_path: Path
) -> None:
    """An (unbounded) run whose change stream does not exist stops with exit 1 and one line
    naming Spanner and the status, instead of retrying the query forever."""
    cfg = churn_emulator.config
    proc = _cli(
        [
            *FILES,
            *("--source", "spanner", "--spanner-emulator-host", churn_emulator.host),
            *("--spanner-project", cfg.project, "--spanner-instance", cfg.instance),
            *("--spanner-database", cfg.database, "--spanner-change-stream", "DroppedStream"),
            *("--output-dir", str(tmp_path / "out"), "--progress", "off"),
        ],
        tmp_path,
    )
    code = _finish(proc, tmp_path, "run", 150)
    err = (tmp_path / "run.err").read_text()
    assert code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("shoal: error: Spanner: the change-stream query failed with "), lines


# -- Kafka -----------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_a_sync_topic_that_went_back_is_unrecoverable() -> None:
    """The embedded broker keeps topics in memory: restarted under a running process (same
    port), it has an empty sync topic again, and the next append lands at offset 0. The sync
    log refuses that (``SyncTopicLost``, an ``Unrecoverable``) instead of going on from "now".
    Control: appends to the healthy topic go forward and set nothing fatal."""
    port = free_port()
    first = EmbeddedBroker(port=port)
    async with first:
        sync = KafkaSyncLog(KafkaConfig.embedded(first.bootstrap), "went-back")
        await sync.start()
        offsets = [await sync.append(b"state %d" % i) for i in range(3)]
        assert offsets == sorted(offsets)
        assert offsets[-1] > offsets[0]
        assert sync.statistics().append_failures == 0  # nothing refused while healthy
    try:
        async with EmbeddedBroker(port=port):
            with pytest.raises(SyncTopicLost) as caught:
                await _append_until_refused(sync)
    finally:
        await sync.close()
    assert caught.value is sync.fatal
    assert isinstance(caught.value, Unrecoverable)
    assert str(caught.value).startswith("Kafka: the sync topic 'went-back_connector_sync'")
    assert "went back" in str(caught.value)


async def _append_until_refused(sync: KafkaSyncLog) -> None:
    for _ in range(5):  # the producer may need a moment to reach the new broker
        try:
            await sync.append(b"after the restart")
        except SyncTopicLost:
            raise
        except SyncLogError as exc:
            print(f"append failed, trying again: {exc}")
    raise AssertionError("five appends after the restart, none refused")


@pytest.mark.asyncio
@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_own_message_read_before_its_ack_is_not_taken_for_a_lost_topic() -> None:
    """The healthy case the first version of the check stopped runs on: this process's reader
    reads the message an append has just written before the append's acknowledgement arrives
    (a loaded event loop). The append then lands at an offset the process has already read,
    which is right: only what was in the log *before* the send may not be overtaken. Each ack
    is held here until the reader has read the message, on every append; nothing is refused."""
    async with EmbeddedBroker() as broker:
        sync = KafkaSyncLog(KafkaConfig.embedded(broker.bootstrap), "read-before-ack")
        await sync.start()
        read: dict[int, bytes] = {}
        producer = sync._producer
        assert producer is not None
        send = producer.send_and_wait

        async def ack_after_read(*args: object, **kwargs: object) -> object:
            meta = await send(*args, **kwargs)
            await wait_for(lambda: meta.offset in read, 30, f"offset {meta.offset} read")
            return meta

        async def reader() -> None:
            async with contextlib.aclosing(sync.read(0)) as messages:
                async for offset, payload in messages:
                    read[offset] = payload  # noqa: PERF403 (the test watches it fill)

        try:
            async with asyncio.TaskGroup() as tg:
                reading = tg.create_task(reader())
                producer.send_and_wait = ack_after_read
                offsets = [await sync.append(b"state %d" % i) for i in range(20)]
                reading.cancel()
        finally:
            await sync.close()
    assert offsets == sorted(offsets) == list(read)[:20]
    assert all(read[o] == b"state %d" % i for i, o in enumerate(offsets))
    assert sync.fatal is None


@pytest.mark.asyncio
@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_a_reader_whose_topic_came_back_shorter_is_unrecoverable() -> None:
    """A process that only reads (it appends nothing after the loss) sees it too: the embedded
    broker restarts under it, another client creates the sync topic again and writes less than
    the reader had read; the reader's fetches answer a high watermark at or below what it read,
    and after ``went_back_after_s`` it stops with ``SyncTopicLost``. Control: while the log is
    healthy the same reader reads on with nothing fatal."""
    port = free_port()
    first = EmbeddedBroker(port=port)
    await first.astart()
    config = KafkaConfig.embedded(first.bootstrap)
    sync = KafkaSyncLog(config, "came-back", went_back_after_s=0.5)
    await sync.start()
    read: list[int] = []
    caught: list[BaseException] = []

    async def reader() -> None:
        try:
            async with contextlib.aclosing(sync.read(0)) as messages:
                async for offset, _ in messages:
                    read.append(offset)
        except SyncTopicLost as exc:
            caught.append(exc)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(reader())
            for i in range(10):
                await sync.append(b"before %d" % i)
            await wait_for(lambda: len(read) == 10, 30, "ten messages read")
            await asyncio.sleep(1.0)  # the control: a healthy log, read to its end, for 2x grace
            healthy = (sync.fatal, len(caught))
            await first.astop()
            async with EmbeddedBroker(port=port), KafkaSyncLog(config, "came-back") as other:
                for i in range(3):
                    await other.append(b"after %d" % i)
                await wait_for(lambda: bool(caught), 60, "the reader refused the topic")
    finally:
        await sync.close()
        await first.astop()  # idempotent: stopped above unless the test failed before
    assert healthy == (None, 0)
    assert caught[0] is sync.fatal
    assert "its high watermark is 3 after a fetch, though this process read offset 9" in str(
        caught[0]
    ), caught[0]
    assert read == list(range(10))


def _broker_pid(run_pid: int) -> int:
    pids = [p for p in children(run_pid) if "tansu" in cmdline(p)]
    assert len(pids) == 1, f"expected one embedded broker under {run_pid}, found {pids}"
    return pids[0]


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_broker_paused_past_the_session_timeout_heals_and_loses_nothing(tmp_path: Path) -> None:
    """The embedded broker is frozen (SIGSTOP) for longer than the group session timeout (3 s),
    then continued: the tasks lose their membership (their leases run out, so they stop
    reading), join again and go on; the bounded run exits 0 with exactly the stream's rows."""
    out = tmp_path / "out"
    start = _now_us()
    proc = _cli(
        [
            *FILES,
            *("--duration", "25", "--drain-timeout", "120"),
            *SIM,
            *("--sim-start-ts", str(start), "--output-dir", str(out)),
            *("--summary-json", str(tmp_path / "summary.json"), "--progress", "off"),
        ],
        tmp_path,
    )
    broker = -1
    try:
        wait_until(lambda: _files_written(out) or proc.poll() is not None, 120, "first commit")
        assert proc.poll() is None, _logs(tmp_path, "run")
        broker = _broker_pid(proc.pid)
        os.kill(broker, signal.SIGSTOP)
        time.sleep(10)
    finally:
        if broker > 0:
            os.kill(broker, signal.SIGCONT)
        code = _finish(proc, tmp_path, "run", 250)
    ended = _now_us()
    logs = _logs(tmp_path, "run")
    assert code == 0, logs[-5000:]
    summary = _summary(tmp_path / "summary.json")
    assert summary.errors.get("membership_lost", 0) >= 1, summary.errors
    ids = _ids(out / "data")
    assert_no_row_twice(ids)
    assert_catches_a_double(assert_no_row_twice, ids)  # the check sees a doubled row
    model = _model(start)
    cut = assert_one_cut(model, ids, earliest=start + 25_000_000, latest=ended)
    assert summary.caught_up
    assert summary.produced_rows == summary.rows_written == len(stream_rows(model, cut)) == len(ids)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_broker_unreachable_past_the_limit_stops_the_run_naming_kafka(tmp_path: Path) -> None:
    """Frozen for longer than --kafka-unreachable-limit-s, the broker stops the (unbounded) run:
    exit 1 and one line naming Kafka and the limit, within a bounded time."""
    proc = _cli(
        [
            *FILES,
            *SIM,
            *("--kafka-unreachable-limit-s", "8", "--output-dir", str(tmp_path / "out")),
            *("--progress", "off"),
        ],
        tmp_path,
    )
    broker = -1
    try:
        wait_until(
            lambda: _files_written(tmp_path / "out") or proc.poll() is not None, 120, "commit"
        )
        assert proc.poll() is None, _logs(tmp_path, "run")
        broker = _broker_pid(proc.pid)
        os.kill(broker, signal.SIGSTOP)
        paused = time.monotonic()
        code = _finish(proc, tmp_path, "run", 120)
        took = time.monotonic() - paused
    finally:
        if broker > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(broker, signal.SIGCONT)
    err = (tmp_path / "run.err").read_text()
    assert code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("shoal: error: Kafka at 127.0.0.1:"), lines
    assert "(kafka.unreachable_limit_s = 8)" in lines[0], lines
    print(f"stopped {took:.1f} s after the broker froze (limit 8 s)")
    assert took < 8 + 60, f"took {took:.0f}s to stop"


def _files_written(out: Path) -> bool:
    return first_commit(out)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_embedded_broker_gone_stops_the_run_instead_of_starting_over(tmp_path: Path) -> None:
    """The embedded broker a run started dies (SIGKILL): its topics lived in memory, so the
    connector's state is gone; the run stops with exit 1 and one line naming Kafka and the
    broker, instead of going on against whatever answers next."""
    proc = _cli(
        [*FILES, *SIM, "--output-dir", str(tmp_path / "out"), "--progress", "off"], tmp_path
    )
    try:
        wait_until(
            lambda: _files_written(tmp_path / "out") or proc.poll() is not None, 120, "commit"
        )
        assert proc.poll() is None, _logs(tmp_path, "run")
        broker = _broker_pid(proc.pid)
        os.kill(broker, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        code = _finish(proc, tmp_path, "run", 120)
    took = time.monotonic() - killed
    err = (tmp_path / "run.err").read_text()
    assert code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("shoal: error:")]
    assert lines == [
        f"shoal: error: Kafka: the embedded broker (pid {broker}) exited with code -9; it kept "
        "its topics in memory, so the connector's state is gone with it"
    ], err[-3000:]
    assert took < 60, f"took {took:.0f}s to stop"
