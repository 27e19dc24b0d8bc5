"""Overhead of dearcomm against torch DDP where communication is cheap.

On loopback with a compute-bound model both should take the compute time; the
ratio dearcomm/DDP shows what the engine itself costs (target: <= 1.05).
Schedules are interleaved in rounds so that drift of the machine hits all alike.

    torchrun --nproc_per_node=2 benchmarks/overhead.py [--rounds 8 --iters 10 --json out.json]
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dearcomm

RUNS = [("ddp", "ddp", None, None), ("wfbp", "wfbp", "replicated", None),
        ("dear-sharded", "dear", "sharded", None), ("dear-replicated", "dear", "replicated", None),
        ("bytescheduler", "bytescheduler", "replicated", None), ("bytescheduler/p1", "bytescheduler", "replicated", 1.0)]


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def build(schedule, update, partition, args):
    model = make_model(args.width, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if schedule == "ddp":
        return DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb), optimizer
    return dearcomm.wrap(model, optimizer, bucket_mb=args.bucket_mb, schedule=schedule, update=update,
                         partition_mb=partition)


def timed_iterations(model, optimizer, x, y, iters):
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256, help="per rank")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per schedule per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)

    runs = {name: build(schedule, update, partition, args) for name, schedule, update, partition in RUNS}
    for model, optimizer in runs.values():
        timed_iterations(model, optimizer, x, y, 3)  # warm-up: buckets, caches, allocator
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, optimizer) in runs.items():
            times[name] += timed_iterations(model, optimizer, x, y, args.iters)
            if hasattr(model, "sync"):  # untimed: what a run leaves in flight must not run into the next run
                model.sync()

    # Every rank's iteration is as slow as the slowest rank's: report the max over ranks.
    med = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    if rank == 0:
        ddp = med[0].item()
        print(f"world size {world}, {params / 1e6:.1f} M parameters, batch {args.batch}/rank, "
              f"{args.threads} thread(s)/rank, bucket {args.bucket_mb} MB, "
              f"{args.rounds} x {args.iters} iterations each")
        print(f"{'schedule':<18}{'median ms':>10}{'p10 ms':>9}{'p90 ms':>9}{'vs ddp':>8}")
        rows = {}
        for (name, t), m in zip(times.items(), med.tolist()):
            q = statistics.quantiles(t, n=10, method="inclusive")
            rows[name] = dict(median_ms=1e3 * m, p10_ms=1e3 * q[0], p90_ms=1e3 * q[-1], ratio_to_ddp=m / ddp)
            print(f"{name:<18}{1e3 * m:>10.2f}{1e3 * q[0]:>9.2f}{1e3 * q[-1]:>9.2f}{m / ddp:>8.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world_size=world, params=params, args=vars(args), results=rows), f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
