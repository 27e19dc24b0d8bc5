"""prepare(): Accelerator.prepare with dearcomm where Accelerate puts DDP.

Accelerate has no hook for another data-parallel wrapper: prepare_model()
wraps every trainable model in DistributedDataParallel, except with
``evaluation_mode=True``, which does everything else (device placement, the
autocast of mixed precision). So prepare() asks for that, wraps the model and
optimizer with dearcomm, and hands the returned optimizer and the other
objects to Accelerate as usual. accelerator.accumulate() then runs the
accumulating micro-batches under the model's no_sync(), and save_state() /
load_state() see dearcomm's synced state_dict()s on every rank
(checkpoints.py; clipping: clipping.py).
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend

import dearcomm
from dearcomm._wrap import resolve_options

from .checkpoints import copy_weights_when_saving
from .clipping import route_clipping

_DATA_PARALLEL = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *others: Any,
            **options: Any) -> Tuple[Any, ...]:
    """Returns ``(model, optimizer, *others)`` prepared as ``accelerator.prepare``
    would, with ``dearcomm.wrap(model, optimizer, **options)`` in place of DDP.

    ``options`` are dearcomm.wrap()'s (README, "Options of dearcomm.wrap").
    ``others`` are anything else for ``accelerator.prepare``: dataloaders, LR
    schedulers (built over ``optimizer``: dearcomm's shares its param_groups).
    The model is the same object, now also a dearcomm module; the optimizer is
    Accelerate's wrapper around dearcomm's. ``accelerator.clip_grad_norm_(
    model.parameters(), m)`` clips through dearcomm (clipping.py).
    """
    resolve_options(**options)  # a bad option fails before anything is moved or wrapped
    if accelerator.distributed_type not in _DATA_PARALLEL:
        raise NotImplementedError(
            f"dearcomm: prepare() replaces DDP, which Accelerate uses with several CPU processes or GPUs "
            f"(DistributedType.MULTI_CPU, MULTI_GPU); this accelerator is {accelerator.distributed_type}. Launch "
            "with `accelerate launch --multi_gpu --num_processes N` (on CPU with ACCELERATE_USE_CPU=1 in the "
            "environment), or use accelerator.prepare()")
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        raise NotImplementedError(
            "dearcomm: prepare() with Accelerate's dynamo_backend would compile the model before dearcomm wraps it; "
            "launch without it and call torch.compile(model) on the model that prepare() returns")
    model = accelerator.prepare_model(model, evaluation_mode=True)  # placement and autocast, no DDP
    model, dear_optimizer = dearcomm.wrap(model, optimizer, **options)
    # No device placement: dearcomm keeps the optimizer state beside its buckets, on the parameters' device
    # (Accelerate's placement is a state_dict() / load_state_dict() round trip).
    prepared_optimizer = accelerator.prepare_optimizer(dear_optimizer, device_placement=False)
    route_clipping(accelerator, model, dear_optimizer, options.get("schedule", "dear"))
    copy_weights_when_saving(accelerator)
    if not others:
        return model, prepared_optimizer
    prepared = accelerator.prepare(*others)
    return (model, prepared_optimizer, *(prepared if len(others) > 1 else (prepared,)))
