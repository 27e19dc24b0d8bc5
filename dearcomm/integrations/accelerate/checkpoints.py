"""accelerator.save_state() and save_model() for dearcomm models.

With update="sharded" a dearcomm model's parameters are views into flat
bucket buffers. save_state() and save_model() write safetensors, and
Accelerate first drops every tensor that shares storage with another one (it
takes them for tied weights): all but one parameter per buffer would be
missing from the checkpoint. A save_state pre-hook, Accelerate's own
mechanism for changing what gets saved, gives it copies of those state
dicts instead, on the processes that write; save_model() reads the model
through accelerator.get_state_dict(), which returns copies for a dearcomm
model.
"""
from __future__ import annotations

import weakref

import torch
from accelerate import Accelerator

from dearcomm import DearModule


_hooked: "weakref.WeakSet[Accelerator]" = weakref.WeakSet()


def copy_weights_when_saving(accelerator: Accelerator) -> None:
    if accelerator not in _hooked:
        accelerator.register_save_state_pre_hook(_CopyWeights(accelerator))
        accelerator.get_state_dict = _CopiedStateDict(accelerator.get_state_dict)
        _hooked.add(accelerator)


class _CopiedStateDict:
    """accelerator.get_state_dict, whose state dict of a dearcomm model holds
    copies (save_model() wrote one parameter of each bucket)."""

    def __init__(self, get_state_dict) -> None:
        self._get_state_dict = get_state_dict

    def __call__(self, model, *args, **kwargs):
        state = self._get_state_dict(model, *args, **kwargs)
        if state is not None and isinstance(model, DearModule):
            state = {name: _own_copy(value) for name, value in state.items()}
        return state


class _CopyWeights:
    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = weakref.ref(accelerator)

    def __call__(self, models, weights, output_dir) -> None:
        accelerator = self._accelerator()
        writes = accelerator.is_local_main_process if accelerator.project_configuration.save_on_each_node \
            else accelerator.is_main_process
        if not writes:
            return
        for i, model in enumerate(models):
            if isinstance(model, DearModule) and i < len(weights):
                weights[i] = {name: _own_copy(value) for name, value in weights[i].items()}


def _own_copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value
