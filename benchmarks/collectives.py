"""Collective microbenchmarks, nccl-tests style.

    torchrun --nproc_per_node=2 benchmarks/collectives.py                      # gloo, CPU
    torchrun --nproc_per_node=8 benchmarks/collectives.py --backend nccl       # GPUs
    torchrun --nproc_per_node=2 benchmarks/collectives.py --fusion 200x4-64KiB # many small tensors

Sizes mode: reduce-scatter, all-gather and all-reduce, for torch.distributed's
own call ("torch") and dearcomm's backend on the same group ("dearcomm"), each
size doubling from --min-bytes to --max-bytes. Size is the full buffer (the
reduce-scatter's input, the all-gather's output). Columns follow nccl-tests:
algbw = size / time; busbw = algbw * 2(p-1)/p for all-reduce and * (p-1)/p for
reduce-scatter and all-gather (see benchmarks/README.md). #wrong counts wrong
elements in a separate check pass; any wrong element makes the exit code 1.

Fusion mode: K tensors one collective each, vs dearcomm's fused bucket (pack +
one collective), vs that bucket when .grad is a view into it (autograd
accumulated in place: no pack), vs one flat collective of the same bytes.
"""
import argparse
import re
import sys

import torch
import torch.distributed as dist

from common import Table, human_bytes, init, iterations_for, median_seconds, write_json

import dearcomm
from dearcomm import _C, _cuda
from dearcomm._torch_collectives import all_gather_single, reduce_scatter_single

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUS_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
              "all_gather": lambda p: (p - 1) / p}


def backend_capsule(kind, device):
    if kind == "nccl":
        return _cuda.nccl_backend(dist.group.WORLD, device, dist.default_pg_timeout)
    return _C.process_group_backend(dist.group.WORLD)


def make_op(op, impl, backend, numel, dtype, device):
    """(run, check): run() does one collective; check() returns #wrong elements."""
    p, r = dist.get_world_size(), dist.get_rank()
    shard = numel // p
    full = torch.full((shard * p,), float(r + 1), dtype=dtype, device=device)
    part = torch.full((shard,), float(r + 1), dtype=dtype, device=device)
    out_full, out_part = torch.empty_like(full), torch.empty_like(part)
    total = p * (p + 1) / 2
    if op == "reduce_scatter":
        run = ((lambda: reduce_scatter_single(out_part, full)) if impl == "torch"
               else (lambda: _C.reduce_scatter(backend, full, out_part).wait()))
        check = lambda: (out_part != total).sum().item()  # noqa: E731
    elif op == "all_gather":
        run = ((lambda: all_gather_single(out_full, part)) if impl == "torch"
               else (lambda: _C.all_gather(backend, part, out_full).wait()))
        expected = torch.arange(1, p + 1, dtype=dtype, device=device).repeat_interleave(shard)
        check = lambda: (out_full != expected).sum().item()  # noqa: E731
    else:
        def run():
            out_full.copy_(full)
            if impl == "torch":
                dist.all_reduce(out_full)
            else:
                _C.all_reduce(backend, out_full).wait()
        check = lambda: (out_full != total).sum().item()  # noqa: E731
    return run, check


