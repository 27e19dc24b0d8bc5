"""Soak: many steps of a small model; resident memory must stay flat after
warm-up. Prints RSS samples per rank and the fitted slope (KiB per 100 steps).

    torchrun --nproc_per_node=2 benchmarks/soak.py [--steps 1000 --schedule dear --json out.json]
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from common import init, write_json

import dearcomm


def rss_kib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1024


def slope_per_100_steps(points):
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--schedule", default="dear", choices=["dear", "wfbp"])
    parser.add_argument("--update", default=None, choices=["sharded", "replicated"])
    parser.add_argument("--json")
    args = parser.parse_args()

    device = init("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.LayerNorm(256), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.05, schedule=args.schedule, update=args.update)
    g = torch.Generator().manual_seed(rank)
    samples = []
    for step in tqdm(range(1, args.steps + 1), disable=rank != 0, desc=f"soak {args.schedule}", mininterval=2):
        x, y = torch.randn(32, 64, generator=g, device=device), torch.randint(0, 10, (32,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step % 100 == 0:
            model.state_dict()  # exercise the flush path too
        if step >= args.warmup and step % args.every == 0:
            samples.append((step, rss_kib()))
    slope = slope_per_100_steps(samples)
    everyone = [None] * world
    dist.all_gather_object(everyone, (samples, slope))
    if rank == 0:
        print(f"{'step':>6}" + "".join(f"{'rank ' + str(r) + ' RSS MiB':>16}" for r in range(world)))
        for i, (step, _) in enumerate(samples):
            print(f"{step:>6}" + "".join(f"{everyone[r][0][i][1] / 1024:>16.1f}" for r in range(world)))
        for r, (_, s) in enumerate(everyone):
            print(f"rank {r}: RSS slope after warm-up {s:+.1f} KiB per 100 steps")
    write_json(args.json, dict(args=vars(args), ranks=[dict(samples=s, slope_kib_per_100_steps=k)
                                                        for s, k in everyone]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
