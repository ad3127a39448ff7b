"""The Spark bridge writing Delta tables, in its own process (its own Spark session), for the
test of a SIGKILL between a micro-batch's data files and its commit
(tests/integration/test_spark_delta.py).

Usage: ``python -m tests.proc_spark_delta OUTPUT_URI``: puts the micro-batches of
:func:`micro_batches` into a ``SparkBridge(table_format="delta")`` one after the other, each
after the previous one committed. From the ``HANG_AT``-th commit (2) on, the committer's
``commit`` says what the executors wrote and then waits to be killed, so the process dies with
that micro-batch's data files in the tables' directories and nothing of it committed. Prints
one JSON line per event: ``{"committed": n}``, ``{"staged": batch, "files": [...]}`` (paths
relative to the output). Spark's workers reach the store through the environment the test
gives this process (``AWS_*``)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from protocol.records import ColumnType, DataChange, Mod
from runtime.files.commit import Committer
from runtime.ports import SinkBatch
from runtime.spark import SparkBridge, SparkConfig

HANG_AT = 2
TOKEN = "p"

_ID = ColumnType("Id", '{"code":"INT64"}', True, 1)
_AMOUNT = ColumnType("Amount", '{"code":"NUMERIC"}', False, 2)
_NOTE = ColumnType("Note", '{"code":"STRING"}', False, 3)


def record(ts: int, table: str, *, note: bool = False) -> DataChange:
    """One UPDATE of row ``ts`` of ``table``; ``note``: the table has gained column ``Note``."""
    values = f'{{"Amount":"1.25","Note":"n{ts}"}}' if note else '{"Amount":"1.25"}'
    columns = (_ID, _AMOUNT, _NOTE) if note else (_ID, _AMOUNT)
    mod = Mod(f'{{"Id":"{ts}"}}', values, "{}")
    return DataChange(ts, "0", f"tx{ts}", True, table, columns, (mod,), "UPDATE", "NEW_VALUES")


def micro_batches() -> list[SinkBatch]:
    """Two micro-batches of one partition over three tables; in the second, table ``T0`` has
    gained a column."""
    first = tuple(record(1_000 + i, f"T{i % 3}") for i in range(30))
    second = tuple(record(2_000 + i, f"T{i % 3}", note=i % 3 == 0) for i in range(30))
    return [SinkBatch(TOKEN, first, 1_500), SinkBatch(TOKEN, second, 2_500)]


def _say(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def config(output: str) -> SparkConfig:
    return SparkConfig(
        output_dir=output,
        max_rows=10_000,
        max_age_s=0.05,
        table_format="delta",
        app_name="shoal-proc-spark-delta",
        conf={"spark.ui.enabled": "false"},
    )


def _hang_from(n: int) -> None:
    """Make the ``n``-th and later commits of any committer hang (after the data files)."""
    real = Committer.commit
    calls = 0

    def commit(self: Committer, batch: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls < n:
            return real(self, batch, *args, **kwargs)
        tables: Sequence[Any] = kwargs.get("tables", ())
        _say({"staged": batch, "files": [f"{t}/{f.path}" for t, files, _ in tables for f in files]})
        while True:  # killed here, between the data files and the commit point
            time.sleep(60)

    Committer.commit = commit  # type: ignore[method-assign]


async def main(output: str) -> None:
    _hang_from(HANG_AT)
    async with SparkBridge(config(output)) as bridge:
        for n, batch in enumerate(micro_batches(), 1):
            await (await bridge.put(batch))
            _say({"committed": n})


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
