"""CPU profile of one model under each schedule, each in a quiet stretch of its
own (train_bench.py interleaves every run in one process; this does not):
rank 0 prints wall and process CPU per iteration and the top self-CPU ops.

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/profile_schedules.py --model resnet --batch 32 \\
        --runs ddp dear-sharded dear-sharded/p0.25
    sudo .venv/bin/python benchmarks/netlab.py --ranks 2 --rate 1gbit -- benchmarks/profile_schedules.py ...
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MODELS  # noqa: E402
from train_bench import build, iteration, make, settle  # noqa: E402  (train_bench's runs and loop)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="resnet")
    parser.add_argument("--model-args", nargs="*", default=[])
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--runs", nargs="+", default=["ddp", "dear-sharded"], help="train_bench run names")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for name in args.runs:
        model, optimizer = build(name, args)
        x, y = make(args).batch(args.batch, torch.Generator().manual_seed(dist.get_rank()))
        for _ in range(3):
            iteration(model, optimizer, x, y)
        settle(model)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.iters):
                iteration(model, optimizer, x, y)
            settle(model)
        wall, cpu = (time.perf_counter() - wall) / args.iters * 1e3, (time.process_time() - cpu) / args.iters * 1e3
        if dist.get_rank() == 0:
            print(f"=== {name}: {wall:.1f} ms/it wall, {cpu:.1f} ms/it process CPU (profiled)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                            max_name_column_width=50))
        del model, optimizer
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
