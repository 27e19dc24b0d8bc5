"""wrap(schedule="usbyte") without blocks: the job plans its own, as US-Byte's
planner does from a profile. At the first training forward every rank times
the collectives (network_probe) and profiles its compute (as wrap()'s "auto"
does, _auto.measure_job); rank 0 plans (usbyte.plan_job) and every rank
trains with rank 0's blocks and priorities from that forward on. Where some
rank cannot profile (a parameter without a gradient on its batch), every
rank trains without a plan (buckets of bucket_mb, input side first) and
rank 0 logs why."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
from torch import nn

from ._auto import ProfilingFailed, measure_job
from ._rank0 import rank0s
from ._runtime import _weak_hook
from .usbyte import JobPlan, plan_job

logger = logging.getLogger("dearcomm")


class USBytePlanner:
    def __init__(self, runtime, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.runtime = runtime
        self.optimizer = optimizer
        self.plan: Optional[JobPlan] = None
        self.handle = module.register_forward_pre_hook(_weak_hook(self._before_forward), with_kwargs=True, prepend=True)

    def _before_forward(self, module: nn.Module, args, kwargs) -> None:
        runtime = self.runtime
        if runtime.planning or not (module.training and torch.is_grad_enabled()):
            return
        self.handle.remove()
        try:
            profile, network = measure_job(runtime, module, self.optimizer, args, kwargs)
        except ProfilingFailed as e:  # on every rank alike
            if runtime.rank == 0:
                logger.warning("dearcomm: usbyte could not profile the job (%s); it trains without a plan: "
                               "buckets of bucket_mb, input side first", e)
            return
        chosen = None
        if runtime.rank == 0:
            chosen = plan_job(profile, network, runtime.world_size, comm_dtype=runtime.options.comm_dtype)
            logger.info("%s", chosen.describe())
        self.plan = rank0s(chosen, runtime.group)
        runtime.reconfigure(dataclasses.replace(runtime.options, **self.plan.wrap_options()))
