from typing import Any, Dict

import torch

from . import _cuda


def build_info() -> Dict[str, Any]:
    """What this build of dearcomm contains.

    cuda: whether the CUDA/NCCL backend (dearcomm._C_cuda) was compiled in and
    loads; nccl_version: the NCCL it runs with, or None; torch: torch's version.
    Recorded by setup.py at build time (None where it recorded nothing, e.g. a
    CMake build): cuda_requested, DEARCOMM_CUDA then ("0", "1" or "auto");
    cuda_skipped, why the CUDA part was not built (None: it was).
    cuda_error: why dearcomm._C_cuda does not import, or None.
    """
    cuda = _cuda.load()
    try:
        from . import _build_config
        requested, skipped = _build_config.CUDA_REQUESTED, _build_config.CUDA_SKIPPED
    except ImportError:
        requested = skipped = None
    return {
        "version": "0.1.0",
        "torch": torch.__version__,
        "cuda": cuda is not None,
        "nccl_version": cuda.nccl_version() if cuda is not None else None,
        "backends": ["c10d (CPU: gloo)"] + (["nccl (CUDA)"] if cuda is not None else []),
        "cuda_requested": requested,
        "cuda_skipped": skipped,
        "cuda_error": None if cuda is not None else _cuda.load_error(),
    }
