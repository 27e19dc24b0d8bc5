"""What a wrapped module gains: ``sync()``, and state_dict()/load_state_dict()
that see finished updates. Like FSDP2's ``fully_shard``, wrapping swaps the
module's class for a subclass that mixes these in, so parameter names,
``isinstance`` checks, attribute access and the class name stay as they were.

``copy.deepcopy(model)`` and ``pickle``/``torch.save(model)`` give a plain,
synced module of the original class: no runtime, no dearcomm hook, and
parameters that own their memory."""
from __future__ import annotations

import contextlib
import copy
import operator
import weakref
from typing import Dict, Iterator, List, Tuple, Type

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._runtime import DearRuntime
from .overlap import OverlapReport

_classes: Dict[Type[nn.Module], Type[nn.Module]] = {}

# Instance attributes that wrap() adds; a plain copy leaves them behind.
_ATTRIBUTES = ("_dear", "_dear_hooks")

_CONVERTED = ("dearcomm: this would move the wrapped model's parameters {}; dearcomm's buckets hold them as "
              "they were at wrap(), so training would silently stop synchronising them. Convert or move the model "
              "before dearcomm.wrap(), not after")

_NO_MODULE = ("dearcomm: a wrapped model has no attribute 'module': dearcomm.wrap() returns your model itself, not "
              "a wrapper around it (as FSDP2's fully_shard does); use `model` where a DDP script uses `model.module`")


_NO_JOIN = ("dearcomm: a wrapped model has no {}: DDP's join() for uneven inputs (ranks with different numbers of "
            "batches) is not supported; give every rank the same number of steps (DistributedSampler pads the last "
            "batches to that by default, or drop_last=True)")
_JOIN_ATTRIBUTES = ("join", "join_hook", "join_device", "join_process_group")  # DDP's, and torch's Joinable's


