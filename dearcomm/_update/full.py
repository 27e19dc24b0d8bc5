"""update="replicated" with schedule="wfbp" (DDP's way): the all-reduces leave
the averaged gradient in .grad when backward returns, and step() runs the
user's optimizer on it. .grad may be edited freely between backward and step()."""
from __future__ import annotations

from typing import List, Optional

import torch

from .._step_hooks import step_without_hooks
from .base import UpdateStrategy


class FullAfterReduction(UpdateStrategy):
    name = "full_after_reduction"
    averaged_in_grad = True
    checks_grad_versions = False

    def still_scaled(self, user_unscaled: bool) -> Optional[List[torch.Tensor]]:
        return None if user_unscaled else self.averaged_tensors()  # scaler.unscale_ did .grad, which is applied

    def averaged_tensors(self) -> List[torch.Tensor]:
        return [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool = False) -> torch.Tensor:
        # Every rank holds the same full gradients: torch's own clipping, no communication.
        return torch.nn.utils.clip_grad_norm_(self.runtime.params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite)

    def apply(self) -> None:
        step_without_hooks(self.optimizer)
