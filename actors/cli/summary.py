"""The run's summary (:class:`~actors.cli.progress.RunSummary`): its final sample, the sink's own
figures (the file sink's rows and dropped duplicates, the Spark bridge's writes, jobs and phases)
and what the run knows of its stream; printed at the end and written by ``--summary-json``."""

from __future__ import annotations

from typing import Any

from actors.cli.config import ShoalConfig
from actors.cli.ports import Ledger
from actors.cli.progress import PartitionEnd, RunSummary
from runtime.files.sink import FileSink
from runtime.looplag import LoopLag
from runtime.metrics import Sample

__all__ = ["summarize"]


def summarize(
    config: ShoalConfig,
    final: Sample,
    *,
    reason: str,
    caught_up: bool | None,
    drained: bool,
    partitions: tuple[PartitionEnd, ...],
    output_dir: str,
    seconds: float,
    ledger: Ledger | None,
    file_sink: FileSink | None,
    bridge: Any,
    produced_records: int | None,
    produced_rows: int | None,
    stream_start: int | None,
    stream_end: int | None,
    rebalances: int,
    loop_lag: LoopLag,
    warnings: dict[str, int],
) -> RunSummary:
    """The summary of a run that ended for ``reason`` (``bridge``: the Spark bridge, if any;
    ``rebalances``: the most any task of this process went through)."""
    errors = dict(final.errors)
    for task in final.tasks:
        for kind, n in task.errors.items():
            errors[kind] = errors.get(kind, 0) + n
    if ledger is not None and ledger.duplicates:
        # handed to the sink twice (a partition resumed at its watermark by a new owner)
        errors["records_read_twice"] = ledger.duplicates
    rows = ledger.rows if ledger is not None else None
    if file_sink is not None:
        stats = file_sink.statistics()
        rows = stats.rows
        if stats.duplicates_dropped:
            errors["duplicates_dropped_by_sink"] = stats.duplicates_dropped
    spark_figures: dict[str, Any] = {}
    if bridge is not None:
        spark = bridge.stats()
        rows = spark.rows_committed
        spark_figures = {
            "spark_writes": bridge.typed_writes,
            "spark_jobs": bridge.typed_write_jobs,
        }
        if bridge.first_put_at is not None and bridge.last_commit_at is not None:
            spark_figures["sink_write_s"] = bridge.last_commit_at - bridge.first_put_at
            phases = dict(bridge.phase_s)
            if bridge.committer is not None:
                phases.update({f"commit_{k}": v for k, v in bridge.committer.phase_s.items()})
            spark_figures["sink_phase_s"] = {k: round(v, 3) for k, v in phases.items()}
        counts = {
            "duplicate_rows_dropped_by_spark": spark.rows_deduplicated,
            "spark_batches_failed": spark.batches_failed,
            "spark_attempts_failed": spark.attempts_failed,
        }
        errors.update({kind: n for kind, n in counts.items() if n})
    epoch = max((t.epoch for t in final.tasks), default=-1)
    leader = next((t.leader for t in final.tasks if t.epoch == epoch), "")
    return RunSummary(
        connector=config.run.connector,
        source=config.run.source,
        sink=config.run.sink,
        output_dir=output_dir,
        seconds=seconds,
        tasks=final.tasks,
        records_read=sum(t.records_read for t in final.tasks),
        records_delivered=sum(t.records_delivered for t in final.tasks),
        rows_written=rows,
        produced_records=produced_records,
        produced_rows=produced_rows,
        stream_start=stream_start,
        stream_end=stream_end,
        caught_up=caught_up,
        drained=drained,
        reason=reason,
        partitions=partitions,
        epoch=epoch,
        leader=leader,
        rebalances=rebalances,
        errors=errors,
        records_filtered=final.records_filtered,
        records_filtered_by=dict(final.records_filtered_by),
        records_columns_stripped=final.records_columns_stripped,
        snapshot_done=final.snapshot_done,
        snapshot_total=final.snapshot_total,
        loop_lag_p99_s=loop_lag.percentile(0.99),
        loop_lag_max_s=loop_lag.max_s,
        warnings=dict(warnings),
        **spark_figures,
    )
