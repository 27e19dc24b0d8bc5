"""The pipeline runtime on real processes (gloo send/recv, a deadline on every
run): parameters equal single-process training on the global batch after
every step, for partitions with and without replicated stages (and a stage
without parameters) and for the GPipe, 1F1B, list-scheduled and planned
orders, at world sizes 2, 3 and 4 (a stage that starts with an in-place
ReLU, a replica without a micro-batch, a frozen first stage and BatchNorm's
statistics among them); misuse (a plan for more ranks, ranks that disagree on the
plan, orders that deadlock, a module that is not a chain, a batch of another
shape) is an error on every rank before anything hangs. profile_sequential
on real modules."""
import copy

import pytest
import torch
from torch import nn

from dearcomm.pipeline import (LayerProfile, Plan, chain, gpipe_orders, list_orders, one_f_one_b_orders,
                               plan_pipeline, simulate, uniform)
from tests.multiprocess import run_workers

GLOBAL_BATCH, STEPS = 12, 3


def make_model(kind: str = "plain") -> nn.Sequential:
    torch.manual_seed(0)
    # In place, as torchvision's models: a stage that starts with it must not write the received leaf.
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 17), nn.ReLU(inplace=True), nn.Linear(17, 5))
    if kind == "frozen-first":  # a first stage with nothing to train (a frozen embedding, a Flatten)
        model[0].requires_grad_(False)
    if kind == "batchnorm":  # running statistics: one micro-batch, so that one process sees the same batches
        model[1] = nn.BatchNorm1d(13)
    if kind == "mixed-dtypes":  # a float64 head: the replicas' flat gradient buffer is float64
        model[4] = Float64Head(model[4])
    return model


class Float64Head(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.fc = linear.double()

    def forward(self, x):
        return self.fc(x.double()).float()


def make_data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


def make_optimizer(kind: str):
    if kind == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def build_plan(case: str, world: int, M: int) -> Plan:
    profile = chain("toy", [LayerProfile(f"l{i}", 1.0 + i % 3, 2.0, 4e3, 1e3) for i in range(5)])
    topo = uniform(world)
    shapes = {
        "two-stages": ((0, 2, 5), ((0,), (1,))),
        "relu-first": ((0, 3, 5), ((0,), (1,))),
        "replicated-first": ((0, 3, 5), ((0, 1), (2,))),
        "three-stages": ((0, 1, 3, 5), ((0,), (1,), (2,))),
        "replicated-middle": ((0, 1, 4, 5), ((0,), (1, 2), (3,))),
        "four-stages": ((0, 1, 2, 4, 5), ((0,), (1,), (2,), (3,))),
        "one-replicated-stage": ((0, 5), ((0, 1),)),
    }
    if case == "planned":
        return plan_pipeline(profile, topo, M)
    bounds, devices = shapes[case.split(":")[0]]
    rule = case.split(":")[1]
    orders = {"gpipe": lambda: gpipe_orders(devices, M),
              "1f1b": lambda: one_f_one_b_orders(devices, M, profile, topo, bounds),
              "list": lambda: list_orders(profile, topo, bounds, devices, M)}[rule]()
    plan = Plan(bounds, devices, orders, M, case)
    simulate(plan, profile, topo)  # rejects deadlocking orders
    return plan


def _worker(rank, world, cases):
    # Several cases per spawn: starting processes is the slow part here.
    worst = max(_one_case(rank, world, *case) for case in cases)
    if world == 2:  # a plan for more devices than ranks: a clear error, no hang
        from dearcomm.pipeline.runtime import PipelineRuntime
        with pytest.raises(ValueError, match="devices up to 2 but the process group has 2 ranks"):
            PipelineRuntime(make_model(), build_plan("three-stages:gpipe", 3, 2), nn.functional.cross_entropy,
                            make_optimizer("sgd"), torch.zeros(6, 7))
    return worst


def _one_case(rank, world, case, M, optim, kind="plain"):
    from dearcomm.pipeline.runtime import PipelineRuntime
    plan = build_plan(case, world, M)
    model = make_model(kind)
    reference = copy.deepcopy(model)
    ref_opt = make_optimizer(optim)(reference.parameters())
    loss_fn = nn.functional.cross_entropy
    runtime = PipelineRuntime(model, plan, loss_fn, make_optimizer(optim), make_data(0)[0].chunk(M)[0])
    # Building it trained nothing: the shape probe left BatchNorm's statistics as they were.
    assert all(torch.equal(p, q) for p, q in zip(model.buffers(), reference.buffers()))
    where = plan.stage_of_device(rank)
    worst = 0.0
    for step in range(STEPS):
        x, y = make_data(step)
        loss = runtime.step(x, y)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        if where is None:
            continue
        if where[0] == plan.num_stages - 1:
            assert abs(loss - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss))), (step, loss, float(ref_loss))
        a, b = plan.stage_layers(where[0])
        mine = list(runtime.module.parameters())
        ref = [p for child in list(reference.children())[a:b] for p in child.parameters()]
        assert len(mine) == len(ref)
        buffers = [b for child in list(reference.children())[a:b] for b in child.buffers()]
        assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(runtime.module.buffers(), buffers))
        for p, q in zip(mine, ref):
            err = float((p - q).abs().max() / q.abs().max().clamp_min(1e-12))
            worst = max(worst, err)
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"[rank {rank}] step {step}: rel err {err:.2e}"
    return worst


