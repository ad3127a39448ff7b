"""Per-key ordered delivery with a retry queue and a dead-letter queue
(docs/design.md#retry-and-dead-letter-queues).

A pure core: :meth:`RetryCore.handle` takes one event and ``now`` (wall-clock seconds, passed in;
due times are written to Kafka and must mean the same to the next owner) and returns the
commands the shell must carry out, in order. No I/O, no clock, randomness only from the seeded
``random.Random`` the core owns.

Rules (message consumption, and the per-key ``GroupState``):

* Records arrive with an ordering key (``group_id`` in the design; here the table and primary key of
  a row). Each gets a sequence number in arrival order; per key, records are delivered in that
  order.
* **A key never has two records in flight.** A record of a key with one in flight waits in memory
  (``waiting``) behind it; it is not yet settled, so its batch is not acknowledged upstream.
* A delivery that fails goes to the **retry queue** (RQ) with ``attempts`` failures so far and a
  due time ``now + backoff``, ``backoff = min(base * 2**(attempts-1), max) * (1 + jitter * u)``
  with ``u`` from the seeded generator. When its due time comes (:class:`Tick`) it is sent again.
* After ``max_attempts`` failures the record goes to the **dead-letter queue** (DLQ) with its last
  error.
* **While a key has a record in the RQ, its later records wait behind it, parked in the RQ in
  order too** (``attempts = 0``, due at once), so a new owner finds them there. Other keys flow
  on. Parked records are sent one at a time, oldest first, each after the one before it was
  delivered (or dead-lettered).
* A key with a record in the DLQ either **blocks** (``dlq_blocks=True``: its later records stay
  parked until the DLQ record is replayed or discarded, so order is kept) or **releases**
  (``dlq_blocks=False``: later records flow on; the dead-lettered record is out of order if it is
  ever replayed).
* :class:`ReplayDlq` puts a dead-lettered record back into the RQ at its place by sequence number
  (with ``attempts = 0``, due at once); :class:`DiscardDlq` drops it.
* A record id seen again while it is still held (in flight, waiting, RQ or DLQ) is a
  :class:`Duplicate`; nothing else happens to it (upstream re-delivery after a crash).

Durability: the state lives in two Kafka topics, so a new owner of the partition resumes it. The
commands :class:`ParkInRetry` and :class:`Released` are the RQ topic's entries,
:class:`SendToDlq` and :class:`Discarded` the DLQ topic's. Every one carries a ``version`` from a
counter that only grows (a new core starts above every version and sequence number in the log), and
:func:`from_log` folds the entries of both topics in any order: for each record, the entry with
the highest version says where it is (RQ, DLQ, or gone). So a crash between two writes never
loses a record; at worst a record delivered from the RQ is delivered again (at least once).

The design's ``GroupState`` (``p``: the latest entry produced to the RQ for the group, ``c``: the
latest consumed) is the per-key queue here: its entries are exactly those between ``c`` and ``p``.

:meth:`RetryCore.validate` checks the invariants (one record in flight per key; sequence order per
key in every queue; every held record in exactly one place); tests call it after every step.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

# --- configuration ---------------------------------------------------------------------------


class RetryPolicy(msgspec.Struct, frozen=True):
    max_attempts: int = 5  # failures before the DLQ
    base_backoff: float = 0.1  # seconds
    max_backoff: float = 30.0
    jitter: float = 0.2  # backoff is stretched by up to this fraction
    dlq_blocks: bool = True  # a key with a DLQ record holds its later records back

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be at least 1")
        if self.base_backoff < 0 or self.max_backoff < 0 or self.jitter < 0:
            raise ValueError("backoff and jitter must not be negative")


# --- events (stimuli) ------------------------------------------------------------------------


class Event(msgspec.Struct, frozen=True, tag_field="e"):
    pass


class Deliver(Event, frozen=True, tag="deliver"):
    record_id: str
    key: str


class DeliveryOk(Event, frozen=True, tag="ok"):
    record_id: str


class DeliveryFailed(Event, frozen=True, tag="failed"):
    record_id: str
    error: str


class Tick(Event, frozen=True, tag="tick"):
    pass


class ReplayDlq(Event, frozen=True, tag="replay"):
    record_id: str


class DiscardDlq(Event, frozen=True, tag="discard"):
    record_id: str


class Drive(Event, frozen=True, tag="drive"):
    """Whether this core sends the RQ's records (it is the queue's driver) from now on."""

    on: bool


# --- commands --------------------------------------------------------------------------------


class Command(msgspec.Struct, frozen=True, tag_field="c"):
    pass


class SendToSink(Command, frozen=True, tag="send"):
    """Deliver the record; answer with :class:`DeliveryOk` or :class:`DeliveryFailed`."""

    record_id: str
    key: str
    attempts: int  # failures so far


class ParkInRetry(Command, frozen=True, tag="park"):
    """RQ entry: the record is in the retry queue (newly, or with a new due time)."""

    record_id: str
    key: str
    seq: int
    version: int
    attempts: int
    due: float
    error: str = ""


class Released(Command, frozen=True, tag="released"):
    """RQ entry: the record left the retry queue because it was delivered."""

    record_id: str
    key: str
    version: int


class SendToDlq(Command, frozen=True, tag="dlq"):
    """DLQ entry: the record is dead-lettered after ``attempts`` failures."""

    record_id: str
    key: str
    seq: int
    version: int
    attempts: int
    error: str


class Discarded(Command, frozen=True, tag="discarded"):
    """DLQ entry: the dead-lettered record was dropped by an operator."""

    record_id: str
    key: str
    version: int


class Duplicate(Command, frozen=True, tag="duplicate"):
    """The record is already held; the shell settles it with the copy it has."""

    record_id: str


LogEntry = ParkInRetry | Released | SendToDlq | Discarded
"""What the RQ and DLQ topics hold."""


class Observe(Event, frozen=True, tag="observe"):
    """An entry read from the RQ/DLQ topics: this owner's own (an echo, ignored) or another
    owner's (folded in: the highest version of a record says where it is)."""

    entry: LogEntry


