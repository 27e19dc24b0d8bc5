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
import warnings
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
        self._module = module
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
        self.sync_gradients = True  # False inside DearModule.no_sync()
        self._warned_order = False
        self._zeros: Dict[int, torch.Tensor] = {}  # find_unused_parameters: stand-in gradients
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
            if engine.prefetch_misses and not self._warned_order:
                self._warned_order = True
                warnings.warn(
                    "dearcomm: this forward runs modules in another order than the first forward did (e.g. a "
                    "conditional branch); parameters stay correct, but all-gathers it needed early could not be "
                    "prefetched. Shown once.", stacklevel=2)
        else:
            engine.flush()  # eval / no_grad: see every update, prefetch nothing

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.sync_gradients:
            return  # accumulating: .grad sums micro-batches, the last backward communicates
        if self.engine is None:
            with _C.no_python_tls():  # its collectives' Works must not keep backward's Python objects
                self._build_engine()
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.engine.mark_grad_ready(self.index[param], param.grad)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        if self.options.find_unused_parameters:
            for i in self.engine.missing_grads():
                if i not in self._zeros:
                    self._zeros[i] = torch.zeros_like(self.params[i], memory_format=torch.contiguous_format)
                self.engine.mark_grad_ready(i, self._zeros[i])
        self.engine.check_backward_complete()

    # ---- engine ------------------------------------------------------------

    def _build_engine(self) -> None:
        now = {p for p in self._module.parameters() if p.requires_grad}
        if now != set(self.names):
            added = [n for n, p in self._module.named_parameters() if p.requires_grad and p not in self.names]
            removed = [n for p, n in self.names.items() if p not in now]
            raise ValueError(f"dearcomm: the module's trainable parameters changed after wrap() (added {added}, "
                             f"removed or frozen {removed}); change the model before wrapping it")
        self.params = self._agree_on_forward_order()
        self.index = {p: i for i, p in enumerate(self.params)}
        names = [self.names[p] for p in self.params]

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
            self.options.comm_dtype,
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

    def _agree_on_forward_order(self) -> List[nn.Parameter]:
        """Every rank lays out buckets in rank 0's first-forward order (a
        data-dependent first forward may differ between ranks), after checking
        that every rank trains the same parameters; parameters rank 0's forward
        did not use go last, in registration order."""
        mine = [(name, tuple(p.shape), str(p.dtype)) for p, name in self.names.items()]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, (mine, [self.names[p] for p in self._forward_order]), group=self.group)
        for rank, (theirs, _) in enumerate(everyone):
            if theirs != mine:
                diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                raise ValueError(
                    f"dearcomm: [rank {self.rank}] rank {rank} trains different parameters: {len(theirs)} vs "
                    f"{len(mine)}; first difference at position {diff}: "
                    f"{theirs[diff] if diff < len(theirs) else None} vs {mine[diff] if diff < len(mine) else None}. "
                    "Every rank must wrap the same model.")
        by_name = {name: p for p, name in self.names.items()}
        order = [by_name[name] for name in everyone[0][1]]
        used = set(order)
        return order + [p for p in self.names if p not in used]

    def sync(self) -> None:
        if self.engine is not None:
            self.engine.flush()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
