"""How the Trainer's precision plugin drives dearcomm's optimizer.

Lightning's precision plugins step with ``optimizer.step(closure)`` and clip
``.grad`` with torch between backward and step. dearcomm's optimizer takes no
closure, and under schedule="dear" ``.grad`` holds this rank's local gradient,
so torch's clipping would clip the wrong tensor (dearcomm refuses it). As
Lightning's DeepSpeed and FSDP strategies come with their own precision
plugins, DearStrategy adapts whichever plugin the Trainer chose (32-true,
bf16-mixed, 16-mixed, ...) by mixing :class:`SteppedByDearcomm` into its class
for the duration of ``fit``; autocast, scaling and checkpointed scaler state
stay the plugin's own.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Type

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

_classes: Dict[Type[Precision], Type[Precision]] = {}


class SteppedByDearcomm:
    """Mixin for the Trainer's precision plugin while DearStrategy trains."""

    _dear_clip_in_step: Optional[float]
    """With a GradScaler: the norm that optimizer.step() clips to after
    unscaling (dearcomm.wrap(max_grad_norm=)); None: clip between backward and step."""

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if getattr(self, "scaler", None) is not None:
            # MixedPrecision runs the closure itself, then scaler.step(optimizer): no closure reaches step().
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        # What a torch optimizer does inside step(closure), here before dearcomm's step():
        # forward, backward, on_before_optimizer_step hooks and clipping.
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward ran, so there is nothing to step
        optimizer.step(**kwargs)
        return closure_result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        if clip_val is None or clip_val <= 0:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise NotImplementedError(
                "dearcomm: DearStrategy clips by norm only (gradient_clip_algorithm='norm', the default): dearcomm "
                "clips the global norm of the averaged gradients, which never exist in full under schedule='dear'")
        if self._dear_clip_in_step is not None:
            if clip_val != self._dear_clip_in_step:
                raise ValueError(
                    f"dearcomm: with a GradScaler (precision='16-mixed') optimizer.step() clips to "
                    f"Trainer(gradient_clip_val={self._dear_clip_in_step}) after unscaling; clipping to {clip_val} "
                    "from configure_gradient_clipping() or clip_gradients() is not supported")
            return
        # Manual optimization hands over a LightningOptimizer, a copy of the
        # optimizer's attributes: the clip asked of it never reached step().
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        optimizer.clip_grad_norm_(clip_val)  # the global norm of the averaged gradients, as DDP + torch's clipping


def adapt(plugin: Precision, clip_in_step: Optional[float]) -> None:
    """Makes ``plugin`` a SteppedByDearcomm in place. Its class keeps the
    original's names: Lightning files a checkpoint's scaler state under the
    plugin's class name, so checkpoints move between DDP and DearStrategy."""
    cls = type(plugin)
    if not issubclass(cls, SteppedByDearcomm):
        if cls not in _classes:
            _classes[cls] = type(cls.__name__, (SteppedByDearcomm, cls),
                                 {"__qualname__": cls.__qualname__, "__module__": cls.__module__})
        plugin.__class__ = _classes[cls]
    plugin._dear_clip_in_step = clip_in_step


def restore(plugin: Precision) -> None:
    """Undoes adapt(): the plugin the Trainer chose, as it was."""
    cls = type(plugin)
    if issubclass(cls, SteppedByDearcomm):
        plugin.__class__ = cls.__bases__[1]  # (SteppedByDearcomm, the original)
        plugin.__dict__.pop("_dear_clip_in_step", None)