class ForgetSettled(Event, frozen=True, tag="forget"):
    """Every entry written before this core's clock was ``upto`` has been observed (a barrier
    begun then completed): :meth:`RetryCore.forget_settled` as an event, so a trace holds it."""

    upto: int


RetryEvent = (
    Deliver
    | DeliveryOk
    | DeliveryFailed
    | Tick
    | ReplayDlq
    | DiscardDlq
    | Drive
    | Observe
    | ForgetSettled
)
RetryCommand = SendToSink | ParkInRetry | Released | SendToDlq | Discarded | Duplicate

RQ_ENTRIES = (ParkInRetry, Released)
DLQ_ENTRIES = (SendToDlq, Discarded)


class RetryProtocolError(Exception):
    """An event that does not fit the core's state (e.g. an outcome for a record not in flight)."""


class RetryInvariantError(AssertionError):
    """:meth:`RetryCore.validate` found broken state."""


class GroupState(msgspec.Struct, frozen=True):
    """Where a key's held records are (a view for operators and tests)."""

    key: str
    in_flight: str | None
    rq: tuple[str, ...]
    dlq: tuple[str, ...]
    waiting: tuple[str, ...]


class RetryStats(msgspec.Struct, frozen=True):
    sent: int
    delivered: int
    failed: int
    parked: int
    dead_lettered: int
    replayed: int
    discarded: int
    duplicates: int
    held: int  # records in flight, waiting, in the RQ or in the DLQ
    observed: int = 0  # other owners' entries folded in


# --- state -----------------------------------------------------------------------------------


@dataclass
class _Held:
    record_id: str
    seq: int
    version: int = 0
    attempts: int = 0
    due: float = 0.0
    error: str = ""


@dataclass
class _Key:
    in_flight: str | None = None
    in_flight_seq: int = -1
    from_queue: bool = False
    queue: list[_Held] = field(default_factory=list)  # the RQ, by seq
    dlq: list[_Held] = field(default_factory=list)  # by seq
    waiting: deque[tuple[str, int]] = field(default_factory=deque)  # in memory, by seq
    scheduled: float | None = None  # the due time this key has in the timer heap

    def empty(self) -> bool:
        return self.in_flight is None and not self.queue and not self.dlq and not self.waiting


def _seqs(items: Iterable[_Held]) -> list[int]:
    return [h.seq for h in items]


