"""Whether the kernel's packet work for dearcomm's CPU collectives is on the
ranks' own CPU clocks. Times all-reduces and reduce-scatters alone (10 of
each size, every rank at once) and compares the whole machine's busy time
(/proc/stat: user, system, interrupts, softirq) with the sum of every rank's
process CPU (time.process_time: all its threads) over the same calls.

    .venv/bin/torchrun --nproc_per_node=4 benchmarks/kernel_cpu.py
    .venv/bin/torchrun --nproc_per_node=2 benchmarks/kernel_cpu.py --sizes-mib 16 64

"busy - ranks" near 0 while softirq is not: the packet work (loopback TCP's
receive side, run as softirq) runs in the ranks' own context and is already
in their CPU, and in the per-MiB host cost the simulator fits from it
(Network.host_ms_per_mib); charging the softirq again would count it twice.
A kernel that accounts interrupt time apart (CONFIG_IRQ_TIME_ACCOUNTING)
leaves it out of the tasks' clocks: there "busy - ranks" reads the softirq.
Run on an otherwise idle machine: another process's CPU counts as busy.
"""
import argparse
import time

import torch
import torch.distributed as dist

from dearcomm import _C
from dearcomm._cpu_switches import cpu_backend
from dearcomm.contention import _machine_since, machine_cpu_s

CALLS = 10


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    if machine_cpu_s() is None:
        parser.error("reads the machine's CPU from /proc/stat (Linux)")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = cpu_backend(dist.group.WORLD)
    if rank == 0:
        print(f"{world} ranks; {CALLS} calls each; seconds over the calls (the machine's from /proc/stat, 10 ms ticks; "
              f"wall and ranks from the clocks, to the ms)")
        print(f"{'size':>8} {'kind':>15} {'wall':>7} {'busy':>6} {'softirq':>8} {'idle':>6} {'ranks':>7} "
              f"{'busy - ranks':>13}")
    for mib in args.sizes_mib:
        full = torch.zeros(mib * 2**18 // world * world)
        shard = torch.zeros(full.numel() // world)
        calls = {"all_reduce": lambda: _C.all_reduce(backend, full).wait(),
                 "reduce_scatter": lambda: _C.reduce_scatter(backend, full, shard).wait()}
        for kind, call in calls.items():
            call()  # connections and buffers set up outside the timing
            dist.barrier()
            machine, cpu, wall = machine_cpu_s(), time.process_time(), time.perf_counter()
            for _ in range(CALLS):
                call()
            ranks = torch.tensor([time.process_time() - cpu])
            wall = time.perf_counter() - wall
            machine = _machine_since(machine)  # before the all-reduce below, which is not timed
            dist.all_reduce(ranks)
            if rank == 0:
                busy, softirq, idle = (machine[k] for k in ("busy", "softirq", "idle"))
                print(f"{mib:>5} MiB {kind:>15} {wall:>7.3f} {busy:>6.2f} {softirq:>8.2f} {idle:>6.2f} "
                      f"{ranks.item():>7.3f} {busy - ranks.item():>+13.3f}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
