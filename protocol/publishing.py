"""Incremental messages (docs/design.md#incremental-state-messages): a task writes only its own state,
as the difference between what it has and what its earlier messages told the CIM, with group
commit and the coalescing of watermark-only changes. Functions over one
:class:`~protocol.task.TaskCore`'s state, each with its rule as its docstring; the core decides
when a message was fenced or read back (``TaskCore._on_sync``) and calls :func:`resync`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.cim import TaskView, apply_state
from protocol.messages import StateMessage, TaskState

if TYPE_CHECKING:
    from protocol.task import TaskCore

__all__ = ["diff", "mark_sent", "maybe_publish", "publish_due", "resync", "shares_to_send"]


def publish_due(core: TaskCore) -> int | None:
    """When :func:`maybe_publish` gets past its holds, if it then publishes or clears a
    flag (an urgent change with nothing new to say still clears ``_urgent``)."""
    if not core.member or core.generation < 0:
        return None
    probe = core._sync_failing_since >= 0 and not core._unread
    flagged = core._urgent or core._answer or probe
    if not (flagged or core.mine != core._sent_parts or shares_to_send(core)):
        return None
    at = -(10**18)
    if not (flagged or core.draining):
        at = core._last_publish + core.config.publish_interval
    if core._unread:
        at = max(at, core._last_publish + core.config.coalesce_wait)
    return at


def maybe_publish(core: TaskCore, now: int) -> StateMessage | None:
    """A member's state message: at once for an ownership change, an answer to a rebalance, or
    a drain; watermark-only changes coalesced for ``publish_interval``. Group commit: while
    one of its messages is unread, further changes wait up to ``coalesce_wait``. While an
    append failed and nothing of its own is on its way, a message goes out even with nothing
    new in it (a probe): a task with nothing to say (one whose answer was lost) would never
    read one back, and never be allowed to read again."""
    if not core.member or core.generation < 0:
        return None
    probe = core._sync_failing_since >= 0 and not core._unread
    due = core._urgent or core._answer or core.draining or probe  # a drain's: at once
    since = now - core._last_publish
    if not due and since < core.config.publish_interval:
        return None
    if core._unread and since < core.config.coalesce_wait:
        return None  # group commit: goes out with whatever else changed, once read back
    state = diff(core, now, force=core._answer or probe)
    core._urgent = False
    core._answer = False
    if state is None:
        return None
    mark_sent(core, state)
    core._last_publish = now
    core._unread.add(state.state_timestamp)
    core.counters["messages_published"] += 1
    return StateMessage(
        task_id=core.me,
        message_timestamp=now,
        epoch=core.generation,
        sync_epoch=core.cim.sync_epoch,
        connector_state=(state,),
    )


def shares_to_send(core: TaskCore) -> bool:
    """Whether a state message carries the share section. Not while this task's plan's
    epoch is on its way (``leading.settle_plan``): the section would carry the plan's offers
    outside their epoch, and without them it would withdraw them from the epoch that may
    land first; share changes wait until the epoch landed or was fenced."""
    return core._plan_out is None and core.shares != core._sent_share


def diff(core: TaskCore, now: int, *, force: bool, epoch: bool = False) -> TaskState | None:
    """This task's state as the difference against what it told the CIM: the partitions that
    changed, those it no longer holds, and the whole share section when it changed (an epoch
    message carries it always). With ``Rules.release_with_offer`` a partition that left the
    state for the share section, and a finished partition whose children are offered from
    here, wait for the message that carries the section. ``None``: nothing to say (unless
    ``force``)."""
    data = tuple(p for t, p in core.mine.items() if core._sent_parts.get(t) != p)
    removed = tuple(t for t in core._sent_parts if t not in core.mine)
    send = core.shares != core._sent_share if epoch else shares_to_send(core)
    if not send and core.config.rules.release_with_offer:
        # A partition that left this task's state for its share section (a released
        # move, an offer) leaves it in the message that carries the offer: sent alone, the
        # removal leaves it held by nobody in the CIM, and lost if this task dies before
        # the held share section goes out (its next life drops an unreleased move).
        removed = tuple(t for t in removed if core.shares.get(t) == core._sent_share.get(t))
        # Likewise a finished partition names its children, and a child offered from here
        # is held by nobody but the share section: sent alone, the parent's end leaves
        # that child unknown to the CIM, and unread for ever if this task dies before the
        # held section goes out. The end waits for the section; meanwhile
        # the CIM shows the parent owned here, and dealt out after a death, re-read to its
        # end by its next owner, which registers the children again.
        unsent = {t for t, o in core.shares.items() if core._sent_share.get(t) != o}
        data = tuple(
            p for p in data if p.status != "finished" or not unsent.intersection(p.children)
        )
    shares = tuple(core.shares.values()) if send else None
    if not (data or removed or shares is not None or force):
        return None
    core._last_state_ts = max(now, core._last_state_ts + 1)
    return TaskState(
        task_id=core.me,
        state_timestamp=core._last_state_ts,
        data=data,
        removed=removed,
        share=shares,
    )


def mark_sent(core: TaskCore, state: TaskState) -> None:
    """What the CIM is told once ``state`` lands, the base of the next difference: ``state``
    folded in as the CIM folds it (``cim.apply_state``)."""
    sent = TaskView(partitions=core._sent_parts, share=core._sent_share)
    apply_state(sent, state)
    core._sent_parts, core._sent_share = sent.partitions, sent.share


def resync(core: TaskCore) -> None:
    """One of our messages was fenced, an append failed, or the CIM's view of this task
    differs from what its messages said: diff against what the CIM really holds, at once."""
    core.counters["resync"] += 1
    view = core.cim.view(core.me)
    core._sent_parts = dict(view.partitions)
    core._sent_share = dict(view.share)
    core._urgent = True
