"""The leader's planner (docs/design.md#epochs and #cap-and-fair-spread).

Given the CIM and the members of the new generation, the leader opens a new epoch:

* Survivors keep everything they own: the planner never moves a live task's partition.
* Tasks that are not members are dropped from the state (the epoch message does that).
* Ownerless partitions are collected: what dead tasks owned (with their last published
  watermark), what dead tasks offered (``new``, or in a ``move``, released or not), ``new``
  offers and released moves addressed to a dead task, and the leader's own earlier offers to
  dead tasks. Finished partitions of dead tasks are adopted by the leader as finished (they are
  still referred to by children); a partition finished in any dead task's state is never
  offered, whatever an older offer of it by another dead task still says. When the stream has
  never been started, the roots are ownerless, and so are the snapshot's partitions when the
  leader's shell planned a snapshot (``protocol/snapshot.py``, rules 1 and 3: the plan carries
  the snapshot to its epoch message). A snapshot partition the CIM records done is finished
  wherever some state still shows it: it is never offered.
* A member the epoch *resets* (a task restarted under its id whose new life has never been a
  member of any generation, and which had not answered this generation when the leader asked
  for the plan, or had while survivors are members: ``protocol/leading.py``, ``reset_members``)
  counts as dead for what the CIM credits to it: its new life has read nothing, and its earlier
  life is no member of this generation, so that life's lease is bounded as a dead task's is. Its
  partitions are dealt out to the other members (it gets none of them), and the epoch lists it
  in ``reset`` so every CIM drops its state (``protocol/cim.py``, rule 5d).
* The leader itself may be such a task (a fresh life that leads beside survivors: on Kafka the
  first member to join a rebalance leads it, and a restarted process joins first). It cannot be
  listed in ``reset`` (its own state in the epoch message carries the plan's offers), so it
  *yields* instead (``leader_yields``): its unfinished partitions are ownerless and go to the
  other members (to itself only when every other member is at the cap), and its epoch message
  removes them from its state in the same message as the offers carrying them. Its offers and
  its finished partitions stay its own. A crash-looping leader thus holds nothing unread past
  the epoch it leads, as a crash-looping follower does not.
* Ownerless partitions are offered, in token order, each to the member with the smallest load
  (ties by task id) whose load is below the per-task cap; when every member is at the cap the
  partition is parked (offered to nobody) until a task has room.
* The leader puts these offers in the ``share`` section of its own state in the epoch message,
  so the members pick them up with the ordinary sharing protocol (``protocol/task.py``).

The planner is a pure function; the leader calls it once it has every member's answer for the
generation, or when its bounded wait is over (a member that did not answer never fails the group:
it keeps what the CIM says it owns).
"""

from __future__ import annotations

import uuid
from random import Random

import msgspec

from protocol import snapshot as snapshots
from protocol.cim import Cim
from protocol.messages import Partition, Share, SnapshotPlan


class Plan(msgspec.Struct, frozen=True):
    generation: int
    members: tuple[str, ...]
    sync_epoch: str
    offers: tuple[Share, ...]  # ownerless partitions, each offered to a member (or parked)
    adopt: tuple[Partition, ...]  # finished partitions of dead tasks the leader keeps
    stream_start: int = -1
    reset: tuple[str, ...] = ()  # members whose earlier lives' state the epoch drops
    snapshot: SnapshotPlan | None = None  # the snapshot the epoch records (with stream_start)
    # the leader's own partitions its plan deals out (``leader_yields``: a fresh leader)
    yielded: tuple[str, ...] = ()


