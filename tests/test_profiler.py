"""dearcomm.profile(): per-module forward and backward times, gradient-ready
times, parameter sizes in the engine's forward order and the optimizer step,
measured on one process and read by dearcomm.simulate; profiles saved as JSON
and checked field by field when loaded."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dearcomm
from dearcomm import Network, TrainingProfile, simulate
from dearcomm.profiler import ParamProfile, ProfiledModule
from tests.multiprocess import run_workers
from tests.real_models import SPECS

FORWARD_SLEEP_MS = 40.0
BACKWARD_SLEEP_MS = 60.0


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_SLEEP_MS / 1e3)
        return grad


class SleepyForward(nn.Linear):
    def forward(self, x):
        time.sleep(FORWARD_SLEEP_MS / 1e3)
        return super().forward(x)


class Known(nn.Module):
    """Registered a, b, c; called c, b, a. b sleeps in its forward; backward
    sleeps right after a's gradient is produced, before b's (its output is the
    input of b's SlowBackward), so the sleep is b's backward time."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = SleepyForward(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(SlowBackward.apply(self.b(self.c(x))))


def loss_of(out, batch):
    return out.square().mean()


def test_times_land_on_the_module_that_spent_them():
    torch.manual_seed(0)
    model = Known()
    prof = dearcomm.profile(model, torch.randn(4, 8), loss_fn=loss_of, iterations=3, warmup=1)
    assert [m.name for m in prof.modules] == ["c", "b", "a"], "modules must be in the order of their first call"
    by_name = {m.name: m for m in prof.modules}
    assert by_name["b"].forward_ms >= FORWARD_SLEEP_MS
    assert by_name["a"].forward_ms < FORWARD_SLEEP_MS / 2 and by_name["c"].forward_ms < FORWARD_SLEEP_MS / 2
    # Backward runs a, then the sleep, then b: the sleep ends b's backward segment.
    assert by_name["b"].backward_ms >= BACKWARD_SLEEP_MS
    assert by_name["a"].backward_ms < BACKWARD_SLEEP_MS / 2 and by_name["c"].backward_ms < BACKWARD_SLEEP_MS / 2
    ready = {p.name: p.grad_ready_ms for m in prof.modules for p in m.params}
    assert ready["a.weight"] < BACKWARD_SLEEP_MS <= ready["b.weight"] <= ready["c.weight"]
    assert [p.numel for m in prof.modules for p in m.params] == [64, 8] * 3
    assert prof.step_ms == 0.0, "no optimizer, no step"


def test_one_iteration_adds_up_to_the_whole():
    """With one timed iteration the modules' forward times add up to the forward
    and their backward times to the backward: nothing is lost or counted twice."""
    spec = SPECS["resnet18"]
    torch.manual_seed(0)
    model = spec.build()
    batch = spec.batch(torch.Generator().manual_seed(0), 2)
    prof = dearcomm.profile(model, batch, torch.optim.SGD(model.parameters(), lr=0.1),
                            loss_fn=lambda out, b: F.cross_entropy(out, b[1]), iterations=1, warmup=0)
    assert sum(m.forward_ms for m in prof.modules) == pytest.approx(prof.forward_ms, rel=1e-9)
    assert sum(m.backward_ms for m in prof.modules) == pytest.approx(prof.backward_ms, rel=1e-9)
    assert prof.step_ms > 0
    assert prof.num_params == len(list(model.parameters()))


def test_profiling_trains_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    F.mse_loss(model(torch.randn(3, 8)), torch.zeros(3, 4)).backward()
    optimizer.step()
    model.eval()
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in optimizer.state_dict()["state"].items()}
    dearcomm.profile(model, (torch.randn(5, 8), None), optimizer, loss_fn=lambda out, b: out.sum())
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    after = optimizer.state_dict()["state"]
    assert all(torch.equal(state[k][n], after[k][n]) for k in state for n in state[k])
    assert not model.training, "the model's mode is restored"
    assert all(p.grad is None for p in model.parameters())


