"""What a real training loop needs, each against a single-process reference
trained on the global batch: gradient clipping, accumulation with no_sync(),
activation checkpointing, unused parameters, and checkpoints that survive a
restart (also at another world size, and into a plain torch optimizer)."""
import contextlib
import copy
import math
import os
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dearcomm
from dearcomm import _C
from tests.models import MixedNet, batches, global_batch, local_slice, step_on_global_batch, step_on_slice
from tests.multiprocess import run_workers
from tests.test_parity import SCHEDULES, make_optimizer

TOL = dict(rtol=1e-5, atol=1e-6)
GLOBAL_BATCH = 12


def assert_same_parameters(model, reference, what):
    torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()), **TOL,
                               msg=lambda m: f"{what}: {m}")


def averaged_in_grad(schedule, update):
    """Whether .grad holds the averaged gradient after backward (wfbp, as DDP);
    otherwise .grad keeps the local gradient and the average lives in the engine."""
    strategies = {e["name"]: e["updates"] for e in _C.schedules()}
    return strategies[schedule][update] == "full_after_reduction"


def each_schedule(rank, world_size, fn):
    """Runs fn(schedule, update) for every schedule; collects failures by name."""
    failures = {}
    for schedule, update in SCHEDULES:
        try:
            fn(schedule, update)
        except Exception:
            failures[f"{schedule}-{update}"] = traceback.format_exc()
    return failures


# ---- clipping ---------------------------------------------------------------------

def clipping_worker(rank, world_size):
    """Method and option, L2 and the inf norm (whose global value needs a MAX
    all-reduce of the shards' maxima: without it each rank clips by its own)."""
    cases = [(False, 2.0, 0.3), (True, 2.0, 0.3), (False, float("inf"), 0.02)]

    def run(schedule, update):
        for via_option, norm_type, max_norm in cases:
            what = f"option={via_option}, norm_type={norm_type}"
            torch.manual_seed(0)
            model = MixedNet()
            reference = copy.deepcopy(model)
            optimizer, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
            model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.001, schedule=schedule, update=update,
                                             max_grad_norm=max_norm if via_option else None)
            for step, (x, y) in enumerate(batches(4, GLOBAL_BATCH)):
                F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
                norm = None if via_option else optimizer.clip_grad_norm_(max_norm, norm_type)
                optimizer.step()
                optimizer.zero_grad()
                F.cross_entropy(reference(x), y).backward()
                ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
                assert ref_norm > max_norm, f"{what}: the test must actually clip ({ref_norm})"
                ref_opt.step()
                ref_opt.zero_grad()
                if norm is not None:
                    torch.testing.assert_close(norm, ref_norm, **TOL, msg=lambda m: f"{what}, norm: {m}")
                model.sync()
                assert_same_parameters(model, reference, f"step {step}, {what}")
    return each_schedule(rank, world_size, run)


def nonfinite_clip_worker(rank, world_size):
    """torch's signature: foreach= changes nothing; error_if_nonfinite=True
    raises on every rank when the global norm is inf (one rank's gradient)."""
    def run(schedule, update):
        torch.manual_seed(0)
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, make_optimizer("sgd", model), bucket_mb=0.001, schedule=schedule,
                                         update=update)
        x, y = next(batches(1, GLOBAL_BATCH))
        F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        plain = optimizer.clip_grad_norm_(1e9, foreach=True)  # nothing to clip: the norm alone
        assert torch.isfinite(plain), plain
        optimizer.step()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        (loss * (float("inf") if rank == 1 else 1.0)).backward()
        with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
            optimizer.clip_grad_norm_(1.0, error_if_nonfinite=True)
        model.close()
    return each_schedule(rank, world_size, run)


def test_clipping_takes_torchs_error_if_nonfinite_and_foreach():
    for rank, failures in enumerate(run_workers(nonfinite_clip_worker, 2)):
        assert not failures, f"rank {rank}: {failures}"