class RetryCore:
    """The per-key ordering state of one sink (or one shard of it)."""

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        seed: int = 0,
        log_size: int = 1000,
        *,
        shared: bool = False,
    ):
        self.policy = policy or RetryPolicy()
        self._rng = random.Random(seed)
        self._keys: dict[str, _Key] = {}
        self._where: dict[str, str] = {}  # held record id -> key
        self._timers: list[tuple[float, str]] = []  # (due, key), lazily cleaned
        self._clock = 0  # next seq / version
        self._flying = 0  # records in flight, over all keys
        self.log: deque[tuple[float, Event, tuple[Command, ...]]] = deque(maxlen=log_size)
        self._stats = dict.fromkeys(
            ("sent", "delivered", "failed", "parked", "dead_lettered", "replayed", "discarded"), 0
        )
        self._stats["duplicates"] = 0
        self._stats["observed"] = 0
        # Only the driver sends the RQ's records (several owners share one RQ); each owner
        # sends its own new records directly and parks them when their key is blocked.
        self.driving = True
        # record id -> newest entry version known; kept only when other owners' entries are
        # observed (``shared``), and forgotten for settled records (:meth:`forget_settled`)
        self.shared = shared
        self._versions: dict[str, int] = {}
        self._deferred: dict[str, LogEntry] = {}  # foreign entries for records busy here

    # -- queries ---------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest due time of a retry, if any: call ``handle(Tick(), now)`` then."""
        while self._timers:
            due, key = self._timers[0]
            ks = self._keys.get(key)
            if ks is not None and ks.scheduled == due:
                return due
            heapq.heappop(self._timers)
        return None

    def group_state(self, key: str) -> GroupState:
        ks = self._keys.get(key, _Key())
        return GroupState(
            key=key,
            in_flight=ks.in_flight,
            rq=tuple(h.record_id for h in ks.queue),
            dlq=tuple(h.record_id for h in ks.dlq),
            waiting=tuple(r for r, _ in ks.waiting),
        )

    def in_flight_count(self) -> int:
        return self._flying

    def holds(self, record_id: str) -> bool:
        return record_id in self._where

    def blocks(self, key: str) -> bool:
        """Whether a new record of ``key`` would not be sent at once (it would wait or be parked):
        the key has a record in flight, waiting, in the RQ, or (``dlq_blocks``) in the DLQ. A
        sink that delivers most records itself sends such keys' records through the core."""
        ks = self._keys.get(key)
        return ks is not None and (
            ks.in_flight is not None or bool(ks.waiting) or self._blocked(ks)
        )

    def held_count(self) -> int:
        """Records in flight, waiting, in the RQ or in the DLQ."""
        return len(self._where)

    def key_of(self, record_id: str) -> str | None:
        return self._where.get(record_id)

    def dlq_records(self) -> list[SendToDlq]:
        """Every dead-lettered record, as its DLQ entry."""
        return [
            SendToDlq(h.record_id, key, h.seq, h.version, h.attempts, h.error)
            for key, ks in self._keys.items()
            for h in ks.dlq
        ]

    def durable_state(self) -> list[ParkInRetry | SendToDlq]:
        """The latest log entry of every record in the RQ or the DLQ, sorted by record id:
        what :func:`from_log` rebuilds."""
        out: list[ParkInRetry | SendToDlq] = list(self.dlq_records())
        for key, ks in self._keys.items():
            out.extend(
                ParkInRetry(h.record_id, key, h.seq, h.version, h.attempts, h.due, h.error)
                for h in ks.queue
            )
        return sorted(out, key=lambda e: e.record_id)

    def statistics(self) -> RetryStats:
        return RetryStats(**self._stats, held=len(self._where))

    # -- the transition function -----------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, ForgetSettled):  # no command, and nothing deferred is applied
            self.forget_settled(event.upto)
            self.log.append((now, event, ()))
            return []
        match event:
            case Deliver(record_id=rid, key=key):
                cmds = self._deliver(rid, key, now)
            case DeliveryOk(record_id=rid):
                cmds = self._ok(rid, now)
            case DeliveryFailed(record_id=rid, error=error):
                cmds = self._failed(rid, error, now)
            case Tick():
                cmds = self._tick(now)
            case ReplayDlq(record_id=rid):
                cmds = self._replay(rid, now)
            case DiscardDlq(record_id=rid):
                cmds = self._discard(rid, now)
            case Observe(entry=entry):
                cmds = self._observe(entry, now)
            case Drive(on=on):
                cmds = self._drive(on, now)
            case _:
                raise RetryProtocolError(f"unknown event {event!r}")
        if self._deferred:
            cmds += self._apply_deferred(now)
        self.log.append((now, event, tuple(cmds)))
        return cmds

    def _next(self) -> int:
        self._clock += 1
        return self._clock

    def _stamp(self, rid: str) -> int:
        """A new version for an entry of ``rid`` written by this core."""
        v = self._next()
        if self.shared:
            self._versions[rid] = v
        return v

    def _blocked(self, ks: _Key) -> bool:
        return bool(ks.queue) or (self.policy.dlq_blocks and bool(ks.dlq))

    def _park(self, key: str, h: _Held, now: float) -> ParkInRetry:
        h.version = self._stamp(h.record_id)
        self._stats["parked"] += 1
        return ParkInRetry(h.record_id, key, h.seq, h.version, h.attempts, h.due, h.error)

    def _deliver(self, rid: str, key: str, now: float) -> list[Command]:
        if rid in self._where:
            self._stats["duplicates"] += 1
            return [Duplicate(rid)]
        seq = self._next()
        ks = self._keys.setdefault(key, _Key())
        self._where[rid] = key
        if self._blocked(ks):
            h = _Held(rid, seq, due=now)
            ks.queue.append(h)
            return [self._park(key, h, now), *self._advance(key, ks, now)]
        if ks.in_flight is not None:
            ks.waiting.append((rid, seq))
            return []
        return self._send_direct(key, ks, rid, seq)

    def _send_direct(self, key: str, ks: _Key, rid: str, seq: int) -> list[Command]:
        ks.in_flight, ks.in_flight_seq, ks.from_queue = rid, seq, False
        self._flying += 1
        self._stats["sent"] += 1
        return [SendToSink(rid, key, 0)]

    def _in_flight(self, rid: str) -> tuple[str, _Key]:
        key = self._where.get(rid)
        ks = self._keys.get(key) if key is not None else None
        if key is None or ks is None or ks.in_flight != rid:
            raise RetryProtocolError(f"outcome for record {rid!r}, which is not in flight")
        self._flying -= 1
        return key, ks

    def _take_from_queue(self, ks: _Key, rid: str) -> _Held:
        for i, h in enumerate(ks.queue):
            if h.record_id == rid:
                return ks.queue.pop(i)
        raise RetryInvariantError(f"in-flight record {rid!r} is not in its queue")

    def _ok(self, rid: str, now: float) -> list[Command]:
        key, ks = self._in_flight(rid)
        self._stats["delivered"] += 1
        ks.in_flight = None
        del self._where[rid]
        cmds: list[Command] = []
        if ks.from_queue:
            self._take_from_queue(ks, rid)
            cmds.append(Released(rid, key, self._stamp(rid)))
        else:
            cmds += self._park_waiting(key, ks, now)  # held back while it was in flight
        return cmds + self._advance(key, ks, now)

    def _failed(self, rid: str, error: str, now: float) -> list[Command]:
        key, ks = self._in_flight(rid)
        self._stats["failed"] += 1
        ks.in_flight = None
        settled = self._deferred.get(rid)
        if isinstance(settled, Released | Discarded):
            # another owner (the new driver) delivered or dropped it meanwhile: this late
            # failure must not park it again, after the key's later records
            if ks.from_queue:
                self._take_from_queue(ks, rid)
            del self._deferred[rid]
            del self._where[rid]
            self._versions[rid] = max(self._versions.get(rid, 0), settled.version)
            return self._advance(key, ks, now)
        h = self._take_from_queue(ks, rid) if ks.from_queue else _Held(rid, ks.in_flight_seq)
        h.attempts += 1
        h.error = error
        cmds: list[Command] = []
        if h.attempts >= self.policy.max_attempts:
            h.version = self._stamp(rid)
            bisect.insort(ks.dlq, h, key=lambda x: x.seq)
            self._stats["dead_lettered"] += 1
            cmds.append(SendToDlq(rid, key, h.seq, h.version, h.attempts, h.error))
        else:
            h.due = now + self._backoff(h.attempts)
            bisect.insort(ks.queue, h, key=lambda x: x.seq)
            cmds.append(self._park(key, h, now))
        cmds += self._park_waiting(key, ks, now)
        return cmds + self._advance(key, ks, now)

    def _park_waiting(self, key: str, ks: _Key, now: float) -> list[Command]:
        """Once a key is blocked, the records waiting in memory go to the RQ behind; but not
        while a record of the key is in flight straight from upstream (not from the RQ): that
        one is not durable, and parking its successors would put them ahead of it if this
        process crashed and upstream delivered it again. They are parked once it settles."""
        if not ks.waiting or not self._blocked(ks):
            return []
        if ks.in_flight is not None and not ks.from_queue:
            return []
        cmds: list[Command] = []
        while ks.waiting:
            rid, seq = ks.waiting.popleft()
            if ks.queue and ks.queue[-1].seq > seq:
                # another owner parked newer records of this key meanwhile (it read them too,
                # during a hand-off): these go behind, in their own order
                seq = self._next()
            h = _Held(rid, seq, due=now)
            ks.queue.append(h)
            cmds.append(self._park(key, h, now))
        return cmds

    def _backoff(self, attempts: int) -> float:
        p = self.policy
        base: float = min(p.base_backoff * 2.0 ** (attempts - 1), p.max_backoff)
        return base * (1.0 + p.jitter * self._rng.random())

    def _advance(self, key: str, ks: _Key, now: float) -> list[Command]:
        """Send the key's next record if it may go now; else make sure its timer is set."""
        if ks.in_flight is not None:
            return []
        if self.policy.dlq_blocks and ks.dlq:
            ks.scheduled = None
            return []
        if ks.queue:
            if not self.driving:
                ks.scheduled = None  # the driver sends it
                return []
            head = ks.queue[0]
            if head.due <= now:
                ks.in_flight, ks.in_flight_seq, ks.from_queue = head.record_id, head.seq, True
                ks.scheduled = None
                self._flying += 1
                self._stats["sent"] += 1
                return [SendToSink(head.record_id, key, head.attempts)]
            if ks.scheduled != head.due:
                ks.scheduled = head.due
                heapq.heappush(self._timers, (head.due, key))
            return []
        ks.scheduled = None
        if ks.waiting:
            rid, seq = ks.waiting.popleft()
            return self._send_direct(key, ks, rid, seq)
        if ks.empty():
            del self._keys[key]
        return []

    def _tick(self, now: float) -> list[Command]:
        cmds: list[Command] = []
        while self._timers and self._timers[0][0] <= now:
            due, key = heapq.heappop(self._timers)
            ks = self._keys.get(key)
            if ks is None or ks.scheduled != due:
                continue  # stale
            ks.scheduled = None
            cmds += self._advance(key, ks, now)
        return cmds

    def _dlq_entry(self, rid: str) -> tuple[str, _Key, _Held]:
        key = self._where.get(rid)
        ks = self._keys.get(key) if key is not None else None
        if key is not None and ks is not None:
            for i, h in enumerate(ks.dlq):
                if h.record_id == rid:
                    return key, ks, ks.dlq.pop(i)
        raise RetryProtocolError(f"record {rid!r} is not in the DLQ")

    def _replay(self, rid: str, now: float) -> list[Command]:
        key, ks, h = self._dlq_entry(rid)
        self._stats["replayed"] += 1
        h.attempts, h.due = 0, now
        bisect.insort(ks.queue, h, key=lambda x: x.seq)
        cmds: list[Command] = [self._park(key, h, now)]
        cmds += self._park_waiting(key, ks, now)
        return cmds + self._advance(key, ks, now)

    def _discard(self, rid: str, now: float) -> list[Command]:
        key, ks, _ = self._dlq_entry(rid)
        self._stats["discarded"] += 1
        del self._where[rid]
        return [Discarded(rid, key, self._stamp(rid)), *self._advance(key, ks, now)]

    def forget_settled(self, upto: int) -> int:
        """Forget the versions of records no longer held whose last version is ``upto`` or
        older; returns how many. Call it once every entry written before this core's clock
        was ``upto`` has been observed (a barrier begun then has completed): an older entry
        of such a record cannot arrive any more."""
        gone = [rid for rid, v in self._versions.items() if v <= upto and rid not in self._where]
        for rid in gone:
            del self._versions[rid]
        return len(gone)

    @property
    def clock(self) -> int:
        return self._clock

    def _observe(self, e: LogEntry, now: float) -> list[Command]:
        if not self.shared:
            raise RetryProtocolError("Observe needs a shared core (RetryCore(shared=True))")
        # a Lamport clock: what this core writes next is newer than anything it has seen
        self._clock = max(self._clock, e.version, getattr(e, "seq", 0))
        rid = e.record_id
        if e.version <= self._versions.get(rid, 0):
            return []  # this core's own entry read back, or one already superseded
        self._stats["observed"] += 1
        if self._busy(rid):
            old = self._deferred.get(rid)
            if old is None or e.version > old.version:
                self._deferred[rid] = e
            return []
        return self._apply_entry(e, now)

    def _busy(self, rid: str) -> bool:
        """In flight or waiting here: another owner's entry for it waits until it settles."""
        key = self._where.get(rid)
        ks = self._keys.get(key) if key is not None else None
        return ks is not None and (ks.in_flight == rid or any(r == rid for r, _ in ks.waiting))

    def _apply_entry(self, e: LogEntry, now: float) -> list[Command]:
        rid, key = e.record_id, e.key
        self._versions[rid] = e.version
        ks = self._keys.setdefault(key, _Key())
        if self._where.pop(rid, None) is not None:  # a record's key never changes
            ks.queue = [h for h in ks.queue if h.record_id != rid]
            ks.dlq = [h for h in ks.dlq if h.record_id != rid]
        match e:
            case ParkInRetry():
                h = _Held(rid, e.seq, e.version, e.attempts, e.due, e.error)
                bisect.insort(ks.queue, h, key=lambda x: x.seq)
                self._where[rid] = key
            case SendToDlq():
                h = _Held(rid, e.seq, e.version, e.attempts, 0.0, e.error)
                bisect.insort(ks.dlq, h, key=lambda x: x.seq)
                self._where[rid] = key
            case Released() | Discarded():
                pass
        return self._park_waiting(key, ks, now) + self._advance(key, ks, now)

    def _apply_deferred(self, now: float) -> list[Command]:
        cmds: list[Command] = []
        for rid in [r for r in self._deferred if not self._busy(r)]:
            e = self._deferred.pop(rid)
            if e.version > self._versions.get(rid, 0):
                cmds += self._apply_entry(e, now)
        return cmds

    def _drive(self, on: bool, now: float) -> list[Command]:
        if on == self.driving:
            return []
        self.driving = on
        cmds: list[Command] = []
        for key, ks in list(self._keys.items()):
            if on:
                cmds += self._advance(key, ks, now)
            else:
                ks.scheduled = None
        return cmds

    # -- invariants ------------------------------------------------------------------------

    def validate(self) -> None:
        seen: dict[str, str] = {}

        def hold(rid: str, key: str) -> None:
            if rid in seen:
                raise RetryInvariantError(f"record {rid!r} is held twice")
            seen[rid] = key

        for key, ks in self._keys.items():
            if ks.empty():
                raise RetryInvariantError(f"key {key!r} kept with nothing held")
            for name, items in (("rq", ks.queue), ("dlq", ks.dlq)):
                s = _seqs(items)
                if s != sorted(set(s)):
                    raise RetryInvariantError(f"key {key!r}: {name} out of order: {s}")
                for h in items:
                    hold(h.record_id, key)
            ws = [seq for _, seq in ks.waiting]
            if ws != sorted(set(ws)):
                raise RetryInvariantError(f"key {key!r}: waiting out of order: {ws}")
            for rid, _ in ks.waiting:
                hold(rid, key)
            if ks.in_flight is not None:
                queued = {h.record_id for h in ks.queue}
                if ks.from_queue != (ks.in_flight in queued):
                    raise RetryInvariantError(f"key {key!r}: in-flight record misplaced")
                if not ks.from_queue:
                    hold(ks.in_flight, key)
                if ws and ks.in_flight_seq >= ws[0]:
                    raise RetryInvariantError(f"key {key!r}: a waiting record is older")
            # (records wait in memory only behind a record in flight straight from upstream;
            # on a blocked key they are parked as soon as that one settles)
            if ks.waiting and (ks.in_flight is None or ks.from_queue):
                raise RetryInvariantError(f"key {key!r}: records wait with no reason")
            if self.policy.dlq_blocks and ks.dlq:
                if ks.in_flight is not None:
                    raise RetryInvariantError(f"key {key!r}: sending while dead-lettered")
                # (an observer of a shared queue reads the RQ and DLQ topics each at its own
                # pace: it may see a later record dead-lettered before it sees an earlier one
                # released; the driver has caught up with both before it drives)
                consistent = self.driving or not self.shared
                if consistent and ks.queue and ks.dlq[-1].seq > ks.queue[0].seq:
                    raise RetryInvariantError(f"key {key!r}: DLQ record newer than RQ record")
            if (
                self.policy.dlq_blocks
                and ks.in_flight is not None
                and ks.queue
                and (not ks.from_queue or ks.queue[0].record_id != ks.in_flight)
            ):
                raise RetryInvariantError(f"key {key!r}: in flight ahead of the RQ head")
            if (
                self.driving
                and ks.in_flight is None
                and ks.queue
                and not (self.policy.dlq_blocks and ks.dlq)
                and ks.scheduled != ks.queue[0].due
            ):
                raise RetryInvariantError(f"key {key!r}: RQ head has no timer")
            if not self.driving and ks.scheduled is not None:
                raise RetryInvariantError(f"key {key!r}: a timer while not driving")
        flying = sum(ks.in_flight is not None for ks in self._keys.values())
        if flying != self._flying:
            raise RetryInvariantError(f"{self._flying} counted in flight, {flying} found")
        if seen != self._where:
            raise RetryInvariantError("record index does not match the queues")
        if self.log.maxlen is not None and len(self.log) > self.log.maxlen:
            raise RetryInvariantError("event log over its bound")


