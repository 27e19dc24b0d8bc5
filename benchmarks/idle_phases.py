"""Where a CPU training iteration leaves its cores idle: per phase of each
iteration (forward+loss, backward, step+zero_grad), each rank's wall, its
process's CPU (every thread: the training thread, gloo's and dearcomm's),
the wall beyond that CPU (what the rank left of a core it had to itself),
and how long the training thread was blocked (off the CPU and not waiting
to run: in a collective's wait or a lock). Linux only: it reads each
thread's run and run-queue time from /proc/self/task/*/schedstat.

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/idle_phases.py --model widein --batch 128

Each run (DDP, then each dearcomm schedule given) trains --iters measured
iterations after --warmup; medians over the iterations, then over the
ranks. Reading the threads' counters costs about 0.1 ms per phase.
"""
import argparse
import os
import statistics
import sys
import threading
import time
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import all_ranks, init  # noqa: E402
from models import MODELS, fresh  # noqa: E402

import dearcomm  # noqa: E402

PHASES = ("forward+loss", "backward", "step+zero_grad")
Stamp = Tuple[float, Dict[str, Tuple[int, int]]]  # (perf_counter s, {thread id: (run ns, run-queue ns)})


def thread_times() -> Dict[str, Tuple[int, int]]:
    """{thread id: (ns on a CPU, ns runnable but waiting for one)} of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except OSError:  # the thread ended
            continue
        out[tid] = (int(run), int(wait))
    if not out:
        raise RuntimeError("idle_phases.py: /proc/self/task/*/schedstat is not readable here (it needs Linux with "
                           "scheduler statistics)")
    return out


def stamp() -> Stamp:
    return time.perf_counter(), thread_times()


def phase_parts(stamps: Sequence[Stamp], main: str) -> List[Dict[str, float]]:
    """One iteration's phases from the stamps at their boundaries (one more
    stamp than phases): per phase its wall, the process's CPU (every thread
    alive at its end; one born inside it counts from 0), the wall beyond that
    CPU, and the time thread ``main`` was blocked (neither running nor
    waiting to run), all in ms; start and end in perf_counter seconds."""
    out = []
    for (t0, before), (t1, after) in zip(stamps, stamps[1:]):
        wall = t1 - t0
        cpu = sum(run - before.get(tid, (0, 0))[0] for tid, (run, _) in after.items()) / 1e9
        run = (after[main][0] - before[main][0]) / 1e9
        queued = (after[main][1] - before[main][1]) / 1e9
        out.append(dict(wall_ms=1e3 * wall, cpu_ms=1e3 * cpu, beyond_cpu_ms=1e3 * (wall - cpu),
                        blocked_ms=1e3 * max(0.0, wall - run - queued), start=t0, end=t1))
    return out


def summary(ranks: Sequence[Sequence[List[Dict[str, float]]]]) -> Dict[str, object]:
    """Every rank's iterations (each a list of phase_parts) -> per phase the
    median over ranks of each rank's median; the iteration on one clock
    (the earliest start to the latest end) and the core time the ranks left
    unused in it, each its own iteration's wall less its CPU, summed over
    the ranks (a core each: meaningful where the ranks have one each);
    medians over the iterations."""
    keys = ("wall_ms", "cpu_ms", "beyond_cpu_ms", "blocked_ms")
    phases = {}
    for p, name in enumerate(PHASES):
        phases[name] = {k: statistics.median(statistics.median(it[p][k] for it in iterations) for iterations in ranks)
                        for k in keys}
    idle, walls = [], []
    for i in range(min(len(r) for r in ranks)):
        start = min(r[i][0]["start"] for r in ranks)
        end = max(r[i][-1]["end"] for r in ranks)
        walls.append(1e3 * (end - start))
        idle.append(sum(1e3 * (r[i][-1]["end"] - r[i][0]["start"]) - sum(ph["cpu_ms"] for ph in r[i]) for r in ranks))
    return dict(phases=phases, iteration_ms=statistics.median(walls), unused_core_ms=statistics.median(idle))


def measure(model, optimizer, x, y, iters: int, warmup: int) -> List[List[Dict[str, float]]]:
    main = str(threading.get_native_id())
    iterations = []
    for i in range(warmup + iters):
        s0 = stamp()
        loss = F.cross_entropy(model(x), y)
        s1 = stamp()
        loss.backward()
        s2 = stamp()
        optimizer.step()
        optimizer.zero_grad()
        s3 = stamp()
        if i >= warmup:
            iterations.append(phase_parts((s0, s1, s2, s3), main))
    return iterations


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="widein")
    parser.add_argument("--batch", type=int, default=128, help="per rank")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--schedules", nargs="*", default=["dear"], help="dearcomm schedules run after DDP")
    args = parser.parse_args()
    init("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = fresh(args.model).batch(args.batch, torch.Generator().manual_seed(rank))
    results = {}
    for name in ["ddp", *args.schedules]:
        model = fresh(args.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            model, optimizer = dearcomm.wrap(model, optimizer, schedule=name)
        results[name] = summary(all_ranks(measure(model, optimizer, x, y, args.iters, args.warmup)))
        dist.barrier()
    if rank == 0:
        print(f"# {args.model}, batch {args.batch}/rank, {world} ranks on {os.cpu_count()} cores, "
              f"{torch.get_num_threads()} thread(s)/rank; medians of {args.iters} iterations, then of the ranks (ms)")
        for name, r in results.items():
            print(f"\n{name}: iteration {r['iteration_ms']:.1f} ms; the ranks left {r['unused_core_ms']:.1f} "
                  "core-ms of it unused (each its iteration's wall less its CPU, summed)")
            print(f"  {'phase':16}{'wall':>8}{'CPU':>8}{'wall-CPU':>10}{'blocked':>9}")
            for phase, v in r["phases"].items():
                print(f"  {phase:16}{v['wall_ms']:>8.1f}{v['cpu_ms']:>8.1f}{v['beyond_cpu_ms']:>10.1f}"
                      f"{v['blocked_ms']:>9.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