def large_shard_norm_worker(rank, world_size):
    """The norm of one bucket whose shard holds 2M elements, against the fp64
    norm of the averaged gradient: fp32 over the whole shard read 1e-5 low.
    Also the inf norm, of that shard and of one of exactly 32768 elements
    (the pieces' size: no remainder)."""
    errors = {}
    for width, norm_type in [(2048, 2.0), (2048, math.inf), (256, math.inf), (256, 2.0)]:
        for schedule, update in [("dear", "sharded"), ("dear", "replicated")]:
            torch.manual_seed(0)
            model = nn.Linear(width, width, bias=False)
            model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), schedule=schedule,
                                             update=update)
            torch.manual_seed(1 + rank)
            model(torch.randn(8, width)).square().mean().backward()
            average = model.weight.grad.double()
            torch.distributed.all_reduce(average)
            exact = torch.linalg.vector_norm(average / world_size, norm_type)
            norm = optimizer.clip_grad_norm_(1e9, norm_type=norm_type)
            errors[f"{schedule}-{update} width {width} norm {norm_type}"] = abs(norm.item() / exact.item() - 1)
            model.close()
    return errors


def test_the_clipping_norm_of_a_large_shard_is_as_exact_as_torchs():
    for rank, errors in enumerate(run_workers(large_shard_norm_worker, 2)):
        assert max(errors.values()) < 1e-6, f"rank {rank}: relative error of the norm: {errors}"


# ---- accumulation ------------------------------------------------------------------

def train_micro_batches(rank, world_size, schedule, update, optim, micro, quiet, sync_each_step):
    """Three steps of `micro` micro-batches, a backward each (inside no_sync()
    where quiet(i)), against one step on the global batch; compared after
    every step (sync_each_step) or after the last only (a normal loop)."""
    torch.manual_seed(0)
    model = MixedNet()
    reference = copy.deepcopy(model)
    optimizer, ref_opt = make_optimizer(optim, model), make_optimizer(optim, reference)
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.001, schedule=schedule, update=update)
    for step, (x, y) in enumerate(batches(3, GLOBAL_BATCH * micro)):
        xs, ys = local_slice(x, rank, world_size).chunk(micro), local_slice(y, rank, world_size).chunk(micro)
        for i in range(micro):
            with model.no_sync() if quiet(i) else contextlib.nullcontext():
                (F.cross_entropy(model(xs[i]), ys[i]) / micro).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_on_global_batch(reference, ref_opt, x, y)
        if sync_each_step or step == 2:
            model.sync()
            assert_same_parameters(model, reference, f"step {step}")


def accumulation_worker(rank, world_size):
    def run(schedule, update):
        train_micro_batches(rank, world_size, schedule, update, "sgd", micro=4, quiet=lambda i: i < 3,
                            sync_each_step=True)
    return each_schedule(rank, world_size, run)


def backwards_before_step_worker(rank, world_size):
    """Several backwards before step() outside no_sync() (a GAN's
    discriminator: real, then fake samples), as DDP takes them: each
    backward's gradients averaged, .grad their sum. Three micro-batches of a
    third of the loss each equal one step on the global batch. With .grad
    in the buckets (every backward's reductions finished at its end) and
    without (DEARCOMM_GRAD_VIEWS=0: a reduce-scatter or ByteScheduler's
    all-reduces still in flight when the next backward begins). SGD with
    momentum and weight decay, whose step would show a gradient off by a
    factor, and AdamW; and with the middle backward under no_sync(), which
    the third one's reductions carry. A normal loop: no sync() until the
    end."""
    def run(schedule, update):
        for views, optim, middle in (("1", "sgd", "plain"), ("1", "adamw", "plain"), ("0", "sgd", "plain"),
                                     ("1", "sgd", "no_sync")):
            os.environ["DEARCOMM_GRAD_VIEWS"] = views
            try:
                train_micro_batches(rank, world_size, schedule, update, optim, micro=3,
                                    quiet=lambda i: middle == "no_sync" and i == 1, sync_each_step=False)
            except AssertionError as e:
                raise AssertionError(f"{optim}, DEARCOMM_GRAD_VIEWS={views}, middle {middle}: {e}") from None
            finally:
                del os.environ["DEARCOMM_GRAD_VIEWS"]
    return each_schedule(rank, world_size, run)


