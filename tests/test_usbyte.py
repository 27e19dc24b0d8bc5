"""schedule="usbyte" end to end: a job plans its own blocks and order at the
first training forward (every rank the same plan, rank 0's), trains with
them exactly like one process on the global batch, and plan_job picks the
unit whose plan the engine's own schedule code predicts fastest."""
import copy

import pytest
import torch
import torch.nn.functional as F

import dearcomm
from dearcomm.prediction import Network
from dearcomm.profiler import ParamProfile, ProfiledModule, TrainingProfile
from dearcomm.usbyte import plan_job
from tests.multiprocess import run_workers


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


def train_beside_reference(model, optimizer, reference, ref_optimizer, rank, world_size, steps):
    """A plain loop (no sync() between steps) on this rank's slice, and one
    process on the global batch beside it."""
    g = torch.Generator().manual_seed(1)
    n = 4
    for _ in range(steps):
        x, y = torch.randn(n * world_size, 64, generator=g), torch.randint(0, 10, (n * world_size,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_optimizer.step()


def planned_worker(rank, world_size):
    model, reference = mlp(), mlp()
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference))
    model, optimizer = dearcomm.wrap(model, optimizer, schedule="usbyte")
    train_beside_reference(model, optimizer, reference, ref_optimizer, rank, world_size, steps=6)
    runtime = model._dear
    plan = runtime.planner.plan
    layout, index = runtime.engine.layout, runtime.index
    pieces = {}
    for name, p in model.named_parameters():
        slot = layout.params[index[p]]
        pieces[name] = [layout.buckets[b].numel for b in range(slot.bucket, slot.last_bucket + 1)]
    model.sync()
    error = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return dict(error=error, options=plan.wrap_options(), pieces=pieces, schedule=runtime.options.schedule)


# AdamW, clipping, accumulation and checkpoints with explicit blocks and orders: tests/test_parity.py and
# the files that import its SCHEDULES; here the blocks and order the job planned for itself.
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_job_plans_its_blocks_at_the_first_forward_and_trains_exactly(world_size):
    results = run_workers(planned_worker, world_size, deadline=240)
    assert all(r["options"] == results[0]["options"] for r in results), "ranks trained with different plans"
    for rank, r in enumerate(results):
        assert r["schedule"] == "usbyte"
        assert r["error"] < 1e-5, f"rank {rank}: parameters differ from one process by {r['error']}"
        planned = r["options"]["blocks"]
        assert {n: r["pieces"][n] for n in planned} == planned, f"rank {rank}: the buckets are not the plan's blocks"
        assert set(r["options"]["priorities"]) == set(r["pieces"])


def synthetic_profile():
    """A communication-bound job: a large first layer whose gradient is ready last."""
    sizes = [("embed", 0.5, 1.0, [4_000_000]), ("mid", 1.0, 2.0, [1_000_000, 1_000]), ("head", 0.5, 1.5, [500_000])]
    modules = [ProfiledModule(name, f, b, [ParamProfile(f"{name}.p{i}", n, torch.float32, 0.0)
                                          for i, n in enumerate(numels)]) for name, f, b, numels in sizes]
    return TrainingProfile(modules=modules, step_ms=0.5, forward_ms=2.0, backward_ms=4.5, machine={}, iterations=1)


def test_plan_job_keeps_the_unit_the_simulator_predicts_fastest():
    profile, network = synthetic_profile(), Network(alpha_us=30, gbit_s=1)
    job = plan_job(profile, network, world_size=4)
    assert len(job.tried) == 6 and job.predicted_ms == min(ms for _, ms in job.tried)
    assert job.plan.unit == min(job.tried, key=lambda t: t[1])[0]
    unit = dearcomm._C.partition_unit(4, torch.float32)
    assert all(u % unit == 0 for u, _ in job.tried)
    options = job.wrap_options()
    sizes = {"embed.p0": 4_000_000, "mid.p0": 1_000_000, "mid.p1": 1_000, "head.p0": 500_000}
    assert set(options["priorities"]) == set(sizes)
    # Parameters of half a unit or more have their own blocks; smaller ones fuse into buckets of
    # at most one unit, which the planner never splits.
    assert set(options["blocks"]) == {n for n, size in sizes.items() if 2 * size >= job.plan.unit}
    assert options["bucket_mb"] * 2**20 * 2 == job.plan.unit * 4
    for (name, pieces), layer, group in zip(options["blocks"].items(), job.plan.layer_blocks(), job.groups):
        assert sum(pieces) == sizes[name] and all(n % job.align == 0 for n in pieces[:-1]), name
    for group, layer in zip(job.groups, job.plan.layer_blocks()):
        if len(group) > 1 or not job.alone[group[0]]:
            assert len(layer) == 1, "a fused bucket was split"
        else:
            # The plan's first block is the parameter's last piece (backward reports a parameter's
            # pieces last first); only a tail shorter than a partition unit moves.
            pieces = options["blocks"][job.names[group[0]]]
            assert all(abs(a - b) < job.align for a, b in zip(pieces, layer[::-1])), (pieces, layer)
    again = dearcomm.simulate(profile, world_size=4, network=network, schedule="usbyte", **job.simulate_options())
    assert again.iteration_ms == job.predicted_ms
    # Not slower than the bytescheduler defaults on this communication-bound job.
    bytescheduler = dearcomm.simulate(profile, world_size=4, network=network, schedule="bytescheduler")
    assert job.predicted_ms <= bytescheduler.iteration_ms


