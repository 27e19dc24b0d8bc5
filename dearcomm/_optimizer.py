"""The optimizer returned by :func:`dearcomm.wrap`.

It is a ``torch.optim.Optimizer`` that shares ``param_groups`` with the user's
optimizer, so LR schedulers and code that edits hyper-parameters work unchanged.

When and how the update runs is the update strategy's (dearcomm/_update/, one
file each, chosen by the schedule registry's name for the (schedule, update)
pair); this class drives a step and delegates to it:
- update="sharded" (sharded.py): a second instance of the user's optimizer
  class steps over this rank's pieces of the fp32 master shards; the
  all-gather then carries the updated parameters. Optimizer state is 1/p.
- update="replicated", schedule="dear" (replicated.py): step() only finishes
  the reductions and starts the all-gather of averaged gradients; the user's
  optimizer runs on each parameter once its buckets are gathered (in the next
  forward, or at sync()).
- schedule="wfbp" (full.py): the user's optimizer runs in step() on
  all-reduced gradients.

torch.amp.GradScaler: the optimizer declares ``_step_supports_amp_scaling``, so
``scaler.step(optimizer)`` hands it the scaler instead of unscaling ``.grad``
itself. That matters because with dear ``.grad`` is not what gets applied: step()
unscales and inf-checks what is (the reduced shards; wfbp: the averaged .grad),
agrees on found_inf across ranks with one MAX all-reduce, and records that
agreed value for ``scaler.update()``, so every rank skips the same steps and
keeps the same scale.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from . import _C
from ._delayed import STATE_KEY as DELAYED_KEY
from ._options import check_clip_arguments
from ._runtime import _RELABELLED, DearRuntime
from ._torch_collectives import within
from ._update import UpdateStrategy
from ._update.base import refuse_nonfinite

# GradScaler warns on every step that it will stop passing itself to optimizers
# that handle scaling; until it does, that argument is the only way to give
# scaler.update() the found_inf that every rank agreed on (see _amp_step).
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


NO_SYNC_HINT = (" (a backward inside model.no_sync() does not count: run the last micro-batch's backward outside "
                "it)")


class _RefuseDirectStep:
    """A step pre-hook on the optimizer given to wrap(): stepped in place of
    the one wrap() returned it would apply whatever .grad holds, this rank's
    own gradient under schedule="dear" (the ranks drift apart without a word),
    while the all-gathers still write the parameters. Raises while the wrap is
    open; model.close() removes it."""

    def __init__(self, runtime: DearRuntime) -> None:
        self._runtime = weakref.ref(runtime)

    def __call__(self, optimizer: Optimizer, args, kwargs) -> None:
        runtime = self._runtime()
        if runtime is not None and not runtime.closed:
            raise RuntimeError(
                f"dearcomm: step() of the {type(optimizer).__name__} given to wrap(); step the optimizer wrap() "
                "returned instead (model, optimizer = dearcomm.wrap(model, optimizer)): it reduces the gradients "
                "before updating, where yours would apply this rank's own")


class DistributedOptimizer(Optimizer):
    def __init__(self, optimizer: Optimizer, runtime: DearRuntime) -> None:
        self.optimizer = optimizer
        Optimizer.__setstate__(self, {})  # torch's hook tables; the state itself is the user's (below)
        self._runtime = runtime
        self._update: UpdateStrategy = runtime.update(optimizer, runtime)  # when and how the update runs
        runtime.on_engine_built.append(self._update.on_engine_built)
        runtime.on_reconfigure.append(self._follow_update_strategy)
        runtime.on_step_skipped.append(self._step_skipped)
        self._groups = [(id(g["params"]), len(g["params"])) for g in optimizer.param_groups]
        self._scaler: Optional[weakref.ref] = None  # the GradScaler an earlier step() was given
        # clip_grad_norm_'s (max_norm, norm, unscaled, the backward it followed), applied in step()
        self._pending_clip: Optional[Tuple[float, torch.Tensor, bool, int]] = None

    def refuse_direct_steps(self) -> None:
        """From now on (the end of a wrap() that succeeded) the optimizer
        given to wrap() refuses step() while the model is wrapped."""
        handle = self.optimizer.register_step_pre_hook(_RefuseDirectStep(self._runtime))
        self._runtime.on_close.append(handle.remove)

    # The user's optimizer owns these; delegating (not copying) keeps LR
    # schedulers, hyper-parameter edits and the user's load_state_dict(), which
    # replaces the lists, seen by both.
    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, value: setattr(self.optimizer, "param_groups", value))
    state = property(lambda self: self.optimizer.state, lambda self, value: setattr(self.optimizer, "state", value))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, value: setattr(self.optimizer, "defaults", value))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise RuntimeError(
            "dearcomm: add_param_group() after wrap() is not supported: the buckets and the sharded optimizer are "
            "planned from the param groups the optimizer had at wrap(). Give the optimizer every group before "
            "wrap(); a group to enable later can start with lr=0 (set its 'lr' when it should train)")

    def _check_groups_unchanged(self) -> None:
        """Hyper-parameters may change between steps (LR schedulers, edits by
        hand, load_state_dict); the parameters of each group may not."""
        groups = [(id(g["params"]), len(g["params"])) for g in self.param_groups]
        if groups != self._groups:
            raise RuntimeError(
                f"dearcomm: the optimizer's param_groups hold other parameters than at wrap() ({len(self._groups)} "
                f"groups of {[n for _, n in self._groups]} parameters, now {len(groups)} of "
                f"{[n for _, n in groups]}); dearcomm plans its updates from the groups it was given. Change "
                "hyper-parameters only ('lr', 'weight_decay', ...), and give the optimizer its final groups "
                "before wrap()")

    def _follow_update_strategy(self):
        """wrap()'s "auto" changes the options: the state moves to the new
        update strategy (or the new layout of the same one) in torch's full
        format, taken while the old engine exists (a collective for
        "sharded"; every rank re-plans together)."""
        old, runtime = self._update, self._runtime
        state = old.state_dict()

        def move_state() -> None:
            runtime.on_engine_built.remove(old.on_engine_built)
            self._update = runtime.update(self.optimizer, runtime)
            runtime.on_engine_built.append(self._update.on_engine_built)
            self.optimizer.state.clear()  # loading puts the state where the new strategy keeps it
            if state["state"]:
                self._update.load_state_dict(state)
        return move_state

    # ---- step -----------------------------------------------------------------

    _step_supports_amp_scaling = True  # torch.amp.GradScaler: step() unscales what it applies

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Finishes the reductions, then updates (see the module's docstring).
        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step``, not by you."""
        try:
            return self._step(closure, grad_scaler)
        except _RELABELLED as e:
            raise self._runtime.naming_the_model(e) from None

    def _step(self, closure, grad_scaler):
        if closure is not None:
            raise NotImplementedError("dearcomm: optimizer.step(closure) is not supported; compute the loss before step()")
        engine = self._runtime.engine
        if engine is None:
            if self._runtime.closed:
                raise RuntimeError("dearcomm: optimizer.step() after model.close(); wrap the model again to train it")
            raise RuntimeError("dearcomm: optimizer.step() called before the first backward" + NO_SYNC_HINT)
        self._check_groups_unchanged()
        if self._pending_clip is not None and self._pending_clip[3] != self._runtime.backwards:
            raise RuntimeError(
                "dearcomm: clip_grad_norm_() ran before the last backward of this step, so its norm leaves that "
                "backward's gradients out; call it once, after the last backward, right before optimizer.step()")
        for hook in list(self.optimizer._optimizer_step_pre_hooks.values()):
            if not isinstance(hook, _RefuseDirectStep):
                hook(self.optimizer, (), {})  # the user's optimizer's hooks, once a step (its own steps run without)
        scaling = grad_scaler is not None and grad_scaler.is_enabled()
        if scaling and self._runtime.delayed.delays:
            raise NotImplementedError(
                "dearcomm: schedule='deft' with delayed buckets does not take a GradScaler: a delayed gradient was "
                "scaled by an earlier step's scale, which the scaler may have changed since. Use bfloat16 autocast "
                "(no scaler), or wrap(..., max_delay=0)")
        if scaling:
            self._scaler = weakref.ref(grad_scaler)
        clipping = self._runtime.options.max_grad_norm is not None or self._pending_clip is not None
        engine.begin_step(averages_needed=scaling or clipping)  # waits for the reductions unless the schedule leaves them to the next forward
        user_unscaled = scaling and _scaler_stage(grad_scaler, self) == "UNSCALED"
        self._check_grads_untouched(allowed_changes=1 if user_unscaled else 0)
        self._runtime.forget_grad_versions()
        self._update.adopt_parameter_writes()
        pending_clip, self._pending_clip = self._pending_clip, None
        if scaling and self._amp_step(grad_scaler, user_unscaled):
            engine.skip_step()  # inf/NaN on some rank: every rank skips, as GradScaler would
            self._runtime.after_step()
            self._user_post_hooks()
            return None
        if pending_clip is not None:
            max_norm, norm, unscaled, _ = pending_clip
            if scaling and not unscaled:
                norm.mul_(_inverse_scale(grad_scaler, norm.device))  # the tensor returned
            self._update.clip_to(max_norm, norm)
        if self._runtime.options.max_grad_norm is not None:
            self._update.clip_grad_norm_(self._runtime.options.max_grad_norm, 2.0)
        self._update.apply()
        self._update.mark_written()
        self.optimizer._opt_called = True  # what an LR scheduler over your optimizer checks (it may not step itself)
        engine.end_step()
        self._runtime.after_step()
        self._user_post_hooks()
        return None

    def _step_skipped(self) -> None:
        """zero_grad() skipped the step: its pending clip goes, and where the
        user unscaled with the GradScaler of earlier steps, every rank takes
        the same found_inf for scaler.update() (scaler.unscale_ checked this
        rank's .grad only; step() would have agreed on it). Before the first
        scaler.step() the scaler is unknown here (the guide says so). Writes
        into the parameters since the last step are kept, as step() keeps
        them: the skipped step's gathers carry the master shards."""
        self._pending_clip = None
        self._update.adopt_parameter_writes()
        scaler = self._scaler() if self._scaler is not None else None
        if scaler is None or not scaler.is_enabled() or id(self) not in scaler._per_optimizer_states:
            return
        state = scaler._per_optimizer_states[id(self)]
        if _scaler_stage(scaler, self) != "UNSCALED":
            return
        found_inf = sum(v.to(self._runtime.params[0].device) for v in state["found_inf_per_device"].values())
        self._agree_on_found_inf(state, torch.as_tensor(found_inf, dtype=torch.float32,
                                                        device=self._runtime.params[0].device))

    def _agree_on_found_inf(self, state: Dict[str, Any], found_inf: torch.Tensor) -> None:
        """Every rank's inf/NaN verdict, in place, where scaler.update() reads it."""
        within(self._runtime.timeout, "the GradScaler's all-reduce of inf/NaN found", dist.all_reduce, found_inf,
               op=dist.ReduceOp.MAX, group=self._runtime.group)
        state["found_inf_per_device"] = {found_inf.device: found_inf}

    def _user_post_hooks(self) -> None:
        for hook in list(self.optimizer._optimizer_step_post_hooks.values()):
            hook(self.optimizer, (), {})

    def _check_grads_untouched(self, allowed_changes: int = 0) -> None:
        changed = self._runtime.grads_changed_since_backward(allowed_changes)
        if changed:
            raise RuntimeError(
                f"dearcomm: .grad of {changed[0]!r}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''} "
                "was changed after backward (e.g. by torch.nn.utils.clip_grad_norm_ (after scaler.unscale_ too), "
                "or some .grad zeroed before step(); zero_grad() of every parameter skips the step). "
                f"With schedule={self._runtime.options.schedule!r} .grad "
                "holds this rank's local gradient; what step() applies was reduced during backward, so the change "
                "would be lost. "
                "Clip with optimizer.clip_grad_norm_(max_norm) between backward and step(), or "
                "wrap(..., max_grad_norm=...) (with a GradScaler: scaler.unscale_(optimizer) then "
                "optimizer.clip_grad_norm_(max_norm), or wrap(max_grad_norm=), applied after unscaling; under "
                "Lightning Trainer(gradient_clip_val=), under Accelerate accelerator.clip_grad_norm_). "
                "schedule='wfbp' keeps the averaged gradient in .grad, as DDP does.")

    def _amp_step(self, scaler, user_unscaled: bool) -> bool:
        """Unscales what this step applies and checks it for inf/NaN; returns
        whether any rank found some. The agreed answer goes where
        scaler.update() reads it."""
        device = self._runtime.params[0].device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        state = scaler._per_optimizer_states[id(self)]
        targets = self._update.still_scaled(user_unscaled)
        if targets is None:  # scaler.unscale_ unscaled and checked what this step applies
            targets = []
            for value in state["found_inf_per_device"].values():
                found_inf += value.to(device)
        if targets:
            inv_scale = _inverse_scale(scaler, device)
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for tensor in targets:
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
            for tensors in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
        self._agree_on_found_inf(state, found_inf)
        return bool(found_inf.item())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: ``set_to_none=True`` sets .grad to None, and the next
        backward copies each new gradient into its bucket and makes .grad its
        view again (as DDP with gradient_as_bucket_view=True).
        ``set_to_none=False`` zero-fills the buckets that .grad points into
        (one fill per bucket) and keeps .grad as those views: the next backward
        accumulates straight into the buckets (as Megatron's main_grad).
        A .grad that is no bucket view gets torch's zero_grad(set_to_none)."""
        self._runtime.zero_grad([p for group in self.param_groups for p in group["params"]], set_to_none)

    # ---- gradient clipping ------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clips the averaged gradients of this step to a global norm, as
        torch.nn.utils.clip_grad_norm_ does on one process, and returns that
        norm. Call it between backward and step(); it finishes the reductions.
        dear: the norm comes from the reduce-scattered shards (padding is zero)
        with one scalar all-reduce, and the shards are scaled before any update
        or all-gather. wfbp: every rank holds full averaged gradients already
        (torch.nn.utils.clip_grad_norm_(model.parameters()) works as well).
        With a GradScaler (scaler.unscale_(optimizer) first or not), dear's
        shards are still scaled here (unscale_ reaches .grad only): the norm
        is divided by the scale, and the clipping applied in step(), after
        the scaler unscaled the shards. From the second step on the norm
        returned is the unscaled one at once; in the first, dearcomm meets
        the scaler only in step(), which corrects the returned tensor in
        place (read it after step()). wrap(max_grad_norm=) clips in step()
        as well. ``error_if_nonfinite`` as torch's: a norm that is inf or NaN
        raises instead of clipping; ``foreach`` is taken for torch's signature
        and changes nothing here."""
        check_clip_arguments(max_norm, norm_type)
        engine = self._runtime.engine
        if engine is None or engine.state not in (_C.IterationState.BACKWARD, _C.IterationState.REDUCED):
            raise RuntimeError("dearcomm: clip_grad_norm_() belongs between backward and optimizer.step()")
        engine.finish_reductions()
        self._check_grads_untouched()  # nothing to check where step() applies .grad as it is then
        if self._update.averaged_in_grad:  # wfbp: .grad, which a GradScaler's unscale_ unscaled
            return self._update.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        norm = self._update.grad_norm(norm_type)
        if error_if_nonfinite:
            refuse_nonfinite(norm, norm_type)
        scaler = self._scaler() if self._scaler is not None else None
        unscaled = scaler is not None and scaler.is_enabled()
        if unscaled:
            norm.mul_(_inverse_scale(scaler, norm.device))
        self._pending_clip = (float(max_norm), norm, unscaled, self._runtime.backwards)
        return norm

    # ---- checkpoints ------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """torch's format, full and the same on every rank: loadable here at any
        world size, or into a plain torch optimizer of the same class. With
        update="sharded" this gathers the state (a collective: call it on every
        rank); sharded_state_dict() is the cheap per-rank form.
        schedule="deft" adds the delays in force and the delayed gradients
        later steps apply (key "dearcomm_delayed"), so a resumed run trains
        exactly as an uninterrupted one; a plain torch optimizer ignores it."""
        self._runtime.sync()
        return self._with_delayed(self._update.state_dict())

    def sharded_state_dict(self) -> Dict[str, Any]:
        """This rank's part of the optimizer state, without communication; load
        it on the same rank at the same world size."""
        self._runtime.sync()
        return self._with_delayed(self._update.sharded_state_dict())

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Accepts state_dict() (any world size), a plain torch optimizer's
        state_dict(), or this rank's sharded_state_dict(). schedule="deft"
        takes the checkpoint's delays and the delayed gradients it holds
        (none where it has none)."""
        self._runtime.sync()
        delayed = state_dict.get(DELAYED_KEY)
        auto = self._runtime.auto
        if self._runtime.options.choice.takes_delays or (auto is not None and auto.max_delay):
            self._runtime.delayed.load_state_dict(delayed)
        elif delayed and any(delayed["pending"].values()):
            raise ValueError(f"dearcomm: this checkpoint holds delayed gradients of schedule='deft' (parameters "
                             f"{sorted(delayed['delays'])}) that later steps apply; load it into a model wrapped "
                             f"with schedule='deft' (or schedule='auto' with max_delay), or they would be lost")
        self._update.load_state_dict({k: v for k, v in state_dict.items() if k != DELAYED_KEY})

    def _with_delayed(self, state: Dict[str, Any]) -> Dict[str, Any]:
        if not self._runtime.options.choice.takes_delays:
            return state
        return {**state, DELAYED_KEY: self._runtime.delayed.state_dict()}


def _inverse_scale(scaler, device: torch.device) -> torch.Tensor:
    """1 / the GradScaler's current scale, as GradScaler computes it for unscale_."""
    return scaler._scale.double().reciprocal().float().to(device)


def _scaler_stage(scaler, optimizer) -> str:
    """GradScaler's stage for this optimizer: "READY", "UNSCALED" (the user
    called scaler.unscale_(optimizer)) or "STEPPED"."""
    return scaler._per_optimizer_states[id(optimizer)]["stage"].name
