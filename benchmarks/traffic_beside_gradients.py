"""What the training loop's own traffic on the training group costs while
the engine's gradient traffic is in flight: the same model and schedule with
and without it, alternated in rounds in one process.

    sudo .venv/bin/python benchmarks/netlab.py --ranks 2 --rate 1gbit -- \\
        benchmarks/traffic_beside_gradients.py --traffic loss --model widein --batch 128 --schedule deft --json results/loss-deft.json

--traffic buffers: wrap()'s per-forward buffer broadcast, broadcast_buffers
  True against False (GPT's causal mask, ResNet's BatchNorm statistics; the
  MLPs have none).
--traffic loss: a dist.all_reduce of the loss after every step (what a loop
  that logs the mean loss does) against none.
Both start while dear's all-gathers (issued in step()) or deft's delayed
all-reduce are still sending. Iteration = forward, loss, backward, step and
the loop's traffic (the median of the slowest rank's, after WARMUP steps per
model).
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
    parser.add_argument("--traffic", choices=("buffers", "loss"), default="buffers")
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
    for with_traffic in (True, False):
        torch.manual_seed(0)
        model = MODELS[args.model]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        broadcast = with_traffic or args.traffic != "buffers"
        model, optimizer = dearcomm.wrap(model, optimizer, schedule=args.schedule, partition_mb=args.partition_mb,
                                         broadcast_buffers=broadcast)
        name = f"broadcast_buffers={broadcast}" if args.traffic == "buffers" else \
            ("loss all-reduced" if with_traffic else "no loss all-reduce")
        runs[name] = (model, optimizer, with_traffic and args.traffic == "loss", [])
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    x, y = model.batch(args.batch, torch.Generator().manual_seed(rank))
    for round_ in range(args.rounds):
        for model, optimizer, log_loss, times in runs.values():
            for i in range(args.iters + (WARMUP if round_ == 0 else 0)):
                start = time.perf_counter()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if log_loss:
                    dist.all_reduce(loss.detach().clone())
                if round_ > 0 or i >= WARMUP:
                    times.append((time.perf_counter() - start) * 1e3)
            model.sync()  # the next run starts on an idle link
    medians = {name: statistics.median(times) for name, (_, _, _, times) in runs.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, medians)
    slowest = {name: max(m[name] for m in everyone) for name in medians}
    if rank == 0:
        print(f"# {args.model}, batch {args.batch}/rank, schedule={args.schedule} partition_mb={args.partition_mb}, "
              f"{dist.get_world_size()} ranks, buffers {buffers / 1024:.1f} KiB; "
              f"{args.rounds} rounds x {args.iters} iterations, the slowest rank's median")
        for name, ms in slowest.items():
            print(f"{name:<26} {ms:8.1f} ms")
        with_ms, without_ms = slowest.values()
        print(f"the loop's {args.traffic} traffic: {with_ms / without_ms:.3f}x the iteration without")
    write_json(args.json, dict(vars(args), world_size=dist.get_world_size(), buffer_bytes=buffers,
                               ms=slowest))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
