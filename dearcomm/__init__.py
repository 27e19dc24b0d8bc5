"""dearcomm: data-parallel training with DeAR's decoupled all-reduce.

Each gradient all-reduce becomes a reduce-scatter overlapped with backward and
an all-gather overlapped with the next forward, over fused buckets.

    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=25.0)
"""
import torch  # noqa: F401  (loads libc10/libtorch before the extension)

from . import _C
from ._build_info import build_info
from ._module import DearModule
from ._optimizer import DistributedOptimizer
from ._options import SCHEDULES, WrapOptions  # SCHEDULES: every schedule name, from the registry
from ._wrap import wrap
from .prediction import ModuleProfile, Network, Prediction, simulate

__version__ = "0.1.0"
__all__ = ["wrap", "build_info", "DearModule", "DistributedOptimizer", "WrapOptions", "SCHEDULES", "simulate",
           "ModuleProfile", "Network", "Prediction"]
