"""Profile a model's training iteration on this machine, in the form the
simulator reads (dearcomm.simulate): per-module forward and backward times,
when each gradient becomes ready, the parameters' sizes in forward order,
the optimizer step's time, and what copying the gradients into a flat
buffer and dividing it in place cost per MiB (the engine's pack and average
of a bucket, timed after each backward).

    profile = dearcomm.profile(model, (x, y), optimizer, loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]))
    profile.save("profile.json")                  # with the machine and torch versions
    p = dearcomm.simulate(dearcomm.TrainingProfile.load("profile.json"), world_size=8,
                          network=dearcomm.Network(alpha_us=30, gbit_s=10))

A "module" is one that owns parameters directly, as the engine hooks them: its
forward time runs from its first call to the next such module's first call
(what runs between them, activations and pooling, is counted with the module
before), so the modules' forward times add up to the whole forward; its
backward time runs from the previous module's last gradient (in backward
order) to its own last one, and what backward does after the last gradient
is counted with the first module. Times are medians over `iterations` timed
iterations after `warmup` untimed ones, with no communication.

With ``group=`` (every rank of it calls profile() at once), the ranks run each
iteration as synchronous data-parallel training does: they start its forward
and its optimizer step together (untimed barriers), and each iteration is
described by the rank that took longest over it, which the others wait for in
training. Every rank returns that same profile. Ranks that share a machine's
memory bandwidth and caches compute more slowly in step than one at a time
(measured here: an optimizer step 1.1-1.35x, a whole iteration 3-13% with the
slowest rank), so a profile for predicting a job's iterations is taken so.

The model's and the optimizer's state are restored afterwards: profiling
trains nothing.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import platform
import statistics
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._lockstep import Lockstep
from ._step_hooks import step_without_hooks
from .prediction import ModuleProfile, _check_number

FORMAT = "dearcomm-profile"
PASS_BYTES = 256 * 2**20  # the most gradient memory a profile copies to time a pack
VERSION = 1


@dataclasses.dataclass(frozen=True)
class ParamProfile:
    name: str
    numel: int
    dtype: torch.dtype
    grad_ready_ms: float
    """When its gradient was accumulated, from the start of backward (median)."""


@dataclasses.dataclass(frozen=True)
class ProfiledModule:
    name: str
    forward_ms: float
    backward_ms: float
    params: Sequence[ParamProfile]


@dataclasses.dataclass(frozen=True)
class TrainingProfile:
    """One rank's training iteration, measured (see the module's docstring)."""
    modules: Sequence[ProfiledModule]
    """Modules that own parameters, in the order of their first forward call."""
    step_ms: float
    """optimizer.step() over the whole model (0 without an optimizer)."""
    forward_ms: float
    backward_ms: float
    machine: Dict[str, Any]
    iterations: int
    pack_ms_per_mib: float = 0.0
    """Copying gradients into a flat buffer, per MiB (what the engine's pack of
    a bucket costs the host where .grad is not the bucket view)."""
    average_ms_per_mib: float = 0.0
    """Dividing a flat buffer in place, per MiB (the average after a reduction)."""

    def for_simulation(self) -> List[ModuleProfile]:
        """The modules as dearcomm.simulate reads them, their times scaled to
        add up to the whole forward and the whole backward, as they do in
        each iteration: each is a median over the iterations, and the medians
        of many short times, each delayed now and then by another process on
        the core, add up to less than the median whole (ResNet, 4 ranks on 2
        cores: 528 ms against 573). The times are checked first (a profile
        edited in memory, dataclasses.replace, too): a NaN total would read
        as none, a NaN ready time as the module's start."""
        for name in ("forward_ms", "backward_ms", "step_ms", "pack_ms_per_mib", "average_ms_per_mib"):
            _check_number(f"TrainingProfile.{name}", getattr(self, name), allow_zero=True)
        for m in self.modules:
            for p in m.params:
                _check_number(f"param {p.name!r} grad_ready_ms", p.grad_ready_ms, allow_zero=True)
        forward = _to_total(self.forward_ms, [m.forward_ms for m in self.modules])
        backward = _to_total(self.backward_ms, [m.backward_ms for m in self.modules])
        return [ModuleProfile(m.name, m.forward_ms * forward, m.backward_ms * backward, [p.numel for p in m.params],
                              _dominant_dtype(m), [p.dtype for p in m.params],
                              [f * m.backward_ms * backward for f in shares])
                for m, shares in zip(self.modules, self._grad_ready_shares())]

    def _grad_ready_shares(self) -> List[List[float]]:
        """Per module, per parameter: how far into the module's backward its
        gradient is ready, as a share of it (0 to 1). A module's backward runs
        from the gradient before it (in backward order) to its own last one;
        the tail that the first module also counts (backward after the last
        gradient) comes before its gradients here, as it does with all of a
        module's gradients at its end."""
        shares: List[List[float]] = [[] for _ in self.modules]
        begin = 0.0  # the module's backward begins at the previous one's last gradient (from the end of forward)
        for i in reversed(range(len(self.modules))):
            ready = [p.grad_ready_ms for p in self.modules[i].params]
            end = max(ready, default=begin)
            span = end - begin
            shares[i] = [min(1.0, max(0.0, (r - begin) / span)) if span > 0 else 1.0 for r in ready]
            begin = max(begin, end)
        return shares

    @property
    def num_params(self) -> int:
        return sum(len(m.params) for m in self.modules)

    def to_dict(self) -> Dict[str, Any]:
        return dict(format=FORMAT, version=VERSION, machine=self.machine, iterations=self.iterations,
                    step_ms=self.step_ms, forward_ms=self.forward_ms, backward_ms=self.backward_ms,
                    pack_ms_per_mib=self.pack_ms_per_mib, average_ms_per_mib=self.average_ms_per_mib,
                    modules=[dict(name=m.name, forward_ms=m.forward_ms, backward_ms=m.backward_ms,
                                  params=[dict(name=p.name, numel=p.numel, dtype=str(p.dtype).replace("torch.", ""),
                                               grad_ready_ms=p.grad_ready_ms) for p in m.params])
                             for m in self.modules])

    @classmethod
    def median_of(cls, profiles: Sequence["TrainingProfile"]) -> "TrainingProfile":
        """One profile from several of the same model: each time the median of
        theirs. On a machine whose speed drifts (shared cores, memory
        bandwidth), profiles taken at intervals across a run describe it
        better than one taken at its start."""
        profiles = list(profiles)
        if not profiles or not all(isinstance(p, TrainingProfile) for p in profiles):
            raise ValueError("dearcomm: median_of() takes one or more TrainingProfile objects")
        def shape(profile):
            return [(m.name, [(p.name, p.numel) for p in m.params]) for m in profile.modules]

        for i, other in enumerate(profiles[1:], 1):
            if shape(other) != shape(profiles[0]):
                raise ValueError(f"dearcomm: median_of(): profile {i} has other modules or parameters than "
                                 "profile 0; combine profiles of the same model only")
        med = statistics.median
        modules = [ProfiledModule(m.name, med(p.modules[i].forward_ms for p in profiles),
                                  med(p.modules[i].backward_ms for p in profiles),
                                  [dataclasses.replace(q, grad_ready_ms=med(p.modules[i].params[j].grad_ready_ms
                                                                             for p in profiles))
                                   for j, q in enumerate(m.params)])
                   for i, m in enumerate(profiles[0].modules)]
        return cls(modules=modules, step_ms=med(p.step_ms for p in profiles),
                   forward_ms=med(p.forward_ms for p in profiles), backward_ms=med(p.backward_ms for p in profiles),
                   machine=profiles[0].machine, iterations=sum(p.iterations for p in profiles),
                   pack_ms_per_mib=med(p.pack_ms_per_mib for p in profiles),
                   average_ms_per_mib=med(p.average_ms_per_mib for p in profiles))

    @classmethod
    def from_dict(cls, data: Dict[str, Any], source: str = "the profile") -> "TrainingProfile":
        """Checks every field; a bad one raises ValueError naming it."""
        return _parse(data, source)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Writes the profile as JSON. Every rank may save to one shared path
        and load it at once: the file is written beside and renamed into
        place, so a reader sees a whole profile, never a half-written one."""
        path = Path(path)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")  # created as open() creates a file
        try:
            with open(partial, "x") as f:
                f.write(json.dumps(self.to_dict(), indent=1) + "\n")
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "TrainingProfile":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"dearcomm: {path} is not a JSON profile: {e}") from None
        return _parse(data, str(path))


def profile(model: nn.Module, batch: Any, optimizer: Optional[torch.optim.Optimizer] = None, *,
            loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, iterations: int = 5,
            warmup: int = 2, group: Optional[Any] = None, find_unused_parameters: bool = False) -> TrainingProfile:
    """Times `iterations` training iterations of `model` on `batch` (after
    `warmup` untimed ones) and returns the medians.

    The model is called as ``model(**batch)`` for a dict, ``model(batch[0])``
    for a tuple or list (input, target, ...), else ``model(batch)``.
    ``loss_fn(output, batch)`` gives the loss; without one, the output's
    ``.loss`` (Hugging Face models), or the output itself if it is a scalar,
    or the sum of the output. Give the plain model, before dearcomm.wrap or DDP.
    ``group``: a process group whose ranks all call profile() at once, to
    profile them in step as they train (see the module's docstring).
    ``find_unused_parameters`` as wrap()'s: a parameter without a gradient
    is taken as ready when backward ends, where the engine reduces it
    (without it, such a parameter is an error)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"dearcomm: profile() takes an nn.Module, got {type(model).__name__}")
    if hasattr(model, "_dear") or isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("dearcomm: profile() the plain model, before dearcomm.wrap() or DDP: a wrapped model "
                         "communicates, and the profile is of one rank's compute")
    for name, value in (("iterations", iterations), ("warmup", warmup)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "iterations" else 0):
            raise ValueError(f"dearcomm: {name} must be an int >= {1 if name == 'iterations' else 0}, got {value!r}")
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    return profile_calls(model, lambda: _loss(model, batch, loss_fn), optimizer, iterations=iterations,
                         warmup=warmup, group=group, find_unused_parameters=find_unused_parameters)


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """profile() steps ``optimizer`` as the model's own: the time of its step
    is the profile's step_ms."""
    if getattr(optimizer, "_runtime", None) is not None:  # DistributedOptimizer, by duck type: no import cycle
        raise ValueError("dearcomm: profile() takes the plain model's own optimizer, not the one dearcomm.wrap() "
                         "returned (that one steps the wrapped model, after its backward): build one over the plain "
                         "model's parameters, e.g. torch.optim.AdamW(plain_model.parameters())")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"dearcomm: profile()'s optimizer must be a torch.optim.Optimizer (or None), "
                        f"got {type(optimizer).__name__}")
    trainable = {p for p in model.parameters() if p.requires_grad}
    held = {p for group in optimizer.param_groups for p in group["params"]}
    if not held & trainable:
        raise ValueError("dearcomm: profile()'s optimizer holds none of the model's parameters (an optimizer of "
                         "another model?); its step would not be the model's: pass one built over "
                         "model.parameters()")
    if trainable - held:
        raise ValueError(f"dearcomm: profile()'s optimizer leaves {len(trainable - held)} of the model's "
                         f"{len(trainable)} trainable parameters out; profile with the one optimizer that steps "
                         f"them all (as wrap() takes)")