def ownerless(
    cim: Cim,
    members: tuple[str, ...],
    leader: str,
    reset: tuple[str, ...] = (),
    hold_handoffs: bool = True,
    leader_yields: bool = False,
) -> tuple[dict[str, Partition], dict[str, Partition]]:
    """(unfinished ownerless partitions, finished ones to adopt), by token. A ``reset``
    member's state counts as a dead task's; with ``leader_yields`` so do the leader's own
    unfinished partitions (not its offers). ``hold_handoffs`` off (a teeth test) deals out a
    hand-off in flight between two members when a dead task shows a stale share of it."""
    live = set(members) - set(reset)
    owned: set[str] = set()
    for task, view in cim.tasks.items():
        if task in live:
            owned.update(
                t
                for t, p in view.partitions.items()
                if p.status == "finished"
                or (p.status != "incoming" and not (leader_yields and task == leader))
            )
    # A hand-off in flight between two members is held: the offerer released it and the target,
    # which answered the move, takes it over from that release. A dead task's stale share of the
    # partition (a move it released long ago) must not deal it out beside them: the target gives
    # up its take-over for the plan and the offerer never picks up an offer of what it hands
    # away, so nobody reads it. Only an answered move is held: a released move to a target
    # that came back under the same id (a fresh life that never answered it) is stale, and
    # another member may have read on. A finished copy still wins.
    handing: set[str] = set()
    for task, view in cim.tasks.items() if hold_handoffs else ():
        if task not in live:
            continue
        for token, share in view.share.items():
            if share.kind != "move" or not share.released or share.target not in live:
                continue
            got = cim.view(share.target).partitions.get(token)
            if got is not None and got.status == "incoming" and got.source == task:
                handing.add(token)
    lost: dict[str, Partition] = {}
    adopt: dict[str, Partition] = {}

    def take(part: Partition) -> None:
        if part.token in owned or cim.snapshot.done(part.token):
            return
        if part.status == "finished":
            adopt.setdefault(part.token, part)
            return
        if part.token in handing:
            return
        known = lost.get(part.token)
        if known is None or part.watermark > known.watermark:
            lost[part.token] = msgspec.structs.replace(part, status="owned", source="")

    for task, view in cim.tasks.items():
        dead = task not in live
        if dead or (leader_yields and task == leader):
            for part in view.partitions.values():
                if part.status == "owned" or (dead and part.status == "finished"):
                    take(part)
        for share in view.share.values():
            if share.kind == "move" and not share.released and not dead:
                continue  # still read by its live offerer
            # (a dead task's move that it had not released is its partition too: its owned
            # entry may never have reached the CIM, written while its generation was fenced.
            # ``take`` keeps the newest watermark of the two.)
            if dead or (share.target is not None and share.target not in live):
                take(share.partition)
            elif task == leader and share.target is None:
                take(share.partition)  # re-plan the leader's parked partitions
    # Orphans (Cim rule 5c): what tasks an earlier epoch dropped held, that no state took since
    # (the leader offers them; a plan deals out those still left)
    for part in cim.orphans.values():
        take(part)
    # Finished anywhere is finished: a dead task's released move (or offer) still carries the
    # partition as owned after its new owner read it to its end.
    for token in adopt:
        lost.pop(token, None)
    return lost, adopt


def plan(
    cim: Cim,
    members: tuple[str, ...],
    leader: str,
    generation: int,
    now: int,
    cap: int,
    rng: Random,
    roots: tuple[Partition, ...] = (),
    stream_start: int = -1,
    reset: tuple[str, ...] = (),
    hold_handoffs: bool = True,
    snapshot: SnapshotPlan | None = None,
    leader_yields: bool = False,
) -> Plan:
    """The plan of ``generation``. With ``roots`` (the stream was never started) the plan
    starts it at ``stream_start``, and with ``snapshot`` records that snapshot too and deals
    out its partitions with the roots. With ``leader_yields`` (a fresh leader beside other
    members) the leader's own unfinished partitions are dealt out to the others."""
    reset = tuple(sorted(set(reset) & set(members) - {leader}))
    leader_yields = leader_yields and any(m != leader and m not in reset for m in members)
    lost, adopt = ownerless(cim, members, leader, reset, hold_handoffs, leader_yields)
    mine = cim.view(leader).partitions
    yielded = tuple(t for t in sorted(lost) if leader_yields and t in mine)
    for root in (*roots, *snapshots.work_items(snapshot)):
        lost.setdefault(root.token, root)
    # a reset member takes nothing in this plan (it has not answered: handing its partitions
    # back to it would cost what keeping them costs); the leader is always there to take them,
    # but a yielding leader only what no other member has room for
    order = sorted(m for m in members if m not in reset and not (leader_yields and m == leader))
    loads = cim.loads([*order, leader])
    if leader_yields:  # the leader's load without what it gives up
        moving = {t for t, s in cim.view(leader).share.items() if s.kind == "move"}
        loads[leader] -= sum(1 for t in yielded if t not in moving and not cim.waits(mine[t]))
    offers: list[Share] = []
    for token in sorted(lost):
        candidates = [m for m in order if cap <= 0 or loads[m] < cap]
        if not candidates and leader_yields and (cap <= 0 or loads[leader] < cap):
            candidates = [leader]
        target = min(candidates, key=lambda m: (loads[m], m)) if candidates else None
        if target is not None:
            loads[target] += 1
        offers.append(Share(partition=lost[token], target=target, kind="new", since=now))
    return Plan(
        generation=generation,
        members=tuple(members),
        sync_epoch=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        offers=tuple(offers),
        adopt=tuple(adopt[t] for t in sorted(adopt)),
        stream_start=stream_start,
        reset=reset,
        snapshot=snapshot,
        yielded=yielded,
    )
