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

torch.amp.GradScaler: the optimizer declares ``_step_supports_amp_scaling``, so
``scaler.step(optimizer)`` hands it the scaler instead of unscaling ``.grad``
itself. That matters because with dear ``.grad`` is not what gets applied: step()
unscales and inf-checks what is (the reduced shards; wfbp: the averaged .grad),
agrees on found_inf across ranks with one MAX all-reduce, and records that
agreed value for ``scaler.update()``, so every rank skips the same steps and
keeps the same scale.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from . import _C
from ._optim_state import Piece, consolidate, load_consolidated
from ._options import FULL_AFTER_REDUCTION, REPLICATED_BEFORE_USE, SHARDED_AT_STEP
from ._runtime import DearRuntime, weakly

# GradScaler warns on every step that it will stop passing itself to optimizers
# that handle scaling; until it does, that argument is the only way to give
# scaler.update() the found_inf that every rank agreed on (see _amp_step).
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


class DistributedOptimizer(Optimizer):
    def __init__(self, optimizer: Optimizer, runtime: DearRuntime) -> None:
        self.optimizer = optimizer
        Optimizer.__setstate__(self, {})  # torch's hook tables; the state itself is the user's (below)
        self._runtime = runtime
        self._strategy = runtime.options.update_strategy  # when the update runs
        # .grad holds the averaged gradient after the reductions (wfbp); else
        # .grad stays local and the average lives in the engine's shards (dear).
        self._averaged_in_grad = self._strategy == FULL_AFTER_REDUCTION
        self._shard_optimizer: Optional[Optimizer] = None
        self._pieces: List[Piece] = []                 # sharded: this rank's parts of parameters
        self._group_of: Dict[torch.Tensor, int] = {}    # replicated: param -> its group's index
        self._averaged: List[torch.Tensor] = []         # replicated: per param, its averaged-gradient view
        self._pending_state: Optional[Dict[str, Any]] = None  # loaded before the engine existed
        self._step_hyperparameters: List[Dict[str, Any]] = []  # replicated dear: of the last step()
        self._consolidations = 0  # completed consolidated state_dict() calls: names their rendezvous
        runtime.on_engine_built.append(self._on_engine_built)

    # The user's optimizer owns these; delegating (not copying) keeps LR
    # schedulers, hyper-parameter edits and the user's load_state_dict(), which
    # replaces the lists, seen by both.
    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, value: setattr(self.optimizer, "param_groups", value))
    state = property(lambda self: self.optimizer.state, lambda self, value: setattr(self.optimizer, "state", value))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, value: setattr(self.optimizer, "defaults", value))

    # ---- set-up, once the engine has a layout -------------------------------

    def _on_engine_built(self, engine: _C.Engine) -> None:
        group_of = {p: g for g, group in enumerate(self.param_groups) for p in group["params"]}
        if self._strategy == SHARDED_AT_STEP:
            self._build_shard_optimizer(engine, group_of)
            if self._pending_state is not None:  # loaded before the pieces existed
                pending, self._pending_state = self._pending_state, None
                self.load_state_dict(pending)
        elif self._strategy == REPLICATED_BEFORE_USE:
            self._group_of = group_of
            self._averaged = [engine.averaged_grad(i) for i in range(len(self._runtime.params))]
            engine.set_update_fn(weakly(self._update_params))  # a dropped optimizer updates nothing

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
                entry = Piece(b, piece.param, piece.param_offset, piece.bucket_offset,
                              master[lo:lo + piece.numel], grad[lo:lo + piece.numel])
                groups[group].append(entry.master)
                self._pieces.append(entry)
        if not self._pieces:
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

    @staticmethod
    def _hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    # ---- step -----------------------------------------------------------------

    _step_supports_amp_scaling = True  # torch.amp.GradScaler: step() unscales what it applies

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Finishes the reductions, then updates (see the module's docstring).
        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step``, not by you."""
        if closure is not None:
            raise NotImplementedError("dearcomm: optimizer.step(closure) is not supported; compute the loss before step()")
        engine = self._runtime.engine
        if engine is None:
            if self._runtime.closed:
                raise RuntimeError("dearcomm: optimizer.step() after model.close(); wrap the model again to train it")
            raise RuntimeError("dearcomm: optimizer.step() called before the first backward")
        scaling = grad_scaler is not None and grad_scaler.is_enabled()
        clipping = self._runtime.options.max_grad_norm is not None
        if scaling or clipping or not engine.finishes_reductions_in_forward:
            engine.finish_reductions()  # else (bytescheduler) the next forward waits for each bucket's
        user_unscaled = scaling and _scaler_stage(grad_scaler, self) == "UNSCALED"
        self._check_grads_untouched(allowed_changes=1 if user_unscaled else 0)
        self._runtime.forget_grad_versions()
        if scaling and self._amp_step(grad_scaler, user_unscaled):
            engine.skip_step()  # inf/NaN on some rank: every rank skips, as GradScaler would
            self._runtime.after_step()
            return None
        if clipping:
            self._clip(self._runtime.options.max_grad_norm, 2.0)
        if self._shard_optimizer is not None:
            for shard_group, group in zip(self._shard_optimizer.param_groups, self.param_groups):
                shard_group.update(self._hyperparameters(group))  # LR schedulers edit the user's groups
            for piece in self._pieces:
                piece.master.grad = piece.grad
            self._shard_optimizer.step()
        elif self._strategy == FULL_AFTER_REDUCTION:
            self.optimizer.step()
        else:  # replicated dear: the update runs per bucket, after its all-gather
            self._step_hyperparameters = [self._hyperparameters(g) for g in self.param_groups]
        engine.start_gathers()
        self._runtime.after_step()
        return None

    def _check_grads_untouched(self, allowed_changes: int = 0) -> None:
        changed = self._runtime.grads_changed_since_backward(allowed_changes)
        if changed:
            raise RuntimeError(
                f"dearcomm: .grad of {changed[0]!r}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''} "
                "was changed after backward (e.g. by torch.nn.utils.clip_grad_norm_, or scaler.unscale_ before "
                "clipping, or zero_grad() before step()). With schedule='dear' .grad holds this rank's local "
                "gradient; what step() applies was reduce-scattered during backward, so the change would be lost. "
                "Clip with optimizer.clip_grad_norm_(max_norm) between backward and step(), or "
                "wrap(..., max_grad_norm=...) (with a GradScaler: wrap(max_grad_norm=), applied after unscaling). "
                "schedule='wfbp' keeps the averaged gradient in .grad, as DDP does.")

    def _amp_step(self, scaler, user_unscaled: bool) -> bool:
        """Unscales what this step applies and checks it for inf/NaN; returns
        whether any rank found some. The agreed answer goes where
        scaler.update() reads it."""
        engine = self._runtime.engine
        device = self._runtime.params[0].device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        state = scaler._per_optimizer_states[id(self)]
        if not self._averaged_in_grad:
            # Shards were never unscaled (scaler.unscale_ only touched the local .grad).
            targets = [engine.grad_shard(b) for b in range(len(engine.layout.buckets))]
        elif not user_unscaled:
            targets = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        else:  # wfbp after scaler.unscale_: .grad is unscaled and checked already
            targets = []
            for value in state["found_inf_per_device"].values():
                found_inf += value.to(device)
        if targets:
            inv_scale = scaler._scale.double().reciprocal().float().to(device)
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for tensor in targets:
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
            for tensors in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self._runtime.group)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        return bool(found_inf.item())

    def _update_params(self, indices: List[int]) -> None:
        """Replicated update of parameters whose averaged gradients were just
        gathered: the user's optimizer, restricted to them, with the
        hyper-parameters of the step() it belongs to (an LR scheduler may have
        stepped since)."""
        params = self._runtime.params
        chosen = [(params[i], self._averaged[i]) for i in indices if params[i] in self._group_of]
        by_group: List[List] = [[] for _ in self.param_groups]
        for param, _ in chosen:
            by_group[self._group_of[param]].append(param)
        saved = [dict(group) for group in self.param_groups]
        # The optimizer reads the averaged gradients in place (views of the
        # gathered bucket); the user's .grad, which the next backward
        # accumulates into, is put back untouched.
        user_grads = [param.grad for param, _ in chosen]
        try:
            for group, hyper, group_params in zip(self.param_groups, self._step_hyperparameters, by_group):
                group.update(hyper, params=group_params)
            for param, averaged in chosen:
                param.grad = averaged
            with torch.no_grad():
                self.optimizer.step()
        finally:
            for (param, _), grad in zip(chosen, user_grads):
                param.grad = grad
            for group, original in zip(self.param_groups, saved):
                group.clear()
                group.update(original)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero-fills the gradient buckets that .grad points into (one fill per
        bucket) and keeps .grad as those views, for ``set_to_none`` True or
        False: the next backward then accumulates straight into the buckets
        (as DDP with gradient_as_bucket_view=True, or Megatron's main_grad).
        A .grad that is no bucket view gets torch's zero_grad(set_to_none)."""
        self._runtime.zero_grad([p for group in self.param_groups for p in group["params"]], set_to_none)

    # ---- gradient clipping ------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the averaged gradients of this step to a global norm, as
        torch.nn.utils.clip_grad_norm_ does on one process, and returns that
        norm. Call it between backward and step(); it finishes the reductions.
        dear: the norm comes from the reduce-scattered shards (padding is zero)
        with one scalar all-reduce, and the shards are scaled before any update
        or all-gather. wfbp: every rank holds full averaged gradients already
        (torch.nn.utils.clip_grad_norm_(model.parameters()) works as well).
        With a GradScaler and dear, use wrap(max_grad_norm=) instead: it clips
        after the scaler unscaled the shards."""
        engine = self._runtime.engine
        if engine is None or engine.state not in (_C.IterationState.BACKWARD, _C.IterationState.REDUCED):
            raise RuntimeError("dearcomm: clip_grad_norm_() belongs between backward and optimizer.step()")
        engine.finish_reductions()
        if not self._averaged_in_grad:
            self._check_grads_untouched()
        return self._clip(max_norm, norm_type)

    def _clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        engine = self._runtime.engine
        if self._averaged_in_grad:
            return torch.nn.utils.clip_grad_norm_(self._runtime.params, max_norm, norm_type)
        norm_type = float(norm_type)
        shards = [engine.grad_shard(b) for b in range(len(engine.layout.buckets))]
        local = torch.stack([torch.linalg.vector_norm(s.float(), norm_type) for s in shards])
        whole = engine.reduction == "all_reduce"  # every rank holds every bucket's average: no sum over ranks
        if norm_type == float("inf"):
            total = local.max()
            if not whole:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self._runtime.group)
        else:
            total = local.pow(norm_type).sum()
            if not whole:
                dist.all_reduce(total, group=self._runtime.group)
            total = total.pow(1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for shard in shards:
            shard.mul_(coefficient.to(shard.dtype))
        return total

    # ---- checkpoints ------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """torch's format, full and the same on every rank: loadable here at any
        world size, or into a plain torch optimizer of the same class. With
        update="sharded" this gathers the state (a collective: call it on every
        rank); sharded_state_dict() is the cheap per-rank form."""
        self._runtime.sync()
        if self._strategy != SHARDED_AT_STEP:
            return self.optimizer.state_dict()
        if self._runtime.engine is None:
            return self._pending_state or {"state": {}, "param_groups": [
                {**self._hyperparameters(g), "params": []} for g in self.param_groups]}
        return consolidate(self)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """This rank's part of the optimizer state, without communication; load
        it on the same rank at the same world size."""
        self._runtime.sync()
        if self._strategy != SHARDED_AT_STEP:
            return self.optimizer.state_dict()
        return {
            "dearcomm_sharded": True,
            "rank": self._runtime.rank,
            "world_size": self._runtime.world_size,
            "shard": self._shard_optimizer.state_dict() if self._shard_optimizer is not None else None,
            "param_groups": [self._hyperparameters(g) for g in self.param_groups],
            "layout": self._layout_signature(),
        }

    def _layout_signature(self):
        """Where each parameter's elements sit in the shards: a shard's state
        only means something under the same bucket layout (bucket_mb, the
        parameters, dearcomm's alignment rules)."""
        engine = self._runtime.engine
        if engine is None:
            return None
        layout = engine.layout
        return ([(s.bucket, s.offset, s.numel) for s in layout.params],
                [b.shard_numel for b in layout.buckets])

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Accepts state_dict() (any world size), a plain torch optimizer's
        state_dict(), or this rank's sharded_state_dict()."""
        self._runtime.sync()
        sharded = bool(state_dict.get("dearcomm_sharded"))
        if self._strategy != SHARDED_AT_STEP:
            if sharded:
                raise ValueError("dearcomm: this is a sharded optimizer state; the optimizer uses update='replicated'")
            self.optimizer.load_state_dict(state_dict)
            return
        if self._runtime.engine is None:
            self._pending_state = state_dict  # pieces exist once the first backward planned the buckets
            return
        if not sharded:
            load_consolidated(self, state_dict)
            return
        rank, world = self._runtime.rank, self._runtime.world_size
        if (state_dict["rank"], state_dict["world_size"]) != (rank, world):
            raise ValueError(
                f"dearcomm: [rank {rank}] this optimizer state is the shard of rank {state_dict['rank']} of "
                f"{state_dict['world_size']}; each rank must load its own shard at the same world size ({world}), "
                "or use state_dict() (consolidated) instead")
        saved_layout, layout = state_dict.get("layout"), self._layout_signature()
        if saved_layout is not None and layout is not None and _as_lists(saved_layout) != _as_lists(layout):
            raise ValueError(
                f"dearcomm: [rank {rank}] this sharded optimizer state was saved under another bucket layout "
                "(a different bucket_mb, model or dearcomm version); its shards would land on the wrong elements. "
                "Save and load state_dict() (consolidated) instead, which does not depend on the layout")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        if self._shard_optimizer is not None and state_dict["shard"] is not None:
            self._shard_optimizer.load_state_dict(state_dict["shard"])


def _as_lists(value):
    """Tuples and lists compare equal after a round trip through torch.save."""
    return [_as_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


def _scaler_stage(scaler, optimizer) -> str:
    """GradScaler's stage for this optimizer: "READY", "UNSCALED" (the user
    called scaler.unscale_(optimizer)) or "STEPPED"."""
    return scaler._per_optimizer_states[id(optimizer)]["stage"].name