def profile_calls(model: nn.Module, compute_loss: Callable[[], torch.Tensor],
                  optimizer: Optional[torch.optim.Optimizer] = None, *, iterations: int = 5,
                  warmup: int = 2, group: Optional[Any] = None,
                  find_unused_parameters: bool = False) -> TrainingProfile:
    """profile() for a caller that runs the forward itself: ``compute_loss()``
    runs one forward of ``model`` and returns a scalar loss. The model's and
    the optimizer's state are restored afterwards (wrap()'s "auto" profiles
    the user's first batch this way). ``find_unused_parameters`` (wrap()'s):
    a parameter that gets no gradient in an iteration is taken as ready when
    its backward ends, where the engine reduces it, instead of an error."""
    params = {p: n for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("dearcomm: the model has no parameter that requires grad; there is nothing to profile")
    lockstep = Lockstep(group, next(iter(params)).device) if group is not None else None
    try:
        saved_model = copy.deepcopy(model.state_dict())
        saved_optimizer = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    except Exception as e:  # out of memory, say: the other ranks must not wait at the first meeting
        if lockstep is not None:
            lockstep.start(warmup + iterations, steps=optimizer is not None, failure=e)
        raise
    if lockstep is not None:
        lockstep.start(warmup + iterations, steps=optimizer is not None)
    was_training = model.training
    model.train()
    try:
        probe = _Probe(model, params, lockstep)
        try:
            samples = probe.run(compute_loss, optimizer, warmup + iterations)[warmup:]
        finally:
            probe.remove()
    finally:
        model.load_state_dict(saved_model)
        if optimizer is not None:
            optimizer.load_state_dict(saved_optimizer)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    try:
        measured = _per_iteration(samples, probe, params, find_unused_parameters)
    except ValueError as e:
        if lockstep is None:
            raise
        measured = e  # the other ranks raise it too
    machine = _machine(probe.cuda)
    if lockstep is not None:
        measured = _slowest_rank(lockstep.gather(measured))
        machine["ranks_in_step"] = lockstep.world_size
    return _summarise(*measured, machine, iterations)


# ---- measuring -------------------------------------------------------------

class _Probe:
    """Hooks that stamp every owning module's first forward call and every
    parameter's gradient accumulation, per iteration; with a Lockstep, the
    ranks start each forward and each optimizer step together."""

    def __init__(self, model: nn.Module, params: Dict[nn.Parameter, str], lockstep: Optional[Lockstep] = None):
        self.model = model
        self.lockstep = lockstep
        self.cuda = any(p.is_cuda for p in params)
        self.names: Dict[nn.Module, str] = {}
        self.handles = []
        for name, sub in model.named_modules():
            self.names[sub] = name or type(model).__name__
            self.handles.append(sub.register_forward_pre_hook(self._on_forward))
        for p in params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.forward_order: Optional[List[nn.Module]] = None
        self.params = list(params)
        self.flat: Optional[torch.Tensor] = None  # _passes()'s buffer

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _on_forward(self, module: nn.Module, args) -> None:
        if module not in self.calls:
            self.calls[module] = self.now()

    def _on_grad(self, param: nn.Parameter) -> None:
        self.ready[param] = self.now()

    def _meet(self) -> None:
        if self.lockstep is not None:
            self.lockstep.meet()

    def run(self, compute_loss: Callable[[], torch.Tensor], optimizer, count: int) -> List[Dict[str, Any]]:
        """`count` iterations' stamps (in lockstep, after its first
        meeting). In lockstep, a rank that fails tells the others before it
        raises; a last meeting catches a failure in the last iteration."""
        try:
            samples = [self.iteration(compute_loss, optimizer) for _ in range(count)]
            self._meet()
        except BaseException as e:
            if self.lockstep is not None:
                self.lockstep.fail(e)
            raise
        return samples

    def iteration(self, compute_loss: Callable[[], torch.Tensor], optimizer) -> Dict[str, Any]:
        self.calls: Dict[nn.Module, float] = {}
        self.ready: Dict[nn.Parameter, float] = {}
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        self._meet()
        start = self.now()
        loss = compute_loss()
        forward_end = self.now()
        loss.backward()
        backward_end = self.now()
        pack_per_mib, average_per_mib = self._passes()
        step_start = step_end = self.now()
        if optimizer is not None:
            self._meet()
            step_start = self.now()
            step_without_hooks(optimizer)  # profiling steps are not the user's steps
            step_end = self.now()
        order = list(self.calls)  # in the order of their first call
        if self.forward_order is None:
            self.forward_order = order
        elif order != self.forward_order:
            raise ValueError("dearcomm: the model's modules ran in another order than in the first iteration; "
                             "profile a model whose forward does the same work every iteration")
        return dict(start=start, forward_end=forward_end, backward_end=backward_end, step_start=step_start,
                    step_end=step_end, calls=self.calls, ready=self.ready, pack_per_mib=pack_per_mib,
                    average_per_mib=average_per_mib)

    def _passes(self) -> Tuple[float, float]:
        """Seconds per MiB to copy this backward's gradients into a flat
        buffer (the engine's pack) and to divide it in place (its average):
        the gradients of the first parameters' dtype, up to PASS_BYTES."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0, 0.0  # _per_iteration names the parameters without a gradient
        grads = [g for g in grads if g.dtype == grads[0].dtype]
        chosen, size = [], 0
        for g in grads:
            if chosen and size + g.nbytes > PASS_BYTES:
                break
            chosen.append(g.reshape(-1))
            size += g.nbytes
        numel = size // chosen[0].element_size()
        if self.flat is None or self.flat.dtype != chosen[0].dtype or self.flat.numel() < numel:
            self.flat = torch.empty(numel, dtype=chosen[0].dtype, device=chosen[0].device)
        flat = self.flat[:numel]
        begin = self.now()
        torch.cat(chosen, out=flat)
        packed = self.now()
        flat.div_(2)
        averaged = self.now()
        mib = flat.nbytes / 2**20
        return (packed - begin) / mib, (averaged - packed) / mib

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _loss(model: nn.Module, batch, loss_fn) -> torch.Tensor:
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(batch[0])
    else:
        output = model(batch)
    if loss_fn is not None:
        loss = loss_fn(output, batch)
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, torch.Tensor):
        loss = output if output.dim() == 0 else output.float().sum()
    else:
        raise ValueError(f"dearcomm: the model returned a {type(output).__name__} without .loss; give "
                         "profile() a loss_fn(output, batch)")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("dearcomm: loss_fn must return a scalar tensor")
    return loss


# What one iteration measured, in plain numbers (seconds), as ranks exchange it:
# per module (forward order) its forward and backward, per parameter (the
# modules' order) its gradient's ready time from the end of forward, the totals.
_Timed = Dict[str, Any]
# The modules in forward order: (name, [(parameter name, numel, dtype name)]).
_Layout = List[Tuple[str, List[Tuple[str, int, str]]]]


def _per_iteration(samples: List[Dict[str, Any]], probe: _Probe, params: Dict[nn.Parameter, str],
                   find_unused_parameters: bool = False) -> Tuple[_Layout, List[_Timed]]:
    owned = _readers(probe.model, probe.forward_order, params)
    order = [m for m in probe.forward_order if owned.get(m)]
    no_grad = [params[p] for p in params if any(p not in s["ready"] for s in samples)]
    if no_grad and not find_unused_parameters:
        raise ValueError(f"dearcomm: {len(no_grad)} parameter(s) got no gradient: {no_grad[:8]}; every parameter "
                         "that requires grad must take part in the loss, or find_unused_parameters=True (as in wrap()) "
                         "takes it as ready when backward ends")
    timed = []
    for s in samples:
        s = dict(s, ready={p: s["ready"].get(p, s["backward_end"]) for p in params})  # unused: at backward's end
        # Forward: from each module's first call to the next one's; before the first, counted with the first.
        bounds = [s["start"]] + [s["calls"][m] for m in order[1:]] + [s["forward_end"]]
        forward = [bounds[i + 1] - bounds[i] for i in range(len(order))]
        # Backward, last module first: from the previous module's last gradient to this one's.
        backward = [0.0] * len(order)
        previous = s["forward_end"]
        for i in reversed(range(len(order))):
            ready = max(s["ready"][p] for p in owned[order[i]])
            backward[i] = max(0.0, ready - previous)
            previous = max(previous, ready)
        backward[0] += max(0.0, s["backward_end"] - previous)
        timed.append(dict(forward=forward, backward=backward,
                          ready=[s["ready"][p] - s["forward_end"] for m in order for p in owned[m]],
                          forward_total=s["forward_end"] - s["start"],
                          backward_total=s["backward_end"] - s["forward_end"],
                          step=s["step_end"] - s["step_start"], pack_per_mib=s["pack_per_mib"],
                          average_per_mib=s["average_per_mib"]))
    layout = [(probe.names[m], [(params[p], p.numel(), str(p.dtype).replace("torch.", "")) for p in owned[m]])
              for m in order]
    return layout, timed


def _to_total(total: float, parts: Sequence[float]) -> float:
    """The factor that makes ``parts`` add up to ``total`` (1 where either is 0)."""
    summed = sum(parts)
    return total / summed if total > 0 and summed > 0 else 1.0


def _slowest_rank(gathered: List[Tuple[_Layout, List[_Timed]]]) -> Tuple[_Layout, List[_Timed]]:
    """Each iteration as the rank that took longest over it had it."""
    layout = gathered[0][0]
    for rank, (other, _) in enumerate(gathered[1:], 1):
        if other != layout:
            raise ValueError(f"dearcomm: profile(): rank {rank} profiled other modules or parameters than rank 0; "
                             "profile the same model on every rank of the group")
    total = lambda t: t["forward_total"] + t["backward_total"] + t["step"]  # noqa: E731
    return layout, [max(iteration, key=total) for iteration in zip(*(timed for _, timed in gathered))]


def _summarise(layout: _Layout, timed: List[_Timed], machine: Dict[str, Any], iterations: int) -> TrainingProfile:
    ms = 1e3

    def med(values) -> float:
        return statistics.median(values) * ms

    modules, j = [], 0
    for i, (name, owned) in enumerate(layout):
        params = [ParamProfile(pname, numel, getattr(torch, dtype), med(t["ready"][j + k] for t in timed))
                  for k, (pname, numel, dtype) in enumerate(owned)]
        j += len(owned)
        modules.append(ProfiledModule(name, med(t["forward"][i] for t in timed), med(t["backward"][i] for t in timed),
                                      params))
    return TrainingProfile(modules=modules, step_ms=med(t["step"] for t in timed),
                           forward_ms=med(t["forward_total"] for t in timed),
                           backward_ms=med(t["backward_total"] for t in timed), machine=machine,
                           iterations=iterations, pack_ms_per_mib=med(t["pack_per_mib"] for t in timed),
                           average_ms_per_mib=med(t["average_per_mib"] for t in timed))


def _readers(model: nn.Module, called: List[nn.Module], params: Dict[nn.Parameter, str]
             ) -> Dict[nn.Module, List[nn.Parameter]]:
    """Which module's forward reads each parameter, as the engine decides it:
    the first module in forward order that owns it (tied weights), or, for an
    owner the forward never called (nn.MultiheadAttention reads out_proj's
    weight without calling out_proj), its nearest called ancestor."""
    parent: Dict[nn.Module, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parent.setdefault(child, module)
    position = {m: i for i, m in enumerate(called)}
    reader_of: Dict[nn.Parameter, nn.Module] = {}
    for module in model.modules():
        reader = module
        while reader not in position and reader in parent:
            reader = parent[reader]
        if reader not in position:
            continue
        for p in module.parameters(recurse=False):
            if p in params and (p not in reader_of or position[reader] < position[reader_of[p]]):
                reader_of[p] = reader
    missing = [name for p, name in params.items() if p not in reader_of]
    if missing:
        raise ValueError(f"dearcomm: {len(missing)} parameter(s) belong to no module the forward called: "
                         f"{missing[:8]}; freeze them (requires_grad_(False)) or profile a model that uses them")
    readers: Dict[nn.Module, List[nn.Parameter]] = {}
    for p in params:  # registration order within a module
        readers.setdefault(reader_of[p], []).append(p)
    return readers


def _machine(cuda: bool) -> Dict[str, Any]:
    info = dict(torch=torch.__version__, python=platform.python_version(), platform=platform.platform(),
                processor=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                torch_threads=torch.get_num_threads(), device="cpu")
    if cuda:
        info.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def _dominant_dtype(module: ProfiledModule) -> torch.dtype:
    """The dtype most of the module's elements have (a module's parameters
    almost always share one)."""
    sizes: Dict[torch.dtype, int] = {}
    for p in module.params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel
    return max(sizes, key=sizes.get)


# ---- loading ---------------------------------------------------------------

def _parse(data: Any, source: str) -> TrainingProfile:
    def fail(what: str) -> ValueError:
        return ValueError(f"dearcomm: {source}: {what}")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise fail(f"not a dearcomm profile (expected a JSON object with \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise fail(f"profile version {data.get('version')!r}; this dearcomm reads version {VERSION}")

    def time_ms(obj: Dict[str, Any], key: str, where: str) -> float:
        if key not in obj:
            raise fail(f"{where} has no {key!r}")
        value = obj[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise fail(f"{where} has {key} = {value!r}; expected a finite number >= 0")
        return float(value)

    modules = data.get("modules")
    if not isinstance(modules, list) or not modules:
        raise fail("no modules")
    parsed, names, param_of = [], set(), {}
    for i, m in enumerate(modules):
        if not isinstance(m, dict) or not isinstance(m.get("name"), str):
            raise fail(f"module {i} has no name")
        where = f"module {m['name']!r}"
        if m["name"] in names:
            raise fail(f"{where} appears twice")
        names.add(m["name"])
        raw_params = m.get("params")
        if not isinstance(raw_params, list) or not raw_params:
            raise fail(f"{where} has no params")
        params = []
        for j, p in enumerate(raw_params):
            pwhere = f"{where} param {p.get('name', j) if isinstance(p, dict) else j!r}"
            if not isinstance(p, dict) or not isinstance(p.get("name"), str):
                raise fail(f"{pwhere} has no name")
            numel = p.get("numel")
            if not isinstance(numel, int) or isinstance(numel, bool) or numel < 1:
                raise fail(f"{pwhere} has numel = {numel!r}; expected an int >= 1")
            dtype = getattr(torch, str(p.get("dtype")), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise fail(f"{pwhere} has dtype {p.get('dtype')!r}; expected a floating dtype such as 'float32'")
            if p["name"] in param_of:
                raise fail(f"param {p['name']!r} appears twice (modules {param_of[p['name']]!r} and {m['name']!r})")
            param_of[p["name"]] = m["name"]
            params.append(ParamProfile(p["name"], numel, dtype, time_ms(p, "grad_ready_ms", pwhere)))
        parsed.append(ProfiledModule(m["name"], time_ms(m, "forward_ms", where), time_ms(m, "backward_ms", where),
                                     params))
    iterations = data.get("iterations")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise fail(f"iterations = {iterations!r}; expected an int >= 1")
    machine = data.get("machine", {})
    if not isinstance(machine, dict):
        raise fail("machine must be an object")
    # Profiles saved before these were measured read 0: no pack or average cost.
    passes = {key: time_ms(data, key, "the profile") if key in data else 0.0
              for key in ("pack_ms_per_mib", "average_ms_per_mib")}
    backward_ms = time_ms(data, "backward_ms", "the profile")
    late = [(p.name, p.grad_ready_ms) for m in parsed for p in m.params
            if p.grad_ready_ms > backward_ms * (1 + 1e-9) + 1e-9]
    if late:  # ready times count from the end of the whole forward: none lies past the backward's end
        raise fail(f"param {late[0][0]!r} has grad_ready_ms = {late[0][1]!r}, past the end of backward "
                   f"(backward_ms = {backward_ms!r}; ready times count from the end of forward)")
    return TrainingProfile(modules=parsed, step_ms=time_ms(data, "step_ms", "the profile"),
                           forward_ms=time_ms(data, "forward_ms", "the profile"),
                           backward_ms=backward_ms, machine=machine, iterations=iterations, **passes)
