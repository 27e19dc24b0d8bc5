"""Update strategies: when and how the optimizer runs, one file each.

The C++ schedule registry (``_C.schedules()``) names the strategy of every
(schedule, update) pair; STRATEGIES maps each such name to its class here. A
new strategy is its own file (an UpdateStrategy, see base.py) plus one entry.
"""
from __future__ import annotations

from typing import Dict, Type

from .base import UpdateStrategy
from .full import FullAfterReduction
from .replicated import ReplicatedBeforeUse
from .sharded import ShardedAtStep

STRATEGIES: Dict[str, Type[UpdateStrategy]] = {
    cls.name: cls for cls in (ShardedAtStep, ReplicatedBeforeUse, FullAfterReduction)
}


def strategy_class(name: str) -> Type[UpdateStrategy]:
    """The class of the strategy the C++ registry calls ``name``."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise NotImplementedError(
            f"dearcomm: the C++ schedule registry names update strategy {name!r}, which has no Python "
            f"object; expected one of {sorted(STRATEGIES)}. Add dearcomm/_update/<file>.py with an "
            "UpdateStrategy subclass of that name and its entry in dearcomm._update.STRATEGIES") from None


__all__ = ["STRATEGIES", "UpdateStrategy", "strategy_class"]