def from_log(
    entries: Iterable[LogEntry],
    policy: RetryPolicy | None = None,
    seed: int = 0,
    *,
    shared: bool = False,
) -> RetryCore:
    """Rebuild a core from the RQ and DLQ topics' entries (any order, duplicates allowed): the
    entry with the highest version decides where each record is. Nothing is in flight; call
    ``handle(Tick(), now)`` to start sending the due RQ heads."""
    core = RetryCore(policy, seed, shared=shared)
    latest: dict[str, LogEntry] = {}
    top = 0
    for e in entries:
        top = max(top, e.version, getattr(e, "seq", 0))
        cur = latest.get(e.record_id)
        if cur is None or e.version > cur.version:
            latest[e.record_id] = e
    core._clock = top
    if core.shared:
        core._versions = {rid: e.version for rid, e in latest.items()}
    for e in latest.values():
        match e:
            case ParkInRetry():
                h = _Held(e.record_id, e.seq, e.version, e.attempts, e.due, e.error)
                core._keys.setdefault(e.key, _Key()).queue.append(h)
            case SendToDlq():
                h = _Held(e.record_id, e.seq, e.version, e.attempts, 0.0, e.error)
                core._keys.setdefault(e.key, _Key()).dlq.append(h)
            case Released() | Discarded():
                continue
        core._where[e.record_id] = e.key
    for key, ks in core._keys.items():
        ks.queue.sort(key=lambda x: x.seq)
        ks.dlq.sort(key=lambda x: x.seq)
        if ks.queue and not (core.policy.dlq_blocks and ks.dlq):
            ks.scheduled = ks.queue[0].due
            heapq.heappush(core._timers, (ks.scheduled, key))
    return core


