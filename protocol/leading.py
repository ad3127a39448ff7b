"""The leader's duties (docs/design.md#epochs): when it may plan, what it asks its planner for,
how its plan becomes its epoch message, the re-send of a failed epoch append, the withdrawal of a
plan another epoch fenced, and its periodic checkpoints. Functions over one
:class:`~protocol.task.TaskCore`'s state, each with its rule as its docstring; the planning
itself is ``protocol/planner.py``'s (in the shell, off the event loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import offers, publishing
from protocol.events import Publish, RequestPlan, TaskCommand
from protocol.messages import EpochMessage, Partition, Share
from protocol.planner import Plan

if TYPE_CHECKING:
    from protocol.task import TaskCore

__all__ = [
    "checkpoint_due",
    "duties",
    "epoch_open",
    "leader_yields",
    "may_plan",
    "on_plan",
    "plan_due",
    "resend_epoch",
    "reset_members",
    "settle_plan",
    "withdraw_plan",
]


# -- when -------------------------------------------------------------------------------------
def epoch_open(core: TaskCore, generation: int) -> bool:
    """An epoch of ``generation`` can still land: the CIM holds none that new, and no
    message of a later generation fences it (CIM rule 2a)."""
    return core.cim.epoch < generation and not core.cim.superseded(generation)


def may_plan(core: TaskCore, now: int) -> bool:
    """The leader plans and opens its generation's epoch only (a) while its lease holds: once
    it has run out, the coordinator may have removed it and completed a newer generation, and
    a process paused that long has read nothing meanwhile; and (b) once its own answer in this
    generation is in its CIM, so that the CIM it plans from has read the log at least up to
    when it joined (a process back from a pause may have a timer due before it has read
    anything). Both become true again only through events (a lease, a message read).
    (``Rules.lead_under_lease``.)"""
    if not core.config.rules.lead_under_lease:
        return True
    return core.lease_valid(now) and core.cim.view(core.me).epoch_seen >= core.generation


def plan_due(core: TaskCore) -> int | None:
    """The leader's bounded wait for rebalance answers ends (``answer_timeout``), while its
    generation's epoch is open and it may plan."""
    gen = core.generation
    if (
        core._leads()
        and core._plan_deadline >= 0
        and core._plan_requested < gen
        and epoch_open(core, gen)
        and may_plan(core, max(core._plan_deadline, core._now))
    ):
        return core._plan_deadline  # (all answers in: requested at the event that brought it)
    return None


def checkpoint_due(core: TaskCore) -> int | None:
    """The leader of the CIM's epoch writes a checkpoint every ``checkpoint_interval``."""
    if core._leads() and core.cim.epoch == core.generation and core.cim.leader == core.me:
        return core._last_checkpoint + core.config.checkpoint_interval
    return None


# -- what -------------------------------------------------------------------------------------
def duties(core: TaskCore, now: int) -> list[TaskCommand]:
    """The leader asks for a plan once every member answered its generation (but for fresh
    lives beside survivors, which the plan resets anyway: :func:`_reset_anyway`), or its
    bounded wait ran out (``answer_timeout``), while that generation's epoch is open and it may
    plan
    (:func:`may_plan`): for the members, the roots when the stream has not started (and the
    snapshot with ``TaskConfig.snapshot``), the members to reset (:func:`reset_members`) and
    whether it yields its own partitions (:func:`leader_yields`). The leader of the CIM's epoch
    writes a checkpoint every ``checkpoint_interval``."""
    if not core.member or core.leader != core.me:
        return []
    out: list[TaskCommand] = []
    gen = core.generation
    if (
        core._plan_deadline >= 0
        and core._plan_requested < gen
        and epoch_open(core, gen)
        and may_plan(core, now)
    ):
        waiting = [m for m in core.members if core.cim.view(m).epoch_seen < gen]
        anyway = _reset_anyway(core, gen)
        unanswered_fresh = [m for m in waiting if m in anyway]
        answered = len(unanswered_fresh) == len(waiting)
        if answered or now >= core._plan_deadline:
            if len(waiting) > len(unanswered_fresh):
                core.counters["plan_without_all_answers"] += 1
            elif unanswered_fresh:
                core.counters["plan_without_fresh_answers"] += 1
            core._plan_requested = gen
            need_roots = core.cim.stream_start < 0
            out.append(
                RequestPlan(
                    gen,
                    core.members,
                    need_roots=need_roots,
                    reset=reset_members(core, gen),
                    snapshot=need_roots and core.config.snapshot,
                    leader_yields=leader_yields(core),
                )
            )
    if (
        core.cim.epoch == gen
        and core.cim.leader == core.me
        and now - core._last_checkpoint >= core.config.checkpoint_interval
    ):
        core._last_checkpoint = now
        out.append(Publish(core.cim.checkpoint(core.me, now)))
    return out


