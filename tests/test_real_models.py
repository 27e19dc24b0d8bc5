"""Real models (issue 8): torchvision ResNet-18 and ViT, timm ViT,
nn.TransformerEncoder, Hugging Face GPT-2 (tied embeddings) and BERT, built
from configs, trained in a normal loop:

    loss = loss_fn(model(local batch)); loss.backward(); optimizer.step(); optimizer.zero_grad()

with no model.sync() between steps, for every schedule/update and bucket_mb 0
(one bucket per tensor) and 25 (the default), at world sizes 2 and 3. After
the last step, model.sync() and then the parameters and buffers must equal the
yardstick's, and the loss of every step must equal the yardstick's loss on the
same samples (so parameters were current before every forward, not only at the
end).

Yardsticks: one process trained on the global batch; for ResNet-18, whose
BatchNorm makes data-parallel training differ from one process, torch DDP
(broadcast_buffers=True, its default; its buffers as its next forward would
start from them, rank 0's) in the same worker, from a deep copy of
the same initial model, on the same slices (at 3 ranks its parameters and
buffers are compared by the error of their whole update: see
PARAMETER_UPDATE_RTOL). For the other models DDP also runs beside, as the case
"<optimizer>-ddp": it must match the single-process reference at the same
tolerance (a check of the harness itself).

Each (group of models, world size) runs in one set of processes that loops
over models, optimizers, schedules and bucket sizes; every case's mismatches
are collected by name, so one run reports every failing case.
"""
import copy
import itertools
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dearcomm
from tests.models import local_slice
from tests.multiprocess import run_workers
from tests.real_models import GROUPS, SPECS, make_optimizer

STEPS = 3
GLOBAL_BATCH = 12  # divisible by 2 and 3
WORLD_SIZES = [2, 3]
SCHEDULES = [("dear", "sharded"), ("dear", "replicated"), ("wfbp", "replicated"), ("bytescheduler", "replicated")]
BUCKET_MBS = [0.0, 25.0]
# Looser than test_parity's rtol 1e-5 / atol 1e-6: these models are deeper
# (attention softmax, LayerNorm/BatchNorm, GELU, tied embeddings) and the
# gradients of one process on the whole batch and of p ranks averaged are sums
# in different orders, whose float32 rounding differences grow through the
# layers and through AdamW's m / sqrt(v) on small gradient elements (see
# make_optimizer). At this tolerance torch DDP against the single process
# stays within 0.22 of it on every model here, at 2 and 3 ranks, whereas the
# mismatches this file is about (a stale bucket, a missed update) are of the
# order of the learning rate (1e-3) and more.
TOL = dict(rtol=1e-4, atol=1e-5)
# ResNet-18 at more than 2 ranks: its parameters after 3 steps are not
# reproducible to an elementwise tolerance by any two implementations. An
# average of 3 gradients rounds differently in another summation order (one of
# 2 does not: a/2 + b/2 is exact, so at 2 ranks DDP and dearcomm agree to the
# last bit), and this model, with BatchNorm over 4 samples, ReLU and max-pool,
# amplifies such a difference ~200x per step, with occasional jumps. Measured
# at 3 ranks: torch DDP with bucket_cap_mb=1 against DDP with 25 differs by up
# to 44x TOL; dearcomm (dear or wfbp) against DDP, over 12 data seeds, by up to
# 0.11 of the parameters' whole update (L2) and 1e-4 of the running statistics'
# update, while the losses stay within TOL. So at more than 2 ranks this
# model's parameters and buffers are compared by the L2 error of their whole
# update, relative to it; a shard or step left out is 0.3 or more, buffers that
# are not broadcast 0.2. Its losses are compared at TOL at every world size.
PARAMETER_UPDATE_RTOL = 0.25
BUFFER_UPDATE_RTOL = 1e-2


def dearcomm_cases(optimizer):
    return [f"{optimizer}-{schedule}-{update}-bucket{bucket_mb:g}MB"
            for (schedule, update), bucket_mb in itertools.product(SCHEDULES, BUCKET_MBS)]


