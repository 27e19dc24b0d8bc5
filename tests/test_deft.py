"""schedule="deft" end to end: buckets applied late train exactly like a
single process that applies the same gradients with the same delays (delayed
SGD is reproducible), in users' loops (LR scheduler, torch's clipping on
.grad, no_sync() accumulation, checkpoints taken on every rank and resumed);
max_delay=0 trains exactly as one process on the global batch; a job plans
its own delays; the guard switches delays off where they make training
diverge and leaves them where they do not."""
import copy
import dataclasses
import itertools
import traceback

import pytest
import torch
import torch.nn.functional as F

import dearcomm
from dearcomm import _C
from dearcomm._delayed import switch_delays_off
from dearcomm._delays import bucket_delays
from tests.models import MixedNet, batches, global_batch, local_slice
from tests.multiprocess import run_workers
from tests.test_parity import make_optimizer

STEPS = 8
# parameter name -> iterations late (MixedNet: embed and conv are nearest the input, launched last)
DELAYS = {
    "input-side": {"embed.weight": 1, "conv.weight": 1, "conv.bias": 1},
    "all": {name: 1 for name, _ in MixedNet().named_parameters()},
    "two-late": {"embed.weight": 2, "conv.weight": 1, "conv.bias": 1, "norm.weight": 2, "norm.bias": 2},
    "none": {},
}


class DelayedReference:
    """One process on the global batch that applies each delayed parameter's
    gradient `delay` steps late (nothing in its first `delay` steps)."""

    def __init__(self, model, delays):
        self.params = dict(model.named_parameters())
        self.delays = delays
        self.history = {name: [] for name in delays}

    def swap(self):
        for name, delay in self.delays.items():
            p = self.params[name]
            self.history[name].append(p.grad.clone())
            p.grad = self.history[name].pop(0) if len(self.history[name]) > delay else None


def micro_batches(tensor, rank, world_size, parts):
    """This rank's slice in `parts` micro-batches; rank None: the global
    micro-batches, each the ranks' micro-batches side by side."""
    ranks = range(world_size) if rank is None else [rank]
    slices = [local_slice(tensor, r, world_size).chunk(parts) for r in ranks]
    return [torch.cat([s[m] for s in slices]) for m in range(parts)]


def loop(model, optimizer, scheduler, rank, world_size, steps, clip, accumulate, swap=None, start=0):
    """The user's loop: zero_grad, backward (no_sync() for all but the last
    micro-batch), torch's clip_grad_norm_ on .grad, step. rank None: the
    reference on the global batch, `swap` applying its delays."""
    for step, (tokens, labels) in enumerate(batches(steps, global_batch(world_size))):
        if step < start:
            continue
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        xs, ys = micro_batches(tokens, rank, world_size, accumulate), micro_batches(labels, rank, world_size, accumulate)
        for m, (x, y) in enumerate(zip(xs, ys)):
            last = m == accumulate - 1
            context = model.no_sync() if rank is not None and not last else _Nothing()
            with context:
                F.cross_entropy(model(x), y).backward()
        if swap:
            swap()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def build(optim, delays=None, **wrap_options):
    torch.manual_seed(0)
    model = MixedNet()
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = make_optimizer(optim, model), make_optimizer(optim, reference)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.8 ** s)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_optimizer, lambda s: 0.8 ** s)
    if delays is not None:
        wrap_options["delays"] = delays
        wrap_options.setdefault("max_delay", max(delays.values(), default=0))
    model, optimizer = dearcomm.wrap(model, optimizer, schedule="deft", bucket_mb=0.0, **wrap_options)
    return model, optimizer, scheduler, reference, ref_optimizer, ref_scheduler


def differences(model, reference):
    return {name: (a - b).abs().max().item()
            for (name, a), b in zip(model.named_parameters(), reference.parameters())
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)}


CASES = [dict(optim=o, delays=d, clip=c, accumulate=a)
         for o, d, (c, a) in itertools.product(["sgd", "adamw"], DELAYS, [(None, 1), (0.5, 2)])]


