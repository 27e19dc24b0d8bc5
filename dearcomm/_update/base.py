"""The interface of an update strategy: when and how the optimizer runs.

The C++ schedule registry names a strategy for each (schedule, update) pair
(``WrapOptions.update_strategy``); the registry in ``__init__`` maps that name
to one class here. ``DistributedOptimizer`` makes one instance per wrapped
optimizer and delegates to it; the runtime and the module read only the class
attributes, which say where the averaged gradients live.

The life of one step, as the optimizer drives it:

    on_engine_built(engine)   once, when the first backward planned the buckets
    averaged_tensors()        what this step applies: GradScaler unscales them
    clip_grad_norm_(...)      clips them to a global norm (returns the norm)
    apply()                   at step(), after unscaling and clipping, before
                              the engine starts the all-gathers
"""
from __future__ import annotations

import abc
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch.optim import Optimizer


def refuse_nonfinite(norm: torch.Tensor, norm_type: float) -> None:
    """clip_grad_norm_(error_if_nonfinite=True), as torch's: a global norm
    that is inf or NaN raises (every rank holds the same one)."""
    if not torch.isfinite(norm):
        raise RuntimeError(f"dearcomm: the total norm of order {float(norm_type)} of the averaged gradients is "
                           "non-finite, so it cannot be clipped (as torch.nn.utils.clip_grad_norm_ says); to "
                           "scale them by it anyway, leave error_if_nonfinite=False")


def hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


class UpdateStrategy(abc.ABC):
    name: ClassVar[str]
    """The strategy's name in the C++ schedule registry."""

    averaged_in_grad: ClassVar[bool]
    """True: .grad holds the averaged gradient once the reductions finished,
    and is what step() applies. False: .grad keeps this rank's local gradient
    and the average lives in the engine's buffers."""

    checks_grad_versions: ClassVar[bool]
    """True: what step() applies was reduced from .grad as it was at the end
    of backward, so step() refuses a .grad changed since (the change would be
    lost); the runtime notes the versions at the end of backward."""

    def __init__(self, optimizer: Optimizer, runtime) -> None:
        self.optimizer = optimizer  # the user's: its param_groups are the ones LR schedulers edit
        self.runtime = runtime

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def group_of(self) -> Dict[torch.Tensor, int]:
        """Each parameter of the user's optimizer -> the index of its param group."""
        return {p: g for g, group in enumerate(self.param_groups) for p in group["params"]}

    def on_engine_built(self, engine) -> None:
        """Once the first backward planned the buckets."""

    @classmethod
    def grad_versions(cls, params: List[torch.Tensor]) -> Optional[List[Tuple[Optional[torch.Tensor], int]]]:
        """At the end of backward: each parameter's .grad and its version,
        where what step() applies was reduced from .grad as it is now (a later
        change would be lost, so step() refuses it); None where step() applies
        .grad as it will be then."""
        return None

    def adopt_parameter_writes(self) -> None:
        """At step(), before anything is applied: where the optimizer updates
        a copy of the parameters, take in what was written into them since
        the last step (load_state_dict, nn.init, copy_, clamping)."""

    def still_scaled(self, user_unscaled: bool) -> Optional[List[torch.Tensor]]:
        """What GradScaler must still unscale and inf-check at step(); None:
        scaler.unscale_(optimizer) (``user_unscaled``) did it already to what
        this step applies, and its found_inf stands."""
        return self.averaged_tensors()

    @abc.abstractmethod
    def averaged_tensors(self) -> List[torch.Tensor]:
        """The averaged gradients this step applies, once the reductions
        finished: what a GradScaler unscales and inf-checks."""

    @abc.abstractmethod
    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scales averaged_tensors() to at most ``max_norm`` in total, as
        torch.nn.utils.clip_grad_norm_ does on one process; returns the norm
        (error_if_nonfinite: refuse_nonfinite)."""

    @abc.abstractmethod
    def apply(self) -> None:
        """At step(): runs the update, or prepares the one the engine calls later."""

    def mark_written(self) -> None:
        """After apply(): the parameters count as written in place, as after
        a torch optimizer's step, also where the engine writes them behind
        autograd's back (the all-gathers): a backward through a graph kept
        from before the step raises instead of reading the new values."""
        torch.autograd.graph.increment_version(self.runtime.params)

    # Checkpoints. By default the user's optimizer holds the whole state.

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def sharded_state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if state_dict.get("dearcomm_sharded"):
            raise ValueError("dearcomm: this is a sharded optimizer state; the optimizer uses update='replicated'")
        self.optimizer.load_state_dict(state_dict)
