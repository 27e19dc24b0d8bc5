"""The NCCL backend on real GPUs (one rank per visible GPU, so 1 GPU works
too): its collectives against torch.distributed's NCCL results, and training
parity as on CPU, also with every collective delayed on its side stream
(which exposes any missing cross-stream wait)."""
import os

import pytest
import torch
import torch.distributed as dist

from dearcomm._torch_collectives import all_gather_single, reduce_scatter_single

from tests.gpu import HAVE_GPU, requires_gpu
from tests.multiprocess import run_workers
from tests.test_parity import CONFIGS, config_id, train_and_compare

pytestmark = requires_gpu
WORLD = torch.cuda.device_count() if HAVE_GPU else 0
GPU_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def collectives_worker(rank, world_size):
    from dearcomm import _C, _cuda

    device = torch.device("cuda", torch.cuda.current_device())
    backend = _cuda.nccl_backend(dist.group.WORLD, device, dist.default_pg_timeout)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for shard in (1, 17, 4099):
            g = torch.Generator(device="cuda").manual_seed(rank)
            # small integers: every summation order gives the same exact result
            full = torch.randint(-8, 8, (shard * world_size,), generator=g, device=device).to(dtype)
            part = full[:shard].clone()
            ours, theirs = torch.empty(shard, dtype=dtype, device=device), torch.empty(shard, dtype=dtype, device=device)
            _C.reduce_scatter(backend, full, ours).wait()
            reduce_scatter_single(theirs, full)
            ours_ag, theirs_ag = (torch.empty_like(full) for _ in range(2))
            _C.all_gather(backend, part, ours_ag).wait()
            all_gather_single(theirs_ag, part)
            ours_ar, theirs_ar = full.clone(), full.clone()
            _C.all_reduce(backend, ours_ar).wait()
            dist.all_reduce(theirs_ar)
            for name, a, b in [("reduce_scatter", ours, theirs), ("all_gather", ours_ag, theirs_ag),
                               ("all_reduce", ours_ar, theirs_ar)]:
                if not torch.equal(a, b):
                    failures.append(f"{name} {dtype} shard {shard}: {(a != b).sum().item()} elements differ")
    return failures


def test_collectives_match_torch_distributed():
    for rank, failures in enumerate(run_workers(collectives_worker, WORLD, backend="nccl")):
        assert not failures, f"rank {rank}: {failures}"


def parity_worker(rank, world_size, configs, delay_cycles):
    if delay_cycles:
        os.environ["DEARCOMM_DEBUG_STREAM_DELAY_CYCLES"] = str(delay_cycles)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    return {config_id(cfg): train_and_compare(rank, world_size, cfg, device, GPU_TOLERANCE) for cfg in configs}


# ~2 ms per collective at 2 GHz: far longer than these small models' kernels (10 ms took a minute on an H200).
@pytest.mark.parametrize("delay_cycles", [0, 4_000_000], ids=["no-delay", "delayed-side-streams"])
def test_parity_with_single_process_on_gpu(delay_cycles):
    configs = [c for c in CONFIGS if c["bucket_mb"] != 25.0]
    results = run_workers(parity_worker, WORLD, configs, delay_cycles, backend="nccl", deadline=600)
    for rank, per_config in enumerate(results):
        bad = {name: failures for name, failures in per_config.items() if failures}
        assert not bad, f"rank {rank}: " + "\n".join(f"{k}: {v[:2]}" for k, v in bad.items())


def link_model_worker(rank, world_size, iterations):
    """bytescheduler on NCCL: the link model each backward's policy got."""
    import dearcomm

    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = dearcomm.wrap(model, optimizer, schedule="bytescheduler", bucket_mb=4, credit_mb=4)
    x = torch.randn(64, 1024, device=device)
    models = []
    for _ in range(iterations):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        models.append(list(model._dear.engine.link_model))
        optimizer.step()
    torch.cuda.synchronize()
    return len(model._dear.engine.layout.buckets), models


def test_the_credit_runs_on_a_link_model_timed_on_the_gpu():
    """The link model on NCCL: its stamps are CUDA timing events, read once
    the GPU passed them (the host runs ahead), and the figures are summed
    through pinned memory. Every rank adopts the same model at the same
    backward, never before the fourth (engine.h: kLinkAgreementLag), and one
    is adopted within a few more once the GPU caught up."""
    iterations = 10
    results = run_workers(link_model_worker, WORLD, iterations, backend="nccl")
    buckets, models = results[0]
    for rank, (_, other) in enumerate(results):
        assert other == models, f"rank {rank} ran on another link model: {other} vs {models}"
    assert models[:3] == [[], [], []]
    known = [m for m in models if m]
    assert known, f"no link model in {iterations} iterations: {models}"
    assert all(len(m) == buckets and m[0] == 0 for m in known), known
