"""What schedule="deft" adds around the engine when buckets are applied late:
checkpoints of the gradients still to be applied, and the convergence guard.

Checkpoints. A delayed parameter's averaged gradient of the last ``delay``
backwards is still to be applied when a checkpoint is taken between steps.
``optimizer.state_dict()`` saves it (after a sync(), which waits for those
reductions) with the delays in force; ``load_state_dict()`` takes those
delays over (a job that plans its own delays keeps the checkpoint's instead)
and has the next steps apply the saved gradients where the engine would have
applied its own: a resumed run trains exactly as the uninterrupted one.

The guard. Delays change the optimisation: a gradient applied one step late
was computed at parameters one update older. For gradient descent on a
quadratic with curvature λ and learning rate η, one step of delay makes the
iteration diverge for ηλ between 1 and 2, where without delay it converges;
in a network the same instability shows as a burst of large gradients (and
loss) that can leave it dead. (The relative change of successive gradients,
‖g_t − g_{t−1}‖ / ‖g_t‖, does not show it: it is exactly 1 along such a
diverging mode, and about √2 for gradient noise alone.) The guard therefore
watches the norm of the delayed parameters' applied averages: the median
over the first ``WINDOW`` steps with delays is the baseline, and once a norm
within a later window of ``WINDOW`` steps exceeds ``GROWTH`` times it, delays
are switched off for the rest of training (every bucket applied on time,
deft as wfbp; the gradients then still in flight are dropped, as the first
steps with delays have none) and rank 0 logs a warning. Every rank decides
alike: the verdict is all-reduced once per window. What it does not see is
a delay that slows convergence without a burst; docs/benchmarks.md measures
that, with the loss.
"""
from __future__ import annotations

import collections
import math
import dataclasses
import logging
import statistics
from typing import Deque, Dict, List, Optional

import torch
import torch.distributed as dist

from ._torch_collectives import within

logger = logging.getLogger("dearcomm")

WINDOW = 20
GROWTH = 10.0
STATE_KEY = "dearcomm_delayed"  # in optimizer.state_dict()


def nonzero(delays: Optional[Dict[str, int]]) -> Dict[str, int]:
    """The parameters a delays mapping applies late (0 means on time)."""
    return {n: int(d) for n, d in (delays or {}).items() if d}


def switch_delays_off(runtime) -> None:
    """Every bucket applied on time from now on, and "auto" may not choose
    delays again: what the guard does where delays hurt."""
    if runtime.auto is not None:
        runtime.auto.forbid_delays()
    runtime.reconfigure(dataclasses.replace(runtime.options, delays={}, max_delay=0))


