"""Schedules that plan their own options at the first training forward:
wrap(schedule="usbyte") without blocks (US-Byte's blocks and order,
dearcomm.usbyte) and wrap(schedule="deft") without delays (which buckets to
apply late, dearcomm.deft). Every rank times the collectives
(network_probe) and profiles its compute (as wrap()'s "auto" does,
_auto.measure_job); rank 0 plans, and every rank trains with rank 0's plan
from that forward on. Where some rank cannot profile (a parameter without a
gradient on its batch), or no try of the network probe could be fitted,
every rank trains without a plan (the schedule's defaults) and rank 0 logs
why."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from . import deft, usbyte
from ._auto import ProfilingFailed, measure_job
from ._rank0 import rank0s
from ._runtime import _weak_hook
from .network_probe import NetworkNotFitted

logger = logging.getLogger("dearcomm")


def _plan_usbyte(profile, network, runtime):
    return usbyte.plan_job(profile, network, runtime.world_size, comm_dtype=runtime.options.comm_dtype)


def _plan_deft(profile, network, runtime):
    options = runtime.options
    return deft.plan_job(profile, network, runtime.world_size, bucket_mb=options.bucket_mb,
                         comm_dtype=options.comm_dtype, max_delay=options.effective_max_delay)


# schedule -> (plan from (profile, network, runtime), what training without a plan means)
PLANNERS = {
    "usbyte": (_plan_usbyte, "buckets of bucket_mb, input side first"),
    "deft": (_plan_deft, "no bucket delayed"),
}


def plans_itself(options) -> bool:
    """Whether wrap()'s options leave the schedule's plan to it."""
    if options.schedule == "usbyte":
        return options.blocks is None and options.priorities is None
    if options.schedule == "deft":
        return options.delays is None and options.effective_max_delay > 0
    return False


class SelfPlanner:
    def __init__(self, runtime, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.runtime = runtime
        self.optimizer = optimizer
        self.schedule = runtime.options.schedule
        self.make_plan: Callable[[Any, Any, Any], Any] = PLANNERS[self.schedule][0]
        self.plan: Optional[Any] = None
        self.handle = module.register_forward_pre_hook(_weak_hook(self._before_forward), with_kwargs=True, prepend=True)

    def _before_forward(self, module: nn.Module, args, kwargs) -> None:
        runtime = self.runtime
        if runtime.planning or not (module.training and torch.is_grad_enabled()):
            return
        self.handle.remove()
        try:
            profile, network = measure_job(runtime, module, self.optimizer, args, kwargs)
        except (ProfilingFailed, NetworkNotFitted) as e:  # on every rank alike
            if runtime.rank == 0:
                logger.warning("dearcomm: %s could not profile the job (%s); it trains without a plan: %s",
                               self.schedule, e, PLANNERS[self.schedule][1])
            return
        chosen = None
        if runtime.rank == 0:
            chosen = self.make_plan(profile, network, runtime)
            logger.info("%s", chosen.describe())
        self.plan = rank0s(chosen, runtime.group, what=f"{self.schedule}'s plan")
        runtime.reconfigure(dataclasses.replace(runtime.options, **self.plan.wrap_options()))