# ---- activation checkpointing -------------------------------------------------------

class Checkpointed(MixedNet):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, tokens):
        x = self.embed(tokens).transpose(1, 2)
        x = checkpoint(lambda t: self.norm(self.conv(t).transpose(1, 2)), x, use_reentrant=self.use_reentrant)
        x = checkpoint(lambda t: torch.relu(self.fc(t.flatten(1))) * self.scale, x, use_reentrant=self.use_reentrant)
        # The last layer too: its gradients, the backward's first, arrive inside a reentrant checkpoint's own backward.
        return checkpoint(self.head, x, use_reentrant=self.use_reentrant)


def checkpointing_worker(rank, world_size):
    def run(schedule, update):
        for reentrant in (True, False):
            torch.manual_seed(0)
            model = Checkpointed(reentrant)
            reference = copy.deepcopy(model)
            optimizer, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
            model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.001, schedule=schedule, update=update)
            for x, y in batches(4, GLOBAL_BATCH):
                step_on_slice(model, optimizer, x, y, rank, world_size)
                step_on_global_batch(reference, ref_opt, x, y)
            model.sync()
            assert_same_parameters(model, reference, f"use_reentrant={reentrant}")
    return each_schedule(rank, world_size, run)


# ---- writes into parameters between steps ----------------------------------------------

def parameter_writes_worker(rank, world_size):
    """What users write into a wrapped model's parameters between steps, after
    sync(): a submodule's load_state_dict (a pretrained part), weight clipping
    in place (WGAN), nn.init on one layer. With update="sharded" the optimizer
    steps a master copy, which must take these writes in; the reference does
    the same writes on one process."""
    def writes(model, step):
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.2, 0.2)
        if step == 1:
            model.head.load_state_dict({k: torch.full_like(v, 0.01) for k, v in model.head.state_dict().items()})
        if step == 2:
            nn.init.constant_(model.fc.bias, 0.05)

    def run(schedule, update):
        torch.manual_seed(0)
        model = MixedNet()
        reference = copy.deepcopy(model)
        optimizer, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.001, schedule=schedule, update=update)
        for step, (x, y) in enumerate(batches(4, GLOBAL_BATCH)):
            step_on_slice(model, optimizer, x, y, rank, world_size)
            step_on_global_batch(reference, ref_opt, x, y)
            model.sync()
            writes(model, step)
            writes(reference, step)
        model.sync()
        assert_same_parameters(model, reference, "writes between steps")
    return each_schedule(rank, world_size, run)


# ---- unused parameters ---------------------------------------------------------------

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x, use_branch):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def unused_worker(rank, world_size):
    """Also guards against dropping what no_sync() accumulated for a
    parameter that the last micro-batch does not use: it must be reduced (as
    DDP does), not replaced by zeros; and against moving a parameter that no
    rank used (`never`): as with DDP it keeps .grad None and the optimizer
    skips it, where a zero gradient would move it under momentum and weight
    decay. first="backward": that first micro-batch outside no_sync(), two
    backwards before step(): `never` gets no gradient in either, and must
    still keep .grad None."""
    def run(schedule, update):
        run_steps(schedule, update, first=None)
        run_steps(schedule, update, first="no_sync")
        run_steps(schedule, update, first="backward")

    def run_steps(schedule, update, first):
        accumulate = first is not None
        torch.manual_seed(0)
        model = Branchy()
        reference = copy.deepcopy(model)
        optimizer, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
                              for m in (model, reference))
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0, schedule=schedule, update=update,
                                         find_unused_parameters=True)
        g = torch.Generator().manual_seed(3)
        for step in range(3):
            x, y = torch.randn(world_size * 4, 6, generator=g), torch.randint(0, 2, (world_size * 4,), generator=g)
            branch_on = lambda r: (r + step) % 2 == 0  # noqa: E731  - used on some ranks only
            if accumulate:  # a first micro-batch that uses the branch everywhere
                with model.no_sync() if first == "no_sync" else contextlib.nullcontext():
                    F.cross_entropy(model(local_slice(x, rank, world_size), True),
                                    local_slice(y, rank, world_size)).backward()
            F.cross_entropy(model(local_slice(x, rank, world_size), branch_on(rank)),
                            local_slice(y, rank, world_size)).backward()
            optimizer.step()
            optimizer.zero_grad()
            loss = sum(F.cross_entropy(reference(local_slice(x, r, world_size), branch_on(r)),
                                       local_slice(y, r, world_size)) for r in range(world_size)) / world_size
            if accumulate:
                loss = loss + sum(F.cross_entropy(reference(local_slice(x, r, world_size), True),
                                                  local_slice(y, r, world_size)) for r in range(world_size)) / world_size
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            model.sync()
            assert_same_parameters(model, reference, f"first micro-batch {first}, step {step}")
    return each_schedule(rank, world_size, run)


