"""A hypothesis state machine for the mirror's merge (protocol/mirror.py).

A model database commits transactions; their change records land in the pending queues of a few
partitions, a snapshot at T lands in its own queue. Batches are merged in any order: the next
records of one partition (as a reader delivers them), any records of any queues (out of order
within a partition too), batches delivered again, and garbage collection at a completeness
watermark (everything before it merged; a batch delivered again brings only what is after it,
as the output's batch identities guarantee). After every step every row keeps its invariants
and the mirror shows what applying every merged change in version order gives; whenever every
queue is merged, it equals the database.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from protocol.mirror import MirrorRow, RowId, collect, merge, mirror_changes, validate
from protocol.records import DataChange
from tests.mirror_model import Database, Op, apply, reference, visible

CAPTURES = ("OLD_AND_NEW_VALUES", "NEW_VALUES", "NEW_ROW", "NEW_ROW_AND_OLD_VALUES")
SOURCES = ("p0", "p1", "p2")
OPS = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.integers(0, 2),
        st.integers(0, 2),
        st.integers(0, 7),
        st.integers(1, 9),
    ),
    min_size=1,
    max_size=4,
)


class MirrorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.db = Database("OLD_AND_NEW_VALUES")
        self.ts = 1000
        self.pending: dict[str, list[DataChange]] = {s: [] for s in (*SOURCES, "snapshot")}
        self.batches: list[list[DataChange]] = []
        self.merged: dict[tuple[int, str, str, str], DataChange] = {}
        self.store: dict[RowId, MirrorRow] = {}
        self.collected_at = -1

    @initialize(
        capture=st.sampled_from(CAPTURES),
        before=st.lists(OPS, max_size=4),
        snapshot=st.booleans(),
        chunk=st.integers(1, 3),
    )
    def start(self, capture: str, before: list[list[Op]], snapshot: bool, chunk: int) -> None:
        """Transactions before the start; with a snapshot at T they are not streamed (the stream
        starts after T), without one the stream holds them."""
        self.db = Database(capture)
        for ops in before:
            self.ts += 10
            records = self.db.commit(self.ts, ops)
            if not snapshot:
                self.pending["p0"].extend(records)
        if snapshot:
            self.pending["snapshot"] = self.db.snapshot(self.ts, chunk)

    @rule(ops=OPS, step=st.integers(1, 6), sources=st.lists(st.sampled_from(SOURCES), min_size=4))
    def commit(self, ops: list[Op], step: int, sources: list[str]) -> None:
        self.ts += step
        for i, rec in enumerate(self.db.commit(self.ts, ops)):
            self.pending[sources[i % len(sources)]].append(rec)

    def _merge(self, batch: list[DataChange]) -> None:
        plan = merge(self.store, batch)
        apply(self.store, plan)
        for rec in batch:
            self.merged[
                (rec.commit_ts, rec.server_transaction_id, rec.record_sequence, rec.table)
            ] = rec

    @rule(source=st.sampled_from((*SOURCES, "snapshot")), n=st.integers(1, 4))
    def deliver_the_next_records_of_a_partition(self, source: str, n: int) -> None:
        batch, self.pending[source] = self.pending[source][:n], self.pending[source][n:]
        if batch:
            self.batches.append(batch)
            self._merge(batch)

    @rule(data=st.data())
    def deliver_any_records(self, data: st.DataObject) -> None:
        everything = [(s, i) for s, recs in self.pending.items() for i in range(len(recs))]
        if not everything:
            return
        chosen = data.draw(
            st.lists(st.sampled_from(everything), min_size=1, max_size=5, unique=True)
        )
        batch = [self.pending[s][i] for s, i in chosen]
        for s, i in sorted(chosen, key=lambda c: -c[1]):
            del self.pending[s][i]
        self.batches.append(batch)
        self._merge(batch)

    @precondition(lambda self: bool(self.batches))
    @rule(index=st.integers(0, 10**6))
    def deliver_a_batch_again(self, index: int) -> None:
        batch = self.batches[index % len(self.batches)]
        again = [r for r in batch if r.commit_ts > self.collected_at]
        before = dict(self.store)
        plan = merge(self.store, again)
        assert plan.rows == ()
        assert plan.stale == plan.mods
        assert self.store == before

    @rule(lag=st.integers(0, 12))
    def collect_garbage(self, lag: int) -> None:
        waiting = [r.commit_ts for recs in self.pending.values() for r in recs]
        watermark = (min(waiting) - 1 if waiting else self.ts) - lag
        kept = {}
        for rid, row in self.store.items():
            new = collect(row, watermark)
            if new is not None:
                kept[rid] = new
        self.store = kept
        self.collected_at = max(self.collected_at, watermark)

    @invariant()
    def every_row_keeps_its_invariants(self) -> None:
        for row in self.store.values():
            validate(row)

    @invariant()
    def the_mirror_shows_the_merged_changes_in_version_order(self) -> None:
        assert visible(self.store) == reference(mirror_changes(self.merged.values()))

    @rule()
    def deliver_everything_left(self) -> None:
        rest = [r for recs in self.pending.values() for r in recs]
        self.pending = {s: [] for s in self.pending}
        if rest:
            self.batches.append(rest)
            self._merge(rest)

    @invariant()
    def with_everything_merged_the_mirror_is_the_database(self) -> None:
        if not any(self.pending.values()):
            assert visible(self.store) == self.db.rows


TestMirror = MirrorMachine.TestCase
TestMirror.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
