"""Runs a plan for real: one process per device (torchrun or any
torch.distributed group, rank = device), each holding its stage's layers of
an nn.Sequential, activations and gradients sent point-to-point (gloo
isend/irecv), one synchronous update per iteration, after every
micro-batch's backward (gradients accumulate over the micro-batches).

Usage contract (as for collectives): every rank builds the same model from
the same seed, the same plan (plan on one rank and broadcast it, or plan
deterministically everywhere), and calls step() with the same global batch.

One step:
  1. every receive this device will need is posted up front (irecv into
     preallocated buffers, tag 2m for micro-batch m's activation, 2m+1 for
     its gradient), so a sender never waits for its peer to reach the matching
     call: transfers start as soon as their producer ends, as the simulator
     assumes;
  2. the device runs its plan order: F waits for its activation, runs the
     stage and isends the output; B waits for its gradient, runs backward and
     isends the input's gradient (the last stage's B starts from the loss,
     scaled by 1/M so that the sum is the global batch's mean);
  3. it waits for its sends, all-reduces (sum) the gradients among its
     stage's replicas (one flat buffer; a replica that got no micro-batch
     adds zeros), and the optimizer steps.
Deadlock freedom comes from the plan: the runtime refuses orders that
deadlock (as simulate() does) and a plan that differs between ranks, and the
process group's timeout ends anything else in an error.
"""
from __future__ import annotations

import hashlib
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .plan import BACKWARD, FORWARD, Plan, check_runs_through
from .profile import check_microbatch, first_input, sequential_children


