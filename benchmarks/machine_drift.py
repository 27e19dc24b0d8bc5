"""How far this machine's own speed moves, with no dearcomm code in the
timed work: per round, the same compute-only iterations (plain torch,
zero_grad + forward + backward + AdamW step, every rank at once after a
barrier), their CPU, dearcomm's in-step profile of the same model (what a
prediction starts from), and torch DDP's training iteration and CPU. A
prediction made from a compute profile carries whatever moves DDP's
iteration against the compute alone from one launch to the next.

    .venv/bin/torchrun --nproc_per_node=4 benchmarks/machine_drift.py --model widein --json drift-1.json
    python benchmarks/machine_drift.py --summary drift-*.json    # one row per launch, and their spread

Each round times the three one after the other, so that drift within a
round falls on all of them alike; a launch's figure is the median over its
rounds (of a ratio: the ratio of the medians). Times are the slowest rank's;
CPU the ranks' mean (the thread's for compute alone, the process's for DDP:
gloo's threads too). The profile takes --iters iterations after one warm-up.
"""
import argparse
import json
import math
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

FIGURES = ("compute_ms", "compute_cpu_ms", "profile_ms", "ddp_ms", "ddp_cpu_ms")


def mean_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def timed(step, iters: int, clock):
    """(slowest rank's wall, ranks' mean CPU by `clock`) per iteration of step(), after a barrier."""
    dist.barrier()
    start, cpu = time.perf_counter(), clock()
    for _ in range(iters):
        step()
    return slowest((time.perf_counter() - start) / iters), mean_over_ranks((clock() - cpu) / iters)


def measure(args):
    init("gloo")
    rank = dist.get_rank()
    alone, profiled, ddp = fresh(args.model), fresh(args.model), DistributedDataParallel(fresh(args.model))
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (alone, profiled, ddp)}
    x, y = alone.batch(args.batch, torch.Generator().manual_seed(rank))

    def step(model):
        def run():
            optimizers[model].zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizers[model].step()
        return run

    for model in (alone, ddp):
        for _ in range(2):
            step(model)()
    rounds = []
    for _ in range(args.rounds):
        compute, compute_cpu = timed(step(alone), args.iters, time.thread_time)
        dist.barrier()
        p = dearcomm.profile(profiled, (x, y), optimizers[profiled], iterations=args.iters, warmup=1,
                             loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]), group=dist.group.WORLD)
        ddp_wall, ddp_cpu = timed(step(ddp), args.iters, time.process_time)
        rounds.append(dict(compute_ms=1e3 * compute, compute_cpu_ms=1e3 * compute_cpu,
                           profile_ms=p.forward_ms + p.backward_ms + p.step_ms,
                           ddp_ms=1e3 * ddp_wall, ddp_cpu_ms=1e3 * ddp_cpu))
    launch = {k: statistics.median(r[k] for r in rounds) for k in FIGURES}
    if rank == 0:
        print(f"# {args.model}, batch {args.batch}/rank, {dist.get_world_size()} ranks, {torch.get_num_threads()} "
              f"thread(s)/rank, {args.rounds} rounds x {args.iters} iterations (ms)")
        print_rows([("round %d" % i, r) for i, r in enumerate(rounds)] + [("median", launch)])
    write_json(args.json, dict(model=args.model, batch=args.batch, world_size=dist.get_world_size(),
                               rounds=rounds, launch=launch))
    dist.destroy_process_group()


def print_rows(rows):
    print("| | compute alone | its CPU | in-step profile | DDP iteration | DDP's CPU | DDP / compute | DDP / profile |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['compute_ms']:.1f} | {r['compute_cpu_ms']:.1f} | {r['profile_ms']:.1f} "
              f"| {r['ddp_ms']:.1f} | {r['ddp_cpu_ms']:.1f} | {r['ddp_ms'] / r['compute_ms']:.3f} "
              f"| {r['ddp_ms'] / r['profile_ms']:.3f} |")


QUANTITIES = {"compute alone's CPU": lambda r: r["compute_cpu_ms"],
              "DDP's iteration": lambda r: r["ddp_ms"],
              "DDP / compute alone": lambda r: r["ddp_ms"] / r["compute_ms"],
              "DDP / in-step profile": lambda r: r["ddp_ms"] / r["profile_ms"]}


def spread(launches):
    """Per quantity over ``launches`` (each {"launch": medians, "rounds":
    [...]}): (median over launches, lowest, highest, the sd of the
    launches' logs, the rounds' sd of the log around their launch's
    figure (one degree of freedom per launch), what that leaves a median
    of the rounds: sqrt(pi/2) ~ 1.25 sd / sqrt(rounds), the large-sample
    standard error of a median)."""
    out = {}
    for name, of in QUANTITIES.items():
        values = [of(d["launch"]) for d in launches]
        across = statistics.stdev(math.log(v) for v in values) if len(values) > 1 else None
        deviations = [math.log(of(r) / of(d["launch"])) for d in launches for r in d["rounds"]]
        within = math.sqrt(sum(x * x for x in deviations) / max(1, len(deviations) - len(launches)))
        rounds = statistics.median(len(d["rounds"]) for d in launches)
        out[name] = (statistics.median(values), min(values), max(values), across, within,
                     1.25 * within / math.sqrt(rounds))
    return out


def summarise(paths):
    """One row per launch (its medians), and how far the launches lie apart
    against what the rounds' own noise leaves a launch's median."""
    data = [json.load(open(p)) for p in paths]
    print_rows([(os.path.basename(p), d["launch"]) for p, d in zip(paths, data)])
    print()
    print("| quantity | median over launches | range | launches' sd (log) | rounds' sd within a launch "
          "| what that leaves a launch's median |")
    print("|---|---|---|---|---|---|")
    for name, (median, low, high, across, within, leaves) in spread(data).items():
        print(f"| {name} | {median:.3f} | {low:.3f}-{high:.3f} | {'-' if across is None else f'{across:.1%}'} "
              f"| {within:.1%} | {leaves:.1%} |")


def main():
    if "--summary" in sys.argv:
        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--summary", nargs="+", required=True, metavar="JSON")
        summarise(parser.parse_args().summary)
        return
    measure(model_rounds_parser(__doc__, MODELS, model="widein", batch=128, rounds=8, iters=3).parse_args())


if __name__ == "__main__":
    main()
