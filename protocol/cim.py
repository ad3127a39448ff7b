"""The consolidated state (CIM), built by replaying the sync topic (docs/design.md#sync-topic-and-cim).

Rules, all in :meth:`Cim.apply` (every task applies the same log in the same order, so every
task's CIM is the same at the same offset):

1. A message at an offset already applied is ignored (duplicate delivery, overlapping replay).
2. A ``state`` or ``epoch`` message whose ``epoch`` is older than the CIM's epoch is ignored:
   epochs fence messages written before a rebalance was settled.
   2a. An ``epoch`` message is also ignored once any message of a later generation has been
   applied (:attr:`Cim.newest_generation`: a task answered a generation that began after the
   epoch's): that generation fences the older one's plan as its epoch would. So a task that
   rejoined and read its own answer back knows every epoch that can still land is of its
   generation or later, which it is a member of (``protocol/task.py``, resuming on the answer).
   2b. A ``state`` message from a task that is not a member of the current epoch changes
   nothing but its answer (the epoch it has seen): it was dropped, and whatever it claims was
   written before it learnt that; it joins the state again with the epoch that includes it.
3. A task may change only its own state: in a ``state`` message, entries for other tasks are
   ignored (and counted).
4. Per task the latest state wins by ``stateTimestamp``; an older one is ignored.
5. Only the leader's ``epoch`` message removes tasks: every task not in its member list is
   dropped. The epoch must be newer than the CIM's. A dropped task's answer to a later
   generation than the epoch's (written before the epoch landed: it rejoined meanwhile) is
   kept: that generation's leader waits for it, and the task, whose messages were all read
   back, has no cause to write it again.
   5b. An offer in the epoch resumes from the newest watermark the CIM holds for its partition
   when the epoch lands (the leader may have planned before a dropped task's last report, or
   before a superseded plan's offer), so watermarks never go back.
   5c. What a dropped task held (its partitions and its offers) that no state holds or offers
   once the epoch is applied becomes an *orphan*, kept with its newest watermark (finished
   wins): the leader planned from a CIM taken before the task's last claims landed. Orphans
   stay until some state holds or offers them (a finished one, until nothing refers to it);
   the leader offers them (``protocol/offers.py``) and a plan deals out those still left
   (``protocol/planner.py``).
   5d. A member the epoch lists in ``reset`` (a task restarted under its id, which had not
   answered when the leader planned or had beside survivors: ``protocol/leading.py``
   ``reset_members``) has its state dropped like a dropped task's (rule 5c applies to it),
   keeping only its answer; it stays a member. Its partitions were dealt out by the same epoch.
6. A ``checkpoint`` seeds an empty CIM (a replay that starts at the checkpoint); a CIM that has
   already applied the checkpoint's ``as_of`` offset ignores it.
7. ``marker`` messages change nothing.
8. The connector's snapshot (``protocol/snapshot.py``) is recorded by the epoch that carries it
   (the first one wins) and seeded by a checkpoint; a snapshot partition is done once an
   applied state shows it finished (:attr:`Cim.snapshot`).
9. A ``release`` message (an operator's ``quarantine release``) changes no task's state and is
   never fenced: it records that the quarantine of its partition begun at ``since`` (or
   earlier) is released (:attr:`Cim.releases`; a checkpoint carries them). The partition's
   owner, whoever it is by then, applies it to its own state (``protocol/task.py``).
10. MUTABLE_KEY_RANGE: a *claim* (``Partition.claim``: a partition a task registered from a
    partition start record, in its state or share section) of a token the CIM already holds
    elsewhere (another task's state or offers, or the orphans) is dropped from the state being
    applied; otherwise it is kept as an ordinary partition (``claim`` cleared). So of several
    registrations of one token, by tasks whose partitions each announced it, the first to land
    is the one (``protocol/mutable.py``, rule 8).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import msgspec

from protocol import lifecycle, mutable
from protocol.messages import (
    CheckpointMessage,
    EpochMessage,
    MarkerMessage,
    Partition,
    ReleaseMessage,
    Share,
    StateMessage,
    SyncMessage,
    TaskState,
)
from protocol.snapshot import SnapshotState


class TaskView(msgspec.Struct):
    """One task's state as the CIM knows it."""

    state_ts: int = -1
    partitions: dict[str, Partition] = msgspec.field(default_factory=dict)
    share: dict[str, Share] = msgspec.field(default_factory=dict)
    epoch_seen: int = -1  # the newest epoch this task has written a message in

    def load(self, waits: Callable[[Partition], bool] | None = None) -> int:
        """Unfinished partitions this task is responsible for, counted at their destination:
        owned ones it is not moving away, and ones it is taking over. With ``waits``, owned
        partitions that cannot be read yet (a merged child whose other parents have not
        finished) do not count: they hold no reader, and counting them against a cap could
        park the very parents they wait for (a deadlock the simulator found)."""
        moving = {t for t, s in self.share.items() if s.kind == "move"}
        return sum(
            1
            for t, p in self.partitions.items()
            if p.status == "incoming"
            or (p.status == "owned" and t not in moving and not (waits and waits(p)))
        )