def _reset_anyway(core: TaskCore, gen: int) -> set[str]:
    """The members whose answers the plan need not wait for
    (``Rules.plan_without_fresh_answers``): those :func:`reset_members` resets whether they
    answer or not, fresh lives holding partitions beside survivors. (A fresh member holding
    nothing is waited for: the plan may offer it partitions, which it reads only once it has
    replayed the log.)"""
    rules = core.config.rules
    if not (rules.plan_without_fresh_answers and rules.reset_answered_fresh):
        return set()
    if not any(m not in core.fresh for m in core.members):
        return set()  # the whole group restarted: each keeps what it adopted once it answered
    return set(reset_members(core, gen)) & set(core.fresh)


def reset_members(core: TaskCore, gen: int) -> tuple[str, ...]:
    """The members whose state the epoch of ``gen`` drops (CIM rule 5d): a task restarted
    under its id that has not answered ``gen`` when the leader plans keeps its partitions
    unread until it has (its new life may still be replaying the log, or its join is held
    by the coordinator). Only a *fresh* member qualifies: every group member with its task
    id is a life that has read nothing (it says so when it joins: ``TaskCore._on_joining``;
    never assigned a generation, or never permitted to read in those it was), and the life
    that held the partitions is no member of this generation, its lease bounded as a dead
    task's.

    A fresh member that answered is reset too when members that are no fresh lives (the
    survivors) are there to take its partitions (``Rules.reset_answered_fresh``): its
    earlier life died without handing them over, and a task that dies again soon after
    (a crash loop) would otherwise hold them unread through every recovery. The
    survivors read them from the next epoch; balancing hands some back to it later. When
    every member is fresh (the whole group restarted), each keeps what it adopted."""
    rules = core.config.rules
    candidates = core.fresh if rules.reset_only_fresh else core.members
    survivors = rules.reset_answered_fresh and any(m not in core.fresh for m in core.members)
    out = []
    for member in candidates:
        view = core.cim.view(member)
        if member == core.me or member not in core.members:
            continue
        if view.epoch_seen >= gen and not (survivors and member in core.fresh):
            continue  # answered: keeps what it adopted
        if view.partitions or view.share:
            out.append(member)
    return tuple(sorted(out))


def leader_yields(core: TaskCore) -> bool:
    """Whether this leader's plan deals out its own partitions: the rule of
    :func:`reset_members` applied to the leader itself. A fresh life that leads beside
    survivors has read nothing (a fresh life reads only from its first epoch), and the life
    that held what the CIM credits to it is no member; if it dies again soon after its epoch
    (a crash loop), what it adopted would stay unread through one more recovery each time.
    It cannot be in the epoch's ``reset`` (CIM rule 5d would drop the share section that
    carries the plan's offers), so its own epoch message gives the partitions up instead
    (``planner.plan``'s ``leader_yields``)."""
    rules = core.config.rules
    if not (rules.reset_fresh_leader and rules.reset_answered_fresh) or core.me not in core.fresh:
        return False
    if not any(m not in core.fresh for m in core.members):
        return False  # the whole group restarted: each keeps what it adopted
    return any(p.status == "owned" for p in core.cim.view(core.me).partitions.values())


# -- the plan becomes the epoch -----------------------------------------------------------------
def on_plan(core: TaskCore, plan: Plan, now: int) -> list[TaskCommand]:
    """A plan is discarded unless this task still leads its generation and the epoch is open
    (an epoch that new landed while the plan was made: it fences this one); one made while
    the lease ran out is asked for again once it holds. Otherwise it supersedes a plan of an
    earlier generation whose epoch has not landed (:func:`withdraw_plan`), its offers go into
    the share section (replacing claims made here since the snapshot it came from, or given
    up by a yielding leader; a partition finished here since is kept), offers of this task's
    own made since to tasks that are no members are re-targeted among the plan's members,
    and the epoch message goes out."""
    stale = not epoch_open(core, plan.generation) and core.config.rules.lead_under_lease
    if plan.generation != core.generation or core.leader != core.me or not core.member or stale:
        # (stale: an epoch that new landed while the plan was being made: it fences this one)
        core.counters["plan_discarded"] += 1
        return []
    if not may_plan(core, now):
        # the lease ran out while the plan was being made: ask again once it holds
        core.counters["plan_discarded"] += 1
        core._plan_requested = -1
        return []
    # a plan of an earlier generation whose epoch has not landed yet is superseded by this
    # one (made from a newer CIM): what it offered and this one does not is withdrawn
    before, replaced = withdraw_plan(core, {o.token for o in plan.offers})
    live = set(plan.members)
    for offer in plan.offers:
        held = core.mine.get(offer.token)
        if held is not None and held.status == "finished":
            continue  # finished here after the snapshot the plan came from
        if held is not None:
            # claimed here after that snapshot (not yet in the CIM), or given up by a
            # yielding leader (``leader_yields``): the plan wins
            replaced.setdefault(offer.token, held)
            del core.mine[offer.token]
            yielded = offer.token in plan.yielded
            core.counters["yielded" if yielded else "claims_replanned"] += 1
        before.setdefault(offer.token, core.shares.get(offer.token))
        core.shares[offer.token] = offer
    if core.config.rules.plan_offers_in_epoch_only:
        core._plan_out = (plan, before, replaced)
    planned = {o.token for o in plan.offers}
    for token, offer in list(core.shares.items()):
        dead_target = offer.target is not None and offer.target not in live
        if offer.kind == "new" and dead_target and token not in planned:
            offers.retarget(core, token, plan.members)  # made after the CIM the plan came from
    for part in plan.adopt:
        core.mine.setdefault(part.token, part)
    core.counters["epochs_opened"] += 1
    return [publish_epoch(core, plan, now)]


