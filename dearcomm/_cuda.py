"""The CUDA side, loaded only when CUDA parameters appear: dearcomm._C_cuda
links libcudart and NCCL, which a CPU-only torch does not provide."""
from __future__ import annotations

import collections
import datetime
import os
from types import ModuleType
from typing import Optional

import torch
import torch.distributed as dist

_REBUILD = ("rebuild with nvcc (CUDA_HOME) and NCCL's headers (pip install nvidia-nccl-cu13) present and a CUDA "
            "build of torch: DEARCOMM_CUDA=1 pip install --no-build-isolation -e .")
# Engines built on each process group so far, by the group's name: a group's
# members build its engines in the same order (building one is collective over
# it), while a rank in several groups interleaves them its own way.
_engines_built: "collections.Counter[str]" = collections.Counter()


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
    prefix = store_prefix(group)
    store = dist.distributed_c10d._get_default_store()
    return module.nccl_backend(store, prefix, dist.get_rank(group), dist.get_world_size(group),
                               device.index if device.index is not None else torch.cuda.current_device(),
                               timeout.total_seconds())


def store_prefix(group: dist.ProcessGroup) -> str:
    """The default store's keys for the next engine on `group`, the same on each of its members.

    Counted per group, not per process: with groups {0, 1} and {0, 2}, rank 0
    builds an engine on each while ranks 1 and 2 build one, and a count per
    process would give rank 0's second engine a number rank 2 never reaches
    (its NCCL id then waits on a key nobody sets until the store times out)."""
    name = group.group_name  # torch gives a group the same name on every member
    number = _engines_built[name]
    _engines_built[name] += 1
    return f"dearcomm/group{name}/engine{number}"