def case_id(case):
    extras = (f"-clip{case['clip']}" if case["clip"] else "") + (f"-accumulate{case['accumulate']}"
                                                                if case["accumulate"] > 1 else "")
    return f"{case['optim']}-{case['delays']}{extras}"


def delayed_worker(rank, world_size):
    results = {}
    for case in CASES:
        try:
            delays = DELAYS[case["delays"]]
            model, optimizer, scheduler, reference, ref_optimizer, ref_scheduler = build(case["optim"], delays)
            loop(model, optimizer, scheduler, rank, world_size, STEPS, case["clip"], case["accumulate"])
            # Its delayed all-reduce must not share the link with the next backward's.
            assert model._dear.engine.all_reduces_in_issue_order, "deft's all-reduces are not in issue order"
            loop(reference, ref_optimizer, ref_scheduler, None, world_size, STEPS, case["clip"], case["accumulate"],
                 swap=DelayedReference(reference, delays).swap)
            results[case_id(case)] = differences(model, reference)  # a normal loop: no sync() before reading
        except Exception:
            results[case_id(case)] = traceback.format_exc()
    return results


_results = {}


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("world_size", [2, 3])
def test_delayed_buckets_train_like_a_single_process_with_the_same_delays(world_size, case):
    if world_size not in _results:
        _results[world_size] = run_workers(delayed_worker, world_size, deadline=300)
    for rank, results in enumerate(_results[world_size]):
        assert results[case_id(case)] == {}, f"rank {rank}: {results[case_id(case)]}"


def test_the_reference_can_tell_delays_apart():
    """Applying on time trains to other values than applying late."""
    def final(delays):
        _, _, _, reference, optimizer, scheduler = build_reference("sgd")
        loop(reference, optimizer, scheduler, None, 2, STEPS, None, 1, swap=DelayedReference(reference, delays).swap)
        return list(reference.parameters())
    on_time, late = final({}), final(DELAYS["input-side"])
    assert not all(torch.allclose(a, b) for a, b in zip(on_time, late))


def build_reference(optim):
    torch.manual_seed(0)
    model = MixedNet()
    optimizer = make_optimizer(optim, model)
    return None, None, None, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.8 ** s)


def checkpoint_worker(rank, world_size, delays):
    """Checkpoint after 3 steps (every rank calls state_dict(), as a rank-0
    save does), go on to STEPS. A second job loads it, trains one step,
    checkpoints again and goes on; a third resumes from that second
    checkpoint; the first rolls back to the first checkpoint in place (a
    live engine with its own delayed gradients) and trains the rest again.
    All end equal, and equal to the delayed reference."""
    model, optimizer, scheduler, reference, ref_optimizer, ref_scheduler = build("sgd", delays)
    loop(model, optimizer, scheduler, rank, world_size, 3, None, 1)
    first = copy.deepcopy((model.state_dict(), optimizer.state_dict(), scheduler.state_dict()))
    loop(model, optimizer, scheduler, rank, world_size, STEPS, None, 1, start=3)
    uninterrupted = copy.deepcopy(model)

    def load(job, saved):  # a copy, as from a file: torch's load_state_dict keeps the tensors it is given
        for part, state in zip(job, copy.deepcopy(saved)):
            part.load_state_dict(state)
        return job

    def resume(saved):  # wrapped as a fresh process would, planning its own delays (none given), then loaded
        return load(build("sgd", None)[:3], saved)
    second_job = resume(first)
    loop(*second_job, rank, world_size, 4, None, 1, start=3)
    second = copy.deepcopy(tuple(part.state_dict() for part in second_job))
    loop(*second_job, rank, world_size, STEPS, None, 1, start=4)
    third_job = resume(second)
    loop(*third_job, rank, world_size, STEPS, None, 1, start=4)
    load((model, optimizer, scheduler), first)  # rollback into the live job
    loop(model, optimizer, scheduler, rank, world_size, STEPS, None, 1, start=3)
    loop(reference, ref_optimizer, ref_scheduler, None, world_size, STEPS, None, 1,
         swap=DelayedReference(reference, delays).swap)
    pending = {name: len(tensors) for name, tensors in first[1]["dearcomm_delayed"]["pending"].items()}
    return dict(second=differences(second_job[0], uninterrupted), third=differences(third_job[0], uninterrupted),
                rollback=differences(model, uninterrupted), reference=differences(uninterrupted, reference),
                pending=pending, delays=third_job[0]._dear.options.delays)