def test_parameters_are_read_where_the_engine_makes_them_current():
    """A tied embedding counts once, at its first reader (GPT-2); an owner the
    forward never calls gives its parameters to the nearest called ancestor
    (nn.MultiheadAttention reads out_proj's weight without calling out_proj)."""
    for name in ("hf-gpt2", "torchvision-vit", "hf-bert"):
        model = _built(name)
        prof = _profile_spec(SPECS[name], model)
        names = [p.name for m in prof.modules for p in m.params]
        assert sorted(names) == sorted(f"model.{n}" for n, _ in model.named_parameters()), name
        assert len(names) == len(set(names)), f"{name}: a parameter counted twice"
    vit = {m.name: [p.name for p in m.params] for m in _profile_spec(SPECS["torchvision-vit"],
                                                                      _built("torchvision-vit")).modules}
    attention = "model.encoder.layers.encoder_layer_0.self_attention"
    assert f"{attention}.out_proj.weight" in vit[attention]


def _built(name):
    torch.manual_seed(0)
    return SPECS[name].build()


def _profile_spec(spec, model):
    """The spec's own loss, which calls the model itself: profile() gets a thin
    module that returns it (a dict batch is passed as keywords)."""
    return dearcomm.profile(_CallsLoss(model, spec), {"batch": spec.batch(torch.Generator().manual_seed(0), 2)},
                            iterations=1, warmup=0)


class _CallsLoss(nn.Module):
    def __init__(self, model, spec):
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, batch):
        return self.spec.loss(self.model, batch)[0]


def test_hugging_face_output_loss_and_dict_batches():
    spec = SPECS["hf-bert"]
    torch.manual_seed(0)
    model = spec.build()
    ids, labels = spec.batch(torch.Generator().manual_seed(0), 2)
    prof = dearcomm.profile(model, {"input_ids": ids, "labels": labels}, iterations=1, warmup=0)
    assert prof.modules[0].name == "bert.embeddings.word_embeddings"
    assert prof.modules[-1].name == "classifier"