CASES = {  # world size -> (plan, micro-batches, optimizer[, model])
    # A replica without a micro-batch (fewer micro-batches than replicas, as
    # PipeDream's plans have) still joins its stage's all-reduce.
    2: [("two-stages:gpipe", 4, "sgd"), ("two-stages:1f1b", 6, "adamw"), ("relu-first:1f1b", 4, "sgd"),
        ("one-replicated-stage:list", 1, "adamw"), ("two-stages:gpipe", 1, "sgd", "batchnorm"),
        ("one-replicated-stage:list", 2, "adamw", "mixed-dtypes")],
    3: [("replicated-first:1f1b", 6, "sgd"), ("three-stages:list", 4, "adamw"), ("planned", 4, "sgd"),
        ("replicated-first:list", 1, "sgd")],
    4: [("replicated-middle:list", 6, "sgd"), ("four-stages:1f1b", 4, "adamw"), ("four-stages:gpipe", 2, "sgd"),
        ("four-stages:1f1b", 4, "sgd", "frozen-first")],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_matches_single_process_training(world):
    worst = run_workers(_worker, world, CASES[world], deadline=120)
    assert max(worst) <= 1e-5


def _misuse_worker(rank, world):
    from dearcomm.pipeline import Task
    from dearcomm.pipeline.runtime import PipelineRuntime
    loss_fn, sgd, sample = nn.functional.cross_entropy, make_optimizer("sgd"), torch.zeros(3, 7)
    # Ranks that planned apart (each on its own timings): rank 1 splits elsewhere.
    devices = ((0,), (1,))
    mine = Plan((0, 2, 5) if rank == 0 else (0, 3, 5), devices, gpipe_orders(devices, 4), 4, "mine")
    with pytest.raises(ValueError, match=r"ranks \[1\] hold another plan, model depth or micro-batch shape"):
        PipelineRuntime(make_model(), mine, loss_fn, sgd, sample)
    # A plan only rank 1 finds wrong (for 3 devices): rank 0 learns it instead of waiting in the next collective.
    wrong = build_plan("three-stages:gpipe", 3, 2) if rank == 1 else build_plan("two-stages:gpipe", 2, 2)
    with pytest.raises(ValueError, match="devices up to 2 but the process group has 2 ranks" if rank == 1 else
                       "PipelineRuntime failed on rank 1: PipelineRuntime: the plan places stages on devices up to 2"):
        PipelineRuntime(make_model(), wrong, loss_fn, sgd, sample)
    # Orders that deadlock: device 1 waits for micro-batch 1 first, device 0 sends it after B0.
    task = lambda text: Task(text[0], int(text[3]), int(text[1]))  # noqa: E731
    orders = {0: tuple(map(task, ["F0s0", "B0s0", "F1s0", "B1s0"])),
              1: tuple(map(task, ["F1s1", "F0s1", "B0s1", "B1s1"]))}
    with pytest.raises(ValueError, match=r"plan 'stuck' deadlocks: device 0 waits to run B0s0 for B0s1; "
                                         r"device 1 waits to run F1s1 for F1s0"):
        PipelineRuntime(make_model(), Plan((0, 2, 5), devices, orders, 2, "stuck"), loss_fn, sgd, sample)

    class Residual(nn.Module):  # its children in a chain are another network
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(7, 7), nn.Linear(7, 5)

        def forward(self, x):
            return self.b(x + self.a(x))
    with pytest.raises(TypeError, match="takes an nn.Sequential whose forward only chains its children; got Residual"):
        PipelineRuntime(Residual(), build_plan("two-stages:gpipe", 2, 2), loss_fn, sgd, sample)
    # A batch of other micro-batches than the sample's: the last, short batch of an epoch, another dtype.
    runtime = PipelineRuntime(make_model(), build_plan("two-stages:gpipe", 2, 4), loss_fn, sgd, sample)
    x, y = make_data(0)
    with pytest.raises(ValueError, match=r"global batch of 4 micro-batches shaped like sample_microbatch, "
                                         r"torch.float32 of shape \(12, 7\); got torch.float32 of shape \(8, 7\)"
                                         r".*drop_last=True"):
        runtime.step(x[:8], y[:8])
    with pytest.raises(ValueError, match=r"got torch.float64 of shape \(12, 7\)"):
        runtime.step(x.double(), y)
    with pytest.raises(ValueError, match="12 inputs but 11 targets"):
        runtime.step(x, y[:11])
    with pytest.raises(ValueError, match="12 inputs but a tuple, not a tensor of targets"):
        runtime.step(x, (y,))
    shared = nn.Linear(7, 7)
    with pytest.raises(ValueError, match=r"runs one module \(Linear\) as layers 0 and 2; .* each layer must be"):
        PipelineRuntime(nn.Sequential(shared, nn.Tanh(), shared), build_plan("two-stages:gpipe", 2, 2), loss_fn,
                        sgd, sample)
    return runtime.step(x, y)  # and it still trains


def test_misuse_fails_on_every_rank_without_a_hang():
    losses = run_workers(_misuse_worker, 2, deadline=120)
    assert losses[0] is None and losses[1] > 0


def test_profile_sequential_refuses_a_module_that_is_not_a_chain():
    from dearcomm.pipeline import profile_sequential

    class Subclass(nn.Sequential):  # a forward of its own
        def forward(self, x):
            return super().forward(x) + x
    with pytest.raises(TypeError, match="got Subclass, whose forward may do more"):
        profile_sequential(Subclass(nn.Linear(4, 4)), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="at least one sample along dim 0, got shape \\(0, 4\\)"):
        profile_sequential(nn.Sequential(nn.Linear(4, 4)), torch.zeros(0, 4))


def test_profile_sequential_leaves_the_model_as_it_was():
    """In-place layers after a boundary (every torchvision model) profile,
    and the passes change neither BatchNorm's statistics nor the caller's
    gradients."""
    from dearcomm.pipeline import profile_sequential
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.BatchNorm1d(6), nn.ReLU(inplace=True),
                          nn.Linear(6, 2))
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)
    before = copy.deepcopy(model.state_dict())
    profile = profile_sequential(model, torch.randn(5, 4), torch.randint(0, 2, (5,)), nn.functional.cross_entropy)
    assert len(profile) == 5 and all(l.forward_ms >= 0 for l in profile.layers)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "profiling moved the model's state"
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 0.5))
    assert model[4].weight.grad is None


def _measure_worker(rank, world):
    from dearcomm.pipeline.measure import measure_topology
    with pytest.raises(ValueError, match="repeats must be a positive integer, got 0"):
        measure_topology(repeats=0)
    topology = measure_topology(repeats=3, large_bytes=1 << 20)
    return topology.bandwidth, topology.latency


def test_measured_links_are_every_ranks_and_symmetric():
    results = run_workers(_measure_worker, 3, deadline=120)
    bandwidth, latency = results[0]
    assert all(r == results[0] for r in results), "the ranks plan on different links"
    for i in range(3):
        assert bandwidth[i][i] == 0 and latency[i][i] == 0
        for j in range(3):
            if i != j:
                assert bandwidth[i][j] == bandwidth[j][i] > 0 and latency[i][j] == latency[j][i] > 0
