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

logger = logging.getLogger("dearcomm")

WINDOW = 20
GROWTH = 10.0
STATE_KEY = "dearcomm_delayed"  # in optimizer.state_dict()


class DelayedUpdates:
    def __init__(self, runtime) -> None:
        self.runtime = runtime
        # Per delayed parameter, what the next steps apply instead of the
        # engine's own (None: nothing), oldest first; filled by a load.
        self._queued: Dict[str, List[Optional[torch.Tensor]]] = {}
        # The norm of the delayed parameters' applied averages in the last
        # WINDOW steps that had some (tensors: read once per window, so no
        # step waits for the device), and how many steps had some.
        self._window: Deque[torch.Tensor] = collections.deque(maxlen=WINDOW)
        self.observed = 0
        self._due = False  # a window is full and not judged yet
        self.baseline: Optional[float] = None
        self.switched_off_at: Optional[int] = None  # the step (counted from wrap) where the guard fired
        self.steps = 0

    @property
    def delays(self) -> Dict[str, int]:
        return {n: d for n, d in (self.runtime.options.delays or {}).items() if d}

    def _params(self) -> Dict[str, torch.nn.Parameter]:
        return {name: p for p, name in self.runtime.names.items()}

    # ---- checkpoints -----------------------------------------------------------

    def state_dict(self) -> Dict:
        """After a sync(): the delays in force and, per delayed parameter, its
        averaged gradients still to be applied, oldest first."""
        runtime, params = self.runtime, self._params()
        pending = {}
        for name in self.delays:
            if name in self._queued:  # loaded and not all applied yet
                pending[name] = [t.clone() for t in self._queued[name] if t is not None]
            elif runtime.engine is not None:
                pending[name] = list(runtime.engine.pending_averages(runtime.index[params[name]]))
            else:
                pending[name] = []
        return {"delays": self.delays, "pending": pending}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        """A checkpoint's delays and pending gradients (None: one saved
        without delays: nothing pending)."""
        runtime = self.runtime
        state = state or {"delays": self.delays, "pending": {}}
        delays = {n: int(d) for n, d in state["delays"].items() if d}
        unknown = sorted((set(delays) | set(state["pending"])) - set(self._params()))
        if unknown:
            raise ValueError(f"dearcomm: the checkpoint delays {unknown}, which are not trainable parameters of "
                             f"the module")
        if runtime.planner is not None:  # the checkpoint's delays, not a new plan
            runtime.planner.handle.remove()
            runtime.planner = None
        if delays != self.delays:
            limit = max([runtime.options.effective_max_delay, *delays.values()])
            runtime.reconfigure(dataclasses.replace(runtime.options, delays=delays, max_delay=limit))
        # The first `delay` steps of a fresh engine apply nothing of a delayed
        # parameter, a live one its own: both take the checkpoint's instead,
        # after as many empty steps as the checkpoint was short of `delay`.
        self._queued = {}
        for name, delay in delays.items():
            saved = [t.detach().clone() for t in state["pending"].get(name, [])][-delay:]
            self._queued[name] = [None] * (delay - len(saved)) + saved

    def after_backward(self) -> None:
        """Backward returned: .grad holds what step() applies. Where a
        checkpoint was loaded, its gradients go there instead; the guard
        observes what the delayed parameters apply."""
        delays = self.delays
        if not delays:
            return
        params = self._params()
        for name in list(self._queued):
            param, grad = params[name], self._queued[name].pop(0)
            if grad is None:
                param.grad = None  # torch's optimizers skip it, as the uninterrupted run's step did
            elif param.grad is None:
                param.grad = grad.to(param.dtype)
            else:
                param.grad.copy_(grad)
            if not self._queued[name]:
                del self._queued[name]
        grads = [params[n].grad for n in delays if params[n].grad is not None]
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
            self._window.append(torch.linalg.vector_norm(norms))
            self.observed += 1
            self._due = self.observed % WINDOW == 0

    # ---- the guard -------------------------------------------------------------

    def step_ended(self) -> None:
        """After step(): once per WINDOW observed steps, the verdict."""
        runtime = self.runtime
        self.steps += 1
        if not (self._due and self.delays):
            return
        self._due = False
        window = [float(x) for x in self._window]
        if self.baseline is None:
            self.baseline = statistics.median(window)
            return
        recent = max(window, key=lambda x: math.inf if math.isnan(x) else x)
        verdict = float(not recent <= GROWTH * self.baseline)  # NaN counts as growth
        hurts = torch.tensor([verdict], device=runtime.params[0].device)
        dist.all_reduce(hurts, op=dist.ReduceOp.MAX, group=runtime.group)
        if hurts.item():
            self.switched_off_at = self.steps
            if runtime.rank == 0:
                logger.warning("dearcomm: deft's guard switched delays off at step %d: the delayed parameters' "
                               "gradient norm reached %.3g within the last %d steps, over %gx its first steps' %.3g; "
                               "every bucket is applied on time from now on", self.steps, recent, WINDOW, GROWTH,
                               self.baseline)
            if runtime.auto is not None:
                runtime.auto.max_delay = 0  # nor may "auto" choose delays again
            runtime.reconfigure(dataclasses.replace(runtime.options, delays={}, max_delay=0))
