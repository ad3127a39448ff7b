"""The simulator's parameters from one flat set of overrides, as the tests write them: a field
of the task core's :class:`~protocol.task.Rules` goes into ``SimParams.rules``, one of the
membership core's :class:`~protocol.membership.MemberRules` into ``SimParams.member_rules``
(``lease_rules`` is its ``lease``), any other into :class:`~runtime.sim.faultsim.SimParams`
itself."""

from __future__ import annotations

from typing import Any

from protocol.membership import MemberRules
from protocol.task import Rules
from runtime.sim.faultsim import SimParams

_RULES = frozenset(Rules.__struct_fields__)
_MEMBER = {"lease_rules": "lease"} | {f: f for f in MemberRules.__struct_fields__ if f != "lease"}


def sim_params(**fields: Any) -> SimParams:
    rules = {k: v for k, v in fields.items() if k in _RULES}
    member = {_MEMBER[k]: v for k, v in fields.items() if k in _MEMBER}
    params = {k: v for k, v in fields.items() if k not in _RULES and k not in _MEMBER}
    return SimParams(**params, rules=Rules(**rules), member_rules=MemberRules(**member))
