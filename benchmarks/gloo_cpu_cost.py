"""CPU time that a gloo point-to-point transfer costs its two processes, and
how much a compute loop slows down while a transfer runs beside it. The
pipeline simulator's transfer CPU model (Topology.transfer_cpu, a TransferCpu) is
calibrated from the fitted lines this prints.

    python benchmarks/gloo_cpu_cost.py                          # 2 ranks over loopback
    python benchmarks/gloo_cpu_cost.py --netlab 1gbit           # 2 ranks under netlab (root)
    python benchmarks/gloo_cpu_cost.py --ranks 3 --netlab 1gbit,1gbit,500mbit  # a third rank computes too
    python benchmarks/gloo_cpu_cost.py --combine run1.json run2.json ...   # median of each coefficient

Rank 0 sends, rank 1 receives (every receive posted before the send starts,
as in PipelineRuntime); extra ranks only run the compute loop, to load the
cores as a third pipeline rank would. CPU time is the process's user+system
time (process_time: all its threads, gloo's included); kernel work done in
softirq context on behalf of the socket is in it where the kernel runs it in
the process's own context and does not account interrupt time apart
(benchmarks/kernel_cpu.py measures which).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _cpu_s() -> float:
    return time.process_time()  # every thread of this process, user + system


def _machine_ms():
    """(busy, softirq) ms of the whole machine so far, from /proc/stat (10 ms ticks)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    tick = 1e3 / os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) * tick, (irq + softirq) * tick


