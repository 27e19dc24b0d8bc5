"""The NCCL backend's promise that the host never waits, and the tests' own
power to see a missing cross-stream edge (negative controls). One rank per
GPU, so these run on a single GPU too.

Delays are spin kernels (DEARCOMM_DEBUG_*_DELAY_CYCLES) of about a second:
an enqueue that returns in well under that did not wait for the GPU."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.gpu import HAVE_GPU, requires_gpu
from tests.multiprocess import run_workers
from tests.test_parity import CONFIGS, config_id, train_and_compare

pytestmark = requires_gpu
WORLD = torch.cuda.device_count() if HAVE_GPU else 0
GPU_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# The host's budget for enqueueing work behind a one-second spin: a waiting
# host takes >= 1 s; enqueueing takes milliseconds.
HOST_BUDGET_S = 0.25


def cycles_per_second():
    """The GPU clock, measured with torch's own spin kernel."""
    cycles = 200_000_000
    torch.cuda._sleep(cycles)  # warm-up: clocks ramp up under load
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return cycles / (time.perf_counter() - start)


def _launches_return_at_once(rank, world_size):
    from dearcomm import _C, _cuda

    device = torch.device("cuda", torch.cuda.current_device())
    delay = str(int(cycles_per_second()))  # ~1 s before each collective
    a, b = torch.ones(1 << 20, device=device), torch.ones(1 << 20, device=device)
    os.environ["DEARCOMM_DEBUG_STREAM_DELAY_CYCLES"] = delay  # read when the backend is made
    backend = _cuda.nccl_backend(dist.group.WORLD, device, dist.default_pg_timeout)
    # A communicator's first collective connects to its peers on the host: outside the timed part.
    _C.all_reduce(backend, torch.ones(1, device=device))
    torch.cuda.synchronize()
    start = time.perf_counter()
    first = _C.all_reduce(backend, a)
    second = _C.all_reduce(backend, b)  # today's watchdog made this wait for the first
    first.wait()
    second.wait()
    enqueued = time.perf_counter() - start
    torch.cuda.synchronize()
    finished = time.perf_counter() - start
    return enqueued, finished, a[0].item(), b[0].item()


def test_two_delayed_collectives_return_to_the_host_at_once():
    """Guards against a watchdog (or anything) that blocks enqueue or wait()
    until an earlier collective finishes on the GPU."""
    for rank, (enqueued, finished, a, b) in enumerate(run_workers(_launches_return_at_once, WORLD, backend="nccl")):
        assert finished >= 1.5, f"rank {rank}: the delays did not happen ({finished:.2f} s)"
        assert enqueued < HOST_BUDGET_S, f"rank {rank}: the host waited {enqueued:.2f} s for the GPU"
        assert a == b == WORLD


def _forward_enqueues_before_gather(rank, world_size):
    import dearcomm

    device = torch.device("cuda", torch.cuda.current_device())
    os.environ["DEARCOMM_DEBUG_STREAM_DELAY_CYCLES"] = str(int(cycles_per_second()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).to(device)
    reference = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).to(device)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), bucket_mb=0)
    x = torch.randn(8 * world_size, 256, device=device)
    n = x.shape[0] // world_size
    model(x[rank * n:(rank + 1) * n]).square().mean().backward()
    optimizer.step()  # issues the all-gathers, each ~1 s behind its spin
    reference(x).square().mean().backward()
    ref_opt.step()
    start = time.perf_counter()
    out = model(x)  # the pre-hooks must order the stream, not wait on the host
    enqueued = time.perf_counter() - start
    torch.cuda.synchronize()
    return enqueued, (out - reference(x)).abs().max().item()


def test_forward_pre_hook_enqueues_its_module_before_the_gather_completes():
    for rank, (enqueued, error) in enumerate(run_workers(_forward_enqueues_before_gather, WORLD, backend="nccl")):
        assert enqueued < HOST_BUDGET_S, f"rank {rank}: the forward waited {enqueued:.2f} s on the host"
        assert error < 1e-5, f"rank {rank}: the forward did not see the gathered parameters ({error})"


