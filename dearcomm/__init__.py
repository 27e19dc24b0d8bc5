"""dearcomm: data-parallel training with DeAR's decoupled all-reduce.

Each gradient all-reduce becomes a reduce-scatter overlapped with backward and
an all-gather overlapped with the next forward, over fused buckets.

    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=25.0)
"""
try:
    import torch  # noqa: F401  (loads libc10/libtorch before the extension)

    from . import _C
except ImportError as _engine_missing:  # a source tree not built yet: dearcomm.pipeline works without the engine
    _ENGINE_ERROR = _engine_missing
else:
    _ENGINE_ERROR = None
    from ._build_info import build_info
    from ._module import DearModule
    from ._optimizer import DistributedOptimizer
    from ._options import SCHEDULES, WrapOptions  # SCHEDULES: every schedule name, from the registry
    from ._wrap import wrap
    from ._update.elementwise import register_elementwise_optimizer
    from .prediction import ModuleProfile, Network, Prediction, simulate
    from .profiler import TrainingProfile, profile
    from .contention import (fit_comm_cpu_slowdown, fit_comm_slowdown, fit_compute_cpu_slowdown, fit_compute_slowdown,
                             fit_iteration_cv)
    from .autotune import Plan, plan

__version__ = "0.1.0"
__all__ = ["wrap", "register_elementwise_optimizer", "build_info", "DearModule", "DistributedOptimizer", "WrapOptions",
           "SCHEDULES", "simulate",
           "ModuleProfile", "Network", "Prediction", "profile", "TrainingProfile", "fit_compute_slowdown",
           "fit_comm_slowdown", "fit_comm_cpu_slowdown", "fit_compute_cpu_slowdown", "fit_iteration_cv", "plan", "Plan",
           "fit_network", "NetworkFit", "network_preset", "NETWORK_PRESETS"]

_NETWORK_FIT = ("fit_network", "NetworkFit", "network_preset", "NETWORK_PRESETS")


def __getattr__(name: str):
    """dearcomm.fit_network and the presets, imported on first use: imported
    here eagerly, ``python -m dearcomm.network_fit`` would find its module
    already loaded and run a second copy of it."""
    if _ENGINE_ERROR is not None and (name in __all__ or name == "_C"):
        raise ImportError(f"dearcomm: {name} needs the compiled extension, which did not load "
                          f"({_ENGINE_ERROR}); build it with `make build` (dearcomm.pipeline works without it)")
    if name in _NETWORK_FIT:
        from . import network_fit
        return getattr(network_fit, name)
    raise AttributeError(f"module 'dearcomm' has no attribute {name!r}")
