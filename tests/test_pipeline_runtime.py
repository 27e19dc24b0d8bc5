"""The pipeline runtime on real processes (gloo send/recv, a deadline on every
run): parameters equal single-process training on the global batch after
every step, for partitions with and without replicated stages (and a stage
without parameters) and for the GPipe, 1F1B, list-scheduled and planned
orders, at world sizes 2, 3 and 4; a plan that does not fit the world is an
error."""
import copy

import pytest
import torch
from torch import nn

from dearcomm.pipeline import (LayerProfile, Plan, chain, gpipe_orders, list_orders, one_f_one_b_orders,
                               plan_pipeline, simulate, uniform)
from tests.multiprocess import run_workers

GLOBAL_BATCH, STEPS = 12, 3


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 17), nn.ReLU(), nn.Linear(17, 5))


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
        "replicated-first": ((0, 3, 5), ((0, 1), (2,))),
        "three-stages": ((0, 1, 3, 5), ((0,), (1,), (2,))),
        "replicated-middle": ((0, 1, 4, 5), ((0,), (1, 2), (3,))),
        "four-stages": ((0, 1, 2, 4, 5), ((0,), (1,), (2,), (3,))),
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
        with pytest.raises(ValueError, match="3 stages but only 2 devices"):
            PipelineRuntime(make_model(), build_plan("three-stages:gpipe", 3, 2), nn.functional.cross_entropy,
                            make_optimizer("sgd"), torch.zeros(6, 7))
    return worst


def _one_case(rank, world, case, M, optim):
    from dearcomm.pipeline.runtime import PipelineRuntime
    plan = build_plan(case, world, M)
    model = make_model()
    reference = copy.deepcopy(model)
    ref_opt = make_optimizer(optim)(reference.parameters())
    loss_fn = nn.functional.cross_entropy
    runtime = PipelineRuntime(model, plan, loss_fn, make_optimizer(optim), make_data(0)[0].chunk(M)[0])
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
        for p, q in zip(mine, ref):
            err = float((p - q).abs().max() / q.abs().max().clamp_min(1e-12))
            worst = max(worst, err)
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"[rank {rank}] step {step}: rel err {err:.2e}"
    return worst


CASES = {  # world size -> (plan, micro-batches, optimizer)
    2: [("two-stages:gpipe", 4, "sgd"), ("two-stages:1f1b", 6, "adamw")],
    3: [("replicated-first:1f1b", 6, "sgd"), ("three-stages:list", 4, "adamw"), ("planned", 4, "sgd")],
    4: [("replicated-middle:list", 6, "sgd"), ("four-stages:1f1b", 4, "adamw"), ("four-stages:gpipe", 2, "sgd")],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_matches_single_process_training(world):
    worst = run_workers(_worker, world, CASES[world], deadline=120)
    assert max(worst) <= 1e-5