def test_save_load_and_simulate(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    prof = dearcomm.profile(model, torch.randn(16, 64), torch.optim.SGD(model.parameters(), lr=0.1), iterations=2)
    path = tmp_path / "profile.json"
    prof.save(path)
    loaded = TrainingProfile.load(path)
    assert loaded == prof
    assert loaded.machine["torch"] == torch.__version__
    network = Network(alpha_us=30, gbit_s=10)
    direct = simulate(loaded, world_size=4, network=network)
    listed = simulate(loaded.for_simulation(), world_size=4, network=network, step_ms=loaded.step_ms,
                      pack_ms_per_mib=loaded.pack_ms_per_mib, average_ms_per_mib=loaded.average_ms_per_mib)
    assert direct.iteration_ms == listed.iteration_ms
    assert direct.iteration_ms >= loaded.forward_ms + loaded.backward_ms - 1e-6
    no_step = simulate(loaded, world_size=4, network=network, step_ms=0.0)
    assert no_step.iteration_ms <= direct.iteration_ms


def test_a_profile_being_saved_is_never_read_half_written(tmp_path):
    """Every rank may save to one shared path and load it at once (the guide
    shows it): a reader gets the old profile or the new one, whole."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)])  # a file of some size
    prof = dearcomm.profile(model, torch.randn(4, 8), iterations=1, warmup=0)
    path = tmp_path / "profile.json"
    prof.save(path)
    done = threading.Event()

    def keep_saving():
        for _ in range(300):
            prof.save(path)
        done.set()

    writer = threading.Thread(target=keep_saving)
    writer.start()
    loads = 0
    try:
        while not done.is_set() or loads == 0:
            assert TrainingProfile.load(path) == prof
            loads += 1
    finally:
        writer.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]  # nothing partial left behind
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as any file the user writes


def test_the_pack_and_average_of_a_bucket_are_measured_and_simulated(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))  # 4 MiB of gradients
    prof = dearcomm.profile(model, torch.randn(16, 512), torch.optim.SGD(model.parameters(), lr=0.1), iterations=2)
    assert prof.pack_ms_per_mib > 0 and prof.average_ms_per_mib > 0
    network = Network(alpha_us=0.0, gbit_s=1e9)
    with_passes = simulate(prof, world_size=2, network=network, schedule="wfbp").iteration_ms
    without = simulate(prof, world_size=2, network=network, schedule="wfbp", pack_ms_per_mib=0.0,
                       average_ms_per_mib=0.0).iteration_ms
    # A free network: every pack and average is on the iteration's path, once per byte.
    mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    assert with_passes - without == pytest.approx(mib * (prof.pack_ms_per_mib + prof.average_ms_per_mib), rel=1e-3)
    # A profile saved before they were measured reads 0 for both.
    data = prof.to_dict()
    del data["pack_ms_per_mib"], data["average_ms_per_mib"]
    older = TrainingProfile.from_dict(data)
    assert (older.pack_ms_per_mib, older.average_ms_per_mib) == (0.0, 0.0)
    assert simulate(older, world_size=2, network=network, schedule="wfbp").iteration_ms == pytest.approx(without)


def test_the_simulated_modules_add_up_to_the_whole_forward_and_backward():
    # Medians per module add up to less than the median whole where the
    # times are skewed (another process on the core): simulate() charges the whole.
    params = lambda name: [ParamProfile(f"{name}.weight", 10, torch.float32, 0.0)]  # noqa: E731
    modules = [ProfiledModule("a", 1.0, 2.0, params("a")), ProfiledModule("b", 2.0, 2.0, params("b"))]
    skewed = TrainingProfile(modules=modules, step_ms=0.5, forward_ms=4.5, backward_ms=6.0, machine={}, iterations=3)
    simulated = skewed.for_simulation()
    assert [(m.forward_ms, m.backward_ms) for m in simulated] == [(1.5, 3.0), (3.0, 3.0)]
    free = Network(alpha_us=0.0, gbit_s=1e9)
    replicated = simulate(skewed, world_size=2, network=free, schedule="wfbp", update="replicated")
    assert replicated.iteration_ms == pytest.approx(4.5 + 6.0 + 0.5, rel=1e-3)
    # Times that already add up are kept; so are modules of a profile without totals.
    exact = dataclasses.replace(skewed, forward_ms=3.0, backward_ms=4.0)
    assert [(m.forward_ms, m.backward_ms) for m in exact.for_simulation()] == [(1.0, 2.0), (2.0, 2.0)]
    no_totals = dataclasses.replace(skewed, forward_ms=0.0, backward_ms=0.0)
    assert [(m.forward_ms, m.backward_ms) for m in no_totals.for_simulation()] == [(1.0, 2.0), (2.0, 2.0)]
    # A total edited in memory is checked (a NaN was read as "no total"); numpy's numbers are numbers.
    for bad in (math.nan, -3.0):
        with pytest.raises(ValueError, match=r"dearcomm: TrainingProfile.forward_ms must be a non-negative finite"):
            simulate(dataclasses.replace(skewed, forward_ms=bad), world_size=2, network=free)
    import numpy as np
    assert simulate(dataclasses.replace(skewed, forward_ms=np.float32(4.5)), world_size=2, network=free,
                    schedule="wfbp", update="replicated").iteration_ms == pytest.approx(replicated.iteration_ms)


def test_the_simulated_modules_place_each_gradient_where_it_was_measured():
    # b runs first in backward: gradients at 3 and 1 ms of its 3; a from 3 to 5: at 5 and 4 (and one measured
    # before a's backward began, clamped to its start). Backward 10 ms in all: each module's time doubles.
    # Each parameter's gradient comes before the one before it in forward order, as backward reaches them.
    def params(name, *ready):
        return [ParamProfile(f"{name}.p{i}", 10, torch.float32, r) for i, r in enumerate(ready)]
    modules = [ProfiledModule("a", 1.0, 2.0, params("a", 5.0, 4.0, 2.5)),
               ProfiledModule("b", 1.0, 3.0, params("b", 3.0, 1.0))]
    prof = TrainingProfile(modules=modules, step_ms=0.0, forward_ms=2.0, backward_ms=10.0, machine={}, iterations=1)
    a, b = prof.for_simulation()
    assert (b.backward_ms, b.grad_ready_ms) == (pytest.approx(6.0), [pytest.approx(6.0), pytest.approx(2.0)])
    assert (a.backward_ms, a.grad_ready_ms) == (pytest.approx(4.0), [pytest.approx(4.0), pytest.approx(2.0), 0.0])
    # wfbp over a free network, a bucket per parameter: each all-reduce starts as its gradient is ready
    # (forward [0, 2]; b's at 2 + 2 and 2 + 6; a's at 8 + 0, 8 + 2, 8 + 4), not all at their module's end.
    # wfbp issues buckets last first, so this order is what lets each go when ready.
    p = simulate(prof, world_size=2, network=Network(alpha_us=0.0, gbit_s=1e9), schedule="wfbp", bucket_mb=0,
                 iterations=1)
    assert sorted(op["start_ms"] for op in p.ops) == [pytest.approx(t, abs=1e-3) for t in (4, 8, 8, 10, 12)]


def test_median_of_takes_each_time_s_median_across_profiles():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    base = dearcomm.profile(model, torch.randn(2, 4), torch.optim.SGD(model.parameters(), lr=0.1), iterations=2)

    def scaled(k):  # the same model, every time k times longer
        data = base.to_dict()
        for key in ("step_ms", "forward_ms", "backward_ms", "pack_ms_per_mib", "average_ms_per_mib"):
            data[key] = k * (1 + data[key])
        for m in data["modules"]:
            m.update(forward_ms=k * (1 + m["forward_ms"]), backward_ms=k * (1 + m["backward_ms"]))
            for p in m["params"]:
                p["grad_ready_ms"] = k * (1 + p["grad_ready_ms"])
        return TrainingProfile.from_dict(data)

    combined = TrainingProfile.median_of([scaled(1), scaled(7), scaled(3)])
    assert combined == dataclasses.replace(scaled(3), iterations=3 * base.iterations)
    with pytest.raises(ValueError, match="profile 1 has other modules or parameters"):
        other = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        TrainingProfile.median_of([base, dearcomm.profile(other, torch.randn(2, 4), iterations=1)])
    with pytest.raises(ValueError, match="one or more TrainingProfile"):
        TrainingProfile.median_of([])


def _saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    prof = dearcomm.profile(model, torch.randn(2, 4), iterations=1, warmup=0)
    return prof.to_dict()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["modules"][1].pop("backward_ms"), "module '1' has no 'backward_ms'"),
    (lambda d: d["modules"][0].update(forward_ms=-1.0), "module '0' has forward_ms = -1.0"),
    (lambda d: d["modules"][0].update(forward_ms=math.nan), "module '0' has forward_ms = nan"),
    (lambda d: d["modules"][0]["params"][0].update(grad_ready_ms=math.inf), "grad_ready_ms = inf"),
    (lambda d: d["modules"][0]["params"][0].update(numel=0), "numel = 0"),
    (lambda d: d["modules"][0]["params"][0].update(dtype="int64"), "dtype 'int64'"),
    (lambda d: d.update(step_ms=math.nan), "step_ms = nan"),
    (lambda d: d.update(pack_ms_per_mib=-1.0), "pack_ms_per_mib = -1.0"),
    (lambda d: d.update(average_ms_per_mib="fast"), "average_ms_per_mib = 'fast'"),
    (lambda d: d.update(modules=[]), "no modules"),
    (lambda d: d["modules"].append(dict(d["modules"][0])), "module '0' appears twice"),
    (lambda d: d["modules"][1]["params"].append(dict(d["modules"][0]["params"][0])),
     "param '0.weight' appears twice (modules '0' and '1')"),
    (lambda d: d["modules"][0]["params"][0].update(grad_ready_ms=d["backward_ms"] + 1.0),
     "param '0.weight' has grad_ready_ms = "),
    (lambda d: d.update(version=99), "profile version 99"),
    (lambda d: d.pop("format"), "not a dearcomm profile"),
])
def test_a_bad_profile_names_what_is_wrong(tmp_path, edit, message):
    data = _saved(tmp_path)
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="dearcomm: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        TrainingProfile.load(path)


def test_bad_calls_are_refused():
    model = nn.Linear(4, 2)
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)  # no group needed
    with pytest.raises(ValueError, match="before dearcomm.wrap"):
        dearcomm.profile(ddp, torch.randn(2, 4))
    with pytest.raises(ValueError, match="iterations must be an int >= 1"):
        dearcomm.profile(model, torch.randn(2, 4), iterations=0)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        dearcomm.profile(model, torch.randn(2, 4), loss_fn=lambda out, b: out)
    for model in (_UsesOne(), _DetachesOne()):
        with pytest.raises(ValueError, match=r"2 parameter\(s\) got no gradient: \['(unused|a).weight', '\1.bias'\]"):
            dearcomm.profile(model, torch.randn(2, 4))
    model = _UsesOne()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer .* got str"):
        dearcomm.profile(model, torch.randn(2, 4), "sgd")
    with pytest.raises(ValueError, match="holds none of the model's parameters"):
        dearcomm.profile(model, torch.randn(2, 4), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="leaves 2 of the model's 4 trainable parameters out"):
        dearcomm.profile(model, torch.randn(2, 4), torch.optim.SGD(model.used.parameters(), lr=0.1))


def _wrapped_optimizer_worker(rank, world_size):
    model = nn.Linear(4, 2)
    plain = copy.deepcopy(model)
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        dearcomm.profile(plain, torch.randn(2, 4), optimizer)
    except ValueError as e:
        return str(e)
    return None


def test_the_optimizer_wrap_returned_is_refused_by_name():
    """What a user who wrapped first passes (the README's snippet did): its
    step() failed with 'called without a backward since the last step'."""
    message = run_workers(_wrapped_optimizer_worker, 1)[0]
    assert message and "not the one dearcomm.wrap() returned" in message, message


class _UsesOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def test_with_find_unused_parameters_a_parameter_without_a_gradient_is_ready_at_backwards_end():
    """As the engine reduces it (wrap(find_unused_parameters=True), which
    "auto" profiles with)."""
    model = _UsesOne()
    x = torch.randn(2, 4)
    prof = dearcomm.profile(model, x, iterations=3, find_unused_parameters=True)
    params = {p.name: p for m in prof.modules for p in m.params}
    assert set(params) == {"used.weight", "used.bias", "unused.weight", "unused.bias"}
    assert params["unused.weight"].grad_ready_ms == pytest.approx(prof.backward_ms)
    assert params["used.weight"].grad_ready_ms <= prof.backward_ms


class _DetachesOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x).detach())


# ---- ranks profiled together (group=) ---------------------------------------

class _Stamped(torch.optim.SGD):
    """SGD that notes the wall clock (shared by the processes on this machine)
    at the start of every step."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.started = []

    def step(self, closure=None):
        self.started.append(time.time())
        return super().step(closure)


def _together(rank, world_size, extra_sleep_ms):
    """Rank r's b sleeps r * extra_sleep_ms longer in its forward."""
    global FORWARD_SLEEP_MS
    FORWARD_SLEEP_MS = 40.0 + rank * extra_sleep_ms
    torch.manual_seed(0)
    model = Known()
    optimizer = _Stamped(model.parameters())
    prof = dearcomm.profile(model, torch.randn(4, 8), optimizer, loss_fn=loss_of, iterations=4, warmup=1,
                            group=torch.distributed.group.WORLD)
    return prof.to_dict(), optimizer.started


def test_ranks_profile_in_step_and_agree_on_the_slowest_rank():
    extra = 150.0
    (p0, steps0), (p1, steps1) = run_workers(_together, 2, extra, deadline=120)
    for p in (p0, p1):
        p["machine"] = None
    assert p0 == p1, "every rank returns the same profile"
    b = {m["name"]: m for m in p0["modules"]}["b"]
    assert b["forward_ms"] >= FORWARD_SLEEP_MS + extra, "each iteration is the slower rank's"
    # In step: every optimizer step starts on both ranks together, although
    # rank 1's forward is 150 ms longer (apart, they would drift 150 ms an iteration).
    assert len(steps0) == len(steps1) == 5
    assert max(abs(a - b) for a, b in zip(steps0, steps1)) < extra / 2e3


def _failing(rank, world_size, how):
    """Rank 1 fails (`how`); every rank returns the error it raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    calls = []

    def loss_fn(out, batch):
        calls.append(1)
        if rank == 1 and how == "raises" and len(calls) == 3:
            raise RuntimeError("rank 1's loss broke")
        if rank == 1 and how == "no grad":
            return model[1](torch.randn(2, 4)).sum()  # the first layer gets no gradient
        return out.sum()
    iterations = 4 if rank == 1 and how == "iterations" else 3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 1 and how == "no optimizer":
        optimizer = None
    if rank == 1 and how == "state":  # fails before the first meeting (copying the state to restore)
        def state_dict():
            raise RuntimeError("rank 1 is out of memory")
        optimizer.state_dict = state_dict
    try:
        dearcomm.profile(model, torch.randn(2, 4), optimizer, loss_fn=loss_fn,
                         iterations=iterations, warmup=1, group=torch.distributed.group.WORLD)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("how,rank0,rank1", [
    ("raises", r"profile\(\) failed on rank 1: RuntimeError: rank 1.s loss broke", "^RuntimeError: rank 1.s loss broke"),
    ("no grad", r"failed on rank 1: .*2 parameter\(s\) got no gradient", r"failed on rank 1: .*no gradient"),
    ("iterations", "asked for 4 to 5 iterations", "asked for 4 to 5 iterations"),
    ("state", r"^PeerFailed: .*profile\(\) failed on rank 1: RuntimeError: rank 1 is out of memory$",
     r"^PeerFailed: .*profile\(\) failed on rank 1: RuntimeError: rank 1 is out of memory$"),
    ("no optimizer", "some ranks gave an optimizer and some did not", "some ranks gave an optimizer and some"),
])
def test_a_rank_that_fails_fails_every_rank_without_a_hang(how, rank0, rank1):
    errors = run_workers(_failing, 2, how, deadline=120)
    assert re.search(rank0, errors[0]), errors[0]
    assert re.search(rank1, errors[1]), errors[1]


def _absent_peer(rank, world_size):
    """Rank 1 never comes to profile(group=): rank 0's first meeting waits
    for the group's timeout, then says what it was and what it means (gloo's
    text alone named nothing)."""
    import datetime
    import time

    group = torch.distributed.new_group(timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        time.sleep(8)
        return "away"
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    try:
        dearcomm.profile(model, torch.randn(2, 4), iterations=2, warmup=1, group=group)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_peer_absent_from_the_meetings_is_named_at_the_groups_timeout():
    message = run_workers(_absent_peer, 2, deadline=120)[0]
    assert message.startswith("dearcomm: profile(): the ranks' meeting failed or timed out (the group's timeout"), \
        message
    assert "a peer stalled, died or is elsewhere" in message, message


def test_group_needs_torch_distributed():
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        dearcomm.profile(nn.Linear(4, 2), torch.randn(2, 4), group=object())