def settle_plan(core: TaskCore) -> None:
    """A plan's offers reach the CIM only in its epoch message (where rule 5b of the CIM
    raises their watermarks and the epoch fences what came before). Once the CIM holds an
    epoch at least as new as the plan's generation (or a message of a later one: rule 2a),
    that epoch message either landed (the offers are in the CIM: nothing to do) or never
    will (an epoch that new, or that message, fences it): the plan's offers are then
    withdrawn, never published in a later message of another generation, where they would
    deal out partitions from a CIM long gone (a root read to its end and removed, dealt out
    again from its start). (``Rules.plan_offers_in_epoch_only``.)"""
    if core._plan_out is None:
        return
    plan = core._plan_out[0]
    if epoch_open(core, plan.generation):
        return
    landed = (
        core.cim.epoch == plan.generation
        and core.cim.leader == core.me
        and core.cim.sync_epoch == plan.sync_epoch
    )
    if landed:
        core._plan_out = None
    else:
        core.counters["plan_fenced"] += 1
        withdraw_plan(core, set())


def withdraw_plan(
    core: TaskCore, keep: set[str]
) -> tuple[dict[str, Share | None], dict[str, Partition]]:
    """Withdraw the offers of the plan whose epoch has not landed (but those in ``keep``,
    which a newer plan deals out again): each of its tokens gets back the share entry and
    the claim this task had before the plan. An entry the CIM holds as it stands is kept.
    Returns what the kept tokens had before the plan."""
    if core._plan_out is None:
        return {}, {}
    plan, before, replaced = core._plan_out
    core._plan_out = None
    held = core.cim.view(core.me).share
    for offer in plan.offers:
        token = offer.token
        if token in keep or token not in before:
            continue
        current = core.shares.get(token)
        if current is not None and held.get(token) == current:
            continue  # the CIM holds this entry: not the plan's
        previous = before[token]
        if previous is None:
            core.shares.pop(token, None)
            core.moves.pop(token, None)
        else:
            core.shares[token] = previous
        claim = replaced.get(token)
        if claim is not None and token not in core.mine:
            core.mine[token] = claim
        core.counters["plan_offers_withdrawn"] += 1
        core._urgent = True
    kept = {t: before[t] for t in keep if t in before}
    return kept, {t: replaced[t] for t in keep if t in replaced}


def publish_epoch(core: TaskCore, plan: Plan, now: int) -> Publish:
    """The epoch message of ``plan``: its members, reset, snapshot and stream start, and this
    task's state with its whole share section (the plan's offers); remembered until it is
    read back, so a failed append is sent again (:func:`resend_epoch`)."""
    state = publishing.diff(core, now, force=True, epoch=True)
    assert state is not None
    publishing.mark_sent(core, state)
    core._unread.add(state.state_timestamp)
    core._epoch_out = (plan, state.state_timestamp)
    return Publish(
        EpochMessage(
            task_id=core.me,
            message_timestamp=now,
            epoch=plan.generation,
            sync_epoch=plan.sync_epoch,
            members=plan.members,
            connector_state=(state,),
            stream_start=plan.stream_start,
            reset=plan.reset,
            snapshot=plan.snapshot,
            yielded=bool(plan.yielded),
        )
    )


def resend_epoch(core: TaskCore, failed_ts: int, now: int) -> list[TaskCommand]:
    """The append of this task's epoch message failed: send it again, with the same plan
    (its offers are in this task's share section already) and this task's state as the CIM
    does not hold it yet. Not once a newer generation began or the epoch is in the CIM (a
    late copy of the first append is then ignored as a stale epoch).
    (``Rules.resend_failed_epoch``.)"""
    if (
        core._epoch_out is None
        or core._epoch_out[1] != failed_ts
        or not core.config.rules.resend_failed_epoch
    ):
        return []
    plan = core._epoch_out[0]
    core._epoch_out = None
    if (
        plan.generation != core.generation
        or core.leader != core.me
        or not core.member
        or not epoch_open(core, plan.generation)
    ):
        return []
    core.counters["epoch_resent"] += 1
    return [publish_epoch(core, plan, now)]