def expected_cases(spec):
    return [case for optimizer in spec.optimizers
            for case in ([] if spec.batch_norm else [f"{optimizer}-ddp"]) + dearcomm_cases(optimizer)]


# ---- one training run -------------------------------------------------------------------

def slice_batch(batch, rank, world_size):
    return tuple(local_slice(t, rank, world_size) for t in batch)


def final_state(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.detach().clone() for n, b in model.named_buffers()})


def train_reference(spec, initial, optimizer_kind, data, rank, world_size):
    """One process on the global batch; the loss of this rank's samples is the
    mean of the reference's per-sample losses over this rank's slice."""
    model = copy.deepcopy(initial)
    optimizer = make_optimizer(optimizer_kind, model)
    losses = []
    for batch in data:
        loss, per_sample = spec.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(local_slice(per_sample, rank, world_size).mean())
    return losses, final_state(model)


def train_ddp(spec, initial, optimizer_kind, data, rank, world_size):
    model = copy.deepcopy(initial)
    ddp = DistributedDataParallel(model)  # broadcast_buffers=True
    optimizer = make_optimizer(optimizer_kind, model)
    losses = []
    for batch in data:
        loss, _ = spec.loss(ddp, slice_batch(batch, rank, world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    del ddp
    with torch.no_grad():  # the buffers DDP's next forward starts from: it broadcasts rank 0's first
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)
    return losses, final_state(model)


def train_dearcomm(spec, initial, optimizer_kind, data, rank, world_size, schedule, update, bucket_mb):
    model = copy.deepcopy(initial)
    model, optimizer = dearcomm.wrap(model, make_optimizer(optimizer_kind, model), bucket_mb=bucket_mb,
                                     schedule=schedule, update=update)
    losses = []
    for batch in data:  # a normal loop: no sync() between steps
        loss, _ = spec.loss(model, slice_batch(batch, rank, world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    model.sync()  # finish the last step's all-gathers (and replicated updates)
    return losses, final_state(model)


# ---- comparison -----------------------------------------------------------------------

def tensor_mismatches(what, actual, expected):
    """Every tensor that differs, with the size of the difference."""
    if actual.keys() != expected.keys():
        return [f"{what}: names differ: {sorted(actual.keys() ^ expected.keys())}"]
    bad = []
    for name, e in expected.items():
        a = actual[name]
        try:
            torch.testing.assert_close(a, e, **TOL)
        except AssertionError:
            if a.shape != e.shape or a.dtype != e.dtype:
                bad.append(f"{name}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}")
                continue
            diff = (a.double() - e.double()).abs()
            beyond = diff > TOL["atol"] + TOL["rtol"] * e.double().abs()
            bad.append(f"{name}: max |diff| {diff.max().item():.3g}, max |expected| {e.abs().max().item():.3g}, "
                       f"{int(beyond.sum())}/{e.numel()} elements beyond tolerance")
    if not bad:
        return []
    return [f"{what}: {len(bad)} of {len(expected)} differ:"] + [f"    {line}" for line in bad]


def update_mismatches(what, actual, expected, initial, rtol):
    """The error of the whole training update, relative to it, in the L2 norm
    over all tensors: ||actual - expected|| <= rtol * ||expected - initial||."""
    if actual.keys() != expected.keys():
        return [f"{what}: names differ: {sorted(actual.keys() ^ expected.keys())}"]
    if any(actual[n].shape != e.shape for n, e in expected.items()):
        return [f"{what}: shapes differ"]
    diff = {n: (actual[n].double() - e.double()).norm() for n, e in expected.items()}
    update = {n: (e.double() - initial[n].double()).norm() for n, e in expected.items()}
    error = (torch.stack(list(diff.values())).norm() / torch.stack(list(update.values())).norm()).item()
    if error <= rtol:
        return []
    worst = sorted(expected, key=lambda n: -(diff[n] / update[n].clamp_min(1e-30)).item())[:5]
    return [f"{what}: ||diff|| / ||update|| = {error:.3g} over all {len(expected)} tensors, more than {rtol:g}; "
            "worst tensors:"] + [
        f"    {n}: ||diff|| / ||update|| = {(diff[n] / update[n].clamp_min(1e-30)).item():.3g}, "
        f"max |diff| {(actual[n].double() - expected[n].double()).abs().max().item():.3g}" for n in worst]


def mismatches(run, expected, initial=None):
    """initial (parameters, buffers) given: these are compared by update_mismatches()."""
    (losses, (params, buffers)), (ref_losses, (ref_params, ref_buffers)) = run, expected
    failures = []
    for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
        if not torch.allclose(loss, ref_loss, **TOL):
            failures.append(f"step {step} loss {loss.item():.7g} vs yardstick {ref_loss.item():.7g} "
                            f"(diff {abs(loss.item() - ref_loss.item()):.3g})")
    if initial is None:
        failures += tensor_mismatches("parameters", params, ref_params)
        failures += tensor_mismatches("buffers", buffers, ref_buffers)
    else:
        failures += update_mismatches("parameters", params, ref_params, initial[0], PARAMETER_UPDATE_RTOL)
        failures += update_mismatches("buffers", buffers, ref_buffers, initial[1], BUFFER_UPDATE_RTOL)
    return failures


# ---- workers -----------------------------------------------------------------------------

def run_case(cases, case, train, expected, initial):
    try:
        cases[case] = mismatches(train(), expected, initial)
    except Exception:  # reported per case
        cases[case] = [traceback.format_exc()]


def model_worker(rank, world_size, spec):
    torch.manual_seed(0)
    initial = spec.build().train()
    g = torch.Generator().manual_seed(1)
    data = [spec.batch(g, GLOBAL_BATCH) for _ in range(STEPS)]
    # See PARAMETER_UPDATE_RTOL: averages of more than two gradients round by their order.
    by_update = final_state(initial) if spec.amplifies_rounding and world_size > 2 else None
    cases = {}
    for optimizer_kind in spec.optimizers:
        args = (spec, initial, optimizer_kind, data, rank, world_size)
        if spec.batch_norm:
            expected = train_ddp(*args)
        else:
            expected = train_reference(*args)
            run_case(cases, f"{optimizer_kind}-ddp", lambda: train_ddp(*args), expected, by_update)
        for (schedule, update), bucket_mb in itertools.product(SCHEDULES, BUCKET_MBS):
            run_case(cases, f"{optimizer_kind}-{schedule}-{update}-bucket{bucket_mb:g}MB",
                     lambda: train_dearcomm(*args, schedule, update, bucket_mb), expected, by_update)
    return cases


def group_worker(rank, world_size, names):
    results = {}
    for name in names:
        try:
            results[name] = model_worker(rank, world_size, SPECS[name])
        except Exception:  # building the model or its yardstick failed
            results[name] = {"set-up": [traceback.format_exc()]}
    return results


_results = {}


def results_for(group, world_size):
    key = (group, world_size)
    if key not in _results:
        try:
            _results[key] = run_workers(group_worker, world_size, GROUPS[group], deadline=420)
        except Exception as e:  # a hang or a dead rank: every model of the group reports it
            _results[key] = e
    if isinstance(_results[key], Exception):
        raise _results[key]
    return _results[key]


MODELS = [(group, name) for group, names in GROUPS.items() for name in names]


@pytest.mark.parametrize("group, model", MODELS, ids=[name for _, name in MODELS])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_real_model_trains_like_its_yardstick(world_size, group, model):
    report, failing = [], set()
    for rank, results in enumerate(results_for(group, world_size)):
        cases = results[model]
        if "set-up" not in cases:
            assert sorted(cases) == sorted(expected_cases(SPECS[model])), "a case did not run"
        for case, failures in cases.items():
            if failures:
                failing.add(case)
                report.append(f"--- rank {rank}, {model}, {case}:\n" + "\n".join(failures))
    assert not report, f"{len(failing)} failing cases: {sorted(failing)}\n" + "\n".join(report)
