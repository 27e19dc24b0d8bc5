"""Which optimizers update="sharded" may re-create over parameter shards.

The sharded update steps a second instance of the user's optimizer class over
flat 1-D pieces of the parameters (sharded.py). That equals stepping the
whole parameters only where the update of each element depends on that
element alone: SGD, Adam and the like. Adafactor factors a matrix's second
moment by rows and columns, LAMB and LARS scale by a tensor's norm: on
pieces they compute something else, silently. So only known element-wise
classes (and their subclasses) are sharded; any other trains with
update="replicated", which steps the user's optimizer on whole parameters.
"""
from __future__ import annotations

from typing import Set, Type

import torch
from torch.optim import Optimizer

_ELEMENTWISE: Set[Type[Optimizer]] = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop,
    torch.optim.ASGD,
}


def register_elementwise_optimizer(cls: Type[Optimizer]) -> Type[Optimizer]:
    """Declares ``cls`` element-wise (each element's update depends on that
    element, its gradient and its own state alone, as with Lion or Adam
    variants from other libraries), so that update="sharded" may shard it.
    Usable as a class decorator; returns ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"dearcomm: register_elementwise_optimizer takes a torch.optim.Optimizer subclass, "
                        f"got {cls!r}")
    _ELEMENTWISE.add(cls)
    return cls


def is_elementwise(optimizer: Optimizer) -> bool:
    return any(isinstance(optimizer, cls) for cls in _ELEMENTWISE)


def not_elementwise_message(optimizer: Optimizer) -> str:
    name = type(optimizer).__name__
    return (f"dearcomm: update='sharded' steps {name} over flat shards of the parameters, which equals "
            f"training whole parameters only for an element-wise optimizer (SGD, Adam, AdamW, ...); {name} is "
            "not known to be one (Adafactor, LAMB and LARS are not). Use update='replicated', or, if every "
            f"element's update depends on that element alone, dearcomm.register_elementwise_optimizer({name})")
