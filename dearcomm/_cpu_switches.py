"""The CPU backend's switches must read the same on every rank.

dearcomm's CPU backend reads two environment variables when it is made
(csrc/backends/cpu/process_group_backend.cpp): DEARCOMM_CPU_ORDERED
(all-reduces built from ordered transfers, or gloo's own allreduce) and
DEARCOMM_CPU_POSTER=0 (collectives posted from the training thread, which
rules out ordered all-reduces). Ranks that read them differently issue
different collectives for one all-reduce and wait for each other until the
group's timeout; a variable exported in one node's shell is enough. So
every rank's values are compared first, and a difference is an error that
names it.
"""
from __future__ import annotations

import datetime
import os
from typing import Dict, Optional

import torch.distributed as dist

from ._torch_collectives import all_gather_object_within, group_timeout

SWITCHES = ("DEARCOMM_CPU_ORDERED", "DEARCOMM_CPU_POSTER")


def _meaning(name: str, value: Optional[str]) -> str:
    """What the backend makes of the value (its parsing: "0" or anything else)."""
    if value is None:
        return "unset"
    if name == "DEARCOMM_CPU_ORDERED":
        return "0" if value == "0" else "1"
    return "0" if value == "0" else "not 0"


def check_switches(group: dist.ProcessGroup, timeout: Optional[datetime.timedelta] = None) -> None:
    """Raises on every rank if the ranks of ``group`` set a switch
    differently. A collective: every rank calls it, within ``timeout``
    (default: the group's)."""
    mine: Dict[str, str] = {name: _meaning(name, os.environ.get(name)) for name in SWITCHES}
    everyone = all_gather_object_within(mine, group, timeout or group_timeout(group),
                                        f"the check that every rank sets {' and '.join(SWITCHES)} alike")
    differing = [name for name in SWITCHES if len({theirs[name] for theirs in everyone}) > 1]
    if differing:
        detail = "; ".join(f"{name}: " + ", ".join(f"rank {r} {theirs[name]}" for r, theirs in enumerate(everyone))
                           for name in differing)
        raise ValueError(f"dearcomm: the ranks set {' and '.join(differing)} differently ({detail}); the CPU "
                         "backend would issue different collectives on them and wait until the timeout. Set it "
                         "alike on every rank, or on none")


def cpu_backend(group: dist.ProcessGroup):
    """dearcomm's CPU backend over ``group`` (a capsule for the _C
    collectives), once the ranks agree on its switches. A collective."""
    from . import _C

    check_switches(group)
    return _C.process_group_backend(group)
