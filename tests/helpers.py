"""What the tests share: the repository root, small constructors of protocol messages for the
core tests, waiting for a condition with a generous bound, what the seeded stream model says
a run's output must hold (computed from the model alone, never from what the run reports), and
the exactly-once checks: raw rows counted, never de-duplicated first, with :func:`doubled`
for their controls (the same rows with one written twice must fail the check), and what every
process on the machine shows as its command line."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

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


T = TypeVar("T", bound=Hashable)

REPO = Path(__file__).resolve().parents[1]
"""The repository's root (subprocesses of the tests run from there)."""


async def wait_for(condition: Callable[[], bool], timeout_s: float, message: str) -> None:
    """Poll ``condition`` until it holds; fail with ``message`` after ``timeout_s``. Use it
    instead of sleeping and then asserting: a loaded machine is slow, not wrong, so the bound
    should be generous (several times what an idle machine takes)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {message}") from None


def wait_until(condition: Callable[[], bool], timeout_s: float, message: str) -> None:
    """:func:`wait_for` for synchronous tests (subprocesses, blocking clients)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {message}")
        time.sleep(0.05)


def row_id(rec: DataChange, mod: int) -> str:
    """The id of one output row: ``commit_ts/server_transaction_id/record_sequence/mod``."""
    return f"{rec.commit_ts}/{rec.server_transaction_id}/{rec.record_sequence}/{mod}"


def partition_rows(model: StreamModel, until_ts: int) -> dict[str, dict[str, int]]:
    """Per partition token of ``model``, its rows committed at or before ``until_ts``: row id ->
    commit timestamp."""
    model.generate_until(until_ts)
    out: dict[str, dict[str, int]] = {}
    for token, info in list(model.partitions.items()):
        rows: dict[str, int] = {}
        if info.start_ts <= until_ts:
            for rec in model.records(token, info.start_ts, until_ts):
                if isinstance(rec, DataChange):
                    rows.update({row_id(rec, i): rec.commit_ts for i in range(len(rec.mods))})
        out[token] = rows
    return out


def stream_rows(model: StreamModel, until_ts: int) -> dict[str, int]:
    """Every row of the stream committed at or before ``until_ts``: row id -> commit ts."""
    return {
        row_id(rec, i): rec.commit_ts
        for rec in model.expected(until_ts)
        for i in range(len(rec.mods))
    }


def assert_no_row_twice(written: Iterable[T], what: str = "rows") -> Counter[T]:
    """Every row of ``written`` (raw: as read back, nothing de-duplicated) is there once.
    Returns the rows counted."""
    counts = Counter(written)
    twice = [row for row, n in counts.items() if n > 1]
    assert not twice, f"{len(twice)} {what} written more than once: {twice[:3]}"
    return counts


def exactly(expected: Iterable[T]) -> Callable[[Sequence[T]], None]:
    """The exactly-once check of rows read back raw (nothing de-duplicated): ``expected``, each
    as many times as it is there (so once), no row missing, none extra, none twice."""
    want = Counter(expected)

    def check(rows: Sequence[T]) -> None:
        got = Counter(rows)
        assert got == want, (
            f"{len(rows)} rows vs {want.total()} expected; twice: "
            f"{[r for r, n in got.items() if n > want.get(r, 0) > 0][:3]}; extra: "
            f"{[r for r in got if r not in want][:3]}; missing: "
            f"{[r for r in want if r not in got][:3]}"
        )

    return check


def doubled(rows: Sequence[T]) -> list[T]:
    """``rows`` with one of them (the middle one) written a second time: the input of the
    control that shows an exactly-once check fails on a duplicate."""
    assert rows, "no rows to double: the control would prove nothing"
    return [*rows, rows[len(rows) // 2]]


def assert_catches_a_double(check: Callable[[list[T]], object], rows: Sequence[T]) -> None:
    """The control of an exactly-once check: ``check`` passed ``rows``; it must fail (raise
    ``AssertionError``) on the same rows with one of them twice."""
    try:
        check(doubled(rows))
    except AssertionError:
        return
    raise AssertionError("the exactly-once check passed rows with one of them written twice")


def assert_one_cut(model: StreamModel, written: Collection[str], earliest: int, latest: int) -> int:
    """A bounded run closes the stream at one instant and writes all of it: ``written`` (raw
    rows) is exactly (no row missing, no row extra, no row twice) the stream's rows up to one
    instant ``cut``, and that instant is in ``[earliest, latest]`` (bounds the test measured
    with its own clock). Returns ``cut`` (the newest commit timestamp written)."""
    rows = stream_rows(model, latest)
    ids = set(assert_no_row_twice(written))
    extra = ids - rows.keys()
    assert not extra, (
        f"{len(extra)} rows the stream never produced by {latest}: {sorted(extra)[:3]}"
    )
    cut = max((rows[i] for i in ids), default=model.params.start_ts)
    must = {i for i, ts in rows.items() if ts <= max(cut, earliest)}
    missing = must - ids
    assert not missing, (
        f"{len(missing)} of {len(must)} rows up to {max(cut, earliest)} missing: "
        f"{sorted(missing)[:3]}"
    )
    return cut


def assert_read_without_gaps(
    model: StreamModel, written: Collection[str], floor: int, latest: int
) -> dict[str, int]:
    """A run that stopped while reading (a drain, no catch-up) wrote, from the model's view
    (``written``: raw rows):

    * no row twice;
    * no row the stream did not produce by ``latest`` (no extra);
    * per partition, a prefix of its rows: everything up to the newest row written (no gap);
    * for a partition with any row written, every row of each of its parents (a child is read
      only after its parents finished, and a drain loses nothing already read);
    * every row of the stream up to ``floor`` (the run kept up to within a generous lag).

    Returns, per partition with rows written, the commit timestamp of its newest row."""
    per = partition_rows(model, latest)
    ids = set(assert_no_row_twice(written))
    known = {i for rows in per.values() for i in rows}
    extra = ids - known
    assert not extra, (
        f"{len(extra)} rows the stream never produced by {latest}: {sorted(extra)[:3]}"
    )
    cuts: dict[str, int] = {}
    for token, rows in per.items():
        mine = ids & rows.keys()
        if not mine:
            continue
        cuts[token] = cut = max(rows[i] for i in mine)
        gap = {i for i, ts in rows.items() if ts <= cut} - mine
        assert not gap, f"{token}: {len(gap)} rows before its newest written row missing"
        for parent in model.partitions[token].parents:
            unread = per[parent].keys() - ids
            assert not unread, f"{token} was read but its parent {parent} lacks {len(unread)} rows"
    below = stream_rows(model, floor).keys() - ids
    assert not below, f"{len(below)} rows committed before {floor} (the lag bound) missing"
    return cuts


def command_lines() -> dict[int, str]:
    """Every process's command line as any user of the machine reads it
    (``/proc/<pid>/cmdline``, the arguments joined by spaces), by pid. A process that ends
    while the list is read is left out."""
    lines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        lines[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return lines


def ps_lines() -> list[str]:
    """``ps -ww -eo pid=,args=``: every process's command line as ``ps`` shows it, unabridged."""
    result = subprocess.run(
        ["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, check=True
    )
    return result.stdout.splitlines()
