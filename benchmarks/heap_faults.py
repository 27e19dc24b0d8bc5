"""Page faults and glibc heap state of training runs that share one process.

    torchrun --nproc_per_node=4 benchmarks/heap_faults.py --runs ddp wfbp/p0.25
    MALLOC_TRIM_THRESHOLD_=1073741824 torchrun ... --runs ddp wfbp/p0.25     # a fixed policy

Each run (train_bench.py's names) trains its own copy of the model, interleaved
in rounds as in train_bench.py; per timed iteration this records the process's
minor page faults and, at the end, mallinfo2() (all arenas). On CPU, a minor
fault per 4 KiB page is what glibc's heap trimming costs: memory returned to
the kernel at free() is faulted in again by the next iteration's allocations.
How much of it a run pays depends on where the heap's top happens to be, i.e.
on what else has allocated in the process (docs/benchmarks.md, "Findings: ResNet at 4 ranks").
"""
import argparse
import ctypes
import os
import resource
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_bench  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def mallinfo2() -> MallInfo2:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="train_bench.py run names")
    parser.add_argument("--model", choices=list(train_bench.MODELS), default="resnet")
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    for name in args.runs:
        train_bench.parse_run(name)
    bench_args = argparse.Namespace(model=args.model, model_args=[], batch=args.batch, bucket_mb=25.0)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(train_bench.threads_per_rank(dist.get_world_size()))
    x, y = train_bench.make(bench_args).batch(args.batch, torch.Generator().manual_seed(rank))
    runs = {name: train_bench.build(name, bench_args) for name in args.runs}
    train_bench.warm_up(runs, x, y)

    faults = {name: [] for name in runs}
    for name, model, optimizer in train_bench.interleaved(runs, args.rounds, args.iters, x, y):
        f0 = train_bench.minor_faults()
        train_bench.iteration(model, optimizer, x, y)
        faults[name].append(train_bench.minor_faults() - f0)
    most = {name: train_bench.slowest(statistics.median(f)) for name, f in faults.items()}
    if rank == 0:
        m = mallinfo2()
        print(f"# {args.model}, world {dist.get_world_size()}, batch {args.batch}/rank, {train_bench.allocator_policy()}")
        print(f"{'run':<24}{'faults/iter (most of any rank)':>32}")
        for name, f in most.items():
            print(f"{name:<24}{f:>32.0f}")
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        print(f"rank 0 heap at the end: arena {mib(m.arena)}, in use {mib(m.uordblks)}, free {mib(m.fordblks)}, "
              f"top {mib(m.keepcost)}, {m.hblks} mmapped chunks ({mib(m.hblkhd)})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