def test_usbyte_refuses_auto_options():
    with pytest.raises(ValueError, match="schedule='usbyte' plans its own blocks and order"):
        dearcomm._wrap.resolve_options(schedule="usbyte", bucket_mb="auto")


def unmeasurable_contention_worker(rank, world_size):
    """A small model on a fast link: the collectives are too short beside the
    compute to time how they share the cores; planning goes on without it."""
    import dearcomm._auto as auto
    from dearcomm.contention import NotFitted

    real = auto.measure_contention

    def too_short(*args, **kwargs):
        real(*args, **kwargs)  # every collective of the measurement runs, on every rank
        raise NotFitted("no iteration beside collectives was covered for at least 50% of its time")
    auto.measure_contention = too_short
    result = planned_worker(rank, world_size)
    return result["error"], result["options"]


def test_planning_goes_on_where_contention_cannot_be_measured():
    for rank, (error, options) in enumerate(run_workers(unmeasurable_contention_worker, 2, deadline=240)):
        assert error < 1e-5 and options["priorities"], f"rank {rank}: {error}"


def auto_keeping(schedule):
    """Makes "auto" keep the first candidate of `schedule` it simulates (a
    shortlist of that one: no reference or default to measure it against)."""
    import dearcomm._auto as auto

    auto._first_round = lambda result, *args: (
        [c for c in result.candidates if c.options["schedule"] == schedule][:1], [], None, None)


def auto_mlp_beside_reference():
    """An MLP wrapped with every option "auto", and its one-process reference."""
    model, reference = mlp(), mlp()
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference))
    model, optimizer = dearcomm.wrap(model, optimizer, schedule="auto", bucket_mb="auto", partition_mb="auto",
                                     credit_mb="auto")
    return model, optimizer, reference, ref_optimizer


def auto_with_usbyte_worker(rank, world_size):
    """schedule="auto" with usbyte's plan among its candidates, made to keep
    it: the job trains with the planned blocks and order, exactly."""
    auto_keeping("usbyte")
    model, optimizer, reference, ref_optimizer = auto_mlp_beside_reference()
    train_beside_reference(model, optimizer, reference, ref_optimizer, rank, world_size, steps=5)
    options = model._dear.options
    model.sync()
    error = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return error, options.schedule, options.priorities, str(model.auto_plan())


def auto_replans_away_from_usbyte_worker(rank, world_size):
    """auto kept usbyte's plan, then plans again (as its drift check does)
    and keeps a wfbp candidate: the blocks and order usbyte's plan set go
    with it, and the job trains on exactly."""
    auto_keeping("usbyte")
    model, optimizer, reference, ref_optimizer = auto_mlp_beside_reference()
    train_beside_reference(model, optimizer, reference, ref_optimizer, rank, world_size, steps=3)
    kept = model._dear.options.schedule
    auto_keeping("wfbp")
    model._dear.auto._plan_due, model._dear.auto._replan_reason = True, "a test's re-plan"
    train_beside_reference(model, optimizer, reference, ref_optimizer, rank, world_size, steps=3)
    options = model._dear.options
    model.sync()
    error = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return error, kept, options.schedule, options.blocks, options.priorities, len(model._dear.auto.plans)


def test_auto_plans_again_away_from_usbytes_plan():
    for rank, (error, kept, schedule, blocks, priorities, plans) in enumerate(
            run_workers(auto_replans_away_from_usbyte_worker, 2, deadline=240)):
        assert (kept, schedule, plans) == ("usbyte", "wfbp", 2), f"rank {rank}"
        assert blocks is None and priorities is None, f"rank {rank}: usbyte's plan outlived it"
        assert error < 1e-5, f"rank {rank}: parameters differ from one process by {error}"


def test_auto_can_choose_usbytes_own_plan():
    for rank, (error, schedule, priorities, plan) in enumerate(run_workers(auto_with_usbyte_worker, 2, deadline=240)):
        assert schedule == "usbyte" and priorities, f"rank {rank}: {schedule}"
        assert error < 1e-5, f"rank {rank}: parameters differ from one process by {error}"
        assert "schedule=usbyte" in plan and "parameters ranked>" in plan, plan


def model_error_while_planning_worker(rank, world_size):
    """The model's own ValueError during the planning forward's profiling
    (rank 1's third call) reaches the user on every rank; it was taken for a
    job that cannot be profiled, and training went on without a plan."""
    class Failing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.calls = mlp(), 0

        def forward(self, x):
            self.calls += 1
            if rank == 1 and self.calls == 3:
                raise ValueError("a bad sample on rank 1")
            return self.body(x)
    model = Failing()
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05), schedule="usbyte")
    try:
        model(torch.randn(4, 64)).sum().backward()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_the_models_own_error_while_planning_is_raised():
    seen = run_workers(model_error_while_planning_worker, 2, deadline=120)
    assert seen[1] == "ValueError: a bad sample on rank 1", seen
    assert "failed on rank 1: ValueError: a bad sample on rank 1" in seen[0], seen
