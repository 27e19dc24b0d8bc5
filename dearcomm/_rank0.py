"""Decisions every rank takes alike: rank 0's value of a picklable object."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ._torch_collectives import peer_missing


def rank0s(value: Any, group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None,
           what: str = "a decision of rank 0's") -> Any:
    """``value`` as rank 0 of ``group`` has it, on every rank of the group
    (a collective: every rank calls it, the others' values are ignored).
    ``device``: where an NCCL group's broadcast runs (default: the current
    CUDA device, which a script may not have set to the rank's own).
    ``what``: its name in the error where it fails or times out (the
    group's timeout)."""
    group = group or dist.group.WORLD
    shared = [value]
    try:
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group, device=device)
    except RuntimeError as e:
        raise peer_missing(f"{what} did not reach every rank", e) from e
    return shared[0]