class PipelineRuntime:
    def __init__(self, model: nn.Sequential, plan: Plan, loss_fn: Callable, optimizer_factory: Callable,
                 sample_microbatch: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> None:
        """model: every rank's identical copy (each keeps its stage's children);
        loss_fn(output, target) -> mean loss of a micro-batch;
        optimizer_factory(params) -> the optimizer of this rank's stage;
        sample_microbatch: one micro-batch of inputs, to learn the boundary shapes."""
        if not dist.is_initialized():
            raise RuntimeError("dearcomm: PipelineRuntime needs torch.distributed to be initialised first")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        # Every rank learns every rank's verdict before any raises: one rank's
        # error alone left the others waiting in the next collective.
        try:
            children = sequential_children(model, "PipelineRuntime")
            _check_locally(plan, children, sample_microbatch, self.world)
            error = None
        except (TypeError, ValueError) as e:
            children, error = None, e
        _check_same_everywhere(plan, children, sample_microbatch, group, error)
        self.plan, self.loss_fn = plan, loss_fn
        self._sample = (tuple(sample_microbatch.shape), sample_microbatch.dtype)
        S = plan.num_stages
        where = plan.stage_of_device(self.rank)
        self.stage, self.replica = where if where is not None else (None, None)
        self._boundary = _boundary_buffers(plan, children, sample_microbatch)
        # Every rank creates every replica group, in stage order (new_group is collective).
        self._replicas = None
        for s, devices in enumerate(plan.devices):
            if len(devices) > 1:
                g = dist.new_group(list(devices)) if group is None else dist.new_group(
                    [dist.get_global_rank(group, d) for d in devices])
                if s == self.stage:
                    self._replicas = g
        self._last_group = None
        if len(plan.devices[-1]) > 1:
            self._last_group = self._replicas if self.stage == S - 1 else None
        if self.stage is None:
            self.module, self.optimizer = None, None
            return
        a, b = plan.stage_layers(self.stage)
        self.module = nn.Sequential(*children[a:b])
        params = list(self.module.parameters())
        self.optimizer = optimizer_factory(params) if params else None  # e.g. a stage of activations only
        self.order = plan.orders[self.rank]
        self.task_ms: Dict = {}  # (kind, microbatch) -> compute ms of the last step (wall)
        self.task_cpu_ms: Dict = {}  # the same, this thread's CPU time: without waiting for a shared core

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The global batch splits into micro-batches of the sample's shape
        and dtype: the boundary buffers were sized from it. Every rank holds
        the same batch, so every rank raises alike."""
        M = self.plan.num_microbatches
        shape, dtype = self._sample
        want = (shape[0] * M,) + shape[1:]
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"dearcomm: PipelineRuntime.step() takes the global batch's inputs as one tensor, got "
                            f"{type(inputs).__name__}")
        if tuple(inputs.shape) != want or inputs.dtype != dtype:
            raise ValueError(f"dearcomm: PipelineRuntime.step() takes a global batch of {M} micro-batches shaped "
                             f"like sample_microbatch, {dtype} of shape {want}; got {inputs.dtype} of shape "
                             f"{tuple(inputs.shape)}. A last, smaller batch of an epoch: drop it "
                             "(DataLoader(drop_last=True))")
        if not isinstance(targets, torch.Tensor) or targets.shape[:1] != inputs.shape[:1]:
            got = f"{targets.shape[0] if targets.dim() else 'no'}" if isinstance(targets, torch.Tensor) \
                else f"a {type(targets).__name__}, not a tensor of"
            raise ValueError(f"dearcomm: PipelineRuntime.step(): {inputs.shape[0]} inputs but {got} targets along "
                             "dim 0 (the last stage's loss_fn gets each micro-batch's slice of them)")

    def _peer(self, stage: int, microbatch: int) -> int:
        d = self.plan.device_of(stage, microbatch)
        return d if self.group is None else dist.get_global_rank(self.group, d)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> Optional[float]:
        """One synchronous iteration on the global batch; returns the global
        batch's mean loss on last-stage ranks, None elsewhere."""
        self._check_batch(inputs, targets)
        if self.stage is None:
            return None
        plan, s, S, M = self.plan, self.stage, self.plan.num_stages, self.plan.num_microbatches
        xs, ys = inputs.chunk(M), targets.chunk(M)
        mine = plan.microbatches_of(s, self.replica)
        acts, grads, recvs = {}, {}, {}
        for m in mine:  # 1. post every receive now
            if s > 0:
                acts[m] = torch.empty_like(self._boundary[s - 1])
                recvs[FORWARD, m] = dist.irecv(acts[m], self._peer(s - 1, m), group=self.group, tag=2 * m)
            if s < S - 1:
                grads[m] = torch.empty_like(self._boundary[s])
                recvs[BACKWARD, m] = dist.irecv(grads[m], self._peer(s + 1, m), group=self.group, tag=2 * m + 1)
        sends, saved, loss_sum = [], {}, 0.0
        for task in self.order:  # 2. the plan's order
            m = task.microbatch
            if task.kind == FORWARD:
                if s == 0:
                    x = None
                else:
                    recvs[FORWARD, m].wait()
                    x, x_in = first_input(acts[m])
                t0, c0 = time.perf_counter(), time.thread_time()
                out = self.module(xs[m] if s == 0 else x_in)
                if s == S - 1:
                    out = self.loss_fn(out, ys[m]) / M
                    loss_sum += float(out.detach())
                self.task_ms[FORWARD, m] = (time.perf_counter() - t0) * 1e3
                self.task_cpu_ms[FORWARD, m] = (time.thread_time() - c0) * 1e3
                if s < S - 1:
                    sends.append(dist.isend(out.detach().contiguous(), self._peer(s + 1, m), group=self.group,
                                            tag=2 * m))
                saved[m] = (x, out)
            else:
                x, out = saved.pop(m)
                if s < S - 1:
                    recvs[BACKWARD, m].wait()
                t0, c0 = time.perf_counter(), time.thread_time()
                if out.requires_grad:  # else nothing before it trains: a frozen or parameter-free first stage
                    out.backward(None if s == S - 1 else grads[m])
                self.task_ms[BACKWARD, m] = (time.perf_counter() - t0) * 1e3
                self.task_cpu_ms[BACKWARD, m] = (time.thread_time() - c0) * 1e3
                if s > 0:
                    grad = x.grad if x.grad is not None else torch.zeros_like(acts[m])
                    sends.append(dist.isend(grad.contiguous(), self._peer(s - 1, m), group=self.group,
                                            tag=2 * m + 1))
        for w in sends:  # 3. drain, reduce among replicas, update
            w.wait()
        if self._replicas is not None:
            self._reduce_replicas()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if s != S - 1:
            return None
        if self._last_group is not None:
            total = torch.tensor([loss_sum], dtype=torch.float64)
            dist.all_reduce(total, group=self._last_group)
            loss_sum = float(total)
        return loss_sum


    def _reduce_replicas(self) -> None:
        """Sums the gradients over the stage's replicas. Every replica
        enters, one that ran no micro-batch (more replicas than micro-batches)
        too, with zeros: the last stage's loss is scaled by 1/M, so the sum
        over all micro-batches is the global batch's gradient. One count per
        parameter goes along, so that a parameter no replica's backward
        reached keeps no gradient, as in one process."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        reached = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype)
        flat = torch._utils._flatten_dense_tensors(grads + [reached])
        dist.all_reduce(flat, group=self._replicas)
        *summed, reached = torch._utils._unflatten_dense_tensors(flat, grads + [reached])
        for p, g, n in zip(params, summed, reached.tolist()):
            p.grad = g.to(p.dtype) if n > 0 else None  # the flat buffer holds the widest dtype of the stage


def _boundary_buffers(plan: Plan, children: List[nn.Module], sample: torch.Tensor) -> List[torch.Tensor]:
    """Every stage's output shape and dtype from one no-grad pass of the whole
    model. The pass trains nothing: buffers it moves (BatchNorm's running
    statistics) are put back, as profile_sequential does."""
    kept = [(buf, buf.clone()) for child in children for buf in child.buffers()]
    out = []
    with torch.no_grad():
        x = sample
        for s in range(plan.num_stages):
            a, b = plan.stage_layers(s)
            for child in children[a:b]:
                x = child(x)
            out.append(torch.empty_like(x))
        for buf, value in kept:
            buf.copy_(value)
    return out


def _check_locally(plan: Plan, children: List[nn.Module], sample: torch.Tensor, world: int) -> None:
    """What each rank can check on its own: the sample, and a plan that fits
    this model and world and whose orders do not deadlock."""
    check_microbatch(sample, "PipelineRuntime's sample_microbatch")
    if not isinstance(plan, Plan):
        raise TypeError(f"dearcomm: PipelineRuntime takes a dearcomm.pipeline.Plan, got {type(plan).__name__}")
    used = max((d for g in plan.devices for d in g), default=-1) + 1
    if used > world:
        raise ValueError(f"dearcomm: PipelineRuntime: the plan places stages on devices up to {used - 1} but the "
                         f"process group has {world} ranks; launch {used} ranks (torchrun "
                         f"--nproc_per_node={used}) or plan for {world} devices")
    if plan.bounds and plan.bounds[-1] != len(children):
        raise ValueError(f"dearcomm: PipelineRuntime: the plan splits {plan.bounds[-1]} layers but the model has "
                         f"{len(children)} children; plan on the profile of this model")
    plan.validate(len(children), world)
    check_runs_through(plan)


def _check_same_everywhere(plan, children: Optional[List[nn.Module]], sample, group: Optional[dist.ProcessGroup],
                           error: Optional[Exception]) -> None:
    """Every rank's own verdict, then: every rank holds the same plan, model
    depth and micro-batch shape (a rank that planned otherwise would send
    activations another stage does not expect and train another network
    without an error). Raises on every rank alike."""
    text = "" if error is not None else repr((
        plan.bounds, plan.devices, sorted((d, tuple(map(str, o))) for d, o in plan.orders.items()),
        plan.num_microbatches, len(children), tuple(sample.shape), str(sample.dtype)))
    mine = (hashlib.sha256(text.encode()).hexdigest(), None if error is None else (type(error).__name__, str(error)))
    every: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    failed = [(r, why) for r, (_, why) in enumerate(every) if why is not None]
    if failed:
        if error is not None:
            raise error
        rank, (kind, message) = failed[0]
        raise (TypeError if kind == "TypeError" else ValueError)(
            f"dearcomm: PipelineRuntime failed on rank {rank}: {message.removeprefix('dearcomm: ')}")
    differ = [r for r, (h, _) in enumerate(every) if h != every[0][0]]
    if differ:
        raise ValueError(f"dearcomm: PipelineRuntime: ranks {differ} hold another plan, model depth or "
                         f"micro-batch shape than rank 0 (this rank's plan: {plan.describe()}, {len(children)} "
                         f"layers, sample {tuple(sample.shape)}). Plan on one rank and broadcast the plan "
                         "(torch.distributed.broadcast_object_list); timings differ between ranks")
