"""Plans and trains a small MLP with pipeline stages on CPU (gloo send/recv).

    torchrun --nproc_per_node=3 examples/pipeline_train.py
    torchrun --nproc_per_node=4 examples/pipeline_train.py --microbatches 8 --steps 200

Every rank measures the links between the ranks; rank 0 profiles the model
(one micro-batch, per layer), plans it on those links, and broadcasts the
plan; every rank then runs its stage, and rank 0 prints the measured step
beside the predicted one. The data are made here: points on two interleaved spirals.
"""
import argparse
import dataclasses
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from dearcomm.pipeline import plan_pipeline, profile_sequential
from dearcomm.pipeline.measure import measure_topology
from dearcomm.pipeline.runtime import PipelineRuntime


def spirals(samples: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(samples, generator=g) * 3 * math.pi
    label = torch.randint(0, 2, (samples,), generator=g)
    r = t + math.pi * label
    x = torch.stack([r * torch.cos(t), r * torch.sin(t)], 1) / 10 + 0.05 * torch.randn(samples, 2, generator=g)
    return x, label


def make_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()
    for name in ("steps", "batch", "microbatches", "width"):  # checked before any rank waits for another
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} does not split into --microbatches {args.microbatches} equal "
                     "micro-batches; choose a batch that is a multiple of the micro-batches")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(args.width)
    x, y = spirals(args.batch * 8, seed=1)
    micro = x[: args.batch // args.microbatches]
    topology = measure_topology()  # every rank: gloo's links, not an accelerator's
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:  # one host: the stages share its cores
        topology = dataclasses.replace(topology, host_cores=len(os.sched_getaffinity(0)))
    box = [None]
    if rank == 0:
        profile = profile_sequential(model, micro, y[: len(micro)], nn.functional.cross_entropy, name="spiral-mlp",
                                     clock=time.thread_time)  # the work, without waits for a shared core
        box[0] = plan_pipeline(profile, topology, args.microbatches)
        print(f"plan for {world} processes: {box[0].describe()}", flush=True)
    dist.broadcast_object_list(box, src=0)
    plan = box[0]
    runtime = PipelineRuntime(model, plan, nn.functional.cross_entropy,
                              lambda params: torch.optim.Adam(params, lr=3e-3), micro)
    g = torch.Generator().manual_seed(2)
    warmup = min(20, args.steps // 5)  # the first steps connect the groups: not the step's time
    start = time.perf_counter()
    for step in range(args.steps):
        if step == warmup:
            dist.barrier()
            timed_from = time.perf_counter()
        idx = torch.randint(0, len(x), (args.batch,), generator=g)
        loss = runtime.step(x[idx], y[idx])
        if loss is not None and (step % 50 == 0 or step == args.steps - 1) and runtime.replica == 0:
            print(f"[rank {rank}] step {step:4d}  loss {loss:.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        end = time.perf_counter()
        print(f"{args.steps} steps in {end - start:.1f} s; after the first {warmup}, "
              f"{(end - timed_from) / (args.steps - warmup) * 1e3:.1f} ms a step (predicted "
              f"{plan.predicted_ms:.1f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