class Cim:
    """The consolidated state: every task's latest state, the epoch and its members."""

    def __init__(
        self,
        *,
        fence_epochs: bool = True,
        keep_later_answers: bool = True,
        fence_superseded_epochs: bool = True,
        mutable: bool = False,
    ) -> None:
        self.offset = -1
        self.epoch = -1
        # the newest generation any applied message was written in (rule 2a)
        self.newest_generation = -1
        self.sync_epoch = ""
        self.leader = ""
        self.members: tuple[str, ...] = ()
        self.stream_start = -1
        self.tasks: dict[str, TaskView] = {}
        self.orphans: dict[str, Partition] = {}  # rule 5c
        self.reset: tuple[str, ...] = ()  # the current epoch's reset members (rule 5d)
        # the current epoch's restarted members: its reset members, and its leader when it
        # yielded its own earlier life's partitions (protocol/task.py, probation)
        self.restarted: tuple[str, ...] = ()
        self.snapshot = SnapshotState()  # rule 8
        # rule 9: quarantine releases asked for, token -> the newest quarantine (its since)
        self.releases: dict[str, int] = {}
        self.ignored: Counter[str] = Counter()
        self._fence = fence_epochs
        self._keep_answers = keep_later_answers  # off only in the simulator's teeth test
        self._fence_superseded = fence_superseded_epochs  # off only in a teeth test
        # a MUTABLE_KEY_RANGE stream: a finished orphan stays while an unfinished partition
        # resumes at or before its end (protocol/mutable.py, rule 7)
        self._mutable = mutable
        self._loads_memo: tuple[tuple[str, ...], dict[str, int]] | None = None  # loads()

    # -- applying messages -------------------------------------------------------------------
    def apply(self, offset: int, message: SyncMessage) -> str | None:
        """Fold one log message in. Returns ``None`` when applied, else why it (or a part of
        it) was ignored. A state or epoch message that carries another task's state has that
        part dropped (``"foreign-state"``: a task changes only its own state) and the rest
        applied; an epoch message then still opens its epoch."""
        if offset <= self.offset:
            return self._ignore("duplicate")
        applied, self.offset = self.offset, offset
        self._loads_memo = None
        match message:
            case MarkerMessage():
                return None
            case ReleaseMessage():
                # rule 9: no task's state; the owner of the partition applies it
                self.releases[message.token] = max(
                    message.since, self.releases.get(message.token, message.since)
                )
                return None
            case CheckpointMessage():
                if self.epoch >= 0 or self.tasks or not applied < message.as_of:
                    return self._ignore("checkpoint-not-needed")
                self._load_checkpoint(message)
                return None
            case EpochMessage():
                if message.epoch <= self.epoch and self._fence:
                    return self._ignore("stale-epoch")
                if self.superseded(message.epoch):
                    return self._ignore("superseded-epoch")  # rule 2a
                self.epoch = message.epoch
                self.sync_epoch = message.sync_epoch
                self.leader = message.task_id
                self.members = tuple(message.members)
                if message.stream_start >= 0:
                    self.stream_start = message.stream_start
                if message.snapshot is not None:
                    self.snapshot.record(message.snapshot)  # rule 8
                live = set(message.members)
                self.reset = tuple(t for t in message.reset if t in live)
                self.restarted = self.reset + ((message.task_id,) if message.yielded else ())
                best = self._newest_watermarks()
                dropped: list[TaskView] = []
                for task in [t for t in self.tasks if t not in live]:
                    dropped.append(view := self.tasks.pop(task))
                    if view.epoch_seen > message.epoch and self._keep_answers:
                        self.tasks[task] = TaskView(epoch_seen=view.epoch_seen)  # rule 5
                for task in self.reset:  # rule 5d
                    was = self.tasks.get(task)
                    if was is not None:
                        dropped.append(was)
                        self.tasks[task] = TaskView(was.state_ts, epoch_seen=was.epoch_seen)
                result = self._apply_states(message.task_id, message.epoch, message.connector_state)
                self._raise_offered_watermarks(message.task_id, best)
                self._orphan(dropped)
                return result  # the epoch itself holds even when a foreign state was dropped
            case StateMessage():
                if message.epoch < self.epoch and self._fence:
                    return self._ignore("stale-epoch")
                if self._fence and self.epoch >= 0 and message.task_id not in self.members:
                    # Rule 2b: the current epoch dropped (or never had) this task; what it
                    # claims was written before it learnt that. Only its answer counts.
                    view = self.tasks.setdefault(message.task_id, TaskView())
                    view.epoch_seen = max(view.epoch_seen, message.epoch)
                    self.newest_generation = max(self.newest_generation, message.epoch)
                    return self._ignore("not-a-member")
                result = self._apply_states(message.task_id, message.epoch, message.connector_state)
                if self.orphans:
                    self._prune_orphans((message.task_id,))
                return result

    def _orphan(self, dropped: list[TaskView]) -> None:
        """Rule 5c: the dropped tasks' partitions and offers that no state holds or offers."""
        for view in dropped:
            for part in view.partitions.values():
                if part.status != "incoming":
                    self._keep_orphan(part)
            for offer in view.share.values():
                self._keep_orphan(offer.partition)
        if self.orphans:
            self._prune_orphans(self.tasks)

    def _keep_orphan(self, part: Partition) -> None:
        known = self.orphans.get(part.token)
        if known is not None and (
            known.status == "finished"
            or (
                part.status != "finished"
                and (part.watermark, part.quarantine is not None)
                <= (known.watermark, known.quarantine is not None)
            )
        ):
            return  # finished wins, then the newest watermark, then a quarantine (rule 9)
        self.orphans[part.token] = (
            part
            if part.status == "finished"
            else msgspec.structs.replace(part, status="owned", source="")
        )

    def _prune_orphans(self, tasks: Iterable[str]) -> None:
        """Orphans the states of ``tasks`` now hold or offer are orphans no more; nor is a
        finished one nothing refers to any more (a task would remove it at once)."""
        for task in tasks:
            view = self.tasks.get(task)
            if view is None:
                continue
            for token in [t for t in self.orphans if t in view.share]:
                del self.orphans[token]
            for token in [t for t in self.orphans if t in view.partitions]:
                if view.partitions[token].status != "incoming":
                    del self.orphans[token]
        for token, part in list(self.orphans.items()):
            if part.status == "finished" and lifecycle.removable(part, self.find):
                if self._mutable and not mutable.removable(part, self.unfinished()):
                    continue
                del self.orphans[token]

    def _newest_watermarks(self) -> dict[str, int]:
        """The newest watermark the CIM holds for each partition, in any task's partitions or
        offers (dropped tasks and the previous plan's offers included)."""
        best: dict[str, int] = {}
        for view in self.tasks.values():
            for part in view.partitions.values():
                if part.watermark > best.get(part.token, -1):
                    best[part.token] = part.watermark
            for offer in view.share.values():
                wm = offer.partition.watermark
                if wm > best.get(offer.token, -1):
                    best[offer.token] = wm
        return best

    def _raise_offered_watermarks(self, leader: str, best: dict[str, int]) -> None:
        """Rule 5b: the leader planned from the CIM as it was when it planned; a newer
        watermark may have landed after that (a dropped task's last report, an offer of a plan
        that was superseded). An offer in the epoch resumes from the newest watermark the CIM
        held when the epoch landed, so watermarks never go back."""
        view = self.tasks.get(leader)
        if view is None or not best:
            return
        for token, offer in list(view.share.items()):
            newer = best.get(token, 0)
            if offer.kind == "new" and newer > offer.partition.watermark:
                # the newer watermark's identities are not at hand: resume at it without
                # skipping any (a re-read there is dropped by the sinks that keep positions)
                part = msgspec.structs.replace(offer.partition, watermark=newer, tail=())
                view.share[token] = msgspec.structs.replace(offer, partition=part)

    def superseded(self, generation: int) -> bool:
        """Rule 2a: no epoch of ``generation`` can land any more (a later generation's message
        has been applied)."""
        return self._fence_superseded and generation < self.newest_generation

    def _ignore(self, reason: str) -> str:
        self.ignored[reason] += 1
        return reason

    def _apply_states(self, sender: str, epoch: int, states: Iterable[TaskState]) -> str | None:
        result = None
        view = self.tasks.get(sender)
        if view is None:
            view = self.tasks[sender] = TaskView()
        view.epoch_seen = max(view.epoch_seen, epoch)
        self.newest_generation = max(self.newest_generation, epoch)
        for state in states:
            if state.task_id != sender:
                result = self._ignore("foreign-state")
                continue
            if state.state_timestamp < view.state_ts:
                result = self._ignore("older-state")
                continue
            state = self._settle_claims(sender, state)  # rule 10 (claims exist in one mode)
            apply_state(view, state)
            self.snapshot.fold(state.data)  # rule 8
        return result

    def _load_checkpoint(self, message: CheckpointMessage) -> None:
        self.offset = message.as_of
        self.epoch = message.epoch
        self.sync_epoch = message.sync_epoch
        self.leader = message.leader
        self.members = tuple(message.members)
        self.stream_start = message.stream_start
        for state in message.connector_state:
            view = self.tasks[state.task_id] = TaskView()
            apply_state(view, state)
            view.epoch_seen = state.epoch_seen
        # (rule 2a: a later generation's message is in some task's answer, kept by rule 5)
        self.newest_generation = max(
            [self.epoch, *(view.epoch_seen for view in self.tasks.values())]
        )
        self.orphans = {part.token: part for part in message.orphans}
        self.snapshot = SnapshotState()
        if message.snapshot is not None:
            self.snapshot.record(message.snapshot)
        self.releases = dict(message.releases)

    # -- queries -------------------------------------------------------------------------------
    def _settle_claims(self, sender: str, state: TaskState) -> TaskState:
        """Rule 10: a claim (a partition a task registered from a partition start, in its
        state or its share section) of a token the CIM already holds elsewhere is dropped; the
        first claim to land is credited, and kept as an ordinary partition."""
        if not any(p.claim for p in state.data) and not any(
            s.partition.claim for s in state.share or ()
        ):
            return state
        data = []
        for part in state.data:
            if part.claim:
                if self.known_elsewhere(part.token, sender):
                    self.ignored["claim-lost"] += 1
                    continue
                part = msgspec.structs.replace(part, claim=False)
            data.append(part)
        share = None
        if state.share is not None:
            share = []
            for offer in state.share:
                if offer.partition.claim:
                    if self.known_elsewhere(offer.token, sender):
                        self.ignored["claim-lost"] += 1
                        continue
                    part = msgspec.structs.replace(offer.partition, claim=False)
                    offer = msgspec.structs.replace(offer, partition=part)
                share.append(offer)
        return msgspec.structs.replace(
            state, data=tuple(data), share=None if share is None else tuple(share)
        )

    def known_elsewhere(self, token: str, task: str) -> bool:
        """Whether a task other than ``task`` holds or offers ``token``, or it is an orphan."""
        if token in self.orphans:
            return True
        return any(
            token in view.partitions or token in view.share
            for other, view in self.tasks.items()
            if other != task
        )

    def view(self, task: str) -> TaskView:
        return self.tasks.get(task) or TaskView()

    def waits(self, part: Partition) -> bool:
        """An owned partition that is not readable yet: some parent has not finished, or a
        move-in hold's source has not reached it (protocol/mutable.py, rule 5)."""
        return not lifecycle.readable(part, self.find) or not mutable.released(part, self.find)

    def unfinished(self) -> Iterator[Partition]:
        """Every unfinished partition the CIM holds: in states, offers and orphans."""
        for view in self.tasks.values():
            yield from (p for p in view.partitions.values() if p.status != "finished")
            yield from (s.partition for s in view.share.values())
        yield from (p for p in self.orphans.values() if p.status != "finished")

    def holders(self, token: str) -> Iterator[tuple[str, Partition]]:
        for task, view in self.tasks.items():
            part = view.partitions.get(token)
            if part is not None:
                yield task, part

    def find(self, token: str) -> Partition | None:
        """The partition as its owner (or a finished holder) reports it, ignoring takers-over."""
        best = None
        for _, part in self.holders(token):
            if part.status != "incoming":
                return part
            best = part
        return best

    def offers(self) -> Iterator[tuple[str, Share]]:
        for task, view in self.tasks.items():
            for share in view.share.values():
                yield task, share

    def loads(self, members: Iterable[str]) -> dict[str, int]:
        """Each member's load, plus offers addressed to it that it has not picked up yet.

        Only offers made by members count: an offer of a task that is not a member is dealt
        out again by the planner (``planner.ownerless``), so counting it here as well would
        load its target with partitions it never gets.

        A function of the CIM alone, which only :meth:`apply` changes (it forgets this): the
        last answer is kept per member list, since a task asks for it on every step (its next
        deadline's dry run of a negotiation round); a copy is returned."""
        key = tuple(members)
        if self._loads_memo is None or self._loads_memo[0] != key:
            loads = {m: self.view(m).load(self.waits) for m in key}
            for offerer, share in self.offers():
                target = share.target
                if offerer not in loads:
                    continue
                if target in loads and share.token not in self.view(target).partitions:
                    loads[target] += 1
            self._loads_memo = (key, loads)
        return dict(self._loads_memo[1])

    def checkpoint(self, task_id: str, now: int) -> CheckpointMessage:
        """The whole CIM as a checkpoint message (as of the last applied offset)."""
        return CheckpointMessage(
            task_id=task_id,
            message_timestamp=now,
            epoch=self.epoch,
            sync_epoch=self.sync_epoch,
            as_of=self.offset,
            leader=self.leader,
            members=self.members,
            stream_start=self.stream_start,
            connector_state=tuple(
                TaskState(
                    task_id=task,
                    state_timestamp=view.state_ts,
                    data=tuple(view.partitions.values()),
                    share=tuple(view.share.values()),
                    full=True,
                    epoch_seen=view.epoch_seen,
                )
                for task, view in sorted(self.tasks.items())
            ),
            orphans=tuple(self.orphans[t] for t in sorted(self.orphans)),
            snapshot=self.snapshot.checkpoint(),
            releases=tuple(sorted(self.releases.items())),
        )

    def validate(self) -> None:
        """Invariants of a consolidated state."""
        for task, view in self.tasks.items():
            assert task, "empty task id"
            for token, part in view.partitions.items():
                assert token == part.token, f"{task}: partition keyed {token} is {part.token}"
            for token, share in view.share.items():
                assert token == share.token, f"{task}: share keyed {token} is {share.token}"


