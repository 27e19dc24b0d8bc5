"""The CPU backend's all-reduce in issue order (for a schedule that asks:
deft): a reduce-scatter exchange, a local sum and an all-gather exchange, run
whole by the poster thread, so all-reduces hold the link one at a time, as
on one NCCL stream. gloo's own allreduce runs two at once on its worker
threads, and the one issued first then finishes later: deft's delayed
all-reduce would slow the next backward's."""
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dearcomm
from dearcomm import _C
from tests.models import MixedNet, batches, global_batch, local_slice
from tests.multiprocess import run_workers


def values_worker(rank, world_size):
    backend = _C.process_group_backend(dist.group.WORLD)
    _C.keep_issue_order(backend)
    generator = torch.Generator().manual_seed(rank)
    # Multiples of the world size take the ordered path; 7 elements fall back to gloo's.
    # 2^18 + 5 fp32 per chunk: two pieces of unequal length.
    for numel, dtype in ((world_size * 1000, torch.float32), (world_size * (1 << 19), torch.float32),
                         (world_size * ((1 << 18) + 5), torch.float32), (world_size * 333, torch.bfloat16),
                         (7, torch.float32)):
        ours = torch.randn(numel, generator=generator).to(dtype)
        # fp32 sums of a few bf16 values are exact: rounded once, they are what
        # one sum of the p chunks gives (gloo's ring rounds at every step).
        expected = ours.float()
        pending = _C.all_reduce(backend, ours)
        dist.all_reduce(expected)  # torch's, on the same group, issued while ours may be in flight
        pending.wait(30.0)
        torch.testing.assert_close(ours, expected.to(dtype), rtol=0, atol=1e-5 if dtype == torch.float32 else 0,
                                   msg=lambda m: f"{numel} x {dtype}: {m}")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_sums_as_torch_does(world_size):
    """Guards against a wrong chunk summed or sent (each rank's chunk of the
    reduce-scatter, the all-gather landing in the wrong place), against
    chunks of uneven element sizes, and against a torch collective on the same
    group in the middle of ours mismatching with it (ours use tagged sends)."""
    run_workers(values_worker, world_size, deadline=120)


def order_worker(rank, world_size, env, ask):
    if env is not None:
        os.environ["DEARCOMM_CPU_ORDERED"] = env  # read when the backend is built
    backend = _C.process_group_backend(dist.group.WORLD)
    if ask:
        _C.keep_issue_order(backend)  # what the engine does for a schedule that needs it (deft)
    big, small = torch.ones(world_size * (8 << 20)), torch.ones(world_size)  # 32 MiB per rank, and a few bytes
    finishes = []
    for _ in range(3):
        first, second = _C.all_reduce(backend, big), _C.all_reduce(backend, small)
        second.wait(60.0)
        first.wait(60.0)
        finishes.append((first.completed_ns, second.completed_ns))
    assert torch.equal(small, torch.full((world_size,), float(world_size ** 3)))
    # The buffers are Python's: a job that released its views of them after
    # telling the waiter would need the GIL while this thread, holding it,
    # waits for the poster to drain (60 s, then a warning and a leaked thread).
    start = time.monotonic()
    del first, second, backend
    gc.collect()
    assert time.monotonic() - start < 30, "destroying the backend waited for its poster thread's last job"
    return finishes


@pytest.mark.parametrize("env, ask, ordered", [(None, True, True), ("1", False, True), (None, False, False),
                                               ("0", True, False)],
                         ids=["asked", "forced-by-env", "gloo-by-default", "refused-by-env"])
def test_all_reduces_finish_in_issue_order_where_asked(env, ask, ordered):
    """Guards against the poster posting an all-reduce before the one issued
    earlier has finished (the second would share the link and the first
    finish later), and against the switch (the engine's request, the A/B
    variable) not reaching the backend. Unordered is gloo's allreduce: the
    small one issued second finishes first, which shows the test can see
    the difference."""
    finishes = run_workers(order_worker, 2, env, ask, deadline=120)
    for rank, pairs in enumerate(finishes):
        assert all(a > 0 and b > 0 for a, b in pairs), f"rank {rank}: completion times unknown: {pairs}"
        second_first = [b < a for a, b in pairs]
        if ordered:
            assert not any(second_first), f"rank {rank}: the second all-reduce finished first: {pairs}"
        else:
            assert any(second_first), f"rank {rank}: gloo ran its allreduces in order: {pairs}"


def engine_worker(rank, world_size):
    ordered = {}
    for schedule in ("wfbp", "deft"):
        torch.manual_seed(0)
        net = MixedNet()
        model, optimizer = dearcomm.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), schedule=schedule)
        x, y = next(batches(1, global_batch(world_size)))
        F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        ordered[schedule] = model._dear.engine.all_reduces_in_issue_order
    return ordered


def test_the_engine_asks_for_issue_order_where_its_schedule_needs_it():
    """Guards against the engine not passing deft's request on to the CPU
    backend, and against every schedule paying for the ordered path."""
    for rank, ordered in enumerate(run_workers(engine_worker, 2, deadline=120)):
        assert ordered == {"wfbp": False, "deft": True}, f"rank {rank}: {ordered}"