@pytest.mark.parametrize("delays", ["input-side", "two-late"])
def test_a_checkpoint_holds_the_delayed_gradients_and_resuming_equals_training_on(delays):
    for rank, result in enumerate(run_workers(checkpoint_worker, 2, DELAYS[delays], deadline=240)):
        for way in ("second", "third", "rollback", "reference"):
            assert result[way] == {}, f"rank {rank}, {way}: {result[way]}"
        assert result["delays"] == DELAYS[delays]  # the checkpoint's delays, not a new plan
        assert result["pending"] == DELAYS[delays]  # after 3 steps: `delay` backwards' gradients each


def plain_checkpoint_worker(rank, world_size):
    """A checkpoint without delayed gradients (a plain torch optimizer's)
    keeps a planning job's planner, and refuses nothing."""
    model, optimizer = build("sgd", None)[:2]
    plain = torch.optim.SGD(MixedNet().parameters(), lr=0.1).state_dict()
    optimizer.load_state_dict({**plain, "param_groups": optimizer.state_dict()["param_groups"]})
    return model._dear.planner is not None


def test_a_checkpoint_without_delays_keeps_the_planner():
    assert all(run_workers(plain_checkpoint_worker, 2))

def exact_worker(rank, world_size):
    """max_delay=0: no planning, no delay: the global batch in one process."""
    model, optimizer, scheduler, reference, ref_optimizer, ref_scheduler = build("adamw", max_delay=0)
    loop(model, optimizer, scheduler, rank, world_size, STEPS, 0.5, 2)
    loop(reference, ref_optimizer, ref_scheduler, None, world_size, STEPS, 0.5, 2)
    return differences(model, reference), model._dear.planner


def test_max_delay_zero_trains_exactly_as_one_process():
    for difference, planner in run_workers(exact_worker, 2):
        assert difference == {} and planner is None


def refused_worker(rank, world_size, what):
    """One backward with delayed buckets, then `what` ("scaler": a
    GradScaler's step; "skip": zero_grad() before step()); its refusal."""
    model, optimizer = build("sgd", DELAYS["input-side"])[:2]
    scaler = torch.amp.GradScaler("cpu", enabled=what == "scaler")
    tokens, labels = next(batches(1, global_batch(world_size)))
    scaler.scale(F.cross_entropy(model(local_slice(tokens, rank, world_size)),
                                 local_slice(labels, rank, world_size))).backward()
    try:
        if what == "scaler":
            scaler.step(optimizer)
        else:
            optimizer.zero_grad()  # between backward and step(): skips the step
    except NotImplementedError as e:
        return str(e)
    return None


def test_a_grad_scaler_is_refused_while_buckets_are_delayed():
    for message in run_workers(refused_worker, 2, "scaler"):
        assert message and "GradScaler" in message and "max_delay=0" in message


def test_skipping_a_step_is_refused_while_buckets_are_delayed():
    for message in run_workers(refused_worker, 2, "skip"):
        assert message and "skips the step" in message and "max_delay=0" in message


# ---- a job that plans its own delays -------------------------------------------------------------


