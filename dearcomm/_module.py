"""What a wrapped module gains: ``sync()``, and state_dict()/load_state_dict()
that see finished updates. Like FSDP2's ``fully_shard``, wrapping swaps the
module's class for a subclass that mixes these in, so parameter names,
``isinstance`` checks and attribute access stay as they were."""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Type

from torch import nn

from ._runtime import DearRuntime

_classes: Dict[Type[nn.Module], Type[nn.Module]] = {}


class DearModule:
    """Mixin for modules returned by :func:`dearcomm.wrap`."""

    _dear: DearRuntime

    def sync(self) -> None:
        """Finishes every pending all-gather and update, so the parameters hold
        the result of the last ``optimizer.step()``. state_dict(), eval and
        no-grad forwards call it themselves."""
        self._dear.sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: run the forward and backward of every
        micro-batch but the last inside this context. Gradients then add up
        in ``.grad`` without communication; the last backward, outside it,
        communicates the accumulated sum (divide your loss by the number of
        micro-batches to get their mean, as with DDP)."""
        runtime = self._dear
        previous, runtime.sync_gradients = runtime.sync_gradients, False
        try:
            yield
        finally:
            runtime.sync_gradients = previous

    def register_update_hook(self, hook):
        """Calls ``hook([(name, parameter), ...])`` for each bucket once its
        parameters hold the result of the last ``optimizer.step()`` — with
        dear, when the next forward (or ``sync()``) has waited for the bucket's
        all-gather, so the hook overlaps the rest of the all-gathers; with wfbp,
        at the end of step(). Parameters read right after step() are otherwise
        the previous step's under dear; an EMA updated from this hook equals
        DDP's EMA updated after every step (see the README). Also called for
        steps that a GradScaler skipped. Returns a handle with ``remove()``."""
        return self._dear.register_update_hook(hook)

    def close(self) -> None:
        """Finishes pending all-gathers and updates, then detaches dearcomm:
        hooks removed, engine and bucket buffers released once nothing else
        holds them. The module keeps its (current) parameters; its optimizer
        can no longer step. Dropping the module without close() frees the
        same, by garbage collection."""
        self._dear.close()


def _on_state_dict(module, prefix, keep_vars) -> None:
    module._dear.sync()


def _before_load(module, *args, **kwargs) -> None:
    module._dear.sync()  # a pending all-gather would overwrite what is loaded


def _after_load(module, incompatible_keys) -> None:
    runtime = module._dear
    if runtime.engine is not None and runtime.options.update == "sharded":
        runtime.engine.reload_master_shards()  # the optimizer updates the master copy


def make_dear_module(module: nn.Module, runtime: DearRuntime) -> DearModule:
    cls = module.__class__
    if cls not in _classes:
        _classes[cls] = type(f"Dear{cls.__name__}", (DearModule, cls), {"__module__": cls.__module__})
    module.__class__ = _classes[cls]
    module._dear = runtime
    module.register_state_dict_pre_hook(_on_state_dict)
    module.register_load_state_dict_pre_hook(_before_load)
    module.register_load_state_dict_post_hook(_after_load)
    return module
