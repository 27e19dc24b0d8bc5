"""What wrap()'s per-forward buffer broadcast (broadcast_buffers=True, as DDP)
costs when gradient traffic is still in flight at the forward's start: the
same model and schedule with broadcast_buffers True and False, alternated in
rounds in one process.

    sudo .venv/bin/python benchmarks/netlab.py --ranks 2 --rate 1gbit -- \\
        benchmarks/buffer_broadcast.py --model gpt --batch 8 --schedule deft --json results/buffers-deft.json

On the CPU backend the broadcast goes over the training group, behind the
sends the engine already queued on it (deft's delayed all-reduce, dear's
all-gathers), so the forward can start only when those are through. GPT's
causal mask and ResNet's BatchNorm statistics are such buffers; the MLPs
have none. Iteration = forward, loss, backward, step (the median of the
slowest rank's, after WARMUP steps per model).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import init, write_json
from models import MODELS

import dearcomm

WARMUP = 2


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="gpt")
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--schedule", default="deft")
    parser.add_argument("--partition-mb", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=4, help="timed iterations per run and round")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    init("gloo")
    rank = dist.get_rank()
    runs = {}
    for broadcast in (True, False):
        torch.manual_seed(0)
        model = MODELS[args.model]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = dearcomm.wrap(model, optimizer, schedule=args.schedule, partition_mb=args.partition_mb,
                                         broadcast_buffers=broadcast)
        runs[f"broadcast_buffers={broadcast}"] = (model, optimizer, [])
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    x, y = model.batch(args.batch, torch.Generator().manual_seed(rank))
    for round_ in range(args.rounds):
        for model, optimizer, times in runs.values():
            for i in range(args.iters + (WARMUP if round_ == 0 else 0)):
                start = time.perf_counter()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if round_ > 0 or i >= WARMUP:
                    times.append((time.perf_counter() - start) * 1e3)
            model.sync()  # the next run starts on an idle link
    medians = {name: statistics.median(times) for name, (_, _, times) in runs.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, medians)
    slowest = {name: max(m[name] for m in everyone) for name in medians}
    if rank == 0:
        print(f"# {args.model}, batch {args.batch}/rank, schedule={args.schedule} partition_mb={args.partition_mb}, "
              f"{dist.get_world_size()} ranks, buffers {buffers / 1024:.1f} KiB; "
              f"{args.rounds} rounds x {args.iters} iterations, the slowest rank's median")
        for name, ms in slowest.items():
            print(f"{name:<26} {ms:8.1f} ms")
        on, off = slowest["broadcast_buffers=True"], slowest["broadcast_buffers=False"]
        print(f"broadcasting the buffers: {on / off:.3f}x the iteration without")
    write_json(args.json, dict(vars(args), world_size=dist.get_world_size(), buffer_bytes=buffers, ms=slowest))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
