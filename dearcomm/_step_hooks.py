"""Stepping an optimizer without the step hooks torch runs around step()."""
from __future__ import annotations

from torch.optim import Optimizer


def step_without_hooks(optimizer: Optimizer) -> None:
    """``optimizer.step()`` without the step hooks torch runs around it (the
    optimizer's own and the global ones): an update strategy may step it once
    per bucket, or step another instance; DistributedOptimizer.step runs the
    user's optimizer's hooks once per step instead."""
    step = type(optimizer).step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):  # torch's profile_hook_step wrapper
        step.__wrapped__(optimizer)
    else:
        optimizer.step()
