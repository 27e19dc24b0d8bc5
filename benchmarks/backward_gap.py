"""Where a training backward's time beyond the profiled one goes: the
backward of dearcomm.profile(group=) (ranks in step), of a plain training
loop (no hooks), of torch DDP under no_sync() (its hooks return at once:
no bucket copies, no all-reduce), of DDP, and of dearcomm's default wrap().
The first three apart show what the loop and the hooks cost; DDP against
no_sync, what its bucket copies and collectives cost the backward they run
beside.

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/backward_gap.py --model resnet --batch 32

Rounds alternate the five, the first iteration after each switch dropped;
medians of the slowest rank's backward.
"""
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import init, model_rounds_parser, slowest, write_json  # noqa: E402
from models import MODELS, fresh  # noqa: E402

import dearcomm  # noqa: E402


def timed_backwards(model, optimizer, x, y, iters, context=contextlib.nullcontext):
    """`iters` backwards' wall seconds, the ranks meeting before each forward."""
    out = []
    for _ in range(iters + 1):
        dist.barrier()
        optimizer.zero_grad()
        with context():
            loss = F.cross_entropy(model(x), y)
            start = time.perf_counter()
            loss.backward()
            out.append(time.perf_counter() - start)
        optimizer.step()
    return out[1:]  # the first after a switch


def main():
    args = model_rounds_parser(__doc__, MODELS, model="resnet", batch=32, rounds=6, iters=3).parse_args()
    init("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def adamw(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-4)
    profiled, plain, ddp = fresh(args.model), fresh(args.model), DistributedDataParallel(fresh(args.model))
    base = fresh(args.model)
    wrapped, wrapped_opt = dearcomm.wrap(base, adamw(base))
    optimizers = {m: adamw(m) for m in (profiled, plain, ddp)}
    x, y = plain.batch(args.batch, torch.Generator().manual_seed(rank))
    loss_fn = lambda out, batch: F.cross_entropy(out, batch[1])  # noqa: E731
    runs = {"profile (in step)": [], "plain loop": [], "DDP under no_sync()": [], "DDP": [], "dearcomm default": []}
    for _ in range(args.rounds):
        p = dearcomm.profile(profiled, (x, y), optimizers[profiled], loss_fn=loss_fn, iterations=args.iters,
                             group=dist.group.WORLD)
        runs["profile (in step)"].append(p.backward_ms / 1e3)  # already the slowest rank's
        runs["plain loop"] += timed_backwards(plain, optimizers[plain], x, y, args.iters)
        runs["DDP under no_sync()"] += timed_backwards(ddp, optimizers[ddp], x, y, args.iters, ddp.no_sync)
        runs["DDP"] += timed_backwards(ddp, optimizers[ddp], x, y, args.iters)
        runs["dearcomm default"] += timed_backwards(wrapped, wrapped_opt, x, y, args.iters)
    rows = {name: 1e3 * (statistics.median(v) if name.startswith("profile") else slowest(statistics.median(v)))
            for name, v in runs.items()}
    if rank == 0:
        print(f"# {args.model}, batch {args.batch}/rank, {world} ranks, {torch.get_num_threads()} thread(s)/rank, "
              f"medians of {args.rounds} rounds x {args.iters} iterations (slowest rank)")
        for name, ms in rows.items():
            print(f"{name:24}{ms:>9.1f} ms  {ms / rows['profile (in step)']:.3f}x the profile's backward")
    write_json(args.json, dict(model=args.model, batch=args.batch, world_size=world, backward_ms=rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