def parity_worker(rank, world_size, configs, env):
    os.environ.update({k: str(v) for k, v in env.items()})
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    delay = int(0.005 * cycles_per_second())  # 5 ms: far longer than any kernel of these small models
    for key in ("DEARCOMM_DEBUG_STREAM_DELAY_CYCLES", "DEARCOMM_DEBUG_COMPUTE_DELAY_CYCLES"):
        if os.environ.get(key) == "auto":
            os.environ[key] = str(delay)
    return {config_id(cfg): train_and_compare(rank, world_size, cfg, device, GPU_TOLERANCE) for cfg in configs}


SMALL_CONFIGS = [c for c in CONFIGS if c["bucket_mb"] == 0.0 and c["optim"] == "sgd"]
DELAYS = {
    "side-stream": {"DEARCOMM_DEBUG_STREAM_DELAY_CYCLES": "auto"},
    "compute-stream": {"DEARCOMM_DEBUG_COMPUTE_DELAY_CYCLES": "auto"},
}


@pytest.mark.parametrize("delay", list(DELAYS), ids=list(DELAYS))
def test_parity_holds_under_each_delay(delay):
    results = run_workers(parity_worker, WORLD, SMALL_CONFIGS, DELAYS[delay], backend="nccl", deadline=600)
    for rank, per_config in enumerate(results):
        bad = {name: failures for name, failures in per_config.items() if failures}
        assert not bad, f"rank {rank}: " + "\n".join(f"{k}: {v[:2]}" for k, v in bad.items())


@pytest.mark.parametrize("edge, delay", [("done", "side-stream"), ("ready", "compute-stream")])
def test_negative_control_a_dropped_edge_breaks_parity(edge, delay):
    """Proves the delayed parity test can see a missing edge: dropping the
    "done" wait (E2) while the comm stream is late, or the "ready" wait (E1)
    while the compute stream is late, must give wrong results."""
    env = dict(DELAYS[delay], DEARCOMM_DEBUG_DROP_EDGE=edge)
    results = run_workers(parity_worker, WORLD, SMALL_CONFIGS, env, backend="nccl", deadline=600)
    broken = sum(bool(failures) for per_config in results for failures in per_config.values())
    assert broken > 0, f"dropping the {edge!r} edge went unnoticed: the delayed parity test is blind to it"


COMM_DTYPE_CONFIGS = [dict(c, comm_dtype=dtype) for c in CONFIGS if c["bucket_mb"] == 0.0 and c["optim"] == "adamw"
                      for dtype in (torch.bfloat16, torch.float16)]


def low_precision_worker(rank, world_size, configs):
    device = torch.device("cuda", torch.cuda.current_device())
    bound = dict(rtol=2e-2, atol=2e-3)  # as tests/test_mixed_precision.py on CPU
    return {f"{config_id(cfg)}-{cfg['comm_dtype']}": train_and_compare(rank, world_size, cfg, device, bound)
            for cfg in configs}


def test_bf16_and_fp16_gradients_end_to_end():
    for rank, per_config in enumerate(run_workers(low_precision_worker, WORLD, COMM_DTYPE_CONFIGS, backend="nccl",
                                                  deadline=600)):
        bad = {name: failures for name, failures in per_config.items() if failures}
        assert not bad, f"rank {rank}: " + "\n".join(f"{k}: {v[:2]}" for k, v in bad.items())


def _other_device(rank, world_size):
    """Parameters on cuda:(k+1) while cuda:k is current."""
    current = torch.cuda.current_device()
    device = torch.device("cuda", (current + 1) % torch.cuda.device_count())
    os.environ["DEARCOMM_DEBUG_STREAM_DELAY_CYCLES"] = str(int(0.05 * cycles_per_second()))
    return train_and_compare(rank, world_size, SMALL_CONFIGS[0], device, GPU_TOLERANCE)


@pytest.mark.skipif(not HAVE_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_parameters_on_a_device_other_than_the_current_one():
    """Guards against ordering the current device's stream instead of the
    parameters' device's (a silent race)."""
    # The process group is not bound to a device (bind_device=False): a group
    # bound to cuda:0 would refuse wrap()'s broadcast of cuda:1 parameters.
    for rank, failures in enumerate(run_workers(_other_device, 1, backend="nccl", bind_device=False)):
        assert not failures, f"rank {rank}: {failures[:2]}"