def mlp_and_reference(widths, **wrap_options):
    """An MLP (64 inputs, 10 outputs) wrapped with `wrap_options`, its
    optimizer, and an unwrapped copy with its own (SGD with momentum)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, widths[0])]
    for a, b in zip(widths, widths[1:] + [10]):
        layers += [torch.nn.ReLU(), torch.nn.Linear(a, b)]
    model = torch.nn.Sequential(*layers)
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference))
    model, optimizer = dearcomm.wrap(model, optimizer, **wrap_options)
    return model, optimizer, reference, ref_optimizer


def mlp_beside_reference(rank, world_size, widths, steps, **wrap_options):
    """An MLP wrapped with `wrap_options` trained on this rank's slice in a
    plain loop, beside one process on the global batch that applies the
    delays the job ended up with (planned at its first forward) from step 0.
    Returns the wrapped model, its optimizer and where they differ."""
    model, optimizer, reference, ref_optimizer = mlp_and_reference(widths, **wrap_options)
    g = torch.Generator().manual_seed(1)
    swap = None
    for _ in range(steps):
        x, y = torch.randn(4 * world_size, 64, generator=g), torch.randint(0, 10, (4 * world_size,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        optimizer.step()
        if swap is None:
            swap = DelayedReference(reference, model._dear.options.delays or {}).swap
        ref_optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        swap()
        ref_optimizer.step()
    model.sync()  # the schedule "auto" kept may update in the next forward
    return model, optimizer, differences(model, reference)


def planned_worker(rank, world_size):
    model, _, difference = mlp_beside_reference(rank, world_size, [1024, 1024], 6, schedule="deft", bucket_mb=1.0)
    plan = model._dear.planner.plan
    return dict(delays=model._dear.options.delays, planned=plan.wrap_options()["delays"],
                difference=difference, candidates=len(plan.candidates),
                buckets=len(model._dear.engine.layout.buckets))


def test_a_job_plans_its_delays_at_the_first_forward_and_trains_with_them():
    results = run_workers(planned_worker, 2, deadline=240)
    assert results[0]["delays"] == results[1]["delays"] == results[0]["planned"]  # rank 0's plan everywhere
    for result in results:
        assert result["difference"] == {}
        assert result["candidates"] == 1 + result["buckets"]  # no delay, and each suffix of the launch order


# ---- the guard ------------------------------------------------------------------------------------


def guard_worker(rank, world_size, lr, steps, hooked=False, curvature=1.0):
    """Two parameters pulled to their targets by 0.5 c ||p - t||^2 (c = 1),
    SGD without momentum: on time, lr in (1, 2) converges; one step late,
    it diverges, its gradients oscillating as they grow (and lr 0.5
    converges either way). c < 0 pushes them away: steady growth."""
    torch.manual_seed(0)
    near, far = torch.nn.Parameter(torch.full((32,), 3.0)), torch.nn.Parameter(torch.full((32,), 3.0))
    model = torch.nn.Module()
    model.near, model.far = near, far
    model.forward = lambda: None
    targets = [torch.full((32,), 0.5 + rank), torch.full((32,), -1.0 - rank)]
    optimizer = torch.optim.SGD([near, far], lr=lr)
    model, optimizer = dearcomm.wrap(model, optimizer, schedule="deft", bucket_mb=0.0, delays={"near": 1})
    updated = []
    if hooked:  # an EMA's hook: called after every step, also the one where the guard switches
        model.register_update_hook(lambda params: updated.append(len(params)))
    for _ in range(steps):
        optimizer.zero_grad()
        model()  # the forward pre-hooks; the loss reads the parameters directly
        (0.5 * curvature * (((near - targets[0]) ** 2).sum() + ((far - targets[1]) ** 2).sum())).backward()
        optimizer.step()
    mean_target = sum(0.5 + r for r in range(world_size)) / world_size
    return dict(switched_off_at=model._dear.delayed.switched_off_at, delays=model._dear.options.delays,
                error=(near.detach() - mean_target).abs().max().item(), updated=sum(updated))


def test_the_guard_switches_delays_off_where_they_make_training_diverge():
    results = run_workers(guard_worker, 2, 1.5, 100, True)
    for result in results:
        assert result["switched_off_at"] is not None and result["delays"] == {}
        assert result["error"] < 1e-3  # then it converged on time
        assert result["updated"] >= 2 * 99  # the update hook ran through the switch (both parameters per step)
    assert results[0]["switched_off_at"] == results[1]["switched_off_at"]


def test_the_guard_compares_with_the_first_steps_so_steady_growth_trips_it():
    """Growth of 1.09x a step, without oscillation: within one window of 20
    the largest gradient is only 2.4x the median, but 10x the first window's
    median by the second window's end: step 41, the 40th that applied a
    delayed gradient (the first applies none)."""
    results = run_workers(guard_worker, 2, 1.0, 45, False, -0.1)
    assert [r["switched_off_at"] for r in results] == [41, 41]


def test_the_guard_leaves_delays_on_where_training_converges():
    for result in run_workers(guard_worker, 2, 0.5, 100):
        assert result["switched_off_at"] is None and result["delays"] == {"near": 1}
        assert result["error"] < 1e-3


# ---- options and plans, without processes -----------------------------------------------------------


def test_options_name_what_is_wrong():
    with pytest.raises(ValueError, match="delays apply to schedule='deft'|delays applies to schedule='deft'"):
        dearcomm.WrapOptions(schedule="wfbp", delays={"w": 1})
    with pytest.raises(ValueError, match="max_delay applies to schedule='deft'"):
        dearcomm.WrapOptions(schedule="dear", max_delay=1)
    with pytest.raises(ValueError, match=r"delays\['w'\] is 2; it must be between 0 and max_delay \(1\)"):
        dearcomm.WrapOptions(schedule="deft", delays={"w": 2})
    with pytest.raises(ValueError, match="max_delay must be an int >= 0"):
        dearcomm.WrapOptions(schedule="deft", max_delay=-1)
    with pytest.raises(ValueError, match="partition_mb does not apply"):
        dearcomm.WrapOptions(schedule="deft", partition_mb=4.0)
    with pytest.raises(ValueError, match=r"delays\['w'\] must be an int"):
        dearcomm.WrapOptions(schedule="deft", delays={"w": 0.5})
    assert dearcomm.WrapOptions(schedule="deft").effective_max_delay == 1
    assert dearcomm.WrapOptions(schedule="wfbp").effective_max_delay == 0


def test_the_parameters_of_a_bucket_share_its_delay():
    layout = _C.plan_buckets([100, 100, 100], [torch.float32] * 3, 2**20, 2)  # one bucket
    assert bucket_delays(layout, [1, 1, 1]) == [1]
    with pytest.raises(ValueError, match="'a' \\(delay 1\\) and 'b' \\(delay 0\\) share bucket 0"):
        bucket_delays(layout, [1, 0, 1], ["a", "b", "c"])


def profile(backward_ms, numel=1_000_000, layers=8):
    return [dearcomm.ModuleProfile(f"l{i}", backward_ms / 2, backward_ms, [numel]) for i in range(layers)]


@pytest.mark.parametrize("gbit_s", [3.0, 5.0, 10.0])
def test_a_plan_delays_a_suffix_of_the_launch_order_and_is_what_the_simulator_predicts(gbit_s):
    modules, network = profile(6.0), dearcomm.Network(alpha_us=50, gbit_s=gbit_s)
    plan = dearcomm.deft.plan_modules(modules, network, 4, step_ms=1.0, bucket_mb=4.0)
    delayed = [i for i, d in enumerate(plan.delays) if d]
    assert delayed == list(range(len(delayed)))  # the input side, launched last
    assert 0 < len(delayed) < len(plan.delays)  # some, not all: delaying everything also hides the tail
    assert plan.predicted_ms < plan.undelayed_ms * 0.95
    fastest = min(c.predicted_ms for c in plan.candidates)
    assert plan.predicted_ms <= fastest * (1 + dearcomm.deft.TOLERANCE)
    assert all(c.staleness >= plan.chosen.staleness for c in plan.candidates
               if c.predicted_ms <= fastest * (1 + dearcomm.deft.TOLERANCE))
    again = dearcomm.simulate(modules, world_size=4, network=network, schedule="deft", step_ms=1.0, bucket_mb=4.0,
                              delays=list(plan.delays), iterations=4)
    assert again.iteration_ms == pytest.approx(plan.predicted_ms)
    wfbp = dearcomm.simulate(modules, world_size=4, network=network, schedule="wfbp", step_ms=1.0, bucket_mb=4.0)
    assert plan.undelayed_ms == pytest.approx(wfbp.iteration_ms)


def test_where_nothing_is_exposed_no_bucket_is_delayed():
    plan = dearcomm.deft.plan_modules(profile(6.0, numel=1000), dearcomm.Network(alpha_us=5, gbit_s=100.0), 4)
    assert not any(plan.delays) and plan.wrap_options()["delays"] == {}
    assert "no delay" in plan.describe()


def test_max_delay_bounds_the_plan():
    modules, network = profile(6.0), dearcomm.Network(alpha_us=50, gbit_s=1.0)
    assert dearcomm.deft.plan_modules(modules, network, 4, max_delay=0).delays == (0,) * 8
    plan = dearcomm.deft.plan_modules(modules, network, 4, max_delay=2, bucket_mb=4.0)
    assert max(plan.delays) <= 2 and {c.delay for c in plan.candidates} == {0, 1, 2}


# ---- schedule="auto" ------------------------------------------------------------------------------------


def _auto_keeps_a_deft_plan_that_delays():
    """auto's shortlist made deft's fastest plan that delays something (no
    reference or default to measure it against), on a link slow enough for one."""
    import dearcomm._auto as auto

    auto._first_round = lambda result, *args: ([c for c in result.candidates
                                                 if c.options["schedule"] == "deft" and c.options["delays"]][:1],
                                                [], None, None)
    _link_as_slow_as_compute()


def _link_as_slow_as_compute():
    """auto plans for the network as measured, but slower (see below)."""
    import dearcomm._auto as auto

    measure = auto.measure_job

    def link_as_slow_as_compute(*args):
        # As measured, but on a link whose all-reduce of the model takes as long as a forward and
        # backward: there the input side's all-reduces are exposed and delaying them hides them (on
        # this machine's loopback the planner may find nothing to hide).
        profile, network = measure(*args)
        megabits = sum(p.numel for m in profile.modules for p in m.params) * 32 / 1e6
        gbit_s = megabits / (profile.forward_ms + profile.backward_ms)
        return profile, dataclasses.replace(network, alpha_us=1.0, gbit_s=gbit_s, per_kind={},
                                            compute_slowdown=1.0, comm_slowdown=1.0)
    auto.measure_job = link_as_slow_as_compute


def auto_worker(rank, world_size, max_delay):
    """schedule="auto": with max_delay, deft's plans are candidates, here
    the fastest that delays something made the one kept (a shortlist of
    that one, no reference to measure it against); the job then trains
    exactly as the delayed reference with the delays it chose, from the
    first step."""
    if max_delay:
        _auto_keeps_a_deft_plan_that_delays()
    model, _, difference = mlp_beside_reference(rank, world_size, [2048, 512], 5, schedule="auto", bucket_mb="auto",
                                             max_delay=max_delay)
    plan = model.auto_plan()
    considered = {options.get("schedule") for options, _ in plan.shortlist + plan.runners_up}
    return dict(schedule=model._dear.options.schedule, delays=model._dear.options.delays,
                difference=difference, plan=str(plan), considered=considered)


def test_auto_with_max_delay_can_choose_deft_and_trains_with_its_delays():
    for rank, result in enumerate(run_workers(auto_worker, 2, 1, deadline=300)):
        assert result["schedule"] == "deft" and result["delays"], f"rank {rank}: {result['schedule']}"
        assert result["difference"] == {}, f"rank {rank}"
        assert "schedule=deft" in result["plan"] and "parameters delayed>" in result["plan"], result["plan"]


def auto_with_two_backwards_worker(rank, world_size):
    """schedule="auto" with max_delay on a link where deft's delays are
    predicted fastest, and a loop of two backwards a step (a GAN's
    discriminator: real, then fake samples): the first trial delays
    nothing, its first step shows the two backwards, and deft's trial then
    runs on time instead of raising at a second backward. Trains as one
    process on the global batch with the same two backwards, through the
    first round of trials, deft's included."""
    _link_as_slow_as_compute()
    model, optimizer, reference, ref_optimizer = mlp_and_reference([2048, 512], schedule="auto", bucket_mb="auto",
                                                                   max_delay=1)
    auto = model._dear.auto
    g = torch.Generator().manual_seed(1)
    trained_with, deft_index = [], None
    while deft_index is None or len(auto.plans[0].measured_ms) <= deft_index:
        x, y = torch.randn(4 * world_size, 64, generator=g), torch.randint(0, 10, (4 * world_size,), generator=g)
        optimizer.zero_grad()
        for half in (0, 1):  # this rank's samples 2*half, 2*half+1
            mine = slice(rank * 4 + 2 * half, rank * 4 + 2 * half + 2)
            F.cross_entropy(model(x[mine]), y[mine]).backward()
        optimizer.step()
        trained_with.append((model._dear.options.schedule, bool(model._dear.options.delays)))
        ref_optimizer.zero_grad()
        for half in (0, 1):  # every rank's samples of that half
            rows = [r * 4 + 2 * half + i for r in range(world_size) for i in (0, 1)]
            F.cross_entropy(reference(x[rows]), y[rows]).backward()
        ref_optimizer.step()
        plan = auto.plans[0]
        deft_index = next(i for i, (options, _) in enumerate(plan.shortlist) if options.get("delays"))
        assert len(trained_with) < 100, f"deft's candidate not measured after 100 steps: {plan}"
    model.sync()
    best = min(plan.shortlist, key=lambda entry: entry[1])[0]
    return dict(best=(best["schedule"], bool(best.get("delays"))), trained_with=trained_with,
                max_delay=auto.max_delay, difference=differences(model, reference))


