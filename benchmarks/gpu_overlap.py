"""One training iteration on GPUs: dear against torch DDP, compute alone and
dear's communication alone (serial sum and perfect-overlap lower bound).
Replaces a timed assert: speed lives in benchmarks, never in tests.

    torchrun --nproc_per_node=$(nvidia-smi -L | wc -l) benchmarks/gpu_overlap.py

At one GPU the "communication" is NCCL copying on the device, which competes
with compute for memory bandwidth, so dear can only match the serial sum.

--profile PREFIX: also where the time goes, DDP's and dear's: the host's time
to enqueue one iteration, and torch.profiler's kernels and host calls over a
window of each (tables on rank 0; PREFIX-{ddp,dear}.json, Chrome traces)."""
import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dearcomm
from common import init, median_seconds
from dearcomm import _C, _cuda


def mlp(width, layers, device):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=8)
    parser.add_argument("--iters", type=int, default=7, help="timed windows")
    parser.add_argument("--window", type=int, default=5, help="iterations per timed window")
    parser.add_argument("--profile", default="", metavar="PREFIX", help="profile DDP and dear (see above)")
    args = parser.parse_args()
    device = init("nccl")
    x = torch.randn(args.batch, args.width, device=device)

    def iteration(model, optimizer, set_to_none=True):
        def run():
            optimizer.zero_grad(set_to_none=set_to_none)
            model(x).square().mean().backward()
            optimizer.step()
        return run

    def timed(fn):
        """Per iteration: the median of windows of --window iterations run back
        to back, a device sync only at the end of each window (a sync after
        every iteration would serialise dear's all-gathers, which overlap the
        next forward)."""
        def window():
            for _ in range(args.window):
                fn()
        return median_seconds(window, device, warmup=1, iters=args.iters) / args.window

    plain = mlp(args.width, args.layers, device)
    t_compute = timed(iteration(plain, torch.optim.AdamW(plain.parameters(), lr=1e-4)))
    ddp = DistributedDataParallel(mlp(args.width, args.layers, device), bucket_cap_mb=args.bucket_mb)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    t_ddp = timed(iteration(ddp, ddp_opt))
    model = mlp(args.width, args.layers, device)
    dear, dear_opt = dearcomm.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), bucket_mb=args.bucket_mb)
    t_dear = timed(iteration(dear, dear_opt))
    # zero_grad(set_to_none=False): .grad stays in the buckets, zero-filled, and
    # autograd adds into it (the default copies each new gradient in).
    t_dear_filled = timed(iteration(dear, dear_opt, set_to_none=False))

    # dear's collectives alone, on the same buckets, one after another.
    backend = _cuda.nccl_backend(dist.group.WORLD, device, dist.default_pg_timeout)
    buckets = dear._dear.engine.layout.buckets
    full = [torch.zeros(b.padded_numel, device=device) for b in buckets]
    shards = [torch.zeros(b.shard_numel, device=device) for b in buckets]

    def communicate():
        for f, s in zip(full, shards):
            _C.reduce_scatter(backend, f, s).wait()
        for f, s in zip(full, shards):
            _C.all_gather(backend, s, f).wait()

    t_comm = timed(communicate)
    if dist.get_rank() == 0:
        serial, bound = t_compute + t_comm, max(t_compute, t_comm)
        params = sum(p.numel() for p in plain.parameters())
        print(f"# {torch.cuda.get_device_name(device)}, world size {dist.get_world_size()}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}, {params / 1e6:.0f}M fp32 parameters, "
              f"{len(buckets)} buckets of {args.bucket_mb:g} MiB; ms per iteration, medians of {args.iters} "
              f"windows of {args.window}")
        # compute alone runs the full AdamW step; dear's sharded update steps 1/world_size of it.
        for name, t in [("compute alone (full step)", t_compute), ("communication alone", t_comm), ("serial sum", serial),
                        ("lower bound (perfect overlap)", bound), ("torch DDP", t_ddp), ("dear", t_dear),
                        ("dear, zero_grad(set_to_none=False)", t_dear_filled)]:
            print(f"{name:>36} {1e3 * t:8.2f}")
        print(f"dear / serial {t_dear / serial:.3f}   dear / lower bound {t_dear / bound:.3f}   "
              f"dear / DDP {t_dear / t_ddp:.3f}   zero-filled dear / DDP {t_dear_filled / t_ddp:.3f}")
    if args.profile:
        for name, fn in (("ddp", iteration(ddp, ddp_opt)), ("dear", iteration(dear, dear_opt))):
            profile_run(name, fn, device, args)
    dist.destroy_process_group()


def profile_run(name, fn, device, args):
    """The host's time to enqueue an iteration (no sync inside the window),
    then one profiled window: kernels by device time, host calls by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    host = []
    for _ in range(args.window):
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.window):
            fn()
        torch.cuda.synchronize(device)
    if dist.get_rank() != 0:
        return
    host.sort()
    print(f"\n## {name}: host time to enqueue one iteration, median {1e3 * host[len(host) // 2]:.2f} ms "
          f"(min {1e3 * host[0]:.2f}, max {1e3 * host[-1]:.2f}); profiled window of {args.window} iterations")
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cpu_time_total"):
        try:
            print(averages.table(sort_by=key, row_limit=18, max_name_column_width=60))
        except (AttributeError, KeyError, ValueError) as e:  # an older profiler's key names
            print(f"(no table by {key}: {e})")
    prof.export_chrome_trace(f"{args.profile}-{name}.json")


if __name__ == "__main__":
    main()
