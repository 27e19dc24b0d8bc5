"""The CUDA side, loaded only when CUDA parameters appear: dearcomm._C_cuda
links libcudart and NCCL, which a CPU-only torch does not provide."""
from __future__ import annotations

import datetime
import os
from types import ModuleType
from typing import Optional

import torch
import torch.distributed as dist

from ._rank0 import rank0s

_REBUILD = ("rebuild with nvcc (CUDA_HOME) and NCCL's headers (pip install nvidia-nccl-cu13) present and a CUDA "
            "build of torch: DEARCOMM_CUDA=1 pip install --no-build-isolation -e .")


_load_error: Optional[str] = None  # why dearcomm._C_cuda did not import


def load() -> Optional[ModuleType]:
    """dearcomm._C_cuda, or None if this build has no CUDA part (or cannot load it)."""
    global _load_error
    try:
        from . import _C_cuda
    except ImportError as e:
        _load_error = str(e)
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.dirname(os.path.abspath(_C_cuda.__file__)) != here:
        # An editable install's import finder falls back to its own checkout for
        # a module this copy lacks (a worktree on PYTHONPATH built without CUDA):
        # that _C_cuda was built against another _C and another engine.
        _load_error = f"dearcomm._C_cuda found at {_C_cuda.__file__}, outside this copy of dearcomm ({here})"
        return None
    return _C_cuda


def load_error() -> Optional[str]:
    """The ImportError of the last load() that failed, or None."""
    return _load_error


def nccl_backend(group: dist.ProcessGroup, device: torch.device, timeout: datetime.timedelta):
    """The engine's NCCL backend for `group` on `device` (a capsule for _C.Engine)."""
    module = load()
    if module is None:
        raise NotImplementedError(f"dearcomm: parameters are on {device} but this build of dearcomm has no CUDA/NCCL "
                                  f"backend (dearcomm.build_info()['cuda'] is False); {_REBUILD}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"dearcomm: parameters are on {device} but CUDA is not available in this process")
    index = device.index if device.index is not None else torch.cuda.current_device()
    prefix = store_prefix(group, torch.device("cuda", index))
    store = dist.distributed_c10d._get_default_store()
    return module.nccl_backend(store, prefix, dist.get_rank(group), dist.get_world_size(group), index,
                               timeout.total_seconds())


def store_prefix(group: dist.ProcessGroup, device: Optional[torch.device] = None) -> str:
    """The default store's keys for the next engine on `group`, the same on
    each of its members (a collective over `group`): numbered by rank 0 of
    the group, as the CPU engine's connections are (_engine_group.py), so
    that processes which built different numbers of engines before (a rank
    in two groups, a rank restarted in place) still meet under one key."""
    name = group.group_name  # torch gives a group the same name on every member
    store = dist.distributed_c10d._get_default_store()
    first = dist.get_rank(group) == 0
    number = rank0s(store.add(f"dearcomm/group{name}/engines", 1) if first else None, group, device)
    return f"dearcomm/group{name}/engine{number}"