def test_auto_with_max_delay_trains_a_loop_of_two_backwards_a_step_on_time():
    for rank, result in enumerate(run_workers(auto_with_two_backwards_worker, 2, deadline=300)):
        assert result["best"] == ("deft", True), f"rank {rank}: delays not predicted fastest: {result['best']}"
        assert ("deft", False) in result["trained_with"], f"rank {rank}: {result['trained_with']}"
        assert not any(delayed for _, delayed in result["trained_with"]), f"rank {rank}: {result['trained_with']}"
        assert result["max_delay"] == 0 and result["difference"] == {}, f"rank {rank}: {result}"


def auto_after_the_guard_worker(rank, world_size):
    """auto kept a deft plan that delays; deft's guard switches the delays
    off (as it does where they hurt), and a later re-plan keeps dear: the
    delays go with deft's plan and the job trains on."""
    import dearcomm._auto as auto

    _auto_keeps_a_deft_plan_that_delays()
    model, optimizer, _ = mlp_beside_reference(rank, world_size, [2048, 512], 3, schedule="auto", bucket_mb="auto",
                                    max_delay=1)
    runtime = model._dear
    kept = (runtime.options.schedule, bool(runtime.options.delays))
    switch_delays_off(runtime)  # what the guard does when it fires
    auto._first_round = lambda result, *args: (
        [c for c in result.candidates if c.options["schedule"] == "dear"][:1], [], None, None)
    runtime.auto._plan_due, runtime.auto._replan_reason = True, "a test's re-plan"
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(4, 64, generator=g), torch.randint(0, 10, (4,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.sync()
    moved = all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return dict(kept=kept, schedule=runtime.options.schedule, delays=runtime.options.delays,
                max_delay=runtime.options.max_delay, plans=len(runtime.auto.plans), moved=moved)


def test_auto_plans_again_after_deft_guard_switched_its_delays_off():
    for rank, result in enumerate(run_workers(auto_after_the_guard_worker, 2, deadline=300)):
        assert result["kept"] == ("deft", True) and result["plans"] == 2, f"rank {rank}: {result}"
        assert result["schedule"] == "dear" and result["delays"] is None and result["max_delay"] is None, result
        assert result["moved"], f"rank {rank}: training stopped after the re-plan"


def test_auto_without_max_delay_keeps_every_gradient_on_time():
    for result in run_workers(auto_worker, 2, None, deadline=300):
        assert "deft" not in result["considered"] and result["schedule"] != "deft"
        assert not result["delays"] and result["difference"] == {}
