"""The output ledger: one sink's per-partition bookkeeping (docs/design.md#exactly-once-output).

A pure core shared by the file sink (``runtime.files.sink``) and the Spark bridge
(``runtime.spark.bridge``, its retries in ``runtime.spark.batch``): events in (a batch handed over, a micro-batch committed or failed,
a reader starting, a position learned), decisions out (admit or refuse, which batches fail with
a failed one, which records are re-reads, whether a micro-batch may still commit, when to run a
failed job again). No I/O, no clock, no event loop: the shells carry the decisions out. No
``now`` either: every rule here is about order, not age. Units: commit timestamps and watermarks
are microseconds (``protocol.records.Micros``); the one duration, the retry backoff, is seconds,
as the sink's settings give it.

Rules, per partition token:

1. **Dedup tails** (``protocol.dedup``, the one de-duplication rule). The *committed* tail is
   what the sink's committed micro-batches hold; a batch's records are accepted into it when its
   micro-batch commits (:meth:`OutputLedger.committed`). A sink that drops re-reads before a
   micro-batch commits (the Spark bridge's cutter, one micro-batch ahead of the committer) takes
   its records through the *pending* tail (:meth:`OutputLedger.take_fresh`), which accepts them
   at once; after a failure (rule 3) the pending tail starts again from the committed one at the
   next cut (:meth:`OutputLedger.begin_cut`): what was taken but never committed is no longer
   seen, so its re-read is written. Both tails learn an earlier process's work from a committed
   position or from identities found in the output (:meth:`OutputLedger.seed`,
   :meth:`OutputLedger.seed_identity`), unless the partition has a tail already.
2. **Gaps.** A failed batch with records opens its partition's gap at its first commit timestamp
   ``g`` (the lowest over every failed batch of the partition). While the gap is open, a batch
   of that partition is refused when its watermark is past ``g``, unless it starts at or before
   ``g``: that one is the re-read, and it closes the gap. **Empty batches (heartbeats) follow the
   same rule**: one at or before ``g`` is admitted and the gap stays, one past ``g`` is refused.
   Why: committing a batch records its partition's position at its watermark
   (``protocol.commit.next_position``: every record before it committed). A heartbeat past ``g``
   committed after the failure would record the partition as complete past records that were
   never written, and an owner resuming from that position (``Sink.durable_position``) would
   skip them; a heartbeat at or before ``g`` records nothing past them (the records at ``g`` are
   read again: the position names only identities committed at ``g``). A new reader of the
   partition closes the gap (:meth:`OutputLedger.reader_starts`): it resumes from what is
   committed, and another process may have written those records meanwhile. A failed empty batch
   opens no gap (nothing of it is missing).
3. **The failure cascade.** When a micro-batch fails, every batch the sink holds and that has not
   passed its commit point fails with it (those behind it were de-duplicated, and their positions
   computed, assuming it commits); when the failure is confined to some partitions (the file
   sink's typed layout: only their records do not convert), the held batches of those
   partitions. Every failed batch opens its gap (rule 2). Each failure moves the ledger's
   *generation* on: a micro-batch cut in an earlier generation must not commit
   (:meth:`OutputLedger.current`).
4. **Fencing bookkeeping.** A batch is *held* from its admission until the sink resolves it
   (:meth:`OutputLedger.release`); each gets a key, unique for the ledger's life, that the
   committer's fences name (``protocol.commit.CommitFences``). The shell names a batch by a
   reference of its own (``id()`` of the object); :meth:`OutputLedger.key_of` answers its key
   while it is held. A batch past its commit point (:meth:`OutputLedger.committed`) is still
   held until resolved (its rows may wait in a retry queue) but no cascade fails it.
5. **Attempts** (:func:`retry_delay`). A micro-batch whose job failed runs again, up to
   ``max_attempts`` runs in all, the ``n``-th retry after ``backoff_s * 2**(n-1)`` seconds. A
   refused or incomplete commit is not a failed job: the shell fails it at once.

:meth:`OutputLedger.validate` checks the invariants; ``--debug-validate`` (and the tests) call it
after every event.

Threads: the Spark bridge's cutter calls :meth:`OutputLedger.take_fresh` in a worker thread; it
touches the pending tail only, which nothing else touches while a cut is prepared
(:meth:`OutputLedger.begin_cut` and the seeds run on the event loop between cuts).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from protocol import dedup
from protocol.dedup import Identity, Position
from protocol.records import DataChange, Micros

__all__ = ["Admit", "Held", "OutputLedger", "Refuse", "retry_delay"]


class Admit(msgspec.Struct, frozen=True):
    """The batch is held; ``key`` names it to the committer's fences."""

    key: int


