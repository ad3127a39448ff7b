"""The simulator's parameters from one flat set of overrides, as the tests write them: a field
of the task core's :class:`~protocol.task.Rules` goes into ``SimParams.rules``, any other into
:class:`~runtime.sim.faultsim.SimParams` itself."""

from __future__ import annotations

from typing import Any

from protocol.task import Rules
from runtime.sim.faultsim import SimParams

_RULES = frozenset(Rules.__struct_fields__)


def sim_params(**fields: Any) -> SimParams:
    rules = {k: v for k, v in fields.items() if k in _RULES}
    params = {k: v for k, v in fields.items() if k not in _RULES}
    return SimParams(**params, rules=Rules(**rules))
