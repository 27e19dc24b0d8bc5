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
from accelerate.utils import DDPCommunicationHookType, DistributedType, DynamoBackend

import dearcomm
from dearcomm._wrap import resolve_options

from .checkpoints import copy_weights_when_saving
from .clipping import route_clipping

_DATA_PARALLEL = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


# DistributedDataParallelKwargs -> wrap()'s option of the same meaning.
_DDP_KWARGS = {"find_unused_parameters": "find_unused_parameters", "broadcast_buffers": "broadcast_buffers",
               "bucket_cap_mb": "bucket_mb"}
_DDP_HINTS = ("gradient_as_bucket_view", "static_graph")  # speed hints: dearcomm's .grad are bucket views already


def _with_ddp_kwargs(accelerator: Accelerator, options: dict) -> dict:
    """wrap()'s options with what the Accelerator's DistributedDataParallelKwargs
    (kwargs_handlers) set, which DDP would have read; what dearcomm has no
    counterpart for is refused rather than ignored."""
    handler = getattr(accelerator, "ddp_handler", None)
    if handler is None:
        return options
    for name in ("comm_hook", "comm_wrapper"):  # DDP communication hooks: not DDP's constructor kwargs
        if getattr(handler, name, DDPCommunicationHookType.NO) != DDPCommunicationHookType.NO:
            raise ValueError(f"dearcomm: prepare() replaces DDP, and DistributedDataParallelKwargs({name}=...) has "
                             "no dearcomm counterpart (for compression: prepare(comm_dtype=torch.bfloat16)); "
                             "leave it out")
    out = dict(options)
    for name, value in handler.to_kwargs().items():
        if name in _DDP_HINTS:
            continue
        if name not in _DDP_KWARGS:
            raise ValueError(f"dearcomm: prepare() replaces DDP, and DistributedDataParallelKwargs({name}=...) has "
                             f"no dearcomm counterpart; leave it out (dearcomm's own options: "
                             f"{sorted(set(_DDP_KWARGS.values()))}, comm_dtype for compression, ...)")
        option = _DDP_KWARGS[name]
        if option in options and options[option] != value:
            raise ValueError(f"dearcomm: prepare({option}={options[option]!r}) and "
                             f"DistributedDataParallelKwargs({name}={value!r}) disagree; give one of them")
        out[option] = value
    return out


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *others: Any,
            **options: Any) -> Tuple[Any, ...]:
    """Returns ``(model, optimizer, *others)`` prepared as ``accelerator.prepare``
    would, with ``dearcomm.wrap(model, optimizer, **options)`` in place of DDP.

    ``options`` are dearcomm.wrap()'s (README, "Options of dearcomm.wrap");
    the Accelerator's DistributedDataParallelKwargs count too
    (find_unused_parameters, broadcast_buffers, bucket_cap_mb as bucket_mb;
    one dearcomm has no counterpart for is refused).
    ``others`` are anything else for ``accelerator.prepare``: dataloaders, LR
    schedulers (built over ``optimizer``: dearcomm's shares its param_groups).
    The model is the same object, now also a dearcomm module; the optimizer is
    Accelerate's wrapper around dearcomm's. ``accelerator.clip_grad_norm_(
    model.parameters(), m)`` clips through dearcomm (clipping.py).
    """
    options = _with_ddp_kwargs(accelerator, options)
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