# --- feeding old RQ/DLQ storage topics to new ones (a shard-count change) ----------------------


class FeedCopy(msgspec.Struct, frozen=True):
    """One entry the feeder writes to the newest RQ (``ParkInRetry``) or DLQ (``SendToDlq``)
    storage topic: a record's newest entry, unchanged (same version), with its payload."""

    entry: ParkInRetry | SendToDlq
    payload: bytes | None


class FeedPlan(msgspec.Struct, frozen=True):
    copies: tuple[FeedCopy, ...]  # per key in sequence order (keys sorted)
    held: int  # records held (RQ or DLQ) over all the storage topics read
    present: int  # held records whose newest entry is in the newest storage topics already
    missing_payloads: int  # copies without a payload (none was found: the record cannot be sent)


def feed_plan(
    entries: Iterable[tuple[LogEntry, bool]], payloads: dict[str, bytes] | None = None
) -> FeedPlan:
    """What a feeder writes so that the newest RQ/DLQ storage topics alone hold every record
    still held (docs/design.md#retry-and-dead-letter-queues, "Shard-count changes").

    ``entries``: every entry of the old and the newest RQ/DLQ storage topics, each with whether it
    was read from a newest one (any order, duplicates allowed); ``payloads``: the newest payload
    known per record. Rules:

    1. A record's place is its entry with the highest version over all the topics (as in
       :func:`from_log`); a record released or discarded there needs nothing.
    2. A held record whose newest entry (that version) is in a newest storage topic already needs
       nothing: it was written there after the commit, or copied by an earlier feed (so a feeder
       that crashed half-way is run again and copies each record once).
    3. Every other held record is copied: its newest entry unchanged (the version keeps the fold
       exact: a copy of an entry that a newer one has meanwhile superseded is ignored by every
       reader), to the RQ if it is parked there, to the DLQ if it is dead-lettered.
    4. Copies go out per key in sequence order (keys sorted, so the plan is deterministic).
    """
    latest: dict[str, LogEntry] = {}
    in_new: dict[str, int] = {}  # record id -> highest version read from a newest topic
    for e, new in entries:
        cur = latest.get(e.record_id)
        if cur is None or e.version > cur.version:
            latest[e.record_id] = e
        if new:
            in_new[e.record_id] = max(e.version, in_new.get(e.record_id, 0))
    payloads = payloads or {}
    copies: list[FeedCopy] = []
    held = present = missing = 0
    for rid, e in latest.items():
        if not isinstance(e, ParkInRetry | SendToDlq):
            continue
        held += 1
        if in_new.get(rid, 0) >= e.version:
            present += 1
            continue
        payload = payloads.get(rid)
        missing += payload is None
        copies.append(FeedCopy(e, payload))
    copies.sort(key=lambda c: (c.entry.key, c.entry.seq))
    return FeedPlan(tuple(copies), held, present, missing)


