from typing import Any, Dict

import torch

from . import _cuda


def build_info() -> Dict[str, Any]:
    """What this build of dearcomm contains.

    cuda: whether the CUDA/NCCL backend (dearcomm._C_cuda) was compiled in and
    loads; nccl_version: the NCCL it runs with, or None; torch: torch's version.
    """
    cuda = _cuda.load()
    return {
        "version": "0.1.0",
        "torch": torch.__version__,
        "cuda": cuda is not None,
        "nccl_version": cuda.nccl_version() if cuda is not None else None,
        "backends": ["c10d (CPU: gloo)"] + (["nccl (CUDA)"] if cuda is not None else []),
    }
