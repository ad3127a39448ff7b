"""Durable state of a composite output topic, and the switch barrier (docs/design.md#routing).

A pure core: entries of the metadata topic ``<output>_meta`` (one partition, read from the
beginning up to a fresh marker; compaction is not relied on) are folded, in log order, by
:meth:`OutputMeta.apply`; the time is passed in, as float seconds of wall time (the producers'
lease ``until`` is written to the topic and read by other processes). No I/O, no clock, no
randomness.

The state (:class:`OutputMeta`): the composite output topic (its storage topics with ``P`` and
``K`` and the produce pointer, :class:`protocol.routing.CompositeTopic`), the RQ/DLQ shard count
and their composite topics, a pending switch, the producers' leases, the sealed storage topics,
and ``version``: the number of entries that changed the configuration (every producer and reader
can say which configuration it acts on).

Rules, in log order:

* **Created** is the first configuration; later ``Created`` entries are ignored (two first
  starts may race: the one first in the log wins).
* **StorageAdded(n)** appends storage topic ``n`` partitions with ``K`` by the routing rule
  (:meth:`protocol.routing.CompositeTopic.add_storage_topic`); the pointer does not move.
* **SwitchPrepared(target)** begins a switch of the produce pointer to ``target`` (the next
  storage topic). It is refused (ignored) unless ``target == pointer + 1`` exists and no switch
  is pending. The *ack set* is every producer holding a lease when it is folded (joined and not
  left).
* **The barrier.** A producer that reads ``SwitchPrepared`` stops producing at once (records it
  gets meanwhile are held, not sent), waits until every send it made to the old storage topic is
  acknowledged by Kafka, and appends **Acked**. A producer that joins while a switch is pending
  holds too. The switch is **due** (:meth:`OutputMeta.switch_due`) at ``now`` when every producer
  of the ack set has acked it, left, or let its lease run out ``grace`` ago (``until + grace <
  now``: a producer stops producing ``margin`` before its own ``until``, so a dead or cut-off
  producer has nothing in flight by then). Whoever sees it due appends **SwitchCommitted**; the
  first one folded moves the pointer, later copies are ignored. Producers produce to the new
  storage topic only after they read the commit.
  *So no key has a record in flight to the old storage topic when its first record goes to the
  new one*: every record sent to the old topic by a live producer was acknowledged before its ack,
  a dead producer's sends ended before its lease (plus ``grace``) ran out, and nobody sends to
  the new one before the commit, which follows all of them. A crash of anyone (the operator
  included) leaves a state that the next reader of the log completes: the commit is a rule over
  the log, not one process's decision.
* **Sealed(index, offsets)**: after a commit, seal markers were written to every partition of
  the old storage topic (nothing is written to it any more); ``offsets`` are where. Readers read
  each partition of storage topic ``i`` up to its first seal marker, then go to ``i + 1``
  (:func:`switch_point`): per key, every record of ``T_i`` precedes every record of ``T_{i+1}``.
  A committed storage topic without ``Sealed`` is sealed by whoever sees it (copies are harmless:
  a reader stops at the first marker, and every marker follows every record).
* **Joined(producer, until)** begins or renews a lease (a producer may produce only while it
  holds one it has read back); **Left(producer)** ends it (a clean exit, after its flush).
* **A shard-count change of the RQ/DLQ** is a barrier of the same kind, over the queues' writes
  (their *layout*: the RQ and DLQ storage topics written to, numbered by ``shard_changes``).
  **ShardsPrepared(change, shards, rq_partitions, dlq_partitions)** (``change`` is
  ``shard_changes + 1``; :func:`shards_plan` picks the counts: the shard count must divide them)
  is refused while another is pending or while an older RQ/DLQ storage topic is not fed yet. From
  it, producers hold their RQ/DLQ writes, wait until their writes to the current layout are
  acknowledged and append **ShardsAcked**; it is due by the same rule as a switch
  (:meth:`OutputMeta.shards_due`), and the first **ShardsCommitted** folded applies it: the shard
  count, and a new RQ (DLQ) storage topic when the RQ (DLQ) partition count changes. Producers
  write RQ/DLQ entries to the new layout only after they read the commit, so no key has an entry
  in flight to the old layout when its first entry goes to the new one.
* **The feed.** After a commit that added storage topics, the old ones still hold parked and
  dead-lettered records: readers read every RQ/DLQ storage topic from ``rq_from``/``dlq_from`` on,
  so nothing is lost meanwhile. A feeder copies every record still held there into the newest
  storage topic (:func:`protocol.retry.feed_plan`: the record's newest entry, same version, per
  key in sequence order, skipping copies already there, so a feeder that crashed is simply run
  again), then appends **Fed(change, rq_from, dlq_from)**: readers skip the storage topics before
  those indexes from then on.
* **ShardsSet(shards, rq_partitions, dlq_partitions)** (written by earlier versions) applies a
  shard count at once, without a barrier; its old storage topics are then fed like any other.

Entries that break a rule are ignored and counted in ``ignored`` (concurrent operators cannot
corrupt the state; the operations check their entry with the ``plan_*`` functions first, which
raise :class:`MetaError` with the reason).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec

from protocol.routing import CompositeTopic, StorageTopic, storage_topic_name


class MetaError(ValueError):
    """An operation that the state does not allow (the message says why)."""


# --- entries -------------------------------------------------------------------------------------


class MetaEntry(msgspec.Struct, frozen=True, tag_field="m"):
    pass


class Created(MetaEntry, frozen=True, tag="created"):
    name: str
    partitions: int
    rq_partitions: int
    dlq_partitions: int


class StorageAdded(MetaEntry, frozen=True, tag="added"):
    partitions: int


class SwitchPrepared(MetaEntry, frozen=True, tag="prepare"):
    target: int
    at: float = 0.0  # wall time of the operator (informational)


class Acked(MetaEntry, frozen=True, tag="ack"):
    producer: str
    target: int


class SwitchCommitted(MetaEntry, frozen=True, tag="commit"):
    target: int


class Sealed(MetaEntry, frozen=True, tag="sealed"):
    index: int
    offsets: tuple[int, ...]


class Joined(MetaEntry, frozen=True, tag="join"):
    producer: str
    until: float


class Left(MetaEntry, frozen=True, tag="leave"):
    producer: str


class ShardsSet(MetaEntry, frozen=True, tag="shards"):
    shards: int
    rq_partitions: int
    dlq_partitions: int


class ShardsPrepared(MetaEntry, frozen=True, tag="shards-prepare"):
    """Begin shard-count change number ``change`` of the RQ/DLQ (the barrier)."""

    change: int
    shards: int
    rq_partitions: int
    dlq_partitions: int


class ShardsAcked(MetaEntry, frozen=True, tag="shards-ack"):
    producer: str
    change: int


class ShardsCommitted(MetaEntry, frozen=True, tag="shards-commit"):
    change: int


class Fed(MetaEntry, frozen=True, tag="fed"):
    """Every record held in the RQ (DLQ) storage topics before ``rq_from`` (``dlq_from``) was
    copied to the newest one, as of shard change ``change``: readers skip them from now on."""

    change: int
    rq_from: int
    dlq_from: int


class Marker(MetaEntry, frozen=True, tag="marker"):
    """A read marker (the "produce a marker and read until you see it" technique)."""

    marker: str


Entry = (
    Created
    | StorageAdded
    | SwitchPrepared
    | Acked
    | SwitchCommitted
    | Sealed
    | Joined
    | Left
    | ShardsSet
    | ShardsPrepared
    | ShardsAcked
    | ShardsCommitted
    | Fed
    | Marker
)

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Entry] = msgspec.json.Decoder(Entry)


def encode_entry(entry: Entry) -> bytes:
    return _encoder.encode(entry)


def decode_entry(raw: bytes) -> Entry:
    return _decoder.decode(raw)


# --- state ---------------------------------------------------------------------------------------


class Pending(msgspec.Struct, frozen=True):
    """A prepared switch: its target, the producers that must ack it, those that did."""

    target: int
    ack_set: frozenset[str]
    acked: frozenset[str] = frozenset()


class ShardsPending(msgspec.Struct, frozen=True):
    """A prepared shard-count change: its number and counts, the producers that must ack it."""

    change: int
    shards: int
    rq_partitions: int
    dlq_partitions: int
    ack_set: frozenset[str]
    acked: frozenset[str] = frozenset()


def rq_name(output: str) -> str:
    return f"{output}_rq"


def dlq_name(output: str) -> str:
    return f"{output}_dlq"


def meta_topic(output: str) -> str:
    """The metadata topic of composite output topic ``output``."""
    return f"{output}_meta"


def _internal(name: str, counts: tuple[int, ...], first: int = 0) -> CompositeTopic:
    """The RQ or DLQ composite topic: one storage topic per partition count it has had, from
    index ``first`` on (those before were fed to the newest; K = 1: their entries are folded in any
    order, so their routing needs no shard consistency); the newest is produced to."""
    topics = tuple(
        StorageTopic(storage_topic_name(name, i), n, 1) for i, n in enumerate(counts) if i >= first
    )
    return CompositeTopic(name, topics, len(topics) - 1)


@dataclass
class OutputMeta:
    """The folded metadata log of one composite output topic (see the module docstring)."""

    output: CompositeTopic | None = None
    version: int = 0
    shards: int = 1
    rq_counts: tuple[int, ...] = ()
    dlq_counts: tuple[int, ...] = ()
    pending: Pending | None = None
    leases: dict[str, float] = field(default_factory=dict)  # producer -> until
    sealed: dict[int, tuple[int, ...]] = field(default_factory=dict)  # index -> seal offsets
    ignored: Counter[str] = field(default_factory=Counter)
    entries: int = 0
    shard_changes: int = 0  # committed shard-count changes: the RQ/DLQ layout's number
    shards_pending: ShardsPending | None = None
    rq_from: int = 0  # RQ storage topics before this index are fed (not read any more)
    dlq_from: int = 0

    # -- queries -------------------------------------------------------------------------------

    @property
    def created(self) -> bool:
        return self.output is not None

    def composite(self) -> CompositeTopic:
        if self.output is None:
            raise MetaError("the composite topic has not been created")
        return self.output

    def rq(self) -> CompositeTopic:
        """The RQ storage topics readers read (from ``rq_from``); the newest is written to."""
        return _internal(rq_name(self.composite().name), self.rq_counts, self.rq_from)

    def dlq(self) -> CompositeTopic:
        return _internal(dlq_name(self.composite().name), self.dlq_counts, self.dlq_from)

    def unfed(self) -> bool:
        """Whether an RQ or DLQ storage topic before the newest still has to be fed."""
        self.composite()
        return self.rq_from < len(self.rq_counts) - 1 or self.dlq_from < len(self.dlq_counts) - 1

    def layout(self) -> int | None:
        """The RQ/DLQ layout a producer writes entries to now (``shard_changes``), or None: hold
        (a shard-count change is pending)."""
        if self.output is None or self.shards_pending is not None:
            return None
        return self.shard_changes

    def _waiting(
        self, ack_set: frozenset[str], acked: frozenset[str], now: float, grace: float
    ) -> list[str]:
        return sorted(
            who
            for who in ack_set
            if who not in acked and who in self.leases and self.leases[who] + grace >= now
        )

    def switch_due(self, now: float, grace: float) -> bool:
        """Whether the pending switch may commit at ``now``: every producer of its ack set acked,
        left, or held a lease that ran out more than ``grace`` ago."""
        p = self.pending
        return p is not None and not self._waiting(p.ack_set, p.acked, now, grace)

    def waiting_for(self, now: float, grace: float) -> list[str]:
        """The producers the pending switch still waits for (sorted)."""
        p = self.pending
        return [] if p is None else self._waiting(p.ack_set, p.acked, now, grace)

    def shards_due(self, now: float, grace: float) -> bool:
        """Whether the pending shard-count change may commit at ``now`` (the switch's rule)."""
        p = self.shards_pending
        return p is not None and not self._waiting(p.ack_set, p.acked, now, grace)

    def shards_waiting_for(self, now: float, grace: float) -> list[str]:
        p = self.shards_pending
        return [] if p is None else self._waiting(p.ack_set, p.acked, now, grace)

    def unsealed(self) -> list[int]:
        """Storage topics before the produce pointer that have no seal yet."""
        out = self.composite()
        return [i for i in range(out.produce_pointer) if i not in self.sealed]

    def target(self) -> int | None:
        """The storage topic a producer writes to now, or None: hold (a switch is pending)."""
        if self.output is None or self.pending is not None:
            return None
        return self.output.produce_pointer

    # -- the fold ------------------------------------------------------------------------------

    def apply(self, entry: Entry) -> bool:
        """Fold one entry (log order); returns whether it changed the state."""
        self.entries += 1
        match entry:
            case Marker():
                return False
            case Created():
                return self._created(entry)
            case _ if self.output is None:
                return self._ignore("before created")
            case StorageAdded(partitions=n):
                if n <= 0:
                    return self._ignore("bad partitions")
                self.output = self.output.add_storage_topic(n)
                self.version += 1
                return True
            case SwitchPrepared(target=target):
                if self.pending is not None:
                    return self._ignore("switch already pending")
                if target != self.output.produce_pointer + 1 or target >= len(
                    self.output.storage_topics
                ):
                    return self._ignore("bad switch target")
                self.pending = Pending(target, frozenset(self.leases))
                self.version += 1
                return True
            case Acked(producer=who, target=target):
                p = self.pending
                if p is None or p.target != target:
                    return self._ignore("stale ack")
                self.pending = msgspec.structs.replace(p, acked=p.acked | {who})
                return True
            case SwitchCommitted(target=target):
                if self.pending is None or self.pending.target != target:
                    return self._ignore("stale commit")
                self.output = self.output.switch_produce()
                self.pending = None
                self.version += 1
                return True
            case Sealed(index=index, offsets=offsets):
                if index >= self.output.produce_pointer or index in self.sealed:
                    return self._ignore("stale seal")
                if len(offsets) != self.output.storage_topics[index].partitions:
                    return self._ignore("bad seal")
                self.sealed[index] = offsets
                return True
            case Joined(producer=who, until=until):
                self.leases[who] = max(until, self.leases.get(who, until))
                return True
            case Left(producer=who):
                return self.leases.pop(who, None) is not None
            case ShardsSet(shards=s, rq_partitions=r, dlq_partitions=d):
                if s <= 0 or r <= 0 or d <= 0 or r % s or d % s:
                    return self._ignore("bad shards")
                self._set_shards(s, r, d)
                return True
            case ShardsPrepared(change=n, shards=s, rq_partitions=r, dlq_partitions=d):
                if s <= 0 or r <= 0 or d <= 0 or r % s or d % s:
                    return self._ignore("bad shards")
                if self.shards_pending is not None:
                    return self._ignore("shard change already pending")
                if n != self.shard_changes + 1:
                    return self._ignore("stale shard change")
                if self.unfed():
                    return self._ignore("shard change before the feed")
                self.shards_pending = ShardsPending(n, s, r, d, frozenset(self.leases))
                self.version += 1
                return True
            case ShardsAcked(producer=who, change=n):
                sp = self.shards_pending
                if sp is None or sp.change != n:
                    return self._ignore("stale shards ack")
                self.shards_pending = msgspec.structs.replace(sp, acked=sp.acked | {who})
                return True
            case ShardsCommitted(change=n):
                sp = self.shards_pending
                if sp is None or sp.change != n:
                    return self._ignore("stale shards commit")
                self.shards_pending = None
                self._set_shards(sp.shards, sp.rq_partitions, sp.dlq_partitions)
                return True
            case Fed(change=n, rq_from=r, dlq_from=d):
                if n != self.shard_changes or self.shards_pending is not None:
                    return self._ignore("stale feed")
                if not (0 <= r < len(self.rq_counts) and 0 <= d < len(self.dlq_counts)):
                    return self._ignore("bad feed")
                if r <= self.rq_from and d <= self.dlq_from:
                    return self._ignore("fed already")
                self.rq_from, self.dlq_from = max(r, self.rq_from), max(d, self.dlq_from)
                self.version += 1
                return True
        raise AssertionError(f"unhandled meta entry {entry!r}")  # pragma: no cover

    def _set_shards(self, shards: int, rq: int, dlq: int) -> None:
        if rq != self.rq_counts[-1]:
            self.rq_counts = (*self.rq_counts, rq)
        if dlq != self.dlq_counts[-1]:
            self.dlq_counts = (*self.dlq_counts, dlq)
        self.shards = shards
        self.shard_changes += 1
        self.version += 1

    def _created(self, e: Created) -> bool:
        if self.output is not None:
            return self._ignore("created again")
        if e.partitions <= 0 or e.rq_partitions <= 0 or e.dlq_partitions <= 0:
            return self._ignore("bad partitions")
        self.output = CompositeTopic.create(e.name, e.partitions)
        self.rq_counts, self.dlq_counts = (e.rq_partitions,), (e.dlq_partitions,)
        self.version += 1
        return True

    def _ignore(self, why: str) -> bool:
        self.ignored[why] += 1
        return False

    def validate(self) -> None:
        """The invariants of the folded state (tests call it after every step)."""
        if self.output is None:
            assert self.version == 0
            assert self.pending is None
            assert not self.sealed
            return
        ptr = self.output.produce_pointer
        if self.pending is not None:
            assert self.pending.target == ptr + 1 < len(self.output.storage_topics)
            assert self.pending.acked <= self.pending.ack_set | self.pending.acked
        assert all(i < ptr for i in self.sealed), "a seal past the produce pointer"
        assert self.shards >= 1
        assert self.rq_counts[-1] % self.shards == 0
        assert self.dlq_counts[-1] % self.shards == 0
        if self.shards_pending is not None:
            assert self.shards_pending.change == self.shard_changes + 1
        assert 0 <= self.rq_from < len(self.rq_counts)
        assert 0 <= self.dlq_from < len(self.dlq_counts)


def fold(entries: list[Entry] | tuple[Entry, ...]) -> OutputMeta:
    state = OutputMeta()
    for e in entries:
        state.apply(e)
    return state


# --- operations: check first, then append ------------------------------------------------------


@dataclass(frozen=True)
class AddPlan:
    entry: StorageAdded
    storage: StorageTopic  # the storage topic it will create
    warning: str | None  # K fell to 1: shard consistency with the last storage topic is lost


def plan_add_storage_topic(state: OutputMeta, partitions: int) -> AddPlan:
    """``output add-storage-topic N``: the entry, the new storage topic (its K by the rule) and a
    warning when K falls to 1 although the last storage topic is scaled or sharded."""
    out = state.composite()
    if partitions <= 0:
        raise MetaError(f"a storage topic needs a positive partition count, not {partitions}")
    new = out.add_storage_topic(partitions).storage_topics[-1]
    last = out.storage_topics[-1]
    warning = None
    if partitions % last.base:
        warning = (
            f"K falls to 1: {partitions} is not a multiple of the base {last.base} (P/K of "
            f"{last.name}); keys change shards, so consumers' shard subscriptions need "
            "re-sharding at the switch"
        )
    elif state.shards > 1 and new.base % state.shards:
        warning = f"the base {new.base} is not a multiple of the shard count {state.shards}"
    return AddPlan(StorageAdded(partitions), new, warning)


def plan_switch(state: OutputMeta, at: float) -> SwitchPrepared:
    """``output switch-produce``: prepare the switch to the next storage topic."""
    out = state.composite()
    if state.pending is not None:
        raise MetaError(f"a switch to storage topic {state.pending.target} is already pending")
    target = out.produce_pointer + 1
    if target >= len(out.storage_topics):
        raise MetaError(
            f"no storage topic after {out.producing.name} to switch to: add one first "
            "(output add-storage-topic N)"
        )
    return SwitchPrepared(target, at)


def shards_plan(state: OutputMeta, shards: int) -> ShardsPrepared:
    """``output shards N``: prepare shard-count change ``shard_changes + 1``. The RQ/DLQ keep
    their partition counts when ``N`` divides them, else they get new storage topics of the
    smallest multiple of ``N`` not below the current count. Refused while a change is pending or
    an old storage topic is not fed yet (:func:`feed_due`: finish that first)."""
    if shards <= 0:
        raise MetaError(f"the shard count must be positive, not {shards}")
    state.composite()
    if state.shards_pending is not None:
        raise MetaError(
            f"shard-count change {state.shards_pending.change} (to "
            f"{state.shards_pending.shards}) is already pending"
        )
    if state.unfed():
        raise MetaError(
            "the old RQ/DLQ storage topics are not fed yet: run 'output shards "
            f"{state.shards}' to finish the feed first"
        )

    def count(current: int) -> int:
        return current if current % shards == 0 else -(-current // shards) * shards

    return ShardsPrepared(
        state.shard_changes + 1, shards, count(state.rq_counts[-1]), count(state.dlq_counts[-1])
    )


def feed_due(state: OutputMeta) -> Fed | None:
    """The ``Fed`` entry a feeder appends once it copied every record held in the old RQ/DLQ
    storage topics (those before the newest, from ``rq_from``/``dlq_from``) to the newest; None
    when there is nothing to feed (or a shard change is pending: feed after its commit)."""
    if state.shards_pending is not None or not state.unfed():
        return None
    return Fed(state.shard_changes, len(state.rq_counts) - 1, len(state.dlq_counts) - 1)


def switch_point(state: OutputMeta, index: int) -> tuple[int, ...] | None:
    """The seal offsets of storage topic ``index`` (read each partition below its offset, then
    go on to ``index + 1``), or None while it is the one produced to or not yet sealed."""
    return state.sealed.get(index)
