"""How much a collective in flight slows the compute beside it: the
simulator's Network.compute_slowdown, measured (dearcomm/contention.py).

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/contention.py --model mlp --json results/contention.json
    sudo .venv/bin/python benchmarks/netlab.py --ranks 2 --rate 1gbit -- benchmarks/contention.py --model mlp ...

Each rank times forward+backward iterations of a benchmark model (no
optimizer, no communication) alone, then again while a second thread keeps
dearcomm's backend busy with back-to-back all-reduces of --mib MiB (the
collectives the engine runs, on the same group). For every iteration beside
them it records the fraction of its wall time a collective was in flight;
dearcomm.fit_compute_slowdown turns those into κ. Also printed: the
all-reduce's own time alone and beside compute (the other direction,
Network.comm_slowdown, λ: dearcomm.fit_comm_slowdown).
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import init  # noqa: E402
from models import MODELS  # noqa: E402

from dearcomm.contention import fit_compute_slowdown, measure_contention  # noqa: E402


def compute_iteration(model, x, y) -> None:
    F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)


def measure(model, x, y, mib: float, iters: int) -> dict:
    """dearcomm.contention.measure_contention on the model's forward+backward
    (every rank of the default group calls this together)."""
    return measure_contention(lambda: compute_iteration(model, x, y), nbytes=int(mib * 2**20), iters=iters)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="mlp")
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--mib", type=float, default=64.0, help="all-reduce size")
    parser.add_argument("--iters", type=int, default=12, help="compute iterations alone, and the least beside")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    init("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MODELS[args.model]()
    x, y = model.batch(args.batch, torch.Generator().manual_seed(rank))
    result = dict(model=args.model, batch=args.batch, mib=args.mib, world_size=world, rank=rank,
                  **measure(model, x, y, args.mib, args.iters))
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        print(f"# {args.model}, batch {args.batch}/rank, all-reduce {args.mib:g} MiB, {world} ranks")
        print(f"{'rank':>4} {'compute alone':>14} {'beside':>10} {'covered':>8} {'κ':>7} "
              f"{'all-reduce alone':>17} {'beside compute':>15} {'λ':>6} {'ν (CPU)':>8} {'μ (CPU)':>8}")
        for r in everyone:
            walls = [w for w, c in r["beside"] if c >= 0.5]
            print(f"{r['rank']:>4} {statistics.median(r['alone_s']) * 1e3:>11.2f} ms "
                  f"{(statistics.median(walls) * 1e3 if walls else float('nan')):>7.2f} ms "
                  f"{statistics.median(c for _, c in r['beside']):>8.2f} {r['compute_slowdown']:>7.3f} "
                  f"{statistics.median(r['comm_alone_s']) * 1e3:>14.1f} ms "
                  f"{statistics.median(r['comm_beside_s']) * 1e3:>12.1f} ms {r['comm_slowdown']:>6.2f} "
                  f"{r['comm_cpu_slowdown']:>8.2f} {r['compute_cpu_slowdown']:>8.2f}")
        pooled = fit_compute_slowdown(alone_s=[t for r in everyone for t in r["alone_s"]],
                                      beside=[b for r in everyone for b in r["beside"]])
        print(f"all ranks: {pooled}")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(dict(ranks=everyone, alone_s=[t for r in everyone for t in r["alone_s"]],
                               beside=[b for r in everyone for b in r["beside"]],
                               compute_slowdown=pooled.slowdown), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