@pytest.mark.parametrize("worker", [clipping_worker, accumulation_worker, backwards_before_step_worker,
                                    checkpointing_worker, unused_worker, parameter_writes_worker],
                         ids=["clipping", "no_sync-accumulation", "backwards-before-step", "activation-checkpointing",
                              "unused-parameters", "parameter-writes"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_feature_parity(worker, world_size):
    for rank, failures in enumerate(run_workers(worker, world_size, deadline=240)):
        assert not failures, f"rank {rank}:\n" + "\n".join(f"{k}:\n{v}" for k, v in failures.items())


# ---- checkpoints -----------------------------------------------------------------------

def checkpoint_worker(rank, world_size, schedule, update, partition_mb, path, phase, steps):
    """phase "first": train `steps` steps and save; "second": a process that
    has not trained loads and trains `steps` more; "before": the same, loaded
    into the plain model and optimizer before wrap() (as with DDP);
    "straight": 2*steps without a break."""
    torch.manual_seed(0)
    model = MixedNet()
    optimizer = make_optimizer("adamw", model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if phase == "before":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.001, schedule=schedule, update=update,
                                     partition_mb=partition_mb)
    data = list(batches(2 * steps, GLOBAL_BATCH))
    todo = data[:steps] if phase == "first" else data if phase == "straight" else data[steps:]
    if phase == "second":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    for x, y in todo:
        F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    if phase == "first" and rank == 0:
        torch.save(state, path)
    model.close()
    return {k: v.clone() for k, v in state["model"].items()}, state["optimizer"]


def reference_optimizer_state(steps):
    torch.manual_seed(0)
    reference = MixedNet()
    optimizer = make_optimizer("adamw", reference)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for x, y in list(batches(steps, GLOBAL_BATCH)):
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return reference, optimizer


# Each schedule, and the sharded update with every parameter split into
# one-unit partitions (its optimizer state lives on pieces of many buckets).
CHECKPOINT_CASES = {f"{s}-{u}" + ("-partitioned" if p else ""): (s, u, p)
                    for s, u, p in [(s, u, None) for s, u in SCHEDULES] + [("dear", "sharded", 1 / 2**20)]}
CHECKPOINT_STEPS = 3


def checkpoint_cases_worker(rank, world_size, directory, phases):
    """Every case through `phases`, one phase after the other (in a restart,
    every case's resumed run comes before any straight run: nothing of a
    straight run can help a resumed one), each case with its own model and
    checkpoint file. Returns {phase: {case: result}}."""
    return {phase: {case: checkpoint_worker(rank, world_size, *config, os.path.join(directory, f"{case}.pt"), phase,
                                            CHECKPOINT_STEPS)
                    for case, config in CHECKPOINT_CASES.items()}
            for phase in phases}


def test_checkpoint_restart_equals_uninterrupted_training(tmp_path):
    """Every case trains and saves in one process group; then process groups
    that have trained nothing load each checkpoint, at another world size (3)
    and at the same (2), after wrap() and (at 2) before it, and train on:
    equal to training straight through."""
    first = run_workers(checkpoint_cases_worker, 2, str(tmp_path), ["first"])
    # The consolidated optimizer state is torch's own: equal to a plain torch
    # optimizer trained on the global batch, and the same on every rank.
    reference, ref_opt = reference_optimizer_state(CHECKPOINT_STEPS)
    expected = ref_opt.state_dict()
    for case in CHECKPOINT_CASES:
        for rank, by_phase in enumerate(first):
            opt_state = by_phase["first"][case][1]
            torch.testing.assert_close(opt_state["state"], expected["state"], **TOL,
                                       msg=lambda m: f"{case}, rank {rank}: {m}")
            assert [g["params"] for g in opt_state["param_groups"]] == \
                [g["params"] for g in expected["param_groups"]], case
        plain = make_optimizer("adamw", copy.deepcopy(reference))
        plain.load_state_dict(first[0]["first"][case][1])  # loads into a plain torch optimizer

    for world_size, resumed in ((3, ["second"]), (2, ["second", "before"])):
        results = run_workers(checkpoint_cases_worker, world_size, str(tmp_path), resumed + ["straight"])
        for case in CHECKPOINT_CASES:
            for rank, by_phase in enumerate(results):
                for phase in resumed:
                    torch.testing.assert_close(by_phase[phase][case][0], by_phase["straight"][case][0], **TOL,
                                               msg=lambda m: f"{case} {phase}, world size {world_size}, rank {rank}: {m}")


def test_sharded_state_dict_round_trip_on_the_same_ranks(tmp_path):
    results = run_workers(sharded_round_trip_worker, 2, str(tmp_path))
    assert all(r == "ok" for r in results), results


def sharded_round_trip_worker(rank, world_size, directory):
    path = os.path.join(directory, f"shard{rank}.pt")
    torch.manual_seed(0)
    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, make_optimizer("adamw", model), bucket_mb=0.001)
    for x, y in batches(2, GLOBAL_BATCH):
        F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(optimizer.sharded_state_dict(), path)
    full = optimizer.state_dict()
    optimizer.load_state_dict(torch.load(path, weights_only=False))
    torch.testing.assert_close(optimizer.state_dict()["state"], full["state"], rtol=0, atol=0)
    other = torch.load(path, weights_only=False) | {"rank": 1 - rank}
    try:
        optimizer.load_state_dict(other)
    except ValueError as e:
        assert "each rank must load its own shard" in str(e)
    else:
        return "loading another rank's shard did not raise"
    # Saved under another layout (e.g. bucket_mb changed): the shards would
    # land on the wrong elements without a word.
    relaid = torch.load(path, weights_only=False)
    params, shards = relaid["layout"]
    relaid["layout"] = ([(bucket, offset + 8, numel, last) for bucket, offset, numel, last in params], shards)
    try:
        optimizer.load_state_dict(relaid)
    except ValueError as e:
        assert "another bucket layout" in str(e)
        return "ok"
    return "loading a shard saved under another bucket layout did not raise"


# ---- forward order changes --------------------------------------------------------

class Reordering(nn.Module):
    """Runs its two blocks in the recorded order (a, b) or, with swap set,
    the other way round; both are valid computations."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.head = nn.Linear(5, 2)
        self.swap = False

    def forward(self, x):
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return self.head(torch.tanh(second(torch.tanh(first(x)))))


# Three steps in the recorded order, then swapped, back, and swapped again.
SWAPS = [False, False, False, True, False, True]


def reorder_worker(rank, world_size):
    """Guards two things apart: (1) forwards in the recorded order find every
    all-gather issued by step() (a hook that issues its own bucket's, on every
    forward, fails in the first steps); (2) a forward in another order waits
    for the buckets its modules need, not for the next in the recorded order
    (it would read stale parameters: its loss differs at that very step),
    and issues nothing late either."""
    def run(schedule, update):
        torch.manual_seed(0)
        model = Reordering()
        reference = copy.deepcopy(model)
        optimizer, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0, schedule=schedule, update=update)
        g = torch.Generator().manual_seed(5)
        wrong = []  # collected, not raised: every rank must keep issuing the same collectives
        for step, swap in enumerate(SWAPS):
            model.swap = reference.swap = swap
            x, y = torch.randn(world_size * 3, 5, generator=g), torch.randint(0, 2, (world_size * 3,), generator=g)
            mine, theirs = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(mine), theirs)
            loss.backward()
            optimizer.step()
            with torch.no_grad():  # the reference's parameters are those the forward above had to see
                expected = F.cross_entropy(reference(mine), theirs)
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
            what = f"step {step} ({'swapped' if swap else 'recorded'} order)"
            if not torch.allclose(loss.detach(), expected, **TOL):
                wrong.append(f"{what}: loss {loss.item()} where the reference's parameters give {expected.item()}")
            misses = model._dear.engine.prefetch_misses
            if misses and not any("issued by a forward hook" in w for w in wrong):
                wrong.append(f"{what}: {misses} all-gather(s) issued by a forward hook, not by step(); " + (
                    "in the recorded order: every forward gathers for itself" if not any(SWAPS[:step + 1])
                    else "after a reordered forward"))
        model.sync()
        assert not wrong, "\n".join(wrong)
        assert_same_parameters(model, reference, "after swapped forwards")
    return each_schedule(rank, world_size, run)


def test_forward_order_change_reads_no_stale_parameters():
    for rank, failures in enumerate(run_workers(reorder_worker, 2)):
        assert not failures, f"rank {rank}:\n" + "\n".join(f"{k}:\n{v}" for k, v in failures.items())


# ---- overlap -------------------------------------------------------------------------

def overlap_worker(rank, world_size):
    """Guards the overlap itself: when fc's gradient arrives, in the middle of
    backward, head's reduction must already be in flight while embed's bucket
    is still filling: reductions start as buckets complete, not when backward
    ends or when the last gradient arrives."""
    from dearcomm import _C

    def run(schedule, update):
        if schedule == "usbyte":
            return  # it lays out its own buckets (its plan), not one per tensor; its queue: test_schedule_policies
        torch.manual_seed(0)
        model = MixedNet()
        optimizer = make_optimizer("sgd", model)
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0, schedule=schedule, update=update)
        seen = []

        def bucket_of(param):
            return model._dear.engine.layout.params[model._dear.index[param]].bucket

        def check(param):
            engine = model._dear.engine
            seen.append((engine.bucket_state(bucket_of(model.head.weight)),
                         engine.bucket_state(bucket_of(model.embed.weight))))

        model.fc.weight.register_post_accumulate_grad_hook(check)
        for x, y in batches(2, GLOBAL_BATCH):
            step_on_slice(model, optimizer, x, y, rank, world_size)
        assert seen == [(_C.BucketState.REDUCING, _C.BucketState.FILLING)] * 2, seen
    return each_schedule(rank, world_size, run)


def test_reductions_are_in_flight_while_backward_runs():
    for rank, failures in enumerate(run_workers(overlap_worker, 2)):
        assert not failures, f"rank {rank}:\n" + "\n".join(f"{k}:\n{v}" for k, v in failures.items())


def _round_trip_before_first_backward(rank, world_size):
    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, make_optimizer("adamw", model))
    optimizer.load_state_dict(optimizer.state_dict())  # what Accelerate's optimizer wrapper does at prepare()
    x, y = next(batches(1, global_batch(world_size)))
    step_on_slice(model, optimizer, x, y, rank, world_size)
    return True


def test_optimizer_state_round_trips_before_the_first_backward():
    assert run_workers(_round_trip_before_first_backward, 2, deadline=120) == [True, True]


def _state_on_rank0_only(rank, world_size):
    torch.manual_seed(0)
    model = MixedNet()
    optimizer = make_optimizer("adamw", model)
    if rank == 0:  # a checkpoint loaded on rank 0 alone: the ranks would train from other moments
        x, y = next(batches(1, GLOBAL_BATCH))
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    try:
        dearcomm.wrap(model, optimizer)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_optimizer_state_on_some_ranks_only_is_refused_on_every_rank():
    for rank, message in enumerate(run_workers(_state_on_rank0_only, 2)):
        assert f"[rank {rank}] rank 0's optimizer holds state (loaded before wrap()) and rank 1's does not" in message, \
            message
        assert "load the optimizer's state on every rank" in message
