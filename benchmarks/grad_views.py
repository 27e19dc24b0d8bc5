"""A training iteration over many small gradients, with .grad as views into
the buckets against the copy path (DEARCOMM_GRAD_VIEWS=0: .grad is never a
view; every backward packs each gradient, wfbp unpacks the averages). With
views, zero_grad() (set_to_none=True) sets .grad to None, so the next backward
packs each new gradient into its slot; zero_grad(set_to_none=False) keeps the
views zero-filled, so autograd adds into the bucket and backward packs nothing.

The model is a chain of K bias-free Linear layers whose weights are 4-64 KiB
(widths ramp from 32 to 128), as the fusion microbenchmark's tensors; batch
and step are small so that the per-gradient costs show. torch DDP with
gradient_as_bucket_view False/True runs alongside for reference. Variants are
interleaved in rounds, so drift of the machine hits all alike.

    torchrun --nproc_per_node=2 benchmarks/grad_views.py [--layers 200 --rounds 8 --iters 10 --json out.json]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dearcomm


def make_model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    widths = [32 + (128 - 32) * i // layers for i in range(layers + 1)]  # 4 KiB .. 64 KiB weights
    body = []
    for a, b in zip(widths, widths[1:]):
        body += [nn.Linear(a, b, bias=False), nn.ReLU()]
    return nn.Sequential(*body)


def build(kind: str, schedule: str, update: str, args):
    model = make_model(args.layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if kind.startswith("ddp"):
        return DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb,
                                       gradient_as_bucket_view=kind == "ddp-views"), optimizer
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=args.bucket_mb, schedule=schedule, update=update)
    return model, optimizer


def timed_iterations(model, optimizer, x, iters, set_to_none=True):
    """Per iteration: (whole iteration, backward alone) in seconds."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = model(x).square().mean()
        backward_start = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        optimizer.step()
        times.append((time.perf_counter() - start, backward_end - backward_start))
    return times


def set_to_none(name: str) -> bool:
    return not name.endswith("zero-filled")  # zero_grad(set_to_none=False): the views kept, zero-filled


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per variant per round")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(args.batch, 32, generator=torch.Generator().manual_seed(rank))

    runs, baseline_of = {}, {}
    for schedule, update in (("dear", "sharded"), ("wfbp", "replicated")):
        copy_name, views_name = f"{schedule}, copy (pack)", f"{schedule}, .grad in bucket"
        runs[copy_name] = build("copy", schedule, update, args)
        runs[views_name] = build("views", schedule, update, args)
        runs[views_name + ", zero-filled"] = build("views", schedule, update, args)
        baseline_of[views_name] = baseline_of[views_name + ", zero-filled"] = copy_name
    runs["torch DDP, gradient_as_bucket_view=False"] = build("ddp-copy", None, None, args)
    runs["torch DDP, gradient_as_bucket_view=True"] = build("ddp-views", None, None, args)
    baseline_of["torch DDP, gradient_as_bucket_view=True"] = "torch DDP, gradient_as_bucket_view=False"
    packed = {}
    for name, (model, optimizer) in runs.items():
        # The switch is read when the engine is built, at the first backward.
        os.environ["DEARCOMM_GRAD_VIEWS"] = "1" if "in bucket" in name else "0"
        timed_iterations(model, optimizer, x, 3, set_to_none(name))  # warm-up: buckets, views, allocator
        if hasattr(model, "_dear"):
            packed[name] = model._dear.engine.packed_params
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, optimizer) in runs.items():
            times[name] += timed_iterations(model, optimizer, x, args.iters, set_to_none(name))

    # Every rank's iteration is as slow as the slowest rank's: the max over ranks.
    med = torch.tensor([[statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)]
                        for ts in times.values()], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    model = make_model(args.layers)
    sizes = [p.numel() * 4 for p in model.parameters()]
    if rank == 0:
        print(f"world size {world}, {len(sizes)} gradients of {min(sizes) // 1024}-{max(sizes) // 1024} KiB "
              f"({sum(sizes) / 2**20:.1f} MiB), batch {args.batch}/rank, 1 thread/rank, bucket {args.bucket_mb} MB, "
              f"{args.rounds} x {args.iters} iterations each")
        print(f"{'variant':<46}{'iter ms':>9}{'bwd ms':>9}{'packed':>8}{'iter vs copy':>14}")
        rows = {}
        iteration = {name: it for name, (it, _) in zip(times, med.tolist())}
        for (name, ts), (it, bwd) in zip(times.items(), med.tolist()):
            ratio = it / iteration[baseline_of[name]] if name in baseline_of else 1.0
            spread = statistics.quantiles([t[0] for t in ts], n=10, method="inclusive")
            rows[name] = dict(iteration_ms=1e3 * it, backward_ms=1e3 * bwd, packed_params=packed.get(name),
                              ratio_to_copy=ratio, p10_ms=1e3 * spread[0], p90_ms=1e3 * spread[-1])
            print(f"{name:<46}{1e3 * it:>9.2f}{1e3 * bwd:>9.2f}{str(packed.get(name, '-')):>8}{ratio:>14.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world_size=world, args=vars(args), results=rows), f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