def apply_state(view: TaskView, state: TaskState) -> None:
    """Fold one incremental (or full) task state into its view."""
    view.state_ts = max(view.state_ts, state.state_timestamp)
    if state.full:
        view.partitions = {p.token: p for p in state.data}
        view.share = {s.token: s for s in state.share or ()}
        return
    for token in state.removed:
        view.partitions.pop(token, None)
    for part in state.data:
        view.partitions[part.token] = part
    if state.share is not None:
        view.share = {s.token: s for s in state.share}


class FinalState(msgspec.Struct, frozen=True):
    """Where one partition ended, as the sync log says."""

    token: str
    status: str  # owned | finished | incoming
    watermark: int
    owner: str


def final_states(cims: Iterable[Cim]) -> list[FinalState]:
    """Every partition's final state over some CIMs (e.g. one per task of a process: they replay
    one log, each maybe to a different offset), by token: a finished entry wins, else the newest
    watermark; a partition only offered (not yet picked up) is reported from its offer."""
    out: dict[str, FinalState] = {}
    for cim in cims:
        for owner, view in cim.tasks.items():
            for token, p in view.partitions.items():
                seen = out.get(token)
                if seen is None or p.status == "finished" or p.watermark > seen.watermark:
                    out[token] = FinalState(token, p.status, p.watermark, owner)
            for token, offer in view.share.items():
                if token not in out:
                    part = offer.partition
                    out[token] = FinalState(token, part.status, part.watermark, owner)
    return sorted(out.values(), key=lambda f: f.token)
