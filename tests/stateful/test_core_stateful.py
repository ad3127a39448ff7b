"""Hypothesis state machines for the CIM merge and for share negotiation.

* CIM: random sequences of state, epoch and checkpoint messages (stale, duplicate, foreign and
  late ones included) are folded into a CIM; after every step a fresh replay of the whole log
  gives the same CIM (every task's CIM is the same at the same offset), a replay that starts at
  the latest checkpoint gives it too, and no task outside the epoch's members holds anything.
* Share negotiation: tasks join and leave and children appear at random; whenever the members
  balance, loads end within one of each other and only members above their goal give.
"""

from __future__ import annotations

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protocol import share
from protocol.cim import Cim
from protocol.messages import (
    EpochMessage,
    Partition,
    Share,
    StateMessage,
    SyncMessage,
    TaskState,
)

TASKS = ("a", "b", "c", "d")
TOKENS = tuple(f"p{i}" for i in range(8))
T0 = 1_700_000_000_000_000


def snapshot(cim: Cim) -> object:
    return (
        cim.epoch,
        cim.leader,
        cim.members,
        {t: msgspec.to_builtins(v) for t, v in sorted(cim.tasks.items())},
    )


class CimMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[SyncMessage] = []
        self.cim = Cim()
        self.checkpoint_at: int | None = None
        self.clock = 0

    def _append(self, message: SyncMessage) -> None:
        self.log.append(message)
        self.cim.apply(len(self.log) - 1, message)

    @rule(
        sender=st.sampled_from(TASKS),
        owner=st.sampled_from(TASKS),
        tokens=st.lists(st.sampled_from(TOKENS), max_size=3, unique=True),
        removed=st.lists(st.sampled_from(TOKENS), max_size=2, unique=True),
        epoch_delta=st.integers(-2, 1),
        ts_delta=st.integers(-3, 3),
        wm=st.integers(0, 1000),
    )
    def state_message(
        self,
        sender: str,
        owner: str,
        tokens: list[str],
        removed: list[str],
        epoch_delta: int,
        ts_delta: int,
        wm: int,
    ) -> None:
        self.clock += 1
        data = tuple(Partition(t, T0, watermark=T0 + wm) for t in tokens)
        state = TaskState(owner, self.clock + ts_delta, data=data, removed=tuple(removed))
        epoch = max(-1, self.cim.epoch + epoch_delta)
        self._append(StateMessage(task_id=sender, epoch=epoch, connector_state=(state,)))

    @rule(
        leader=st.sampled_from(TASKS),
        members=st.sets(st.sampled_from(TASKS), min_size=1),
        epoch_delta=st.integers(-1, 2),
        offers=st.lists(
            st.tuples(st.sampled_from(TOKENS), st.sampled_from((*TASKS, None))), max_size=3
        ),
    )
    def epoch_message(
        self,
        leader: str,
        members: set[str],
        epoch_delta: int,
        offers: list[tuple[str, str | None]],
    ) -> None:
        self.clock += 1
        shares = tuple(
            Share(Partition(t, T0, watermark=T0), target=target, kind="new", since=self.clock)
            for t, target in dict(offers).items()
        )
        message = EpochMessage(
            task_id=leader,
            epoch=self.cim.epoch + epoch_delta,
            members=tuple(sorted(members | {leader})),
            connector_state=(TaskState(leader, self.clock, share=shares),),
        )
        self._append(message)

    @rule()
    def checkpoint(self) -> None:
        self.clock += 1
        message = self.cim.checkpoint("a", now=self.clock)
        self._append(message)
        self.checkpoint_at = len(self.log) - 1

    @precondition(lambda self: bool(self.log))
    @rule(index=st.integers(0, 10**6))
    def duplicate_delivery(self, index: int) -> None:
        offset = index % len(self.log)
        before = snapshot(self.cim)
        assert self.cim.apply(offset, self.log[offset]) == "duplicate"
        assert snapshot(self.cim) == before

    @invariant()
    def a_full_replay_gives_the_same_cim(self) -> None:
        fresh = Cim()
        for offset, message in enumerate(self.log):
            fresh.apply(offset, message)
        assert snapshot(fresh) == snapshot(self.cim)

    @invariant()
    def a_replay_from_the_checkpoint_gives_the_same_cim(self) -> None:
        if self.checkpoint_at is None:
            return
        resumed = Cim()
        for offset in range(self.checkpoint_at, len(self.log)):
            resumed.apply(offset, self.log[offset])
        assert (resumed.epoch, resumed.leader, resumed.members) == (
            self.cim.epoch,
            self.cim.leader,
            self.cim.members,
        )
        for task, view in self.cim.tasks.items():
            other = resumed.view(task)
            assert (other.partitions, other.share) == (view.partitions, view.share), task

    @invariant()
    def only_members_hold_anything(self) -> None:
        if self.cim.epoch < 0:
            return
        for task, view in self.cim.tasks.items():
            if task not in self.cim.members:
                assert not view.partitions, (task, view.partitions)
                assert not view.share, (task, view.share)


TestCimMerge = CimMachine.TestCase
TestCimMerge.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class ShareMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loads: dict[str, int] = {"t0": 0}
        self.next_id = 1

    @rule(count=st.integers(0, 30))
    def a_task_joins(self, count: int) -> None:
        self.loads[f"t{self.next_id}"] = count
        self.next_id += 1

    @precondition(lambda self: len(self.loads) > 1)
    @rule(data=st.data())
    def a_task_leaves_and_its_partitions_go_to_the_most_underloaded(
        self, data: st.DataObject
    ) -> None:
        gone = data.draw(st.sampled_from(sorted(self.loads)))
        orphans = self.loads.pop(gone)
        for _ in range(orphans):
            target = share.most_underloaded(self.loads)
            assert target is not None
            self.loads[target] += 1

    @rule(data=st.data(), children=st.integers(1, 4))
    def a_partition_splits(self, data: st.DataObject, children: int) -> None:
        finder = data.draw(st.sampled_from(sorted(self.loads)))
        for _ in range(children):
            target = share.place_child(finder, self.loads, cap=0)
            assert target is not None
            self.loads[target] += 1

    @rule()
    def the_members_balance(self) -> None:
        goal = share.goals(self.loads)
        before = dict(self.loads)
        for donor, target, count in share.balance_moves(self.loads, cap=0):
            assert before[donor] > goal[donor]
            assert before[target] < goal[target]
            self.loads[donor] -= count
            self.loads[target] += count
        assert sum(self.loads.values()) == sum(before.values())
        assert max(self.loads.values()) - min(self.loads.values()) <= 1
        assert share.balance_moves(self.loads, cap=0) == []  # balanced: nothing moves again

    @invariant()
    def loads_are_never_negative(self) -> None:
        assert all(n >= 0 for n in self.loads.values())


TestShareNegotiation = ShareMachine.TestCase
TestShareNegotiation.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