def sizes_mode(args, device, backend):
    p = dist.get_world_size()
    table = Table([("op", "op", 16, "s"), ("impl", "impl", 10, "s"), ("size", "size", 11, "s"),
                   ("count", "count", 12, "d"), ("type", "type", 6, "s"), ("time_us", "time(us)", 11, ".1f"),
                   ("algbw", "algbw(GB/s)", 13, ".3f"), ("busbw", "busbw(GB/s)", 13, ".3f"),
                   ("wrong", "#wrong", 8, "d")],
                  title=f"# world size {p}, backend {args.backend}, dearcomm {dearcomm.build_info()['backends']}")
    wrong = 0
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        nbytes = args.min_bytes
        while nbytes <= args.max_bytes:
            numel = max(p, nbytes // dtype.itemsize // p * p)
            for op in ("reduce_scatter", "all_gather", "all_reduce"):
                for impl in ("torch", "dearcomm"):
                    run, check = make_op(op, impl, backend, numel, dtype, device)
                    run()
                    bad = check()
                    seconds = median_seconds(run, device, warmup=2, iters=iterations_for(numel * dtype.itemsize))
                    size = numel * dtype.itemsize
                    algbw = size / seconds / 1e9
                    wrong += bad
                    table.add(op=op, impl=impl, size=human_bytes(size), bytes=size, count=numel, type=dtype_name,
                              time_us=seconds * 1e6, algbw=algbw, busbw=algbw * BUS_FACTOR[op](p), wrong=bad)
            nbytes *= 2
    return table.rows, wrong


def parse_fusion(spec):
    """'200x4-64KiB' -> 200 tensor sizes (bytes) spread evenly from 4 KiB to 64 KiB."""
    m = re.fullmatch(r"(\d+)x(\d+)(KiB|MiB)?-(\d+)(KiB|MiB)", spec)
    if not m:
        raise SystemExit(f"collectives.py: --fusion wants e.g. 200x4-64KiB, got {spec!r}")
    unit = {"KiB": 1024, "MiB": 1024 ** 2, None: 1}
    k, lo, hi = int(m.group(1)), int(m.group(2)) * unit[m.group(3) or m.group(5)], int(m.group(4)) * unit[m.group(5)]
    return [lo + (hi - lo) * i // max(1, k - 1) for i in range(k)]


def fusion_mode(args, device, backend):
    p = dist.get_world_size()
    dtype = DTYPES[args.dtypes[0]]
    sizes = [max(1, b // dtype.itemsize) for b in parse_fusion(args.fusion)]
    tensors = [torch.randn(n, dtype=dtype, device=device) for n in sizes]
    # One bucket holding every tensor, laid out as the engine lays out a bucket.
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    shard_numel = -(-sum(sizes) // (p * 64)) * 64  # 1/p of the data, in whole 64-element units
    flat = torch.zeros(shard_numel * p, dtype=dtype, device=device)
    shard = torch.empty(shard_numel, dtype=dtype, device=device)
    per_tensor_out = [torch.empty(-(-n // p), dtype=dtype, device=device) for n in sizes]
    per_tensor_in = [torch.zeros(len(o) * p, dtype=dtype, device=device) for o in per_tensor_out]

    def per_tensor():
        pending = [_C.reduce_scatter(backend, i, o) for i, o in zip(per_tensor_in, per_tensor_out)]
        for h in pending:
            h.wait()

    def fused():
        _C.pack(backend, tensors, offsets, flat)
        _C.reduce_scatter(backend, flat, shard).wait()

    def flat_only():
        _C.reduce_scatter(backend, flat, shard).wait()

    # What the engine runs where .grad is a view into the bucket: autograd has
    # accumulated every gradient into its slot already, so nothing is packed
    # and the collective reads the very buffer the views point into.
    in_bucket = torch.zeros_like(flat)
    grad_views = [in_bucket[o:o + n] for o, n in zip(offsets, sizes)]
    for view, tensor in zip(grad_views, tensors):
        view.add_(tensor)  # as AccumulateGrad does into a zeroed .grad

    def accumulated_in_bucket():
        _C.reduce_scatter(backend, in_bucket, shard).wait()

    table = Table([("case", "reduce-scatter of", 48, "s"), ("time_us", "time(us)", 12, ".1f"),
                   ("vs_flat", "vs flat", 9, ".2f")],
                  title=f"# fusion: {len(sizes)} tensors, {human_bytes(sum(sizes) * dtype.itemsize)} "
                        f"({args.fusion}, {args.dtypes[0]}), world size {p}, backend {args.backend}")
    iters = iterations_for(sum(sizes) * dtype.itemsize, hi=20)
    flat_s = median_seconds(flat_only, device, 2, iters)
    for name, fn in [(f"{len(sizes)} tensors, one collective each", per_tensor),
                     ("fused bucket (pack + one collective)", fused),
                     ("gradients accumulated in the bucket (no pack)", accumulated_in_bucket),
                     ("one flat buffer", flat_only)]:
        seconds = flat_s if fn is flat_only else median_seconds(fn, device, 2, iters)
        table.add(case=name, time_us=seconds * 1e6, vs_flat=seconds / flat_s)
    rows = table.rows
    if dist.get_rank() == 0:
        print(f"fused is {rows[0]['time_us'] / rows[1]['time_us']:.1f}x faster than per-tensor "
              f"(target >= 10x) and {rows[1]['vs_flat']:.2f}x the flat collective (target <= 1.1x); "
              f"with .grad in the bucket {rows[0]['time_us'] / rows[2]['time_us']:.1f}x and {rows[2]['vs_flat']:.2f}x")
    return rows, 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--min-bytes", type=int, default=4 * 1024, help="the smallest buffer (default: 4 KiB)")
    parser.add_argument("--max-bytes", type=int, default=None, help="default: 64 MiB (gloo), 256 MiB (nccl)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--fusion", help="fusion mode, e.g. 200x4-64KiB (K tensors of sizes lo..hi)")
    parser.add_argument("--json", help="write all rows here")
    args = parser.parse_args()
    if args.max_bytes is None:
        args.max_bytes = (256 if args.backend == "nccl" else 64) * 1024 * 1024
    if args.min_bytes < 1:
        parser.error(f"--min-bytes must be at least 1 (sizes double from it), got {args.min_bytes}")
    if args.max_bytes < args.min_bytes:
        parser.error(f"--max-bytes ({args.max_bytes}) is below --min-bytes ({args.min_bytes}): no size to measure")

    device = init(args.backend)
    backend = backend_capsule(args.backend, device)
    rows, wrong = (fusion_mode if args.fusion else sizes_mode)(args, device, backend)
    if dist.get_rank() == 0 and not args.fusion:
        print(f"# out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    write_json(args.json, dict(args=vars(args), world_size=dist.get_world_size(), rows=rows, wrong=wrong))
    del backend
    dist.destroy_process_group()
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
