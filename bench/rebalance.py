"""``python -m bench rebalance``: how long a rebalance takes over the embedded broker.

1,000 idle partitions of the simulated stream, 10 tasks (9 in this process, 1 in a subprocess so
that it can be SIGKILLed; ``--processes``: each in its own, as deployed), real actors, real Kafka
adapters, session/heartbeat 4000/500 ms (``KafkaConfig.embedded``). Then
three rebalances, each timed from its cause until every partition is owned by exactly one task,
read by it, and owned counts are within one:

* **join**: an 11th task joins (timed from its join call: its sync-topic replay comes before);
* **leave**: that task leaves gracefully (LeaveGroup);
* **kill**: the subprocess task is SIGKILLed (the group notices after the session timeout).

Each time is split into **Kafka group time** — until every member of the new group has received
its assignment of the new generation (measured at each member's ``events()``) — and **shoal
protocol time** after it: the answers, the leader's plan and epoch message (``epoch_s``: until
it is read back), then the offers, the hand-offs, the readers starting.
``protocol_overhead_s`` is the largest of the three (goal: <= 0.5 s).

**Survivors' unread time** (``survivor_unread_s``, goal <= 0.5 s): for each rebalance, the longest
time any partition that a surviving task owned both before the cause and once settled was not
being read by it — no reader of it running, or the task's lease not valid — sampled every 20 ms
from 2 s before the cause until settled; the largest of the three. A survivor keeps its
partitions in the next epoch, so this is the time the rebalance stopped its work
(docs/design.md#membership-and-leases).

**Sync bytes per rebalance**: bytes appended to the sync topic from the cause until settled, as
read back by an observer, minus the steady rate of idle watermark reports over that window;
the mean of the three.

Last line: ``{"scenario": "rebalance", "join_s":.., "leave_s":.., "kill_s":..,
"protocol_overhead_s":.., "survivor_unread_s":.., "sync_bytes_per_rebalance":..}``. ``--quick``: 200 partitions, 5 tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec

from actors.node import NodeConfig, TaskNode
from actors.task import TaskActor
from protocol import epochs, messages
from protocol.messages import EpochMessage, StateMessage
from protocol.task import TaskConfig
from runtime.kafka import KafkaConfig, KafkaMembership, KafkaSyncLog
from runtime.kafka.broker import EmbeddedBroker
from runtime.ports import GroupAssignment, GroupEvent, Membership, Sink, SinkBatch
from runtime.sim.source import SimulatedSource
from runtime.sim.stream import StreamModel, StreamParams

REPO_ROOT = Path(__file__).resolve().parents[1]
CONNECTOR = "bench-rebalance"


def stream_params(partitions: int) -> StreamParams:
    return StreamParams(
        seed=5,
        roots=partitions,
        split_p=0.0,
        merge_p=0.0,
        move_p=0.0,
        records_per_s=0.05,
        round_us=60_000_000,
    )


def make_source(params: StreamParams, origin: float) -> SimulatedSource:
    """Idle partitions (a heartbeat every 5 s), on a model clock every process shares."""

    def clock() -> int:
        return params.start_ts + int((time.time() - origin) * 1_000_000)

    return SimulatedSource(StreamModel(params), clock=clock, heartbeat_ms=5000, poll_s=1.0)


def node_config(task_id: str, params: StreamParams) -> NodeConfig:
    return NodeConfig(
        task=TaskConfig(
            task_id=task_id,
            cap=0,
            answer_timeout=1_000_000,
            publish_interval=1_000_000,
            checkpoint_interval=10_000_000,
        ),
        stream_start=params.start_ts,
    )


class NullSink(Sink):
    """Commits every batch at once."""

    def __init__(self) -> None:
        self.batches = 0

    async def put(self, batch: SinkBatch) -> asyncio.Future[None]:
        self.batches += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class Assigned(msgspec.Struct, frozen=True, array_like=True):
    at: float  # time.monotonic() (machine-wide: comparable across processes)
    task: str
    generation: int
    members: tuple[str, ...]


class TimedMembership(Membership):
    """A :class:`KafkaMembership` that reports when each assignment reached its reader."""

    def __init__(self, inner: KafkaMembership, record: Callable[[Assigned], None]) -> None:
        self.inner = inner
        self._record = record

    async def events(self) -> AsyncIterator[GroupEvent]:
        async for event in self.inner.events():
            if isinstance(event, GroupAssignment):
                self._record(
                    Assigned(time.monotonic(), self.inner.task_id, event.generation, event.members)
                )
            yield event

    def lease_valid_until(self) -> float:
        return self.inner.lease_valid_until()

    def set_epoch_floor(
        self,
        epoch_floor: Callable[[], int],
        logged: Callable[[], epochs.Logged] | None = None,
        unread: Callable[[int], bool] | None = None,
    ) -> None:
        self.inner.set_epoch_floor(epoch_floor, logged, unread)

    async def close(self) -> None:
        await self.inner.close()


def joiner(
    config: KafkaConfig,
    record: Callable[[Assigned], None],
    joining: Callable[[str, float], None],
) -> Callable[[str], Awaitable[Membership]]:
    async def join(task_id: str) -> Membership:
        joining(task_id, time.monotonic())
        inner = KafkaMembership(config, CONNECTOR, task_id)
        await inner.start()
        return TimedMembership(inner, record)

    return join


class Status(msgspec.Struct, frozen=True):
    owned: frozenset[str]
    reading: frozenset[str]
    leased: bool = True  # the task's lease is valid (its readers may hand batches to the sink)


def task_status(task: TaskActor) -> Status:
    return Status(
        frozenset(task.core.owned_unfinished()),
        frozenset(task.readers),
        task.core.lease_valid(task.clock()),
    )


# ------------------------------------------------------------------------------------------------
# The subprocess task
# ------------------------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()


def _emit(item: dict[str, object]) -> None:
    sys.stdout.buffer.write(_encoder.encode(item) + b"\n")
    sys.stdout.flush()


async def worker(bootstrap: str, task_id: str, origin: float, partitions: int) -> None:
    """One task; prints ``{"assigned": ..}`` per assignment and ``{"status": ..}`` when what it
    owns or reads changes. Runs until killed or its stdin closes."""
    params = stream_params(partitions)
    config = KafkaConfig.embedded(bootstrap)

    def record(assigned: Assigned) -> None:
        _emit({"assigned": assigned})

    def joining(task: str, at: float) -> None:
        _emit({"joining": at})

    async with KafkaSyncLog(config, CONNECTOR) as sync_log:
        node = TaskNode(
            node_config(task_id, params),
            sync_log=sync_log,
            join=joiner(config, record, joining),
            source=make_source(params, origin),
            sink=NullSink(),
        )
        async with node, asyncio.TaskGroup() as group:

            async def report() -> None:
                last: Status | None = None
                while True:
                    task = node.task
                    if task is not None:
                        status = task_status(task)
                        if status != last:
                            _emit({"status": status})
                            last = status
                    await asyncio.sleep(0.02)

            reporter = group.create_task(report())
            loop = asyncio.get_running_loop()
            stdin = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
            await stdin.read()
            reporter.cancel()


class Worker:
    def __init__(self, task_id: str, process: asyncio.subprocess.Process) -> None:
        self.task_id = task_id
        self.process = process
        self.status: Status | None = None

    async def follow(self, bench: Bench) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        while line := await stdout.readline():
            item = msgspec.json.decode(line)
            if "status" in item:
                self.status = msgspec.convert(item["status"], Status)
            elif "assigned" in item:
                bench.assigned.append(msgspec.convert(item["assigned"], Assigned))
            elif "joining" in item:
                bench.joined_at[self.task_id] = float(item["joining"])


# ------------------------------------------------------------------------------------------------
# The harness
# ------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, config: KafkaConfig, partitions: int) -> None:
        self.config = config
        self.params = stream_params(partitions)
        self.tokens = frozenset(StreamModel(self.params).roots)
        self.origin = time.time()
        self.assigned: list[Assigned] = []
        self.joined_at: dict[str, float] = {}
        self.sync_log: list[tuple[float, int]] = []  # (read back at, bytes)
        self.epochs: list[tuple[float, int, tuple[str, ...]]] = []  # (read at, epoch, members)
        # hand-off steps as read back: (read at, "offer" | "incoming" | "released")
        self.steps: list[tuple[float, str]] = []
        self.nodes: dict[str, tuple[TaskNode, contextlib.AsyncExitStack]] = {}
        self.workers: dict[str, Worker] = {}
        self._followers: list[asyncio.Task[None]] = []
        # (at, task, owned, read under a valid lease), every 20 ms
        self.samples: list[tuple[float, str, frozenset[str], frozenset[str]]] = []

    def _joining(self, task_id: str, at: float) -> None:
        self.joined_at[task_id] = at

    async def observe(self) -> None:
        async with (
            KafkaSyncLog(self.config, CONNECTOR) as log,
            contextlib.aclosing(log.read(0)) as reader,
        ):
            async for _, payload in reader:
                at = time.monotonic()
                self.sync_log.append((at, len(payload)))
                message = messages.decode(payload)
                if isinstance(message, EpochMessage):
                    self.epochs.append((at, message.epoch, tuple(sorted(message.members))))
                elif isinstance(message, StateMessage):
                    for state in message.connector_state:
                        if any(p.status == "incoming" for p in state.data):
                            self.steps.append((at, "incoming"))
                        for offer in state.share or ():
                            if offer.kind == "move" and offer.target is not None:
                                self.steps.append((at, "released" if offer.released else "offer"))

    async def start_node(self, task_id: str) -> None:
        stack = contextlib.AsyncExitStack()
        try:
            sync_log = await stack.enter_async_context(KafkaSyncLog(self.config, CONNECTOR))
            node = TaskNode(
                node_config(task_id, self.params),
                sync_log=sync_log,
                join=joiner(self.config, self.assigned.append, self._joining),
                source=make_source(self.params, self.origin),
                sink=NullSink(),
            )
            await stack.enter_async_context(node)
        except BaseException:
            await stack.aclose()
            raise
        self.nodes[task_id] = (node, stack)

    async def stop_node(self, task_id: str) -> None:
        _, stack = self.nodes.pop(task_id)
        await stack.aclose()

    async def start_worker(self, task_id: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.rebalance",
            "--worker",
            self.config.bootstrap_servers,
            task_id,
            repr(self.origin),
            str(len(self.tokens)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=REPO_ROOT,
            env=env,
        )
        worker = self.workers[task_id] = Worker(task_id, process)
        self._followers.append(asyncio.create_task(worker.follow(self)))

    async def start_task(self, task_id: str, *, process: bool) -> None:
        if process:
            await self.start_worker(task_id)
            async with asyncio.timeout(60):  # ready: it has joined
                while task_id not in self.joined_at:  # noqa: ASYNC110 - told over a pipe
                    await asyncio.sleep(0.01)
        else:
            await self.start_node(task_id)

    async def stop_task(self, task_id: str) -> None:
        """Leave gracefully."""
        if task_id in self.nodes:
            await self.stop_node(task_id)
            return
        worker = self.workers.pop(task_id)
        stdin = worker.process.stdin
        assert stdin is not None
        stdin.close()
        await worker.process.wait()

    async def kill_worker(self, task_id: str) -> None:
        worker = self.workers.pop(task_id)
        worker.process.send_signal(signal.SIGKILL)
        await worker.process.wait()

    async def close(self) -> None:
        for task_id in list(self.nodes):
            await self.stop_node(task_id)
        for worker in self.workers.values():
            stdin = worker.process.stdin
            assert stdin is not None
            stdin.close()
            try:
                async with asyncio.timeout(15):
                    await worker.process.wait()
            except TimeoutError:
                worker.process.send_signal(signal.SIGKILL)
                await worker.process.wait()
        self.workers.clear()
        for follower in self._followers:
            await follower

    # -- what everyone owns -------------------------------------------------------------------
    def statuses(self) -> dict[str, Status | None]:
        out: dict[str, Status | None] = {}
        for task_id, (node, _) in self.nodes.items():
            task = node.task
            out[task_id] = task_status(task) if task is not None else None
        for task_id, worker in self.workers.items():
            out[task_id] = worker.status
        return out

    def settled(self) -> bool:
        statuses = list(self.statuses().values())
        if any(s is None for s in statuses):
            return False
        owned = [s.owned for s in statuses if s is not None]
        if any(s.reading != s.owned for s in statuses if s is not None):
            return False
        counts = [len(o) for o in owned]
        return (
            sum(counts) == len(self.tokens)
            and frozenset().union(*owned) == self.tokens
            and max(counts) - min(counts) <= 1
        )

    async def wait_settled(self, timeout: float) -> float:
        """Monotonic time at which it first looked settled (polled every 10 ms)."""
        async with asyncio.timeout(timeout):
            while not self.settled():  # noqa: ASYNC110 - a state spread over processes: polled
                await asyncio.sleep(0.01)
        return time.monotonic()

    def group_done(self, since: float) -> float:
        """When the last current member received the assignment listing exactly the current
        members (after ``since``)."""
        members = tuple(sorted(self.statuses()))
        times = []
        for task_id in members:
            got = [
                a.at
                for a in self.assigned
                if a.task == task_id and a.at >= since and a.members == members
            ]
            if not got:
                raise RuntimeError(f"{task_id} never got the assignment of {members}")
            times.append(min(got))
        return max(times)

    def epoch_read(self, since: float) -> float:
        """When the observer read the epoch message listing exactly the current members."""
        members = tuple(sorted(self.statuses()))
        got = [at for at, _, m in self.epochs if at >= since and m == members]
        if not got:
            raise RuntimeError(f"no epoch of {members} was read")
        return min(got)

    def step_times(self, since: float, until: float) -> dict[str, float]:
        """Per hand-off step: when it was first and last read back in the window."""
        out: dict[str, float] = {}
        for step in ("offer", "incoming", "released"):
            times = [at for at, s in self.steps if s == step and since <= at <= until]
            if times:
                out[f"first_{step}"] = min(times)
                out[f"last_{step}"] = max(times)
        return out

    async def sample_reading(self) -> None:
        """Every 20 ms, what each task owns and reads under a valid lease."""
        while True:
            now = time.monotonic()
            for task_id, status in self.statuses().items():
                if status is not None:
                    reading = status.reading if status.leased else frozenset()
                    self.samples.append((now, task_id, status.owned, reading))
            await asyncio.sleep(0.02)

    def survivor_unread(self, since: float, until: float) -> float:
        """The longest run of samples in ``[since, until]`` in which a partition that its task
        owned at both ends was not read under a valid lease (plus one sample period)."""
        window = [s for s in self.samples if since <= s[0] <= until]
        first: dict[str, frozenset[str]] = {}
        last: dict[str, frozenset[str]] = {}
        for _, task_id, owned, _ in window:
            first.setdefault(task_id, owned)
            last[task_id] = owned
        survivors = set(self.statuses())  # a task that left in the window is no survivor
        kept = {t: first[t] & last[t] for t in first if t in survivors}
        unread_since: dict[tuple[str, str], float] = {}
        longest = 0.0
        for at, task_id, _, reading in window:
            for token in kept.get(task_id, frozenset()):
                key = (task_id, token)
                if token in reading:
                    start = unread_since.pop(key, None)
                    if start is not None:
                        longest = max(longest, at - start)
                elif key not in unread_since:
                    unread_since[key] = at
        for start in unread_since.values():
            longest = max(longest, until - start)
        return round(longest + 0.02, 3) if longest > 0 else 0.0

    def bytes_between(self, t0: float, t1: float) -> int:
        return sum(n for at, n in self.sync_log if t0 <= at <= t1)


class Figures(msgspec.Struct):
    total_s: float
    group_s: float
    protocol_s: float
    epoch_s: float  # of protocol_s: until the leader's epoch message is read back
    # of protocol_s, when each hand-off step was first / last read back (moves only)
    steps_s: dict[str, float]
    sync_bytes: int
    sync_bytes_raw: int
    survivor_unread_s: float  # longest a survivor's kept partition was not read


async def measure(
    partitions: int, tasks: int, bootstrap: str, timeout: float, *, processes: bool = False
) -> dict[str, object]:
    config = KafkaConfig.embedded(bootstrap)
    bench = Bench(config, partitions)
    out: dict[str, object] = {
        "partitions": partitions,
        "tasks": tasks,
        "layout": "process per task" if processes else "one process but the victim",
    }
    async with asyncio.TaskGroup() as group:
        observer = group.create_task(bench.observe())
        sampler = group.create_task(bench.sample_reading())
        try:
            t0 = time.monotonic()
            for i in range(tasks - 1):
                await bench.start_task(f"t{i:02d}", process=processes)
            victim = f"k{tasks - 1:02d}"
            await bench.start_worker(victim)
            await bench.wait_settled(timeout)
            out["start_s"] = round(time.monotonic() - t0, 2)
            print(f"{tasks} tasks own {partitions} partitions after {out['start_s']} s", flush=True)

            await asyncio.sleep(2.0)
            s0, b0 = time.monotonic(), len(bench.sync_log)
            await asyncio.sleep(4.0)
            steady = sum(n for _, n in bench.sync_log[b0:]) / (time.monotonic() - s0)
            out["steady_sync_bytes_per_s"] = round(steady)

            async def timed(name: str, start: float) -> Figures:
                settled = await bench.wait_settled(timeout)
                group_at = bench.group_done(start)
                epoch_at = bench.epoch_read(start)
                await asyncio.sleep(1.0)  # the last messages of the window are read back
                raw = bench.bytes_between(start, settled + 0.5)
                fig = Figures(
                    total_s=round(settled - start, 3),
                    group_s=round(group_at - start, 3),
                    protocol_s=round(max(0.0, settled - group_at), 3),
                    epoch_s=round(epoch_at - group_at, 3),
                    steps_s={
                        k: round(v - group_at, 3)
                        for k, v in bench.step_times(group_at, settled).items()
                    },
                    sync_bytes=max(0, round(raw - steady * (settled + 0.5 - start))),
                    sync_bytes_raw=raw,
                    survivor_unread_s=bench.survivor_unread(start - 2.0, settled),
                )
                print(f"{name}: {msgspec.json.encode(fig).decode()}", flush=True)
                await asyncio.sleep(1.0)
                return fig

            newcomer = f"t{tasks:02d}"
            await bench.start_task(newcomer, process=processes)
            join = await timed("join", bench.joined_at[newcomer])

            start = time.monotonic()
            await bench.stop_task(newcomer)
            leave = await timed("leave", start)

            start = time.monotonic()
            await bench.kill_worker(victim)
            kill = await timed("kill", start)
        finally:
            observer.cancel()
            sampler.cancel()
            await bench.close()
    results = {"join": join, "leave": leave, "kill": kill}
    for name, fig in results.items():
        for key, value in msgspec.structs.asdict(fig).items():
            if key != "steps_s":
                out[f"{name}_{key}"] = value
    out["join_s"] = join.total_s
    out["leave_s"] = leave.total_s
    out["kill_s"] = kill.total_s
    out["protocol_overhead_s"] = max(f.protocol_s for f in results.values())
    out["survivor_unread_s"] = max(f.survivor_unread_s for f in results.values())
    out["sync_bytes_per_rebalance"] = round(statistics.mean(f.sync_bytes for f in results.values()))
    return out


def main(argv: list[str]) -> int:
    # aiokafka logs every heartbeat refused during a rebalance: expected here, by the dozen.
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    if argv and argv[0] == "--worker":
        bootstrap, task_id, origin, partitions = argv[1:5]
        asyncio.run(worker(bootstrap, task_id, float(origin), int(partitions)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench rebalance", description=__doc__)
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="200 partitions, 5 tasks")
    parser.add_argument("--timeout", type=float, default=120.0, help="per rebalance, seconds")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="every task in its own process, as deployed (default: all in this one but the "
        "killed task; their CPU then adds to the protocol time)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.partitions, args.tasks = 200, 5
    if args.tasks < 3 or args.partitions < args.tasks + 1:
        parser.error("need at least 3 tasks and more partitions than tasks")

    async def run() -> dict[str, object]:
        async with EmbeddedBroker() as broker:
            return await measure(
                args.partitions,
                args.tasks,
                broker.bootstrap,
                args.timeout,
                processes=args.processes,
            )

    try:
        result = asyncio.run(run())
    except TimeoutError:
        print("rebalance: a rebalance did not settle in time", file=sys.stderr)
        return 1
    for key, value in result.items():
        print(f"{key:>28}: {value}")
    keys = (
        "join_s",
        "leave_s",
        "kill_s",
        "protocol_overhead_s",
        "survivor_unread_s",
        "sync_bytes_per_rebalance",
    )
    figures = {k: result[k] for k in keys}
    extra = (
        "partitions",
        "tasks",
        "layout",
        "join_group_s",
        "leave_group_s",
        "kill_group_s",
        "join_survivor_unread_s",
        "leave_survivor_unread_s",
        "kill_survivor_unread_s",
    )
    figures.update({k: result[k] for k in extra})
    print(json.dumps({"scenario": "rebalance", **figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