class DearModule:
    """Mixin for modules returned by :func:`dearcomm.wrap`."""

    _dear: DearRuntime
    _dear_hooks: List[RemovableHandle]  # the state_dict / load_state_dict hooks on this module
    _dear_plain_class: Type[nn.Module]  # the class before wrap()

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As optimizer.zero_grad(): with ``set_to_none=False`` a .grad that is a
        view into its gradient bucket is zero-filled in place and kept."""
        self._dear.zero_grad(list(self.parameters()), set_to_none)

    def overlap_report(self) -> OverlapReport:
        """How much of this rank's communication ran beside compute, measured
        over 10 iterations after the first 3 of the options that train
        (dearcomm/overlap.py; under wrap()'s "auto" options, of its choice,
        once its trials are over): iteration, compute, communication and
        exposed communication times (medians), the perfect-overlap bound and,
        with "auto", the plan it chose and its predicted time. Raises until
        those iterations have run."""
        return self._dear.overlap.get()

    def auto_plan(self):
        """What wrap()'s "auto" options chose (a dearcomm AutoPlan: options,
        predicted and default time, the profile and network it used), the
        latest if it re-planned; None before the first training forward or
        without "auto"."""
        auto = self._dear.auto
        return auto.plans[-1] if auto is not None and auto.plans else None

    def register_update_hook(self, hook):
        """Calls ``hook([(name, parameter), ...])`` for each bucket once its
        parameters hold the result of the last ``optimizer.step()`` (a
        parameter that spans buckets once, with the last of them) — with
        dear, when the next forward (or ``sync()``) has waited for the bucket's
        all-gather, so the hook overlaps the rest of the all-gathers; with wfbp,
        at the end of step(). Under dear, parameters read right after step()
        are otherwise still being written by the all-gathers; an EMA updated
        from this hook equals DDP's EMA updated after every step (see the README). Also called for
        steps that a GradScaler skipped. Returns a handle with ``remove()``."""
        return self._dear.register_update_hook(hook)

    def close(self) -> None:
        """Finishes pending all-gathers and updates, then detaches dearcomm:
        hooks removed, engine and bucket buffers released once nothing else
        holds them. The module keeps its (current) parameters and is again of
        its original class; its optimizer can no longer step. Dropping the
        module without close() frees the same, by garbage collection. Where
        finishing fails (a peer is gone), the module is detached all the
        same and the error raised: buckets whose all-gather did not finish
        hold parameters from before the last step."""
        try:
            self._dear.sync()
        finally:
            self._detach()

    def _detach(self) -> None:
        """close() without finishing pending work (close() finishes it first;
        after a failure a peer may be gone, and no collective may wait)."""
        self._dear.close()
        for handle in self._dear_hooks:
            handle.remove()
        plain = type(self)._dear_plain_class
        for name in _ATTRIBUTES:
            del self.__dict__[name]
        self.__class__ = plain

    def _apply(self, fn, recurse: bool = True):
        """Under model.to(), .half(), .double(), .cuda(), share_memory(): the
        engine's buckets hold the parameters' memory (and their dtype and
        device), so a conversion after wrap() would leave them behind and
        training would silently stop synchronising. Refused before anything
        changes where the conversion is visible on an empty tensor (dtype,
        device); otherwise checked after. Buffers convert as usual."""
        params = list(self._dear.names)
        for kind in {(p.dtype, p.device) for p in params}:
            probe = fn(torch.empty(0, dtype=kind[0], device=kind[1]))
            if (probe.dtype, probe.device) != kind:
                raise RuntimeError(_CONVERTED.format(f"from {kind[0]} on {kind[1]} to {probe.dtype} on {probe.device}"))
        before = [p.data_ptr() for p in params]
        result = super()._apply(fn, recurse)
        moved = [self._dear.names[p] for p, ptr in zip(params, before) if p.data_ptr() != ptr]
        if moved:
            raise RuntimeError(_CONVERTED.format(f"to new memory ({moved[:4]}{' ...' if len(moved) > 4 else ''})"))
        return result

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """A plain module of the original class holding the synced parameters
        (e.g. an EMA copy): it has no runtime and no dearcomm hook, and its
        parameters own their memory (with update="sharded" the wrapped model's
        are views into flat buffers). Syncs first: call it on every rank, or
        after ``sync()`` on every rank."""
        self._dear.sync()
        with _as_plain_module(self):
            return copy.deepcopy(self, memo)

    def __reduce_ex__(self, protocol):
        # pickle / torch.save(model): the process group and engine cannot be
        # pickled, and must not come back on load; pickle a plain copy instead.
        # As an argument (loading calls operator.getitem((copy,), 0)): pickle
        # refuses a reduction that builds another class than the object's own,
        # and loading needs neither dearcomm nor the wrapped class.
        return operator.getitem, ((copy.deepcopy(self),), 0)

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails; the model's own `module`
        # (child, parameter, buffer or attribute) is found before this.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                # Not the model itself: `while hasattr(m, "module"): m = m.module`
                # (transformers' unwrap_model, many scripts) would never end.
                raise AttributeError(_NO_MODULE) from None
            if name in _JOIN_ATTRIBUTES:  # model.join(), or torch's Join([model]) asking a Joinable for them
                raise AttributeError(_NO_JOIN.format(name)) from None
            raise


@contextlib.contextmanager
def _as_plain_module(module: DearModule) -> Iterator[None]:
    """For the duration: the module's original class, without the attributes
    and hooks wrap() added; everything is put back afterwards, even on error."""
    dear_class = type(module)
    attributes = {name: module.__dict__.pop(name) for name in _ATTRIBUTES}
    removed = _remove_hooks(attributes["_dear"].hook_handles() + attributes["_dear_hooks"])
    module.__class__ = dear_class._dear_plain_class
    try:
        yield
    finally:
        module.__class__ = dear_class
        module.__dict__.update(attributes)
        for hooks, items in removed:  # back in their order, among the user's hooks
            hooks.clear()
            hooks.update(items)


def _remove_hooks(handles: List[RemovableHandle]) -> List[Tuple[dict, list]]:
    """Takes the handles' hooks out of their dicts; returns each dict touched with its former items."""
    touched: Dict[int, Tuple[dict, list]] = {}
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            hooks = ref()
            if hooks is not None and handle.id in hooks:
                touched.setdefault(id(hooks), (hooks, list(hooks.items())))
                del hooks[handle.id]
    return list(touched.values())


def _syncing(runtime: DearRuntime):
    """A state_dict / load_state_dict pre-hook for every submodule: reading
    parameters must wait for pending all-gathers, and so must loading (an
    all-gather still in flight would overwrite what is loaded). With
    update="sharded", step() then takes what was loaded into the optimizer's
    master copy (UpdateStrategy.adopt_parameter_writes)."""
    runtime = weakref.ref(runtime)

    def hook(module, *args, **kwargs) -> None:
        alive = runtime()
        if alive is not None:
            alive.sync()
    return hook


def make_dear_module(module: nn.Module, runtime: DearRuntime) -> DearModule:
    cls = module.__class__
    if cls not in _classes:
        # The original's names: tools that record the class name (transformers'
        # save_pretrained writes "architectures") must see the user's class.
        _classes[cls] = type(cls.__name__, (DearModule, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "_dear_plain_class": cls})
    module.__class__ = _classes[cls]
    module._dear = runtime
    sync = _syncing(runtime)
    module._dear_hooks = [handle for sub in module.modules() for handle in (
        sub.register_state_dict_pre_hook(sync), sub.register_load_state_dict_pre_hook(sync))]
    return module
