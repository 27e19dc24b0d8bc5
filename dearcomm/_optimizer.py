"""The optimizer returned by :func:`dearcomm.wrap`.

It is a ``torch.optim.Optimizer`` that shares ``param_groups`` with the user's
optimizer, so LR schedulers and code that edits hyper-parameters work unchanged.

- update="sharded": a second instance of the user's optimizer class, with the
  same hyper-parameters and group structure, steps over this rank's pieces of
  the fp32 master shards (views into the engine's buffers); the all-gather then
  carries the updated parameters. Optimizer state is 1/p of the full state.
- update="replicated", schedule="dear": step() only finishes the reductions and
  starts the all-gather of averaged gradients; the user's optimizer runs per
  bucket, restricted to that bucket's parameters, right after the bucket's
  all-gather (in the next forward, or at sync()).
- schedule="wfbp": the user's optimizer runs in step() on all-reduced gradients.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional

import torch
from torch.optim import Optimizer

from . import _C
from ._runtime import DearRuntime


class DistributedOptimizer(Optimizer):
    def __init__(self, optimizer: Optimizer, runtime: DearRuntime) -> None:
        # Share, do not copy: schedulers and users edit these in place.
        Optimizer.__setstate__(self, {
            "defaults": optimizer.defaults,
            "state": optimizer.state,
            "param_groups": optimizer.param_groups,
        })
        self.optimizer = optimizer
        self._runtime = runtime
        self._update = runtime.options.update
        self._schedule = runtime.options.schedule
        self._shard_optimizer: Optional[Optimizer] = None
        self._shard_grads: List[tuple] = []            # (master piece, averaged grad piece)
        self._bucket_params: List[List[List]] = []     # [bucket][group] -> params (replicated)
        self._pending_shard_state: Optional[Dict[str, Any]] = None
        self._step_hyperparameters: List[Dict[str, Any]] = []  # replicated dear: of the last step()
        runtime.on_engine_built.append(self._on_engine_built)

    # ---- set-up, once the engine has a layout -------------------------------

    def _on_engine_built(self, engine: _C.Engine) -> None:
        group_of = {p: g for g, group in enumerate(self.param_groups) for p in group["params"]}
        layout = engine.layout
        if self._update == "sharded":
            self._build_shard_optimizer(engine, group_of)
        elif self._schedule == "dear":
            self._bucket_params = [[[] for _ in self.param_groups] for _ in layout.buckets]
            for i, param in enumerate(self._runtime.params):
                if param in group_of:
                    self._bucket_params[layout.params[i].bucket][group_of[param]].append(param)
            engine.set_update_fn(self._update_bucket)

    def _build_shard_optimizer(self, engine: _C.Engine, group_of: Dict) -> None:
        layout, rank = engine.layout, self._runtime.rank
        groups: List[List[torch.Tensor]] = [[] for _ in self.param_groups]
        for b, spec in enumerate(layout.buckets):
            begin = rank * spec.shard_numel
            master, grad = engine.master_shard(b), engine.grad_shard(b)
            for piece in layout.pieces(b, begin, begin + spec.shard_numel):
                group = group_of.get(self._runtime.params[piece.param])
                if group is None:
                    continue  # trains nowhere: its master copy just stays as it is
                lo = piece.bucket_offset - begin
                master_piece = master[lo:lo + piece.numel]
                groups[group].append(master_piece)
                self._shard_grads.append((master_piece, grad[lo:lo + piece.numel]))
        if not self._shard_grads:
            return  # this rank's shards hold only padding (tiny model, many ranks)
        # Each group carries every hyper-parameter; the constructor's keyword
        # arguments only satisfy required ones (defaults may hold derived keys).
        shard_groups = [dict(self._hyperparameters(g), params=pieces) for g, pieces in zip(self.param_groups, groups)]
        accepted = inspect.signature(type(self.optimizer).__init__).parameters
        kwargs = {k: v for k, v in self.optimizer.defaults.items() if k in accepted}
        try:
            self._shard_optimizer = type(self.optimizer)(shard_groups, **kwargs)
        except TypeError as e:
            raise TypeError(
                f"dearcomm: update='sharded' re-creates {type(self.optimizer).__name__} over parameter shards "
                f"as {type(self.optimizer).__name__}(param_groups, **hyperparameters), which failed: {e}. "
                "Use update='replicated' for this optimizer."
            ) from e
        if self._pending_shard_state is not None:
            self._shard_optimizer.load_state_dict(self._pending_shard_state)
            self._pending_shard_state = None

    @staticmethod
    def _hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    # ---- step -----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError("dearcomm: optimizer.step(closure) is not supported; compute the loss before step()")
        engine = self._runtime.engine
        if engine is None:
            raise RuntimeError("dearcomm: optimizer.step() called before the first backward")
        engine.finish_reductions()
        if self._shard_optimizer is not None:
            for shard_group, group in zip(self._shard_optimizer.param_groups, self.param_groups):
                shard_group.update(self._hyperparameters(group))  # LR schedulers edit the user's groups
            for master_piece, grad_piece in self._shard_grads:
                master_piece.grad = grad_piece
            self._shard_optimizer.step()
        elif self._schedule == "wfbp":
            self.optimizer.step()
        else:  # replicated dear: the update runs per bucket, after its all-gather
            self._step_hyperparameters = [self._hyperparameters(g) for g in self.param_groups]
        engine.start_gathers()
        return None

    def _update_bucket(self, bucket: int) -> None:
        """Replicated update of one bucket: the user's optimizer, restricted to
        its parameters, with the hyper-parameters of the step() it belongs to
        (an LR scheduler may have stepped since)."""
        saved = [dict(group) for group in self.param_groups]
        try:
            for group, hyper, params in zip(self.param_groups, self._step_hyperparameters, self._bucket_params[bucket]):
                group.update(hyper, params=params)
            with torch.no_grad():
                self.optimizer.step()
        finally:
            for group, original in zip(self.param_groups, saved):
                group.clear()
                group.update(original)

    # ---- checkpoints ------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Replicated update: the user's optimizer state (full, torch format).
        Sharded update: this rank's shard of the state; load it on the same rank
        with the same world size and model."""
        self._runtime.sync()
        if self._update != "sharded":
            return self.optimizer.state_dict()
        shard = self._shard_optimizer.state_dict() if self._shard_optimizer is not None else None
        return {
            "dearcomm_sharded": True,
            "rank": self._runtime.rank,
            "world_size": self._runtime.world_size,
            "shard": shard if shard is not None else self._pending_shard_state,
            "param_groups": [self._hyperparameters(g) for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._runtime.sync()
        if self._update != "sharded":
            if state_dict.get("dearcomm_sharded"):
                raise ValueError("dearcomm: this is a sharded optimizer state; the optimizer uses update='replicated'")
            self.optimizer.load_state_dict(state_dict)
            return
        if not state_dict.get("dearcomm_sharded"):
            raise NotImplementedError(
                "dearcomm: update='sharded' loads only its own sharded state_dict() so far; "
                "loading a plain torch optimizer state is not supported yet")
        rank, world = self._runtime.rank, self._runtime.world_size
        if (state_dict["rank"], state_dict["world_size"]) != (rank, world):
            raise ValueError(
                f"dearcomm: [rank {rank}] this optimizer state is the shard of rank {state_dict['rank']} of "
                f"{state_dict['world_size']}; each rank must load its own shard at the same world size ({world})")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        if self._shard_optimizer is not None:
            self._shard_optimizer.load_state_dict(state_dict["shard"])
        else:
            self._pending_shard_state = state_dict["shard"]  # applied once the engine exists
