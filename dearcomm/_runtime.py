"""The per-model runtime: discovers parameters and modules, installs the hooks,
records the forward order and builds the C++ engine at the first backward.

Hooks and what they do:
  forward pre-hook (every module that owns parameters)
      first forward: record the order in which parameters are used;
      after step():   training forward -> engine.require_bucket(b) for the
                      module's buckets (waits for its all-gather, prefetches the
                      next); no-grad/eval forward -> engine.flush().
  post-accumulate-grad hook (every parameter that requires grad)
      engine.mark_grad_ready(i, grad): pack, and launch reductions in order;
      the first one of a backward queues a check, run when backward ends, that
      every parameter got its gradient.
"""
from __future__ import annotations

import datetime
import logging
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import _C, _cuda
from ._options import WrapOptions

logger = logging.getLogger("dearcomm")


def _process_group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


class DearRuntime:
    def __init__(self, module: nn.Module, options: WrapOptions) -> None:
        self.options = options
        self.group = options.process_group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = options.timeout or _process_group_timeout(self.group)

        # Parameters that train, under their first name (tied weights appear once).
        self.names: Dict[nn.Parameter, str] = {}
        for name, param in module.named_parameters():
            if param.requires_grad:
                self.names[param] = name
        if not self.names:
            raise ValueError("dearcomm: the module has no parameter that requires grad; nothing to train")

        self.engine: Optional[_C.Engine] = None
        self.params: List[nn.Parameter] = []  # forward order, once the engine exists
        self.index: Dict[nn.Parameter, int] = {}
        self.on_engine_built: List[Callable[[_C.Engine], None]] = []
        self._forward_order: List[nn.Parameter] = []
        self._recorded = set()
        self._module_params: Dict[nn.Module, List[nn.Parameter]] = {}
        self._module_buckets: Dict[nn.Module, List[int]] = {}
        self._end_of_backward_queued = False
        self._handles = []

        for sub in module.modules():
            owned = [p for p in sub.parameters(recurse=False) if p in self.names]
            if owned:
                self._module_params[sub] = owned
                self._handles.append(sub.register_forward_pre_hook(self._on_forward))
        for param in self.names:
            self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))

    # ---- hooks -------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args) -> None:
        engine = self.engine
        if engine is None:
            for param in self._module_params[module]:
                if param not in self._recorded:
                    self._recorded.add(param)
                    self._forward_order.append(param)
            return
        if engine.state != _C.IterationState.GATHERING:
            return
        if torch.is_grad_enabled() and module.training:
            for bucket in self._module_buckets[module]:
                engine.require_bucket(bucket)
        else:
            engine.flush()  # eval / no_grad: see every update, prefetch nothing

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.engine is None:
            self._build_engine()
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.engine.mark_grad_ready(self.index[param], param.grad)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        self.engine.check_backward_complete()

    # ---- engine ------------------------------------------------------------

    def _build_engine(self) -> None:
        unseen = [p for p in self.names if p not in self._recorded]
        self.params = self._forward_order + unseen
        self.index = {p: i for i, p in enumerate(self.params)}
        names = [self.names[p] for p in self.params]
        self._check_same_parameters_on_every_rank(names)

        layout = _C.plan_buckets(
            [p.numel() for p in self.params],
            [p.dtype for p in self.params],
            self.options.bucket_cap_bytes,
            self.world_size,
        )
        device = self.params[0].device
        backend = _cuda.nccl_backend(self.group, device, self.timeout) if device.type == "cuda" else None
        self.engine = _C.Engine(
            layout, self.params, names, self.group,
            self.options.schedule, self.options.update, self.timeout.total_seconds(), backend,
        )
        for module, owned in self._module_params.items():
            self._module_buckets[module] = sorted({layout.params[self.index[p]].bucket for p in owned})
        if self.rank == 0:
            logger.info(
                "dearcomm: schedule=%s update=%s, %d parameters in %d buckets on %s\n%s",
                self.options.schedule, self.options.update, len(self.params), len(layout.buckets),
                self.engine.backend, layout.describe(),
            )
        for callback in self.on_engine_built:
            callback(self.engine)

    def _check_same_parameters_on_every_rank(self, names: List[str]) -> None:
        # Buckets are planned from the first forward's order on each rank; a rank
        # that planned differently would pair wrong chunks or hang, so compare once.
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, self.params)]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                raise ValueError(
                    f"dearcomm: [rank {self.rank}] rank {rank} has different parameters or forward order: "
                    f"{len(theirs)} vs {len(mine)} parameters; first difference at position {diff}: "
                    f"{theirs[diff] if diff < len(theirs) else None} vs {mine[diff] if diff < len(mine) else None}. "
                    "Every rank must wrap the same model and run the same first forward."
                )

    def sync(self) -> None:
        if self.engine is not None:
            self.engine.flush()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
