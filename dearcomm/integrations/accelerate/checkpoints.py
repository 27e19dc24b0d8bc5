"""accelerator.save_state() and save_model() for dearcomm models.

With update="sharded" a dearcomm model's parameters are views into flat
bucket buffers. save_state() and save_model() write safetensors, and
Accelerate first drops every tensor that shares storage with another one (it
takes them for tied weights): all but one parameter per buffer would be
missing from the checkpoint. Both read the model through
accelerator.get_state_dict(), which for a dearcomm model gives the tensors
that share a buffer with another entry copies of their own (the others, and
any other model's state, as they were).
"""
from __future__ import annotations

import collections
import weakref

import torch
from accelerate import Accelerator

from dearcomm import DearModule


_hooked: "weakref.WeakSet[Accelerator]" = weakref.WeakSet()


def copy_weights_when_saving(accelerator: Accelerator) -> None:
    if accelerator not in _hooked:
        accelerator.get_state_dict = _CopiedStateDict(accelerator.get_state_dict)
        _hooked.add(accelerator)


class _CopiedStateDict:
    """accelerator.get_state_dict, whose state dict of a dearcomm model holds
    no two tensors in one storage (save_model() wrote one parameter of each
    bucket)."""

    def __init__(self, get_state_dict) -> None:
        self._get_state_dict = get_state_dict

    def __call__(self, model, *args, **kwargs):
        state = self._get_state_dict(model, *args, **kwargs)
        if state is None or not isinstance(model, DearModule):
            return state
        storage_of = {name: value.untyped_storage().data_ptr() for name, value in state.items()
                      if isinstance(value, torch.Tensor) and value.numel()}
        holders = collections.Counter(storage_of.values())
        return {name: value.clone() if holders[storage_of.get(name)] > 1 else value for name, value in state.items()}
