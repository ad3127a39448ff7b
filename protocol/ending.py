"""Why a run of the command line ends: a pure rule over what the run knows now.

The run (``actors/cli/run.py``) gathers :class:`Facts` whenever one may have changed and asks
:func:`decide`. The first rule that holds decides, in this order:

1. **A port failed for good** (an ``Unrecoverable`` from the sink, the source or a sync log):
   the run fails with the port's own message (exit 1; docs/operations.md, "When the parts
   around shoal fail"). Retrying what cannot be mended would only look alive.
2. **The embedded broker exited** while the run is not stopping: it kept its topics in memory,
   so the connector's state is gone with it; the run fails.
3. **Kafka out of reach**: with ``kafka.unreachable_limit_s`` above 0 and the run not stopping,
   every task of this process has started and has been out of its group for longer than the
   limit; the run fails, naming Kafka. One task still a member, or one not started yet, keeps
   the run going (shorter outages heal: tasks rejoin and resume).
4. **signal**: a stop was asked (SIGINT/SIGTERM): the run ends and drains.
5. **duration**: the run's deadline passed.
6. **max-records**: the tasks of this process delivered at least ``max_records`` records.
7. **end-at**: with ``end_at``, every task of this process is a member of the group and its
   CIM shows nothing left to read (``protocol/bounds.py``).

Failures come before a stop: a run whose port failed exits 1 even when a signal came too.
Otherwise the run keeps going, and :class:`KeepGoing` says when a fact changes by time alone
(the deadline; the moment every task will have been out of its group for the limit), so the
shell need not poll for those.

Time is the shell's monotonic clock in float seconds (``now``, ``deadline``, the tasks'
``out_of_group_since``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Decision", "End", "Facts", "Fail", "KeepGoing", "Reason", "decide"]

Reason = Literal["signal", "duration", "max-records", "end-at"]


class Facts(msgspec.Struct, frozen=True, kw_only=True):
    """What the run knows now; a default is "not so" (no limit, no end, nothing failed)."""

    now: float  # monotonic seconds
    stop_requested: bool = False  # SIGINT/SIGTERM (or an embedding's stop)
    stopping: bool = False  # the run is past its end (draining): the broker may exit
    deadline: float | None = None  # when ``duration`` runs out; None: no duration
    delivered: int = 0  # records whose batch the sink committed, over this process's tasks
    max_records: int | None = None
    read_to_end: bool | None = None  # rule 7's condition with ``end_at``; None: no end_at
    port_failure: str | None = None  # the first port's Unrecoverable message
    broker_pid: int | None = None  # the embedded broker this run started, if any
    broker_exit_code: int | None = None  # None: still running
    # per task of this process: since when it has been out of its group; None: a member, or
    # not started yet (its time out of the group counts once it started)
    out_of_group_since: tuple[float | None, ...] = ()
    unreachable_limit_s: float = 0.0  # 0: never
    kafka: str = ""  # the bootstrap servers, for the message


class KeepGoing(msgspec.Struct, frozen=True):
    """No rule holds. ``wake_at``: the earliest time a rule may hold by time alone (None: only
    a change of another fact can end the run)."""

    wake_at: float | None = None


class End(msgspec.Struct, frozen=True):
    """The run ends and drains, for ``reason``."""

    reason: Reason


class Fail(msgspec.Struct, frozen=True):
    """The run fails (exit 1) with ``message``; ``cause`` says which rule: a port's
    (``"port"``: the port's own exception is the one to raise), the broker's, or Kafka's."""

    message: str
    cause: Literal["port", "broker", "unreachable"]


Decision = KeepGoing | End | Fail


def decide(facts: Facts) -> Decision:
    """The rules above, first one first."""
    f = facts
    if f.port_failure is not None:
        return Fail(f.port_failure, "port")
    if f.broker_exit_code is not None and not f.stopping:
        return Fail(
            f"Kafka: the embedded broker (pid {f.broker_pid}) exited with code "
            f"{f.broker_exit_code}; it kept its topics in memory, so the connector's state is "
            "gone with it",
            "broker",
        )
    unreachable_at = _unreachable_at(f)
    if unreachable_at is not None and f.now > unreachable_at:
        out = min(f.now - since for since in f.out_of_group_since if since is not None)
        limit = f.unreachable_limit_s
        return Fail(
            f"Kafka at {f.kafka}: no task of this process has been a member of its group for "
            f"{out:.0f}s (kafka.unreachable_limit_s = {limit:g}): the broker is unreachable or "
            "the group does not answer",
            "unreachable",
        )
    if f.stop_requested:
        return End("signal")
    if f.deadline is not None and f.now >= f.deadline:
        return End("duration")
    if f.max_records is not None and f.delivered >= f.max_records:
        return End("max-records")
    if f.read_to_end:
        return End("end-at")
    times = [t for t in (f.deadline, unreachable_at) if t is not None]
    return KeepGoing(min(times) if times else None)


def _unreachable_at(f: Facts) -> float | None:
    """After when rule 3 holds, as long as no task rejoins: when the task that left its group
    last has been out of it for the limit. None: rule 3 cannot hold by time alone."""
    if f.unreachable_limit_s <= 0 or f.stopping or not f.out_of_group_since:
        return None
    if any(since is None for since in f.out_of_group_since):
        return None
    return max(s for s in f.out_of_group_since if s is not None) + f.unreachable_limit_s