_log_encoder = msgspec.msgpack.Encoder()
_log_decoder: msgspec.msgpack.Decoder[LogEntry] = msgspec.msgpack.Decoder(LogEntry)


def encode_entry(entry: LogEntry) -> bytes:
    return _log_encoder.encode(entry)


def decode_entry(raw: bytes) -> LogEntry:
    return _log_decoder.decode(raw)


# --- who drives a shared RQ --------------------------------------------------------------------


def may_drive(leaders: Iterable[tuple[str, str, bool]]) -> bool:
    """Whether a process may drive the RQ that several processes share: one of its tasks,
    given as ``(task id, the group leader it knows, its lease is valid)``, leads the heartbeat
    group under a valid lease. (The group has one leader per generation and a leader whose
    lease ran out stops acting as one, so at most one process is eligible at a time, give or
    take the sends in flight that the take-over grace covers.)"""
    return any(me == leader and lease_valid for me, leader, lease_valid in leaders)


class SteerStep(msgspec.Struct, frozen=True):
    """What the shell of a shared RQ does now: ``stop`` driving, begin the ``catch_up`` (a
    barrier through the RQ/DLQ topics, then :meth:`DriverElection.caught_up`), or nothing."""

    stop: bool = False
    catch_up: bool = False


class DriverElection:
    """The take-over rule of a shared RQ (one queue per process, one driver among them).

    * A queue that is not eligible (:func:`may_drive` says no) stops driving at once.
    * An eligible queue that does not drive waits ``grace_s`` from when it became eligible
      (without a break): the previous driver's sends in flight end meanwhile. Then it catches
      up with the RQ/DLQ topics (their last entries folded in), and drives only if it is still
      eligible when the catch-up is over. A catch-up that fails is tried again at the next step.
    * Losing eligibility during the grace or the catch-up starts the grace over.

    ``now`` is in seconds (the shell's monotonic clock)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.driving = False
        self._eligible_since: float | None = None
        self._catching_up = False

    def step(self, eligible: bool, now: float) -> SteerStep:
        if not eligible:
            self._eligible_since = None
            self._catching_up = False
            if self.driving:
                self.driving = False
                return SteerStep(stop=True)
            return SteerStep()
        if self.driving or self._catching_up:
            return SteerStep()
        if self._eligible_since is None:
            self._eligible_since = now
        if now - self._eligible_since >= self.grace_s:
            self._catching_up = True
            return SteerStep(catch_up=True)
        return SteerStep()

    def caught_up(self, ok: bool, eligible: bool) -> bool:
        """The catch-up ended (``ok``: it completed); returns whether to drive from now on."""
        self._catching_up = False
        if not eligible:
            self._eligible_since = None
            return False
        self.driving = ok
        return self.driving