class DelayedUpdates:
    def __init__(self, runtime) -> None:
        self.runtime = runtime
        # Per delayed parameter, what the next steps apply instead of the
        # engine's own (None: nothing), oldest first; filled by a load.
        self._queued: Dict[str, List[Optional[torch.Tensor]]] = {}
        self.switched_off_at: Optional[int] = None  # the step (counted from wrap) where the guard fired
        self.steps = 0
        self._reset_guard()

    def _reset_guard(self) -> None:
        # The norm of the delayed parameters' applied averages in the last
        # WINDOW steps that had some (tensors: read once per window, so no
        # step waits for the device), how many steps had some, and for which
        # delays (a change of delays starts the guard afresh).
        self._window: Deque[torch.Tensor] = collections.deque(maxlen=WINDOW)
        self.observed = 0
        self._judged = 0  # `observed` at the last verdict
        self.baseline: Optional[float] = None
        self._guarding = self.delays

    @property
    def delays(self) -> Dict[str, int]:
        return nonzero(self.runtime.options.delays)

    # ---- checkpoints -----------------------------------------------------------

    def state_dict(self) -> Dict:
        """After a sync(), between steps: the delays in force, per delayed
        parameter its averaged gradients still to be applied (oldest first),
        and the guard's figures."""
        runtime, params = self.runtime, self.runtime.by_name
        pending = {}
        for name, delay in self.delays.items():
            engine_pending = []
            if runtime.engine is not None:
                engine_pending = list(runtime.engine.pending_averages(runtime.index[params[name]]))
            queued = self._queued.get(name, [])
            # A load's queue stands in for the engine's first `delay` steps: what the engine reduced since
            # the load (one per step taken, delay - len(queued) of them) comes after it.
            since_load = delay - len(queued) if name in self._queued else delay
            mine = engine_pending[len(engine_pending) - since_load:] if since_load else []
            pending[name] = [t.clone() for t in queued if t is not None] + mine
        guard = dict(baseline=self.baseline, window=[float(x) for x in self._window], observed=self.observed,
                     steps=self.steps, switched_off_at=self.switched_off_at)
        return {"delays": self.delays, "pending": pending, "guard": guard}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        """A checkpoint's delays, pending gradients and guard (None: one
        saved without delays: the next `delay` steps apply nothing of the
        delayed parameters, as a fresh start's)."""
        runtime, params = self.runtime, self.runtime.by_name
        if state is None:
            self._queued = {name: [None] * delay for name, delay in self.delays.items()}
            return
        delays = nonzero(state["delays"])
        unknown = sorted((set(delays) | set(state["pending"])) - set(params))
        if unknown:
            raise ValueError(f"dearcomm: the checkpoint delays {unknown}, which are not trainable parameters of "
                             f"the module")
        queued = {}
        for name, delay in delays.items():
            saved = list(state["pending"].get(name, []))[-delay:]
            for t in saved:
                if tuple(t.shape) != tuple(params[name].shape):
                    raise ValueError(f"dearcomm: the checkpoint's delayed gradient of {name!r} has shape "
                                     f"{tuple(t.shape)}, the parameter {tuple(params[name].shape)}")
            # The first `delay` steps of a fresh engine apply nothing of a delayed parameter, a live one its
            # own: both take the checkpoint's instead, after as many empty steps as it was short of `delay`.
            queued[name] = [None] * (delay - len(saved)) + [
                t.detach().to(params[name].device, params[name].dtype, copy=True) for t in saved]
        options = runtime.options
        if options.max_delay is not None and delays and max(delays.values()) > options.max_delay:
            raise ValueError(f"dearcomm: the checkpoint applies parameters up to {max(delays.values())} steps late, "
                             f"but this model was wrapped with max_delay={options.max_delay}; wrap it with "
                             f"max_delay >= {max(delays.values())} (or None) to resume it")
        if runtime.planner is not None:  # the checkpoint's delays, not a new plan
            runtime.planner.handle.remove()
            runtime.planner = None
        if delays != self.delays:
            limit = max([options.effective_max_delay, *delays.values()])
            if runtime.auto is not None:  # "auto" chose deft in the saved run: it keeps that choice
                runtime.auto.keep()
                options = dataclasses.replace(options, schedule="deft", update="replicated", partition_mb=None,
                                              credit_mb=None, blocks=None, priorities=None)
            runtime.reconfigure(dataclasses.replace(options, delays=delays, max_delay=limit))
        self._queued = queued
        self._reset_guard()
        guard = state.get("guard") or {}
        self.baseline = guard.get("baseline")
        self._window.extend(torch.tensor(x) for x in guard.get("window", []))
        self.observed = self._judged = guard.get("observed", 0)
        self.steps = guard.get("steps", self.steps)
        self.switched_off_at = guard.get("switched_off_at")

    def after_backward(self) -> None:
        """Backward returned: .grad holds what step() applies. Where a
        checkpoint was loaded, its gradients go there instead; the guard
        observes what the delayed parameters apply."""
        delays = self.delays
        if not delays:
            return
        if delays != self._guarding:
            self._reset_guard()
        params = self.runtime.by_name
        for name in list(self._queued):
            param, grad = params[name], self._queued[name].pop(0)
            if grad is None:
                param.grad = None  # torch's optimizers skip it, as the uninterrupted run's step did
            elif param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad.copy_(grad)
            if not self._queued[name]:
                del self._queued[name]
        grads = [params[n].grad for n in delays if params[n].grad is not None]
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
            self._window.append(torch.linalg.vector_norm(norms))
            self.observed += 1

    # ---- the guard -------------------------------------------------------------

    def step_ended(self) -> None:
        """After step(): once per WINDOW observed steps, the verdict."""
        runtime = self.runtime
        self.steps += 1
        if not self.delays or not self.observed or self.observed % WINDOW or self._judged == self.observed:
            return
        self._judged = self.observed
        window = [float(x) for x in self._window]
        if self.baseline is None:
            self.baseline = statistics.median(window) if all(math.isfinite(x) for x in window) else math.inf
            if self.baseline == 0:
                self.baseline = None  # nothing to compare with yet: the next window is the baseline
            if self.baseline != math.inf:
                return
        recent = max(window, key=lambda x: math.inf if math.isnan(x) else x)
        verdict = float(not (recent <= GROWTH * self.baseline and math.isfinite(self.baseline)))
        hurts = torch.tensor([verdict], device=runtime.params[0].device)
        within(runtime.timeout, "deft's guard (whether delays hurt)", dist.all_reduce, hurts, op=dist.ReduceOp.MAX,
               group=runtime.group)
        if hurts.item():
            self.switched_off_at = self.steps
            if runtime.rank == 0:
                logger.warning("dearcomm: deft's guard switched delays off at step %d: the delayed parameters' "
                               "gradient norm reached %.3g within the last %d steps, over %gx its first steps' %.3g; "
                               "every bucket is applied on time from now on", self.steps, recent, WINDOW, GROWTH,
                               self.baseline)
            switch_delays_off(runtime)
