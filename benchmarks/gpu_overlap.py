"""One training iteration on GPUs: dear against torch DDP, compute alone and
dear's communication alone (serial sum and perfect-overlap lower bound).
Replaces a timed assert: speed lives in benchmarks, never in tests.

    torchrun --nproc_per_node=$(nvidia-smi -L | wc -l) benchmarks/gpu_overlap.py

At one GPU the "communication" is NCCL copying on the device, which competes
with compute for memory bandwidth, so dear can only match the serial sum."""
import argparse

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
    args = parser.parse_args()
    device = init("nccl")
    x = torch.randn(args.batch, args.width, device=device)

    def iteration(model, optimizer):
        def run():
            optimizer.zero_grad()
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
    t_ddp = timed(iteration(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)))
    model = mlp(args.width, args.layers, device)
    dear, dear_opt = dearcomm.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), bucket_mb=args.bucket_mb)
    t_dear = timed(iteration(dear, dear_opt))

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
                        ("lower bound (perfect overlap)", bound), ("torch DDP", t_ddp), ("dear", t_dear)]:
            print(f"{name:>30} {1e3 * t:8.2f}")
        print(f"dear / serial {t_dear / serial:.3f}   dear / lower bound {t_dear / bound:.3f}   "
              f"dear / DDP {t_dear / t_ddp:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
