"""Move FSM: hand-off only after the new owner is ready (stable/pending/planned)."""

from __future__ import annotations

import pytest

from protocol.handoff import Move, MoveError


def test_move_offer_becomes_pending_then_ready_then_stable() -> None:
    move = Move("p1", stable="a").request("b", revision=5)
    assert move == Move("p1", stable="a", pending="b", trigger=5)
    assert move.phase == "pending"
    ready = move.ready()
    assert ready.phase == "ready"
    assert ready.complete("b") == Move("p1", stable="b", trigger=5)


def test_newer_target_while_pending_is_planned_and_taken_on_abort() -> None:
    move = Move("p1", stable="a").request("b", 1).request("c", 2)
    assert move == Move("p1", stable="a", pending="b", planned="c", trigger=2)
    assert move.abort() == Move("p1", stable="a", pending="c", trigger=2)


def test_replayed_decision_is_applied_once() -> None:
    move = Move("p1", stable="a").request("b", 3)
    assert move.request("c", 3) is move


def test_ready_without_pending_is_a_protocol_error() -> None:
    with pytest.raises(MoveError):
        Move("p1", stable="a").ready()


def test_complete_by_wrong_owner_is_a_protocol_error() -> None:
    with pytest.raises(MoveError):
        Move("p1", stable="a").request("b", 1).complete("c")
