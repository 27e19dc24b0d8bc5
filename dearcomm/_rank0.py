"""Decisions every rank takes alike: rank 0's value of a picklable object."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def rank0s(value: Any, group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> Any:
    """``value`` as rank 0 of ``group`` has it, on every rank of the group
    (a collective: every rank calls it, the others' values are ignored).
    ``device``: where an NCCL group's broadcast runs (default: the current
    CUDA device, which a script may not have set to the rank's own)."""
    group = group or dist.group.WORLD
    shared = [value]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group, device=device)
    return shared[0]