def _fit(xs, ys):
    """Least-squares line y = a + b x."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _compute(work):
    import torch
    a, b = work
    for _ in range(8):
        a = torch.tanh(a @ b)
    return a


def _time_compute(work, reps: int):
    """Median (wall ms, cpu ms) of one compute block."""
    walls, cpus = [], []
    for _ in range(reps):
        c0, t0 = _cpu_s(), time.perf_counter()
        _compute(work)
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((_cpu_s() - c0) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def _window(dist, rank: int, buf, size, reps: int):
    """Median (cpu ms, wall ms, machine busy ms, machine softirq ms) of
    barrier, rank 0 -> 1 transfer, barrier."""
    cpu, wall, busy, soft = [], [], [], []
    for _ in range(reps):
        work = dist.irecv(buf, 0) if rank == 1 and buf is not None else None
        c0, t0, (b0, s0) = _cpu_s(), time.perf_counter(), _machine_ms()
        dist.barrier()
        if rank == 0 and buf is not None:
            dist.isend(buf, 1).wait()
        elif work is not None:
            work.wait()
        dist.barrier()
        cpu.append((_cpu_s() - c0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
        b1, s1 = _machine_ms()
        busy.append(b1 - b0)
        soft.append(s1 - s0)
    return tuple(statistics.median(x) for x in (cpu, wall, busy, soft))


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    # The receiver's gloo thread may finish the data before its own process
    # leaves the barrier, so each window spans barrier .. wait .. barrier and
    # the same window with no transfer in it is subtracted.
    baseline = _window(dist, rank, None, None, args.reps)
    rows = []
    for size in SIZES:
        cpu, wall, busy, soft = (a - b for a, b in zip(_window(dist, rank, torch.ones(size // 4), size, args.reps),
                                                       baseline))
        rows.append(dict(bytes=size, cpu_ms=cpu, wall_ms=wall, machine_busy_ms=busy, machine_softirq_ms=soft))
    # Compute beside a transfer: rank 1 computes while receiving one big
    # message (posted first), against the same compute with no transfer.
    g = torch.Generator().manual_seed(0)
    work = (torch.randn(256, 1024, generator=g), torch.randn(1024, 1024, generator=g) / 32)
    big = torch.ones((16 << 20) // 4)
    dist.barrier()
    alone = _time_compute(work, args.reps) if rank != 0 else None
    dist.barrier()
    beside = []
    for _ in range(args.reps):
        pending = dist.irecv(big, 0) if rank == 1 else None
        dist.barrier()
        if rank == 0:
            dist.isend(big, 1).wait()
        else:
            beside.append(_time_compute(work, 1))
            if pending is not None:
                pending.wait()
        dist.barrier()
    gathered = [None] * dist.get_world_size()
    beside = [statistics.median(x) for x in zip(*beside)] if beside else None
    dist.all_gather_object(gathered, dict(rows=rows, compute_alone=alone, compute_beside=beside))
    if rank == 0:
        _report(gathered, args)
    dist.destroy_process_group()
    return 0


def _report(gathered, args) -> None:
    result = dict(netlab=args.netlab or "loopback", reps=args.reps, ranks=gathered)
    print(f"\ngloo point-to-point CPU time per transfer ({result['netlab']}, median of {args.reps}):")
    print(f"{'bytes':>10} {'send cpu ms':>12} {'send wall ms':>13} {'recv cpu ms':>12} {'recv wall ms':>13} "
          f"{'machine busy':>13} {'softirq':>8}")
    for s, r in zip(gathered[0]["rows"], gathered[1]["rows"]):
        print(f"{s['bytes']:>10} {s['cpu_ms']:>12.3f} {s['wall_ms']:>13.3f} {r['cpu_ms']:>12.3f} {r['wall_ms']:>13.3f} "
              f"{s['machine_busy_ms']:>13.0f} {s['machine_softirq_ms']:>8.0f}")
    sizes = [r["bytes"] for r in gathered[0]["rows"]]
    fits = {}
    for side, ys in (("send", [r["cpu_ms"] for r in gathered[0]["rows"]]),
                     ("recv", [r["cpu_ms"] for r in gathered[1]["rows"]]),
                     ("softirq", [r["machine_softirq_ms"] for r in gathered[0]["rows"]])):
        a, b = _fit(sizes, ys)
        fits[side] = dict(ms_per_message=a, ms_per_mib=b * (1 << 20))
        print(f"{side}: {a:.3f} ms per message + {b * (1 << 20):.3f} ms per MiB of CPU")
    # The packets' kernel work (softirq: veth, tbf, TCP) runs outside both
    # processes but on the same cores; each side is charged half of it.
    cpu = {f"{side}_ms_per_{unit}": max(0.0, fits[side][f"ms_per_{unit}"] + fits["softirq"][f"ms_per_{unit}"] / 2)
           for side in ("send", "recv") for unit in ("message", "mib")}
    result.update(fits=fits, transfer_cpu=cpu)
    print("TransferCpu(" + ", ".join(f"{k}={v:.3f}" for k, v in cpu.items()) + ")")
    for rank, g in enumerate(gathered[1:], 1):
        (wa, ca), (wb, cb) = g["compute_alone"], g["compute_beside"]
        role = "receiving 16 MiB" if rank == 1 else "another rank's transfer running"
        print(f"rank {rank} compute block: {wa:.2f} ms wall ({ca:.2f} cpu) alone, {wb:.2f} ms wall ({cb:.2f} cpu) "
              f"while {role}: {wb / wa - 1:+.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def combine(paths) -> int:
    """One run's fit is noisy on a shared machine: take each coefficient's median."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f)["transfer_cpu"])
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"median of {len(runs)} runs: TransferCpu(" + ", ".join(f"{k}={v:.3f}" for k, v in median.items()) + ")")
    print("--transfer-cpu " + ",".join(f"{median[k]:.3f}" for k in ("send_ms_per_message", "send_ms_per_mib",
                                                                      "recv_ms_per_message", "recv_ms_per_mib")))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--netlab", default="", help="run under netlab at this rate (or a rate per rank); root")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", default="", help="write the measurements here")
    parser.add_argument("--combine", nargs="+", metavar="JSON", help="print the median calibration of these runs")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.combine:
        return combine(args.combine)
    if args.rank_main:
        return rank_main(args)
    command = [sys.executable, os.path.abspath(__file__), "--rank-main", "--reps", str(args.reps),
               "--netlab", args.netlab, "--json", os.path.abspath(args.json) if args.json else ""]
    if args.netlab:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from netlab import Cluster
        with Cluster(args.ranks, args.netlab, burst="64kb") as cluster:
            return cluster.launch(command)
    import subprocess
    procs = [subprocess.Popen(command, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.ranks),
                                                 MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", OMP_NUM_THREADS="1"))
             for r in range(args.ranks)]
    return next((c for c in (p.wait() for p in procs) if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
