"""End to end: the same model, batch, bucket size and seed under torch DDP,
dearcomm wfbp, and dearcomm dear (sharded and replicated), with the measured
pieces, the lower bound and each schedule's own ideal.

    torchrun --nproc_per_node=2 benchmarks/train_bench.py --model mlp            # loopback
    sudo python benchmarks/netlab.py --ranks 2 --rate 1gbit -- benchmarks/train_bench.py --model mlp

Pieces, measured in the same run: T_fwd, T_bwd, T_step (one rank's model, no
communication; T_step(shard) runs the optimizer over 1/p of the parameters) and
the collectives of all buckets launched back to back, alone: T_RS, T_AG, T_AR.
  lower bound (any schedule)   max(T_fwd + T_bwd + T_step, T_AR)
  ideal of ddp / wfbp          T_fwd + max(T_bwd, T_AR) + T_step
  ideal of dear                max(T_fwd, T_AG) + max(T_bwd, T_RS) + T_step(shard or full)
efficiency = ideal / measured (1.0: the schedule hides all it can).
Each rank gets cores/ranks torch threads. Times are medians; the slowest rank counts.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402
from models import MODELS  # noqa: E402

import dearcomm  # noqa: E402
from dearcomm import _C  # noqa: E402
from dearcomm.timeline import Timeline, gather_events, plot_gantt, write_chrome_trace  # noqa: E402

RUNS = {"ddp": ("ddp", None), "wfbp": ("wfbp", "replicated"),
        "dear-sharded": ("dear", "sharded"), "dear-replicated": ("dear", "replicated")}


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def median_time(fn, iters):
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make(args):
    torch.manual_seed(0)
    overrides = {key: int(value) for key, value in (kv.split("=", 1) for kv in args.model_args)}
    return MODELS[args.model](**overrides)


def measure_pieces(args, x, y):
    """Compute pieces on one rank's model and batch, without communication."""
    model = make(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    world = dist.get_world_size()
    shard = [torch.zeros(max(1, p.numel() // world)).requires_grad_() for p in params]
    shard_opt = torch.optim.AdamW(shard, lr=1e-4)
    for s in shard:
        s.grad = torch.randn_like(s)
    holder = {}

    def forward():
        holder["loss"] = F.cross_entropy(model(x), y)

    def backward():
        forward()
        holder["loss"].backward()

    for _ in range(2):
        backward()
        optimizer.step()
        shard_opt.step()
    t_fwd = median_time(forward, args.iters)
    t_fwd_bwd = median_time(backward, args.iters)
    t_step = median_time(optimizer.step, args.iters)
    t_step_shard = median_time(shard_opt.step, args.iters)
    return dict(fwd=slowest(t_fwd), bwd=slowest(max(t_fwd_bwd - t_fwd, 0.0)), step=slowest(t_step),
                step_shard=slowest(t_step_shard))


def measure_collectives(args, model):
    """All buckets' RS, AG and AR, each kind launched back to back and waited, alone."""
    world = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    layout = _C.plan_buckets([p.numel() for p in params], [p.dtype for p in params],
                             int(args.bucket_mb * 2**20), world)
    backend = _C.process_group_backend(dist.group.WORLD)
    full = [torch.zeros(b.padded_numel) for b in layout.buckets]
    shards = [torch.zeros(b.shard_numel) for b in layout.buckets]

    def run(kind):
        if kind == "rs":
            pending = [_C.reduce_scatter(backend, f, s) for f, s in zip(reversed(full), reversed(shards))]
        elif kind == "ag":
            pending = [_C.all_gather(backend, s, f) for f, s in zip(full, shards)]
        else:
            pending = [_C.all_reduce(backend, f) for f in reversed(full)]
        for h in pending:
            h.wait()

    out = {}
    for kind in ("rs", "ag", "ar"):
        run(kind)
        dist.barrier()
        out[kind] = slowest(median_time(lambda: run(kind), max(2, args.iters // 2)))
    return out, len(layout.buckets), sum(b.numel for b in layout.buckets) * 4


def build(name, args):
    schedule, update = RUNS[name]
    model = make(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if schedule == "ddp":
        return DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb), optimizer
    return dearcomm.wrap(model, optimizer, bucket_mb=args.bucket_mb, schedule=schedule, update=update)


def iteration(model, optimizer, x, y, timeline=None):
    span = timeline.span if timeline else (lambda *a: contextlib.nullcontext())
    optimizer.zero_grad()
    with span("compute", "forward+loss"):
        loss = F.cross_entropy(model(x), y)
    with span("compute", "backward"):
        loss.backward()
    with span("compute", "step"):
        optimizer.step()


def record_timeline(args, runs, x, y, label):
    """Three iterations of ddp and dear-sharded, traced, on every rank."""
    per_run = {}
    for name in ("ddp", "dear-sharded"):
        model, optimizer = runs[name]
        timeline = Timeline().attach(model)
        if name == "ddp":
            model.register_comm_hook(None, timeline.ddp_comm_hook)
        iteration(model, optimizer, x, y)  # the first traced iteration starts clean
        timeline.clear()
        for _ in range(3):
            iteration(model, optimizer, x, y, timeline)
        if hasattr(model, "sync"):
            model.sync()
        timeline.collect()
        per_run[name] = gather_events(timeline)
    if dist.get_rank() == 0:
        write_chrome_trace(f"{args.timeline}.json", per_run)
        plot_gantt(f"{args.timeline}.png", {f"{n} (rank 0)": ranks[0] for n, ranks in per_run.items()},
                   title=f"{label}: three iterations")
        print(f"timeline: {args.timeline}.json (Perfetto), {args.timeline}.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="mlp")
    parser.add_argument("--model-args", nargs="*", default=[], help="constructor overrides, e.g. width=1024 depth=6")
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per run per round")
    parser.add_argument("--timeline", help="write PREFIX.json and PREFIX.png of ddp vs dear-sharded")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    network = os.environ.get("DEARCOMM_NETLAB", "loopback")
    g = torch.Generator().manual_seed(rank)
    probe = make(args)
    x, y = probe.batch(args.batch, g)
    n_params = sum(p.numel() for p in probe.parameters())

    pieces = measure_pieces(args, x, y)
    comm, n_buckets, nbytes = measure_collectives(args, probe)
    label = (f"{args.model} ({n_params / 1e6:.1f} M params, {n_buckets} buckets of <= {args.bucket_mb} MB), "
             f"world {world}, {network}, batch {args.batch}/rank, {threads} thread(s)/rank")

    runs = {name: build(name, args) for name in args.runs}
    for model, optimizer in runs.values():
        for _ in range(2):
            iteration(model, optimizer, x, y)
    times = {name: [] for name in runs}
    total = args.rounds * len(runs) * args.iters
    with tqdm(total=total, disable=rank != 0, desc=args.model, mininterval=2, file=sys.stderr) as bar:
        for _ in range(args.rounds):
            for name, (model, optimizer) in runs.items():
                for _ in range(args.iters):
                    start = time.perf_counter()
                    iteration(model, optimizer, x, y)
                    times[name].append(time.perf_counter() - start)
                    bar.update()

    compute = pieces["fwd"] + pieces["bwd"] + pieces["step"]
    bound = max(compute, comm["ar"])
    ideal = {
        "ddp": pieces["fwd"] + max(pieces["bwd"], comm["ar"]) + pieces["step"],
        "wfbp": pieces["fwd"] + max(pieces["bwd"], comm["ar"]) + pieces["step"],
        "dear-sharded": max(pieces["fwd"], comm["ag"]) + max(pieces["bwd"], comm["rs"]) + pieces["step_shard"],
        "dear-replicated": max(pieces["fwd"], comm["ag"]) + max(pieces["bwd"], comm["rs"]) + pieces["step"],
    }
    rows = {}
    for name, t in times.items():
        med = slowest(statistics.median(t))
        q = statistics.quantiles(t, n=10) if len(t) >= 2 else [t[0]] * 9
        rows[name] = dict(median_ms=1e3 * med, p10_ms=1e3 * q[0], p90_ms=1e3 * q[-1], ideal_ms=1e3 * ideal[name],
                          efficiency=ideal[name] / med)
    ddp = rows.get("ddp", {}).get("median_ms")
    if rank == 0:
        ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
        print(f"\n# {label}")
        print(f"pieces (ms): T_fwd {ms(pieces['fwd'])}  T_bwd {ms(pieces['bwd'])}  T_step {ms(pieces['step'])}  "
              f"T_step(shard) {ms(pieces['step_shard'])}  |  T_RS {ms(comm['rs'])}  T_AG {ms(comm['ag'])}  "
              f"T_AR {ms(comm['ar'])} ({nbytes / 2**20:.1f} MiB)")
        print(f"lower bound max(compute, comm) = {ms(bound)} ms;  C/T_bwd = {comm['ar'] / max(pieces['bwd'], 1e-9):.2f};"
              f"  ideal dear gain over ddp = {ideal['ddp'] / ideal['dear-sharded']:.3f}x")
        print(f"{'run':<17}{'median ms':>10}{'p10':>9}{'p90':>9}{'ideal':>9}{'effic.':>8}{'vs ddp':>8}{'vs bound':>9}")
        for name, r in rows.items():
            vs = f"{r['median_ms'] / ddp:.3f}" if ddp else "-"
            print(f"{name:<17}{r['median_ms']:>10.1f}{r['p10_ms']:>9.1f}{r['p90_ms']:>9.1f}{r['ideal_ms']:>9.1f}"
                  f"{r['efficiency']:>8.2f}{vs:>8}{r['median_ms'] / (1e3 * bound):>9.2f}", flush=True)
    if args.timeline and "ddp" in runs and "dear-sharded" in runs:
        record_timeline(args, runs, x, y, label)
    write_json(args.json, dict(label=label, model=args.model, world_size=world, network=network, threads=threads,
                               args=vars(args), pieces_ms={k: 1e3 * v for k, v in pieces.items()},
                               comm_ms={k: 1e3 * v for k, v in comm.items()}, comm_bytes=nbytes,
                               lower_bound_ms=1e3 * bound, runs=rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
