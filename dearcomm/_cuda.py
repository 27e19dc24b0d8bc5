"""The CUDA side, loaded only when CUDA parameters appear: dearcomm._C_cuda
links libcudart and NCCL, which a CPU-only torch does not provide."""
from __future__ import annotations

import datetime
import itertools
import os
from types import ModuleType
from typing import Optional

import torch
import torch.distributed as dist

_REBUILD = ("rebuild with nvcc (CUDA_HOME) and NCCL's headers (pip install nvidia-nccl-cu13) present and a CUDA "
            "build of torch: DEARCOMM_CUDA=1 pip install --no-build-isolation -e .")
_engine_ids = itertools.count()  # every rank builds engines in the same order


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
    ranks = dist.get_process_group_ranks(group)
    prefix = f"dearcomm/engine{next(_engine_ids)}/ranks{ranks[0]}-{ranks[-1]}x{len(ranks)}"
    store = dist.distributed_c10d._get_default_store()
    return module.nccl_backend(store, prefix, dist.get_rank(group), len(ranks),
                               device.index if device.index is not None else torch.cuda.current_device(),
                               timeout.total_seconds())
