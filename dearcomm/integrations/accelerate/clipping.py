"""accelerator.clip_grad_norm_ for dearcomm models.

Accelerate clips with torch's clip_grad_norm_ on ``.grad``. Under dearcomm's
schedule="dear" (and "bytescheduler") ``.grad`` holds this rank's local
gradient, so that norm would be wrong, and dearcomm's step() refuses a changed
``.grad``. prepare() therefore routes this accelerator's clip_grad_norm_ for a
dearcomm model's parameters to the optimizer's clip_grad_norm_, which clips
the averaged gradients to their global norm, as DDP plus torch's clipping do,
and returns that norm. Other parameters go to Accelerate's own method.
"""
from __future__ import annotations

import weakref
from typing import Iterable, List, Tuple

import torch
from accelerate import Accelerator


class ClipThroughDearcomm:
    """Installed as ``accelerator.clip_grad_norm_`` by prepare()."""

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = weakref.ref(accelerator)
        self._accelerate_clip = accelerator.clip_grad_norm_  # Accelerate's own, bound
        self._models: List[Tuple[weakref.ref, weakref.ref, str]] = []  # (model, dearcomm optimizer, schedule)

    def add(self, model: torch.nn.Module, optimizer, schedule: str) -> None:
        self._models.append((weakref.ref(model), weakref.ref(optimizer), schedule))

    def __call__(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        parameters = list(parameters)
        given = set(parameters)
        for model_ref, optimizer_ref, schedule in self._models:
            model, optimizer = model_ref(), optimizer_ref()
            if model is None or optimizer is None:
                continue
            trainable = {p for p in model.parameters() if p.requires_grad}
            if not given & trainable:
                continue
            if not trainable <= given:
                raise ValueError(
                    "dearcomm: accelerator.clip_grad_norm_ got some of a dearcomm model's parameters; dearcomm clips "
                    "all of them to one global norm: pass model.parameters()")
            if self._accelerator().scaler is not None:
                if schedule == "wfbp":  # .grad holds the averages, as with DDP: Accelerate unscales and clips them
                    return self._accelerate_clip(parameters, max_norm, norm_type)
                raise NotImplementedError(
                    f"dearcomm: with mixed_precision='fp16' and schedule={schedule!r} the gradients are unscaled "
                    "inside optimizer.step(); clip there: pass max_grad_norm=... to "
                    "dearcomm.integrations.accelerate.prepare() and drop accelerator.clip_grad_norm_")
            return optimizer.clip_grad_norm_(max_norm, norm_type)
        return self._accelerate_clip(parameters, max_norm, norm_type)


def route_clipping(accelerator: Accelerator, model: torch.nn.Module, optimizer, schedule: str) -> None:
    clip = accelerator.__dict__.get("clip_grad_norm_")
    if not isinstance(clip, ClipThroughDearcomm):
        clip = ClipThroughDearcomm(accelerator)
        accelerator.clip_grad_norm_ = clip  # this accelerator only
    clip.add(model, optimizer, schedule)
