"""``python -m bench poison``: one poison partition among many, quarantined and released.

The embedded broker; ``--tasks`` embedded tasks (``open_task``, real actors and Kafka adapters)
read ``--partitions`` partitions of a simulated stream (no splits or merges) through a sink that
writes every batch through the real typed conversion (``runtime.sim.poison``). One partition's
first record ``--poison-after-s`` into the stream holds a value no INT64 holds: every batch with
it fails. The quarantine rule (``--task-quarantine-after``, here ``--quarantine-after``) parks the
partition; then, for ``--hold-s``, every other partition goes on and nobody reads the parked one.
``quarantine list`` (the admin command's function) must show it; the conversion is fixed (the
sink heals) and ``quarantine release`` appends the release; its owner reads it again from its
watermark. The tasks then drain and leave.

Figures: ``quarantined`` (partitions the list showed: 1), ``hops`` (tasks whose batch the poison
record failed before it was parked: at most 1 without faults), ``lost`` (records committed up to
the horizon, a second before the release, that never reached the sink: every other partition's,
and the poisoned one's before and after the bad record), ``duplicates`` (rows written twice,
raw), ``read_while_parked`` (batches of the parked partition the sink got while it was parked),
``released_and_resumed`` (the poison record reached the sink after the release), and
``quarantine_s`` (from the first failed batch to the quarantine showing in the sync topic).

Last line: ``{"scenario": "poison", ...}``. ``--quick``: 8 partitions, 3 tasks, 3 s held.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import time
import uuid
from collections import Counter
from typing import Any

from bench.common import wait_for
from protocol.records import DataChange
from protocol.task import TaskConfig
from runtime.kafka import KafkaConfig
from runtime.ports import SinkBatch
from runtime.sim.poison import PoisonedSource, TypedRowSink
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams

log = logging.getLogger("bench.poison")


class _Recorder:
    """Per task, the sink callback: who failed on the poison, and what reached the sink of the
    parked partition while it was parked."""

    def __init__(self, sink: TypedRowSink, token: str) -> None:
        self.sink = sink
        self.token = token
        self.failed_on: set[str] = set()
        self.first_failure: float | None = None
        self.parked = False
        self.read_while_parked = 0

    def callback(self, task_id: str) -> Any:
        async def on_batch(batch: SinkBatch) -> None:
            if batch.token == self.token and self.parked:
                self.read_while_parked += 1
            failed = self.sink.failed
            try:
                await self.sink(batch)
            finally:
                if self.sink.failed > failed:
                    self.failed_on.add(task_id)
                    if self.first_failure is None:
                        self.first_failure = time.monotonic()

        return on_batch


async def scenario(
    kafka: KafkaConfig,
    *,
    partitions: int = 8,
    tasks: int = 3,
    quarantine_after: int = 5,
    poison_after_s: float = 3.0,
    hold_s: float = 3.0,
    records_per_s: float = 20.0,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Run the scenario on ``kafka`` (see the module docstring); the figures, with the raw rows
    under ``rows`` and the expected records under ``expected`` (for a test's own checks)."""
    from actors.cli import admin
    from actors.cli.config import KafkaOptions, RunOptions, ShoalConfig
    from actors.runtime import open_task

    connector = f"poison-{uuid.uuid4().hex[:8]}"
    start = time.time_ns() // 1000
    model = StreamModel(
        StreamParams(
            seed=7,
            roots=partitions,
            start_ts=start,
            split_p=0.0,
            merge_p=0.0,
            move_p=0.0,
            records_per_s=records_per_s,
            round_us=60_000_000,
        )
    )
    token = min(model.roots)
    source = PoisonedSource(SimulatedSource(model), token, start + int(poison_after_s * 1e6))
    sink = TypedRowSink()
    recorder = _Recorder(sink, token)
    admin_config = ShoalConfig(
        run=RunOptions(connector=connector),
        kafka=KafkaOptions(bootstrap_servers=kafka.bootstrap_servers),
    )
    figures: dict[str, Any] = {"partitions": partitions, "tasks": tasks, "connector": connector}
    async with contextlib.AsyncExitStack() as stack:
        nodes = []
        for i in range(tasks):
            task_id = f"p{i}"
            config = TaskConfig(
                task_id=task_id,
                quarantine_after=quarantine_after,
                answer_timeout=1_000_000,
                publish_interval=100_000,
            )
            nodes.append(
                await stack.enter_async_context(
                    open_task(
                        kafka,
                        connector=connector,
                        task_id=task_id,
                        source=source,
                        on_batch=recorder.callback(task_id),
                        task=config,
                        stream_start=start,
                    )
                )
            )

        def parked() -> list[str]:
            return [p.token for n in nodes if n.task is not None for p in n.task.core.quarantined()]

        if not await wait_for(lambda: bool(parked()), timeout_s):
            raise TimeoutError(f"the poison partition {token} was not quarantined")
        recorder.parked = True
        figures["quarantine_s"] = round(
            time.monotonic() - (recorder.first_failure or time.monotonic()), 2
        )
        figures["hops"] = len(recorder.failed_on)
        # wait for the quarantine to reach the sync topic, then list it as an operator would
        listed: list[dict[str, Any]] = []
        async with asyncio.timeout(timeout_s):
            while not listed:
                out = io.StringIO()
                await admin.quarantine(admin_config, "list", [], out, as_json=True)
                listed = json.loads(out.getvalue())
        figures["quarantined"] = len(listed)
        figures["listed"] = [
            {k: row[k] for k in ("token", "owner", "watermark_us", "failures", "error", "record")}
            for row in listed
        ]
        # the others go on; nobody reads the parked one
        before = {n.task.core.me: dict(n.status().watermarks) for n in nodes if n.task}
        await asyncio.sleep(hold_s)
        after = {n.task.core.me: dict(n.status().watermarks) for n in nodes if n.task}
        figures["others_advanced"] = sum(
            1
            for task_id, marks in after.items()
            for t, wm in marks.items()
            if t != token and wm > before.get(task_id, {}).get(t, wm)
        )
        figures["read_while_parked"] = recorder.read_while_parked
        # fix the conversion, release it: its owner reads it from its watermark
        sink.heal()
        recorder.parked = False
        horizon = source.inner.now() - 1_000_000
        out = io.StringIO()
        await admin.quarantine(admin_config, "release", [token], out)
        poison = source.poison(horizon)
        expected = [
            r.identity
            for t in sorted(model.roots)
            for r in model.records(t, start, horizon)
            if isinstance(r, DataChange)
        ]
        mods = {
            r.identity: len(r.mods)
            for t in sorted(model.roots)
            for r in model.records(t, start, horizon)
            if isinstance(r, DataChange)
        }
        if not await wait_for(
            lambda: set(expected) <= {identity for identity, _ in sink.rows}, timeout_s
        ):
            log.error("not every record up to the horizon reached the sink after the release")
        figures["released_and_resumed"] = poison is not None and any(
            identity == poison for identity, _ in sink.rows
        )
        figures["still_parked"] = len(parked())
    rows = list(sink.rows)
    counts = Counter(rows)
    written = {identity for identity, _ in rows}
    figures["lost"] = sum(1 for identity in expected if identity not in written)
    figures["duplicates"] = sum(n - 1 for n in counts.values() if n > 1)
    figures["records"] = len(expected)
    figures["kept_as_text"] = sink.kept_as_text
    figures["rows"] = rows
    figures["expected_rows"] = [(i, m) for i in expected for m in range(mods[i])]
    return figures


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from runtime.kafka.broker import EmbeddedBroker

    async with EmbeddedBroker() as broker:
        return await scenario(
            KafkaConfig.embedded(broker.bootstrap),
            partitions=args.partitions,
            tasks=args.tasks,
            quarantine_after=args.quarantine_after,
            hold_s=args.hold_s,
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench poison", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 partitions, 3 tasks, 3 s held")
    parser.add_argument("--partitions", type=int, default=None)
    parser.add_argument("--tasks", type=int, default=None)
    parser.add_argument("--quarantine-after", type=int, default=5)
    parser.add_argument("--hold-s", type=float, default=None)
    args = parser.parse_args(argv)
    quick = {"partitions": 8, "tasks": 3, "hold_s": 3.0}
    full = {"partitions": 32, "tasks": 4, "hold_s": 10.0}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    started = time.monotonic()
    figures = asyncio.run(_main(args))
    figures.pop("rows")
    figures.pop("expected_rows")
    figures["elapsed_s"] = round(time.monotonic() - started, 1)
    for key, value in figures.items():
        print(f"{key}: {value}")
    print(json.dumps({"scenario": "poison", **figures}))
    ok = (
        figures["quarantined"] == 1
        and figures["hops"] <= 1
        and figures["lost"] == 0
        and figures["released_and_resumed"]
    )
    return 0 if ok else 1
