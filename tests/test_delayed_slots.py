"""Buffer slots and reductions in flight across step(): the executor's part
of a delayed schedule (DeFT), driven by a toy policy, wfbp with chosen buckets
applied one step late (csrc/schedule/delayed_for_tests.cpp).

On gloo, the engine trains like a single-process delayed SGD: step t applies
the averaged gradient of step t for undelayed buckets and that of step t - 1
for delayed ones (nothing at step 0). On the simulated device the delayed
reduction overlaps the next iteration, and every state change equals the one
recorded from gloo."""
import pytest
import torch
import torch.distributed as dist

from dearcomm import _C
from tests.multiprocess import run_workers

SIZES = [48, 32, 16, 8]  # forward order; bucket cap 0: one bucket (and index) each
STEPS = 6
LR, MOMENTUM = 0.1, 0.9


def initial(i):
    return torch.linspace(-1.0, 1.0, SIZES[i]) * (i + 1)


def target(rank, step, i):
    """What rank `rank` pulls parameter i towards at `step`: its gradient is 2 (p - target)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
    return torch.randn(SIZES[i], generator=g)


def loss_of(params, rank, step):
    return sum(((p - target(rank, step, i)) ** 2).sum() for i, p in enumerate(params))


def delayed_sgd(world_size, delayed, steps=STEPS):
    """The reference, in one process: the average of every rank's gradient,
    applied at once or one step late (at step 0 a delayed parameter gets no
    .grad, so SGD skips it)."""
    params = [torch.nn.Parameter(initial(i)) for i in range(len(SIZES))]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    previous = None
    for step in range(steps):
        averages = []
        for i, p in enumerate(params):
            grads = [torch.autograd.grad(((p - target(r, step, i)) ** 2).sum(), p)[0] for r in range(world_size)]
            averages.append(torch.stack(grads).mean(0))
        for i, p in enumerate(params):
            p.grad = (previous[i] if previous else None) if i in delayed else averages[i]
        optimizer.step()
        optimizer.zero_grad()
        previous = averages
    return [p.detach() for p in params]


def delayed_worker(rank, world_size, delayed, grad_views, flush_at):
    params = [torch.nn.Parameter(initial(i)) for i in range(len(SIZES))]
    layout = _C.plan_buckets(SIZES, [torch.float32] * len(SIZES), 0, world_size)
    assert len(layout.buckets) == len(SIZES)
    engine = _C.Engine(layout, params, [f"p{i}" for i in range(len(SIZES))], dist.group.WORLD,
                       _C._testing.delayed_schedule(delayed), 60.0, grad_views=grad_views)
    engine.set_recording(True)
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: engine.mark_grad_ready(i, p.grad))
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        loss_of(params, rank, step).backward()
        engine.end_backward()
        engine.begin_step(False)
        optimizer.step()
        engine.end_step()
        optimizer.zero_grad(set_to_none=False)
        if step in flush_at:
            engine.flush()  # sync(): waits for the delayed reductions; their averages keep for the next step
    engine.flush()
    return [p.detach() for p in params], engine.take_records()


@pytest.mark.parametrize("world_size, delayed, grad_views", [
    (2, [1], True), (2, [0, 2], False), (3, [0, 1, 2, 3], True), (3, [3], False),
], ids=["2-one", "2-two-packed", "3-all", "3-last-packed"])
def test_delayed_buckets_train_like_single_process_delayed_sgd(world_size, delayed, grad_views):
    results = run_workers(delayed_worker, world_size, delayed, grad_views, ())
    expected = delayed_sgd(world_size, delayed)
    for rank, (params, _) in enumerate(results):
        for i, (got, want) in enumerate(zip(params, expected)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, parameter {i} (delayed {delayed}): {m}")
    # The reference can tell: applying on time trains to other values.
    on_time = delayed_sgd(world_size, [])
    assert not all(torch.allclose(a, b) for a, b in zip(on_time, expected))


def test_a_flush_waits_for_delayed_reductions_and_keeps_their_averages_for_the_next_step():
    """sync() between steps (a rank-0 checkpoint's flush on every rank here)
    must leave nothing in flight and change nothing the training computes."""
    world_size, delayed = 2, [0, 2]
    results = run_workers(delayed_worker, world_size, delayed, True, (0, 2, 3))
    expected = delayed_sgd(world_size, delayed)
    for params, records in results:
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        waits = [r for r in records if r["event"] == "wait_reduction" and r["bucket"] in delayed]
        assert len(waits) == STEPS * len(delayed)  # every delayed reduction waited exactly once
    assert results[0][1] == results[1][1]


def simulated(delayed, iterations=3):
    layout = _C.plan_buckets(SIZES, [torch.float32] * len(SIZES), 0, 2)
    modules = [(f"m{i}", 1e-3, 2e-3, [i]) for i in range(len(SIZES))]
    costs = {kind: (0.0, 1e-6) for kind in ("reduce_scatter", "all_gather", "all_reduce")}  # 1 us per byte
    return _C.simulate(layout, None, modules, 1e-3, SIZES, _C._testing.delayed_schedule(delayed), costs, iterations)


def test_the_simulated_device_walks_the_states_recorded_from_gloo():
    for delayed in ([1], [0, 1, 2, 3]):
        sim = simulated(delayed, iterations=STEPS)["records"]
        real = [records for _, records in run_workers(delayed_worker, 2, delayed, False, ())]
        assert real[0] == real[1] == sim, delayed


def test_a_delayed_reduction_overlaps_the_next_iteration_in_its_own_slot():
    """4 modules of 1 ms forward and 2 ms backward, step 1 ms, all-reduce
    1 us per byte. On time, bucket 0 (48 fp32, padded to 64 = 256 bytes:
    256 us) is eligible only at the end of backward and nothing hides it:
    4 + 8 + 0.256 + 1 ms. Delayed,
    it runs during the step and is waited for by the next one: 13 ms, and its
    slots take turns."""
    assert simulated([])["iteration_s"] == pytest.approx(13.256e-3)
    result = simulated([0])
    assert result["iteration_s"] == pytest.approx(13.0e-3)
    delayed_ops = [op for op in result["ops"] if op["bucket"] == 0]
    assert [(op["iteration"], op["slot"]) for op in delayed_ops] == [(0, 0), (1, 1), (2, 0)]
    for op in delayed_ops[:2]:  # waited by the step of the next iteration (the last by the final flush)
        assert op["wait_begin_s"] > result["iteration_starts_s"][op["iteration"] + 1]
    assert all(op["slot"] == 0 for op in result["ops"] if op["bucket"] != 0)


def test_a_parameter_split_across_buckets_has_one_delay():
    layout = _C.plan_buckets([4096], [torch.float32], 0, 2, 4096)  # partitions of 4 KiB: 4 buckets
    assert len(layout.buckets) > 1
    costs = {kind: (0.0, 1e-9) for kind in ("reduce_scatter", "all_gather", "all_reduce")}
    with pytest.raises(ValueError, match="parameter 'param 0' spans buckets 0 to .*delays differently"):
        _C.simulate(layout, None, [("m", 1e-3, 1e-3, [0])], 0.0, [4096], _C._testing.delayed_schedule([0]), costs, 1)
