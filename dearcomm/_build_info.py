from typing import Any, Dict

import torch


def build_info() -> Dict[str, Any]:
    """What this build of dearcomm contains.

    cuda: whether the CUDA/NCCL backend was compiled in (not yet: it is a
    separate piece of work); nccl_version: the NCCL it was built against, or None.
    """
    return {
        "version": "0.1.0",
        "torch": torch.__version__,
        "cuda": False,
        "nccl_version": None,
        "backends": ["c10d (CPU: gloo)"],
    }
