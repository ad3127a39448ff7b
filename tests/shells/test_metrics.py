"""The metrics server: /metrics shows the per-task figures of a sample, /healthz and /readyz
answer from it. (The CLI test scrapes a real run.)"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from runtime.metrics import MetricsServer, Sample, TaskSample, liveness, readiness


def _sample(*, ready: bool = True, failed: str | None = None) -> Sample:
    return Sample(
        at=1.0,
        tasks=(
            TaskSample(
                task_id="t0",
                ready=ready,
                member=True,
                leader="t0",
                generation=2,
                epoch=2,
                owned=3,
                reading=3,
                records_read=120,
                records_delivered=100,
                lag_us={"p1": 1_500_000, "p2": 500_000},
                rebalances=2,
                sync_messages=17,
                sync_bytes=4096,
                errors={"reader_failed": 1},
                mailboxes={"task:t0": 4},
            ),
        ),
        errors={"sink_batch_failed": 2},
        failed=failed,
        sink_rows=250,
        sink_inflight=2,
        sink_commit_latency_s=0.75,
    )


async def _get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.asyncio
async def test_metrics_health_and_readiness() -> None:
    current = _sample(ready=False)
    async with MetricsServer(lambda: current, port=0) as server:
        server.observe_rebalance("t0", 2.5)
        server.observe_loop_lag(0.3)
        status, body = await _get(server.port, "/metrics")
        assert status == 200
        for line in (
            'shoal_owned_partitions{task="t0"} 3.0',
            'shoal_records_read_total{task="t0"} 120.0',
            'shoal_records_delivered_total{task="t0"} 100.0',
            'shoal_partition_lag_seconds{partition="p1",task="t0"} 1.5',
            'shoal_epoch{task="t0"} 2.0',
            'shoal_is_leader{task="t0"} 1.0',
            'shoal_rebalances_total{task="t0"} 2.0',
            'shoal_sync_messages_total{task="t0"} 17.0',
            'shoal_sync_bytes_total{task="t0"} 4096.0',
            'shoal_errors_total{kind="reader_failed",task="t0"} 1.0',
            'shoal_errors_total{kind="sink_batch_failed",task=""} 2.0',
            'shoal_mailbox_depth{actor="task:t0",task="t0"} 4.0',
            'shoal_rebalance_duration_seconds_count{task="t0"} 1.0',
            'shoal_event_loop_lag_seconds_bucket{le="0.25"} 0.0',
            'shoal_event_loop_lag_seconds_bucket{le="0.5"} 1.0',
            "shoal_sink_rows_total 250.0",
            "shoal_sink_inflight_batches 2.0",
            "shoal_sink_commit_latency_seconds 0.75",
        ):
            assert line in body, line
        assert await _get(server.port, "/healthz") == (200, "ok\n")
        status, body = await _get(server.port, "/readyz")
        assert status == 503
        assert "replaying" in body
        current = _sample()
        assert await _get(server.port, "/readyz") == (200, "ready\n")
        current = _sample(failed="sink died")
        assert (await _get(server.port, "/healthz"))[0] == 503
        assert (await _get(server.port, "/nope"))[0] == 404


def test_liveness_fails_for_a_task_stuck_out_of_the_group() -> None:
    def out(seconds: float) -> Sample:
        task = msgspec.structs.replace(_sample().tasks[0], member=False, out_of_group_s=seconds)
        return Sample(at=0.0, tasks=(task,))

    assert liveness(_sample(), 60.0) == (True, "ok")
    assert liveness(out(59.0), 60.0) == (True, "ok")  # a rebalance, a slow rejoin: still alive
    assert liveness(out(61.0), 60.0) == (False, "task t0 has been out of the group for 61s")
    assert liveness(_sample(failed="sink died"), 60.0) == (False, "failed: sink died")


@pytest.mark.asyncio
async def test_healthz_says_which_task_is_stuck() -> None:
    task = msgspec.structs.replace(_sample().tasks[0], member=False, out_of_group_s=30.0)
    current = Sample(at=0.0, tasks=(task,))
    async with MetricsServer(lambda: current, port=0, stuck_after_s=10.0) as server:
        status, body = await _get(server.port, "/healthz")
        assert (status, body) == (503, "task t0 has been out of the group for 30s\n")
        _, metrics = await _get(server.port, "/metrics")
        assert 'shoal_out_of_group_seconds{task="t0"} 30.0' in metrics


def test_readiness_reasons() -> None:
    assert readiness(Sample(at=0.0)) == (False, "no task started yet")
    assert readiness(_sample()) == (True, "ready")
    stopping = Sample(at=0.0, tasks=_sample().tasks, stopping=True)
    assert readiness(stopping) == (False, "shutting down")


def test_json_logs_carry_fields_and_tracebacks() -> None:
    import io
    import json
    import logging

    from runtime import logs

    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("aiokafka").level)
    logs.configure("info", json_lines=True, stream=stream)
    try:
        log = logging.getLogger("shoal.test")
        log.info("joined %s", "g1", extra={"task": "t0"})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("aiokafka").setLevel(saved[2])
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "joined g1"
    assert first["task"] == "t0"
    assert first["level"] == "INFO"
    assert first["logger"] == "shoal.test"
    assert "ValueError: boom" in second["exc"]


@pytest.mark.asyncio
async def test_snapshot_progress_in_metrics_display_and_status() -> None:
    from actors.cli.admin import format_status
    from actors.cli.progress import format_table
    from protocol.cim import Cim
    from protocol.messages import EpochMessage, SnapshotItem, SnapshotPlan

    without = _sample()
    current = msgspec.structs.replace(without, snapshot_done=3, snapshot_total=8)
    async with MetricsServer(lambda: current, port=0) as server:
        _, body = await _get(server.port, "/metrics")
        assert 'shoal_snapshot_partitions{state="done"} 3.0' in body
        assert 'shoal_snapshot_partitions{state="total"} 8.0' in body
        current = without
        _, body = await _get(server.port, "/metrics")
        assert 'shoal_snapshot_partitions{state="total"}' not in body  # no snapshot
    table = format_table(msgspec.structs.replace(without, snapshot_done=8, snapshot_total=8), {})
    assert "snapshot: 8/8 partitions done (complete)" in table
    assert not [line for line in format_table(without, {}) if "snapshot" in line]
    cim = Cim()
    items = tuple(SnapshotItem(f"snapshot:T/{i}", "T") for i in range(2))
    plan = SnapshotPlan(read_ts=1_700_000_000_000_000, total=2, chunk_rows=10, items=items)
    cim.apply(0, EpochMessage(task_id="a", epoch=1, members=("a",), snapshot=plan))
    text = format_status("c", cim, 1_700_000_001_000_000)
    assert "snapshot at 2023-11-14T22:13:20Z: 0/2 partitions done" in text


@pytest.mark.asyncio
async def test_a_quarantined_partition_degrades_healthz_and_is_counted() -> None:
    task = msgspec.structs.replace(
        _sample().tasks[0], quarantined={"p2": "at 17: sink failed a batch: TypedError"}
    )
    current = Sample(at=0.0, tasks=(task,), held_by=("p2",))
    async with MetricsServer(lambda: current, port=0) as server:
        # alive (a restart does not help: an operator releases it), and says why
        assert await _get(server.port, "/healthz") == (
            200,
            "degraded: quarantined partitions: p2 (at 17: sink failed a batch: TypedError)\n",
        )
        _, metrics = await _get(server.port, "/metrics")
        assert 'shoal_quarantined_partitions{task="t0"} 1.0' in metrics
    assert liveness(_sample(), 60.0) == (True, "ok")  # the control: none quarantined
    from actors.cli.progress import format_table

    table = format_table(current, {})
    assert table[-1] == "QUARANTINED: p2 on t0 at 17: sink failed a batch: TypedError"
    assert not [line for line in format_table(_sample(), {}) if "QUARANTINED" in line]


def test_status_and_the_quarantine_list_show_a_parked_partition() -> None:
    from actors.cli.admin import format_status, quarantined
    from protocol.cim import Cim
    from protocol.messages import EpochMessage, Partition, Quarantine, StateMessage, TaskState

    cim = Cim()
    cim.apply(0, EpochMessage(task_id="a", epoch=1, members=("a",)))
    q = Quarantine(since=5, failures=5, error="TypedError: 1e400", position=1_700_000_000_000_000)
    parts = (
        Partition("p1", 0, watermark=1_700_000_000_000_000, quarantine=q),
        Partition("p2", 0, watermark=1_700_000_000_500_000),
    )
    cim.apply(1, StateMessage(task_id="a", epoch=1, connector_state=(TaskState("a", 2, parts),)))
    text = format_status("c", cim, 1_700_000_001_000_000)
    assert "HELD BACK by 1 quarantined partition(s)" in text
    (row,) = [line for line in text.splitlines() if line.startswith("p1 ")]
    assert row.endswith("QUARANTINED")
    assert [line for line in text.splitlines() if "QUARANTINED" in line] == [row]
    assert quarantined(cim) == [("a", parts[0])]
