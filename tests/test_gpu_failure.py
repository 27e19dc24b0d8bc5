"""The NCCL backend when things go wrong or go away: a stalled collective
times out (bounded, no hang), a killed peer ends the job, the watchdog's
timeout is the process group's, and nothing outlives a dropped wrap: CUDA
memory, threads, events, contexts on other GPUs."""
import datetime
import faulthandler
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.gpu import HAVE_GPU, requires_gpu
from tests.multiprocess import COLLECTIVE_TIMEOUT, Died, run_workers
from tests.test_gpu_streams import cycles_per_second

pytestmark = requires_gpu
WORLD = torch.cuda.device_count() if HAVE_GPU else 0
needs_two_gpus = pytest.mark.skipif(not HAVE_GPU or torch.cuda.device_count() < 2,
                                    reason="needs two GPUs (NCCL refuses two ranks on one)")


def small_model(device):
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)


def train_steps(model, optimizer, steps, device):
    for _ in range(steps):
        model(torch.randn(8, 64, device=device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()


def _stalled(rank, world_size, mode):
    import dearcomm

    os.environ["DEARCOMM_NCCL_FAILURE"] = mode
    os.environ["DEARCOMM_DEBUG_STREAM_DELAY_CYCLES"] = str(int(10 * cycles_per_second()))  # a 10 s stall
    device = torch.device("cuda", torch.cuda.current_device())
    model = small_model(device)
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     timeout=datetime.timedelta(seconds=1))
    # Where the training thread is while the stall lasts: if the error comes
    # late, the captured stderr shows which call held it.
    faulthandler.dump_traceback_later(4.0, repeat=False)
    start = time.monotonic()
    try:
        for _ in range(50):
            model(torch.randn(8, 64, device=device)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.1)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    finally:
        faulthandler.cancel_dump_traceback_later()
    return None, time.monotonic() - start


def test_a_stalled_collective_raises_within_its_timeout_in_raise_mode():
    for rank, (error, seconds) in enumerate(run_workers(_stalled, WORLD, "raise", backend="nccl", deadline=120)):
        assert error is not None, f"rank {rank}: trained on through a stalled collective"
        assert "did not finish within 1000 ms" in error and "aborted" in error, error
        assert seconds < 8, f"rank {rank}: noticed after {seconds:.1f} s (timeout 1 s)"


def test_a_stalled_collective_ends_the_process_by_default():
    """As ProcessGroupNCCL: after an abort the GPU queue may hold kernels that
    read garbage, so the process ends (SIGABRT) instead of training on."""
    results = run_workers(_stalled, WORLD, "terminate", backend="nccl", deadline=120, allow_death=True)
    for rank, result in enumerate(results):
        assert isinstance(result, Died) and result.exitcode != 0, f"rank {rank}: {result}"


def _timeout_of_nccl_group(rank, world_size):
    import dearcomm

    device = torch.device("cuda", torch.cuda.current_device())
    model = small_model(device)
    model, _ = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return model._dear.timeout


def test_watchdog_timeout_is_the_nccl_process_groups():
    """Guards against reading the timeout from a CPU backend an NCCL group
    does not have (a silent 30 minutes)."""
    for rank, timeout in enumerate(run_workers(_timeout_of_nccl_group, WORLD, backend="nccl")):
        assert timeout == COLLECTIVE_TIMEOUT, f"rank {rank}: {timeout}"


def _events_are_pooled(rank, world_size):
    from dearcomm import _C, _C_cuda, _cuda

    device = torch.device("cuda", torch.cuda.current_device())
    backend = _cuda.nccl_backend(dist.group.WORLD, device, dist.default_pg_timeout)
    buffer = torch.ones(1024, device=device)
    for _ in range(100):
        _C.all_reduce(backend, buffer).wait()
        torch.cuda.synchronize()
        time.sleep(0.03)  # > one watchdog poll (20 ms): the watchdog has let go of the last one
    return _C_cuda.events_created(backend)


def test_cuda_events_are_pooled():
    """Guards against two events created and destroyed per collective: 100
    collectives one after another reuse the same few."""
    for rank, created in enumerate(run_workers(_events_are_pooled, WORLD, backend="nccl")):
        assert created <= 8, f"rank {rank}: {created} events for 100 sequential collectives"


def _buffers_outlive_their_backends(rank, world_size):
    import gc

    from dearcomm import _C, _C_cuda, _cuda

    device = torch.device("cuda", torch.cuda.current_device())
    kept = []
    streams_before = _C_cuda.comm_streams_created()
    for _ in range(3):  # later backends reuse the first one's stream
        backend = _cuda.nccl_backend(dist.group.WORLD, device, dist.default_pg_timeout)
        buffer = torch.ones(1 << 20, device=device)
        _C.all_reduce(backend, buffer).wait()
        kept.append(buffer)
        del backend
        gc.collect()
    total = sum(b.sum().item() for b in kept)
    kept.clear()  # freed after their backends: the allocator records an event on each one's stream
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return total, _C_cuda.comm_streams_created() - streams_before


def test_buffers_freed_after_their_backend_is_dropped():
    """Guards against destroying the communication stream with the backend:
    the caching allocator later records events on it for every buffer it
    was recorded on, which crashed workers at exit (SIGSEGV, no result)."""
    for rank, (total, streams) in enumerate(run_workers(_buffers_outlive_their_backends, WORLD, backend="nccl")):
        assert total == 3 * (1 << 20) * WORLD, f"rank {rank}: {total}"
        assert streams == 1, f"rank {rank}: {streams} streams for 3 backends one after another (not reused)"


def threads():
    return len(os.listdir("/proc/self/task"))


def _cycles(rank, world_size):
    import gc
    import weakref

    import dearcomm

    device = torch.device("cuda", torch.cuda.current_device())
    samples, alive = [], []
    for cycle in range(30):
        model = small_model(device)
        model, optimizer = dearcomm.wrap(model, torch.optim.AdamW(model.parameters()), bucket_mb=0)
        train_steps(model, optimizer, 2, device)
        engine = weakref.ref(model._dear.engine)
        del model, optimizer
        gc.collect()
        alive.append(engine() is not None)
        time.sleep(0.05)  # the watchdog thread's join
        free, _ = torch.cuda.mem_get_info(device)  # the device's view: NCCL's buffers included
        samples.append((torch.cuda.memory_allocated(device), free, threads()))
    return samples, alive


def test_dropped_wraps_free_memory_threads_and_communicators():
    for rank, (samples, alive) in enumerate(run_workers(_cycles, WORLD, backend="nccl", deadline=600)):
        assert not any(alive), f"rank {rank}: an engine outlived its model ({alive.count(True)} of 30)"
        (mem10, free10, threads10), (mem30, free30, threads30) = samples[9], samples[29]
        assert mem30 <= mem10, f"rank {rank}: CUDA memory grew from {mem10} to {mem30} bytes over 20 cycles"
        # A leaked communicator holds tens of MiB of NCCL buffers outside torch's allocator.
        assert free10 - free30 < 64 * 2**20, f"rank {rank}: device memory fell {(free10 - free30) / 2**20:.0f} MiB"
        assert threads30 <= threads10, f"rank {rank}: threads grew from {threads10} to {threads30} (watchdogs?)"


def devices_with_a_context():
    """GPUs on which this process holds a primary context, from the driver
    itself (nvidia-smi's PIDs are the host's inside a container)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    count = ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    active = []
    for i in range(count.value):
        device, flags, is_active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert cuda.cuDeviceGet(ctypes.byref(device), i) == 0
        assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(is_active)) == 0
        if is_active.value:
            active.append(i)
    return active


def _contexts(rank, world_size):
    import dearcomm

    device = torch.device("cuda", torch.cuda.current_device())
    model = small_model(device)
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train_steps(model, optimizer, 3, device)
    time.sleep(0.2)  # the watchdog has polled
    return devices_with_a_context(), device.index


@needs_two_gpus
def test_every_rank_holds_a_context_on_its_own_gpu_only():
    """Guards against a watchdog thread querying events before binding its
    device: a primary context on GPU 0 for every rank (~0.5 GiB each)."""
    for rank, (gpus, own) in enumerate(run_workers(_contexts, WORLD, backend="nccl")):
        assert gpus == [own], f"rank {rank} (cuda:{own}) holds contexts on GPUs {gpus}"


def _peer_dies(rank, world_size, mode):
    import dearcomm

    os.environ["DEARCOMM_NCCL_FAILURE"] = mode
    device = torch.device("cuda", torch.cuda.current_device())
    model = small_model(device)
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     timeout=datetime.timedelta(seconds=5))
    train_steps(model, optimizer, 2, device)
    if rank == 1:
        os._exit(17)
    start = time.monotonic()
    try:
        train_steps(model, optimizer, 20, device)
        time.sleep(8)
        train_steps(model, optimizer, 1, device)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


@needs_two_gpus
@pytest.mark.parametrize("mode", ["raise", "terminate"])
def test_a_killed_peer_fails_the_others_in_bounded_time(mode):
    results = run_workers(_peer_dies, WORLD, mode, backend="nccl", deadline=120, allow_death=True)
    for rank, result in enumerate(results):
        if rank == 1:
            continue
        if mode == "terminate":
            assert isinstance(result, Died) and result.exitcode != 0, f"rank {rank}: {result}"
        else:
            assert not isinstance(result, Died), f"rank {rank}: {result}"
            error, seconds = result
            assert error is not None and "aborted" in error, f"rank {rank}: {result}"
