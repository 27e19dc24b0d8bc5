"""The fsdp2 run of benchmarks/train_bench.py (torch's fully_shard on gloo, CPU):
built by train_bench's own build(), it shards the parameters and trains like
DDP from the same seed, loss for loss; where this torch has no FSDP2 the run
says why and the test skips with that reason.
"""
import argparse
import os
import sys

import pytest
import torch

from tests.multiprocess import run_workers

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
STEPS = 3
WORLD = 2


def _losses(rank, world_size):
    sys.path.insert(0, BENCHMARKS)
    import train_bench

    why = train_bench.fsdp2_unavailable()
    if why:
        return dict(skipped=why)
    from torch.distributed.tensor import DTensor

    args = argparse.Namespace(model="mlp", model_args=["width=64", "depth=2"], bucket_mb=25.0)
    x, y = train_bench.make(args).batch(8, torch.Generator().manual_seed(rank))
    out, grads = {}, {}
    for name in ("ddp", "fsdp2"):
        model, optimizer = train_bench.build(name, args)
        out[name] = [train_bench.iteration(model, optimizer, x, y).item() for _ in range(STEPS)]
        # One more backward: the averaged gradients themselves (AdamW's update
        # hides a gradient off by a constant factor); fsdp2's are sharded.
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads[name] = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    out["grad_diff"] = max((a - b).abs().max().item() for a, b in zip(grads["fsdp2"], grads["ddp"]))
    out["grad_max"] = max(g.abs().max().item() for g in grads["ddp"])
    params = list(model.parameters())
    out["dtensors"] = sum(isinstance(p, DTensor) for p in params)
    out["params"] = len(params)
    out["local_numel"] = sum(p.to_local().numel() for p in params if isinstance(p, DTensor))
    out["numel"] = sum(p.numel() for p in params)
    return out


def test_fsdp2_trains_like_ddp():
    # set up / run
    results = run_workers(_losses, WORLD)
    if "skipped" in results[0]:
        pytest.skip(f"fsdp2 row skipped: {results[0]['skipped']}")
    # check
    for rank, r in enumerate(results):
        assert r["dtensors"] == r["params"], \
            f"[rank {rank}] fsdp2: expected every parameter sharded (DTensor), got {r['dtensors']}/{r['params']}"
        assert r["local_numel"] < r["numel"], \
            f"[rank {rank}] fsdp2: expected a shard smaller than the {r['numel']} elements, got {r['local_numel']}"
        assert r["ddp"][-1] != r["ddp"][0], f"[rank {rank}] ddp: the loss never moved ({r['ddp']}): no update?"
        for step, (got, want) in enumerate(zip(r["fsdp2"], r["ddp"])):
            assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), \
                f"[rank {rank}] step {step}: fsdp2 loss {got!r}, ddp loss {want!r} (all: fsdp2 {r['fsdp2']}, ddp {r['ddp']})"
        assert r["grad_diff"] <= 1e-6 * r["grad_max"], \
            f"[rank {rank}] fsdp2: gradients differ from ddp's by up to {r['grad_diff']!r} (largest {r['grad_max']!r})"
    assert sum(r["local_numel"] for r in results) >= results[0]["numel"], \
        f"fsdp2: the shards hold {[r['local_numel'] for r in results]} elements, fewer than the {results[0]['numel']}"