class Refuse(msgspec.Struct, frozen=True):
    """The batch continues its partition past the gap at ``gap``: fail it (its reader re-reads
    from before the failed records)."""

    gap: Micros


class Held(msgspec.Struct):
    """A batch the sink holds: the shell's reference, its partition, the commit timestamp of its
    first record (None: empty) and whether it passed its commit point."""

    ref: int
    token: str
    first_ts: Micros | None
    passed: bool = False


class OutputLedger:
    """One sink's output ledger; see the module docstring."""

    def __init__(self, *, ahead: bool = False) -> None:
        """``ahead``: the sink drops re-reads before a micro-batch commits, through the pending
        tail (rule 1: :meth:`begin_cut`, :meth:`take_fresh`)."""
        self.ahead = ahead
        self._committed = dedup.Tails()
        self._pending = dedup.Tails()
        self._tokens: set[str] = set()  # partitions with a committed tail
        self._pending_generation = 0
        self._gaps: dict[str, Micros] = {}
        self._held: dict[int, Held] = {}  # key -> batch, in admission order
        self._keys: dict[int, int] = {}  # the shell's ref -> key, while held
        self._next_key = 0
        self._seeded: set[str] = set()
        self.generation = 0  # failures so far (rule 3)
        self.refused = 0  # batches refused by a gap
        self.failed = 0  # batches failed by rule 3

    def __repr__(self) -> str:
        return (
            f"OutputLedger({len(self._held)} held, {len(self._gaps)} gaps, "
            f"generation {self.generation})"
        )

    # --- rule 2 and 4: admission ----------------------------------------------------------

    def admit(
        self, ref: int, token: str, records: Sequence[DataChange], watermark: int
    ) -> Admit | Refuse:
        """A batch is handed over: refuse it (rule 2) or hold it (rule 4)."""
        gap = self._gaps.get(token)
        if gap is not None:
            if records and records[0].commit_ts <= gap:
                del self._gaps[token]  # the re-read
            elif watermark > gap:
                self.refused += 1
                return Refuse(gap)
        key = self._next_key
        self._next_key += 1
        first = min((r.commit_ts for r in records), default=None)
        self._held[key] = Held(ref, token, first)
        self._keys[ref] = key
        return Admit(key)

    def gap(self, token: str) -> Micros | None:
        """The open gap of ``token``, if any."""
        return self._gaps.get(token)

    def reader_starts(self, token: str) -> None:
        """A new reader of ``token`` starts from a committed position: its gap closes."""
        self._gaps.pop(token, None)

    def key_of(self, ref: int) -> int | None:
        """The key of the batch the shell calls ``ref`` while it is held."""
        return self._keys.get(ref)

    def holds(self, key: int) -> bool:
        return key in self._held

    def release_all(self) -> list[int]:
        """The sink stops: it holds nothing any more; the keys it held."""
        keys = list(self._held)
        self._held.clear()
        self._keys.clear()
        return keys

    def release(self, key: int) -> None:
        """The sink resolved batch ``key`` (committed or failed): it no longer holds it."""
        held = self._held.pop(key, None)
        if held is not None and self._keys.get(held.ref) == key:
            del self._keys[held.ref]

    # --- rule 3: the cascade --------------------------------------------------------------

    def fail(self, keys: Iterable[int], *, only_their_partitions: bool = False) -> list[int]:
        """The micro-batch of held batches ``keys`` failed: the keys of every batch that fails
        with it (``keys`` included), in admission order — every held batch not past its commit
        point, or with ``only_their_partitions`` those of the partitions of ``keys``. Their gaps
        open; the generation moves on. The caller fails them and then releases each."""
        failing = {k for k in keys if k in self._held}
        tokens = {self._held[k].token for k in failing}
        doomed = [
            key
            for key, held in self._held.items()
            if key in failing
            or (not held.passed and (not only_their_partitions or held.token in tokens))
        ]
        for key in doomed:
            held = self._held[key]
            if held.first_ts is not None:
                self._gaps[held.token] = min(
                    self._gaps.get(held.token, held.first_ts), held.first_ts
                )
        self.failed += len(doomed)
        self.generation += 1
        return doomed

    def current(self, generation: int) -> bool:
        """Whether a micro-batch cut in ``generation`` may still commit (no failure since)."""
        return generation == self.generation

    # --- rule 1: tails --------------------------------------------------------------------

    def committed(
        self, keys: Iterable[int], entries: Iterable[tuple[str, Sequence[DataChange]]]
    ) -> None:
        """Batches ``keys`` passed their commit point; ``entries`` (token, records written) are
        accepted into the committed tail."""
        for key in keys:
            held = self._held.get(key)
            if held is not None:
                held.passed = True
        for token, records in entries:
            if records:
                self._committed.accept_all(token, records)
                self._tokens.add(token)

    def unseen(self, token: str, records: Iterable[DataChange]) -> list[DataChange]:
        """``records`` of ``token`` not in the committed tail (nothing is accepted)."""
        tail = self._committed.get(token)
        if tail is None:
            return list(records)
        return [r for r in records if not tail.seen(r.commit_ts, r.identity)]

    def begin_cut(self) -> int:
        """A micro-batch is about to be prepared: its generation. After a failure since the last
        cut the pending tail starts again from the committed one."""
        assert self.ahead, "begin_cut needs OutputLedger(ahead=True)"
        if self._pending_generation != self.generation:
            self._pending = self._committed.copy()
            self._pending_generation = self.generation
        return self.generation

    def take_fresh(self, token: str, records: Iterable[DataChange]) -> list[DataChange]:
        """``records`` of ``token`` not in the pending tail; they are accepted into it."""
        assert self.ahead, "take_fresh needs OutputLedger(ahead=True)"
        return self._pending.fresh(token, records)

    def seed(self, token: str, position: Position | None) -> None:
        """``token``'s committed position, as the sink's own record tells (None: none): both
        tails start there unless they have one already."""
        self._seeded.add(token)
        if position is not None:
            self._committed.resume(token, position)
            self._tokens.add(token)
            if self.ahead:
                self._pending.resume(token, position)

    def seed_identity(self, token: str, identity: Identity) -> None:
        """A record of ``token`` found in the output (no progress record to resume from)."""
        self._committed.accept(token, identity)
        self._tokens.add(token)
        if self.ahead:
            self._pending.accept(token, identity)

    def unseeded(self, tokens: Iterable[str]) -> list[str]:
        """Those of ``tokens`` (in order, once each) whose position was not learned yet."""
        return [t for t in dict.fromkeys(tokens) if t not in self._seeded]

    def partitions(self) -> int:
        """The partitions with a committed tail."""
        return len(self._committed)

    # --- invariants -----------------------------------------------------------------------

    def validate(self) -> None:
        """The core's invariants (``--debug-validate`` and the tests call it after every
        event)."""
        assert all(key < self._next_key for key in self._held), self._next_key
        keys = list(self._held)
        assert keys == sorted(keys), keys  # admission order
        for ref, key in self._keys.items():
            assert key in self._held, (ref, key)
            assert self._held[key].ref == ref, (ref, key)
        assert self._pending_generation <= self.generation
        assert self.refused >= 0
        assert self.failed >= 0
        assert len(self._tokens) == len(self._committed), (len(self._tokens), self._committed)
        if not self.ahead:
            assert len(self._pending) == 0, len(self._pending)
        elif self._pending_generation == self.generation:
            # the pending tail runs ahead of the committed one, never behind it
            for token in list(self._tokens):
                done, ahead = self._committed.get(token), self._pending.get(token)
                assert done is not None, token
                assert ahead is not None, token
                assert ahead.ts >= done.ts, (token, ahead, done)


def retry_delay(attempt: int, max_attempts: int, backoff_s: float) -> float | None:
    """After run ``attempt`` (1: the first) of a micro-batch failed: the seconds to wait before
    the next run, or None (it was the last: the micro-batch fails). Rule 5."""
    if attempt < 1 or max_attempts < 1:
        raise ValueError(f"attempt {attempt} and max_attempts {max_attempts} must be >= 1")
    if attempt >= max_attempts:
        return None
    return backoff_s * (1 << (attempt - 1))
