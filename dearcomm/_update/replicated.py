"""update="replicated" of schedule="dear" and of "bytescheduler": step() only
finishes the reductions (bytescheduler: not even that); the all-gathers carry
averaged gradients (bytescheduler: the all-reduces leave them), and the engine
calls the update with the parameters whose every bucket is gathered or
reduced (in the next forward, or at sync()). Every rank then runs the user's optimizer, restricted
to those parameters, on their full averaged gradients: layer-wise optimizers
(LAMB) see whole parameters."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from .._weak import weakly
from .._step_hooks import step_without_hooks
from .base import hyperparameters
from .shard_averages import AveragesInShards


class ReplicatedBeforeUse(AveragesInShards):
    name = "replicated_before_use"

    def __init__(self, optimizer, runtime) -> None:
        super().__init__(optimizer, runtime)
        self._group_of: Dict[torch.Tensor, int] = {}      # parameter -> its group's index
        self._averaged: List[torch.Tensor] = []           # per parameter, its averaged-gradient view
        self._step_hyperparameters: List[Dict[str, Any]] = []  # of the last step()

    def on_engine_built(self, engine) -> None:
        self._group_of = self.group_of()
        self._averaged = [engine.averaged_grad(i) for i in range(len(self.runtime.params))]
        engine.set_update_fn(weakly(self.update_params))  # a dropped optimizer updates nothing

    def apply(self) -> None:
        # The update runs later, under the hyper-parameters of this step() (an
        # LR scheduler may step before the next forward gathers).
        self._step_hyperparameters = [hyperparameters(g) for g in self.param_groups]

    def update_params(self, indices: List[int]) -> None:
        """Called by the engine with the (engine-order) indices of parameters
        whose averaged gradients were just gathered."""
        params = self.runtime.params
        unused = self.runtime.unused_everywhere  # find_unused_parameters: left alone, as with DDP
        chosen = [(params[i], self._averaged[i]) for i in indices if params[i] in self._group_of and i not in unused]
        by_group: List[List] = [[] for _ in self.param_groups]
        for param, _ in chosen:
            by_group[self._group_of[param]].append(param)
        saved = [dict(group) for group in self.param_groups]
        # The optimizer reads the averaged gradients in place (views of the
        # gathered buckets); the user's .grad, which the next backward
        # accumulates into, is put back untouched.
        user_grads = [param.grad for param, _ in chosen]
        try:
            for group, hyper, group_params in zip(self.param_groups, self._step_hyperparameters, by_group):
                group.update(hyper, params=group_params)
            for param, averaged in chosen:
                param.grad = averaged
            with torch.no_grad():
                step_without_hooks(self.optimizer)
        finally:
            for (param, _), grad in zip(chosen, user_grads):
                param.grad = grad
            for group, original in zip(self.param_groups, saved):
                group.clear()
                group.update(original)
