"""dearcomm.wrap(): validation, initial broadcast, and installation."""
from __future__ import annotations

import datetime
import inspect
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from . import _exit, _options
from ._auto import AUTO, AUTO_OPTIONS, AutoPlanner, split_auto
from ._module import DearModule, make_dear_module
from ._optimizer import DistributedOptimizer
from ._options import WrapOptions
from ._runtime import DearRuntime
from ._torch_collectives import all_gather_object_within, group_timeout
from ._self_planning import SelfPlanner, plans_itself
from ._update.elementwise import is_elementwise, not_elementwise_message


def wrap(
    module: nn.Module,
    optimizer: Optimizer,
    *,
    bucket_mb: Union[float, str] = 25.0,
    partition_mb: Union[float, str, None] = None,
    blocks: Optional[Mapping[str, Sequence[int]]] = None,
    priorities: Optional[Mapping[str, int]] = None,
    max_delay: Optional[int] = None,
    delays: Optional[Mapping[str, int]] = None,
    credit_mb: Union[float, str, None] = None,
    schedule: str = "dear",
    update: Optional[str] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    timeout: Optional[datetime.timedelta] = None,
    find_unused_parameters: bool = False,
    max_grad_norm: Optional[float] = None,
    comm_dtype: Optional[torch.dtype] = None,
    broadcast_buffers: bool = True,
) -> Tuple[nn.Module, DistributedOptimizer]:
    """Makes ``module`` and ``optimizer`` train data-parallel with the DeAR schedule.

    At wrap time: checks the model and optimizer, checks that every rank built
    the same model (names, shapes, dtypes of parameters and buffers; else every
    rank raises, naming the first difference), broadcasts parameters and
    buffers from the group's first rank (as DDP does) and installs hooks. The
    first forward records the order in which modules use their parameters; the
    first backward lays out fused buckets in that order and builds the engine.

    In every iteration, schedule="dear":
      * backward: ``.grad`` is a view into its bucket (after the first step,
        where comm_dtype allows), so autograd accumulates straight into the
        bucket; other gradients are packed. Once a bucket is complete its
        reduce-scatter starts (last bucket first).
        ``.grad`` keeps this rank's local gradient; changing it before step()
        is an error (clip with ``optimizer.clip_grad_norm_`` or max_grad_norm).
        ``optimizer.zero_grad()`` sets ``.grad`` to None (the next backward
        copies each gradient into its bucket); ``zero_grad(set_to_none=False)``
        zero-fills the buckets and keeps the views.
      * ``optimizer.step()``: waits for the reduce-scatters. update="sharded":
        runs your optimizer on this rank's 1/p shard of fp32 master parameters,
        then issues the all-gathers of every bucket's parameters, in order.
        update="replicated": issues the all-gathers of averaged gradients.
      * next forward: a module's pre-hook waits for its bucket's all-gather
        (replicated: then updates, with your optimizer, every parameter whose buckets are all gathered); the later
        buckets' all-gathers run meanwhile, overlapping this module's work.
    schedule="wfbp" all-reduces each bucket during backward and finishes when
    backward ends, so ``.grad`` holds the average (as with DDP); step() runs
    your optimizer. It has the replicated update only.
    schedule="bytescheduler" all-reduces partitions under a priority queue
    (input side first) and a credit; step() does not wait: the next forward
    waits for each module's own all-reduces and updates its parameters with
    your optimizer (update="replicated" only).
    schedule="deft" all-reduces as wfbp, but applies the buckets a planner
    chose (delays) one or more steps late (each its own delay, at most
    max_delay): their all-reduces overlap the step and the next iteration.
    When backward returns, ``.grad`` holds what step() applies (for a
    delayed parameter, the average of an earlier backward; None in its
    first steps, which then skip it).

    Anything that reads parameters outside a training forward waits for the
    pending all-gathers first: ``module.sync()``, ``state_dict()``,
    ``load_state_dict()``, and forwards under ``torch.no_grad()`` or ``eval()``.

    Args:
        module: the model, on CPU (gloo). Every rank passes the same architecture.
        optimizer: a torch optimizer over (some of) the module's parameters.
            update="sharded" needs an element-wise optimizer (SGD, Adam, AdamW, ...;
            dearcomm.register_elementwise_optimizer declares others); with any
            other (Adafactor, LAMB, LARS) the update defaults to "replicated".
        bucket_mb: fusion threshold in MiB (default 25); 0 = one bucket per tensor;
            float("inf") = no cap.
        partition_mb: if set, no bucket is larger: a tensor larger than it is
            split into parts of that size, each a bucket of its own
            (ByteScheduler's partitioning); smaller tensors fuse up to it and
            are never cut. Default None: the schedule's own (32 MiB for
            "bytescheduler"; never split for the others).
        blocks: explicit pieces from a planner (US-Byte's unequal blocks):
            {parameter name: element counts of its consecutive pieces}, one
            bucket each; all but the last a multiple of
            dearcomm._C.partition_unit(world_size, dtype). Default: none.
        priorities: schedule="usbyte" only: {parameter name: rank}, lower
            goes first (a planner's order, dearcomm.usbyte); default: input
            side first.
        max_delay: schedule="deft" only: at most how many iterations late a
            bucket's averaged gradient may be applied (default 1; 0: none,
            deft is then wfbp). With schedule="auto": the planner may also
            choose deft, with delays up to this (without it, "auto" picks
            among the schedules that apply every gradient in its own step).
        delays: schedule="deft" only: {parameter name: iterations late}, as
            a planner chose them (dearcomm.deft); the parameters of a bucket
            share its delay. Default: deft plans them at the first training
            forward (see the schedule below).
        credit_mb: schedule="bytescheduler" only: MiB of all-reduces that may be
            in flight (default 64, the paper's); more wait in a priority queue,
            input side first. In flight is modelled from a link rate and tick
            spacing all ranks measure and agree on, from the fourth backward on.
            It reorders only where the partitions are well below the model's
            size: on a slow link, partition_mb=4 with credit_mb of 1 to 4
            (at most one partition in flight) was fastest, 8 and 16 slower
            where one large layer dominates (docs/benchmarks.md); the
            defaults leave the queue empty.
        schedule: "dear" (default), "wfbp", "bytescheduler", "usbyte" or "deft".

        "auto" (schedule, bucket_mb, partition_mb, credit_mb): chosen for this
            job by simulation at the first training forward: every rank times
            the collectives and profiles a few iterations of its compute on
            that batch (its state restored), rank 0 simulates every schedule
            and size left open and all ranks take its choice, logged at INFO
            on rank 0 and in ``model.auto_plan()``. Re-planned when measured
            iterations drift more than 25% from the prediction.
        update: "sharded" (default for dear) or "replicated" (default for wfbp).
        process_group: default: the default group.
        timeout: limit for one collective; default: the process group's timeout.
        find_unused_parameters: False (default): a parameter without a gradient in
            a backward raises an error naming it. True: its gradient counts as zero
            (what no_sync() accumulated, if any); one no rank used is left alone by the step.
        max_grad_norm: if set, step() clips to this global L2 norm first (see
            DistributedOptimizer.clip_grad_norm_).
        comm_dtype: gradients travel in this dtype (torch.bfloat16 / torch.float16
            halve the bytes); default: the parameters' dtype. Master shards stay fp32.
        broadcast_buffers: True (default, as DDP): after each training forward
            every rank holds rank 0's buffers (e.g. BatchNorm statistics), so
            later forwards, eval ones included, start from them. False: buffers stay per rank.

    Returns:
        ``(module, optimizer)``: the same module object, now also a
        :class:`DearModule` (``copy.deepcopy`` and ``torch.save`` of it give a
        plain, synced module of its original class), and a
        :class:`DistributedOptimizer` to use in place of ``optimizer``.
    """
    if isinstance(optimizer, Optimizer) and not is_elementwise(optimizer):
        if update == "sharded":
            raise ValueError(not_elementwise_message(optimizer))
        if update is None:
            update = "replicated"  # every schedule has it; "sharded" would silently train otherwise
    options, auto, auto_max_delay = resolve_options(bucket_mb=bucket_mb, partition_mb=partition_mb, blocks=blocks,
                                    priorities=priorities, max_delay=max_delay, delays=delays,
                                    credit_mb=credit_mb, schedule=schedule, update=update,
                                    process_group=process_group, timeout=timeout,
                                    find_unused_parameters=find_unused_parameters, max_grad_norm=max_grad_norm,
                                    comm_dtype=comm_dtype, broadcast_buffers=broadcast_buffers)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "dearcomm: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group('gloo') (e.g. under torchrun) before dearcomm.wrap()")
    if not isinstance(module, nn.Module):
        raise TypeError(f"dearcomm: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"dearcomm: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(module, DearModule):
        raise ValueError("dearcomm: this module is already wrapped; wrap each model once")
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise ValueError("dearcomm: wrap() takes the plain model, not torch's DistributedDataParallel, which "
                         "dearcomm replaces (it would average every gradient a second time): pass ddp.module, "
                         "or the model before DDP")
    if isinstance(optimizer, DistributedOptimizer):
        raise ValueError("dearcomm: this optimizer is already wrapped; pass the original torch optimizer")
    _check_parameters(module, optimizer)
    # State loaded into the optimizer before wrap() (DDP's habit): carried into the update, whose
    # sharded form would otherwise start from nothing.
    carried = optimizer.state_dict() if optimizer.state else None

    _exit.install()  # before the first collective: a clean exit beside gloo's threads (see _exit.py), errors too
    _check_same_model_on_every_rank(module, options, carried is not None, auto, auto_max_delay, optimizer)
    _broadcast_from_first_rank(module, options.process_group)
    runtime = DearRuntime(module, options)
    if auto:
        runtime.auto = AutoPlanner(runtime, module, optimizer, auto, update_given=update is not None,
                                   max_delay=auto_max_delay)
    elif plans_itself(options) and runtime.world_size > 1:
        runtime.planner = SelfPlanner(runtime, module, optimizer)  # plans at the first training forward
    wrapped = DistributedOptimizer(optimizer, runtime)
    if carried is not None:
        wrapped.load_state_dict(carried)
    wrapped_module = make_dear_module(module, runtime)
    wrapped.refuse_direct_steps()
    return wrapped_module, wrapped


def resolve_options(**options) -> Tuple[WrapOptions, Tuple[str, ...], Optional[int]]:
    """wrap()'s keyword options ("auto" included) -> the options to start
    with, the names that are "auto", and, with schedule="auto", the
    max_delay that lets it consider deft (None: it does not); a bad one
    raises, without a model or a process group (the integrations check
    theirs with it before they start)."""
    known = [name for name in inspect.signature(wrap).parameters if name not in ("module", "optimizer")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"dearcomm: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"dearcomm.wrap()'s options are {', '.join(known)}")
    schedule, names = options.get("schedule"), [entry["name"] for entry in _options._REGISTRY]
    if isinstance(schedule, str) and schedule != AUTO and schedule not in names:
        raise ValueError(f"dearcomm: unknown schedule {schedule!r}; expected one of {', '.join(names)} or "
                         f"{AUTO!r} (dearcomm chooses)")
    auto_max_delay = None
    if options.get("schedule") == AUTO and options.get("delays") is not None:
        raise ValueError("dearcomm: delays are deft's plan for one job; with schedule='auto' give max_delay, and "
                         "auto plans the delays where it picks deft")
    if options.get("schedule") == AUTO and options.get("priorities") is not None:
        raise ValueError("dearcomm: priorities are usbyte's order for one job; with schedule='auto' leave them out, "
                         "and auto plans the order where it picks usbyte")
    if options.get("schedule") == AUTO and options.get("max_delay") is not None:
        auto_max_delay = options.pop("max_delay")  # what deft may delay, if "auto" picks it
        WrapOptions(schedule="deft", max_delay=auto_max_delay)  # checks it
    start, auto = split_auto({name: options.pop(name) for name in AUTO_OPTIONS if name in options},
                             options.get("blocks"))
    return WrapOptions(**start, **options), auto, auto_max_delay


def _check_parameters(module: nn.Module, optimizer: Optimizer) -> None:
    names = {p: n for n, p in module.named_parameters()}
    optimized = set()
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if param not in names:
                raise ValueError(
                    f"dearcomm: the optimizer's param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)}) "
                    "is not a parameter of the module; build the optimizer from module.parameters()")
            optimized.add(param)
    # Another optimizer stepping them would apply .grad, which holds this rank's own gradient under most
    # schedules: the ranks would drift apart without an error.
    left_out = [n for p, n in names.items() if p.requires_grad and p not in optimized]
    if left_out:
        raise ValueError(
            f"dearcomm: trainable parameter(s) {left_out[:8]}{' and more' if len(left_out) > 8 else ''} are in no "
            "param group of the optimizer given to wrap(); every trainable parameter is averaged and updated "
            "through it. Add them to it (a param group of their own for another lr or optimizer setting), or "
            "freeze them (requires_grad_(False)) before wrap()")
    for param, name in names.items():
        if param.requires_grad and not param.is_floating_point():
            raise TypeError(f"dearcomm: parameter '{name}' has dtype {param.dtype}; only real floating-point "
                            "parameters can be trained (freeze it with requires_grad_(False))")
        if param.is_sparse:
            raise TypeError(f"dearcomm: parameter '{name}' is a sparse tensor; only dense parameters are supported")
    devices = {p.device for p in names if p.requires_grad}
    if len(devices) > 1:
        raise ValueError(f"dearcomm: parameters are on several devices {sorted(map(str, devices))}; "
                         "move the whole model to one device before wrap()")
    for device in devices:
        if device.type == "meta":
            raise ValueError("dearcomm: the parameters are on the meta device (shapes without data); materialize "
                             "them first (model.to_empty(device=...) and initialize them) and wrap() the model then")
        if device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"dearcomm: parameters on {device}; dearcomm trains on the CPU (gloo) or on "
                                      "CUDA GPUs (NCCL)")
    for name, sub in module.named_modules():
        if getattr(sub, "sparse", False) is True and isinstance(sub, (nn.Embedding, nn.EmbeddingBag)):
            raise ValueError(f"dearcomm: module '{name}' ({type(sub).__name__}) makes sparse gradients; "
                             "sparse gradients are not supported, construct it with sparse=False")


Entry = Tuple[str, str, Tuple[int, ...], str, Optional[bool]]  # kind, name, shape, dtype, requires_grad


def _signature(module: nn.Module) -> List[Entry]:
    """What the broadcast pairs up by position: every parameter, then every buffer."""
    return ([("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
            + [("buffer", n, tuple(b.shape), str(b.dtype), None) for n, b in module.named_buffers()])


def _layout_options(options: WrapOptions, auto: Sequence[str] = (), auto_max_delay: Optional[int] = None) -> dict:
    """The options every rank must share: they decide the buckets and the
    collectives (find_unused_parameters and max_grad_norm each add one,
    broadcast_buffers one per forward), as wrap() was given them ("auto"
    where it was, not the value it starts from)."""
    blocks = {name: list(pieces) for name, pieces in (options.blocks or {}).items()}  # already plain ints
    shared = dict(schedule=options.schedule, update=options.update, bucket_mb=options.bucket_mb,
                  partition_mb=options.partition_mb, blocks=blocks, priorities=dict(options.priorities or {}),
                  credit_mb=options.credit_mb, max_delay=options.max_delay, delays=dict(options.delays or {}),
                  comm_dtype=str(options.comm_dtype), find_unused_parameters=options.find_unused_parameters,
                  max_grad_norm=options.max_grad_norm, broadcast_buffers=options.broadcast_buffers)
    shared.update({name: AUTO for name in auto})
    if auto_max_delay is not None:
        shared["max_delay"] = auto_max_delay
    return shared


def _optimizer_settings(optimizer: Optimizer) -> tuple:
    """The optimizer's class and each param group's settings (lr, betas, ...)
    as plain values, comparable between ranks: a tensor by its values (its
    repr names its device), another object by its type alone."""
    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().tolist()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return type(value).__name__

    return type(optimizer).__name__, [sorted((k, plain(v)) for k, v in group.items() if k != "params")
                                      for group in optimizer.param_groups]


def _settings_difference(ours: tuple, theirs: tuple, rank: int) -> str:
    if ours[0] != theirs[0] or len(ours[1]) != len(theirs[1]):
        return (f"{ours[0]} with {len(ours[1])} param group(s) on rank 0 but {theirs[0]} with {len(theirs[1])} on "
                f"rank {rank}")
    for g, (a, b) in enumerate(zip(ours[1], theirs[1])):
        mine, other = dict(a), dict(b)
        for key in sorted(set(mine) | set(other)):
            if mine.get(key, "(none)") != other.get(key, "(none)"):
                return (f"param_groups[{g}][{key!r}] is {mine.get(key, '(none)')!r} on rank 0 but "
                        f"{other.get(key, '(none)')!r} on rank {rank}")
    return "their settings differ"


def _check_same_model_on_every_rank(module: nn.Module, options: WrapOptions, optimizer_state: bool,
                                    auto: Sequence[str], auto_max_delay: Optional[int], optimizer: Optimizer) -> None:
    """A rank with another model would pair up other tensors in the broadcast, or
    wait in it until the timeout, and one with other buckets or schedule would
    issue other collectives; one all-gather of the signatures and those options
    lets every rank raise the same error at once instead. ``optimizer_state``:
    whether this rank's optimizer holds state (loaded before wrap()): a rank
    without it would train from other moments than the rest."""
    group = options.process_group or dist.group.WORLD
    everyone = all_gather_object_within((_signature(module), _layout_options(options, auto, auto_max_delay),
                                         optimizer_state, _optimizer_settings(optimizer)), group,
                                        group_timeout(group), "wrap()'s check that every rank built the same model",
                                        next(module.parameters(), torch.empty(0)).device)
    signatures, layouts, states, settings = zip(*everyone)
    me = dist.get_rank(group)
    without = _unlike_rank_0(states)
    if without:
        holds = "holds" if states[0] else "does not hold"
        raise ValueError(
            f"dearcomm: [rank {me}] rank 0's optimizer {holds} state (loaded before wrap()) and "
            f"rank {without[0]}'s {'does not' if states[0] else 'does'} (ranks that differ: {without}); load the "
            "optimizer's state on every rank, before or right after wrap()")
    differing = _unlike_rank_0(layouts)
    if differing:
        other = differing[0]
        changed = {k: (v, layouts[other][k]) for k, v in layouts[0].items() if layouts[other][k] != v}
        raise ValueError(
            f"dearcomm: [rank {me}] rank {other} passed other wrap() options than rank 0 (ranks "
            f"that differ: {differing}): " + ", ".join(f"{k}={a!r} on rank 0 but {b!r} on rank {other}"
                                                      for k, (a, b) in changed.items())
            + ". Every rank must pass the same options: they decide the collectives.")
    differing = _unlike_rank_0(signatures)
    if differing:
        other = differing[0]
        raise ValueError(
            f"dearcomm: [rank {me}] rank {other}'s model differs from rank 0's (ranks that "
            f"differ: {differing}): {_first_difference(signatures[0], signatures[other], other)}. Every rank must "
            "build the same model (same layers, shapes, dtypes and frozen parameters) before wrap().")
    differing = _unlike_rank_0(settings)
    if differing:
        other = differing[0]
        raise ValueError(
            f"dearcomm: [rank {me}] rank {other}'s optimizer differs from rank 0's (ranks that "
            f"differ: {differing}): {_settings_difference(settings[0], settings[other], other)}. Every rank must "
            "build the same optimizer: each rank would update its shard of the parameters with its own settings "
            "(under DDP the ranks would drift apart).")


def _unlike_rank_0(values: Sequence) -> List[int]:
    """The ranks whose value differs from rank 0's."""
    return [r for r, theirs in enumerate(values) if theirs != values[0]]


def _first_difference(expected: List[Entry], got: List[Entry], rank: int) -> str:
    """The first tensor, in rank 0's order, that rank `rank` lacks or has otherwise; else its first extra one."""
    theirs = {entry[:2]: entry for entry in got}
    ours = {entry[:2]: entry for entry in expected}
    for entry in expected:
        other = theirs.get(entry[:2])
        if other is None:
            return f"{_name(entry)} {_describe(entry)} is missing on rank {rank}"
        if other != entry:
            return f"{_name(entry)} is {_describe(entry)} on rank 0 but {_describe(other)} on rank {rank}"
    for entry in got:
        if entry[:2] not in ours:
            return f"{_name(entry)} {_describe(entry)} is extra on rank {rank}"
    i = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    return (f"the same tensors, registered in another order: {_name(expected[i])} comes where rank {rank} "
            f"has {_name(got[i])}")


def _name(entry: Entry) -> str:
    return f"{entry[0]} '{entry[1]}'"


def _describe(entry: Entry) -> str:
    _, _, shape, dtype, requires_grad = entry
    return f"(shape {shape}, {dtype}{', frozen' if requires_grad is False else ''})"


@torch.no_grad()
def _broadcast_from_first_rank(module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Every rank starts from the first rank's parameters and buffers, as with DDP."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src=source, group=group)
