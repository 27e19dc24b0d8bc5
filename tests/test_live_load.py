"""Loading a checkpoint into a model and optimizer that have already trained.

People roll back after a loss spike, or reload the best checkpoint inside the
same job: model.load_state_dict() and optimizer.load_state_dict() on the live
wrapped objects, then training goes on. Each test trains, saves, trains on,
loads what it saved into the live objects and trains on, beside a
single-process reference that does the same on the global batch; the two
must end equal. With update="sharded" the optimizer steps fp32 master shards,
which a module load must reload (DearModule's load post-hook): without that,
training would go on from the parameters before the load.
"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F

import dearcomm
from tests.models import MixedNet, batches, local_slice
from tests.multiprocess import run_workers
from tests.test_parity import SCHEDULES, make_optimizer
from tests.test_training_features import TOL, assert_same_parameters, each_schedule
from tests.test_user_loops import assert_no_failures

GLOBAL_BATCH = 12
PARTITIONS = (None, 1 / 2**20)  # whole tensors; one-unit partitions (every tensor split over buckets)
STEPS = 2  # before saving, between saving and loading, and after loading


def _checkpoint(*objects) -> bytes:
    """What torch.save writes: nothing aliases the live tensors afterwards."""
    buffer = io.BytesIO()
    torch.save([o.state_dict() for o in objects], buffer)
    return buffer.getvalue()


def _restore(data: bytes, *objects) -> None:
    for obj, state in zip(objects, torch.load(io.BytesIO(data), weights_only=False)):
        obj.load_state_dict(state)


class Run:
    """A wrapped model with its optimizer, scheduler and scaler, and the same
    on one process over the global batch, stepped together."""

    def __init__(self, rank, world_size, schedule, update, partition_mb, scaling):
        self.rank, self.world_size = rank, world_size
        torch.manual_seed(0)
        model = MixedNet()
        self.reference = copy.deepcopy(model)
        optimizer, self.ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", self.reference)
        self.model, self.optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.001, partition_mb=partition_mb,
                                                   schedule=schedule, update=update)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.ref_scheduler = torch.optim.lr_scheduler.StepLR(self.ref_opt, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=scaling)
        self.ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=scaling)
        self.data = batches(4 * STEPS + 2, GLOBAL_BATCH)

    def backward(self, overflow_on_rank=None, sync=True):
        x, y = next(self.data)
        loss = F.cross_entropy(self.model(local_slice(x, self.rank, self.world_size)),
                               local_slice(y, self.rank, self.world_size))
        if overflow_on_rank == self.rank:
            loss = loss * float("inf")
        self.scaler.scale(loss).backward()
        ref_loss = F.cross_entropy(self.reference(x), y) * (float("inf") if overflow_on_rank is not None else 1.0)
        self.ref_scaler.scale(ref_loss).backward()

    def step(self, overflow_on_rank=None):
        self.backward(overflow_on_rank)
        for scaler, optimizer, scheduler in ((self.scaler, self.optimizer, self.scheduler),
                                             (self.ref_scaler, self.ref_opt, self.ref_scheduler)):
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()
        assert self.scaler.get_scale() == self.ref_scaler.get_scale()

    def save(self):
        return (_checkpoint(self.model, self.optimizer, self.scheduler, self.scaler),
                _checkpoint(self.reference, self.ref_opt, self.ref_scheduler, self.ref_scaler))

    def assert_matches(self, what):
        self.model.sync()
        assert_same_parameters(self.model, self.reference, what)

    def load(self, saved):
        _restore(saved[0], self.model, self.optimizer, self.scheduler, self.scaler)
        _restore(saved[1], self.reference, self.ref_opt, self.ref_scheduler, self.ref_scaler)


def live_load_worker(rank, world_size, variant):
    """variant "plain": train, save, train, load, train. "pending-no_sync": a
    no_sync() micro-batch's gradients are still in .grad when the load comes
    (they stay, as with torch: the next synchronized backward adds them in).
    "skipped-step": the step just before the load overflowed on one rank and
    every rank skipped it."""
    def run(schedule, update):
        for partition_mb in PARTITIONS:
            if schedule == "usbyte" and partition_mb:
                continue  # usbyte splits by its planner's blocks only
            what = f"partition_mb={partition_mb}"
            r = Run(rank, world_size, schedule, update, partition_mb, scaling=variant == "skipped-step")
            for _ in range(STEPS):
                r.step()
            saved = r.save()
            for _ in range(STEPS):
                r.step()
            if variant == "pending-no_sync":
                with r.model.no_sync():
                    r.backward()
            elif variant == "skipped-step":
                r.step(overflow_on_rank=world_size - 1)
                assert r.scaler.get_scale() < 2.0 ** 8, "the test must actually skip a step"
            r.load(saved)
            assert_same_parameters(r.model, r.reference, f"{what}, right after the load")
            for _ in range(STEPS):
                r.step()
            r.assert_matches(f"{what}, trained on after the load")
            torch.testing.assert_close(r.optimizer.state_dict()["state"], r.ref_opt.state_dict()["state"], **TOL,
                                       msg=lambda m: f"{what}, optimizer state: {m}")
    return each_schedule(rank, world_size, run)


@pytest.mark.parametrize("variant", ["plain", "pending-no_sync", "skipped-step"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_loading_into_a_live_model_equals_single_process_training(world_size, variant):
    assert_no_failures(run_workers(live_load_worker, world_size, variant, deadline=300))


def optimizer_only_worker(rank, world_size):
    """Only the optimizer's state is rolled back (the parameters go on)."""
    def run(schedule, update):
        r = Run(rank, world_size, schedule, update, None, scaling=False)
        for _ in range(STEPS):
            r.step()
        saved = (_checkpoint(r.optimizer), _checkpoint(r.ref_opt))
        for _ in range(STEPS):
            r.step()
        _restore(saved[0], r.optimizer)
        _restore(saved[1], r.ref_opt)
        for _ in range(STEPS):
            r.step()
        r.assert_matches("after loading the optimizer alone")
    return each_schedule(rank, world_size, run)


def test_loading_the_optimizer_alone_into_a_live_one():
    assert_no_failures(run_workers(optimizer_only_worker, 2, deadline=300))


def test_every_schedule_is_covered():
    # deft plans delays that change what training computes: tests/test_deft.py resumes its checkpoints (with
    # delayed gradients pending) against a reference with the same delays.
    assert {s for s, _ in SCHEDULES} | {"deft"} == set(dearcomm.SCHEDULES), \
        "a schedule is missing from the live-load tests"


# ---- other ways state enters a live engine -------------------------------------------

def hand_edits_worker(rank, world_size):
    """Hyper-parameters edited by hand between steps apply from the next step,
    as with torch."""
    def run(schedule, update):
        r = Run(rank, world_size, schedule, update, None, scaling=False)
        for step in range(3 * STEPS):
            if step == STEPS:
                for optimizer in (r.optimizer, r.ref_opt):
                    optimizer.param_groups[1]["lr"] = 0.05
                    optimizer.param_groups[0]["weight_decay"] = 0.5
            r.step()
        r.assert_matches("after editing param_groups' hyper-parameters")
    return each_schedule(rank, world_size, run)


def test_hyperparameters_edited_by_hand_take_effect():
    assert_no_failures(run_workers(hand_edits_worker, 2, deadline=300))


def _refused(fn, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        fn()


def refusals_worker(rank, world_size):
    """What cannot work on a live engine raises a dearcomm error that says what
    to do, instead of training on silently with stale buckets."""
    def run(schedule, update):
        r = Run(rank, world_size, schedule, update, None, scaling=False)
        r.step()
        extra = torch.nn.Parameter(torch.zeros(3))
        _refused(lambda: r.optimizer.add_param_group({"params": [extra]}), r"add_param_group\(\) after wrap\(\)")

        # Converting the whole model is refused before anything changes, so training goes on correctly.
        _refused(lambda: r.model.to(torch.float64), "from torch.float32 on cpu to torch.float64 on cpu")
        _refused(r.model.half, "to torch.float16")
        assert all(p.dtype == torch.float32 for p in r.model.parameters())
        r.model.to("cpu")  # a no-op conversion is fine
        r.step()
        r.assert_matches("after refused conversions")

        # Parameters added to a group by hand: refused at the next step.
        r.optimizer.param_groups[0]["params"].append(extra)
        r.backward()
        _refused(r.optimizer.step, "param_groups hold other parameters than at wrap")

        # A parameter replaced after wrap: its old self gets no gradient.
        r = Run(rank, world_size, schedule, update, None, scaling=False)
        r.step()
        r.model.fc.weight = torch.nn.Parameter(r.model.fc.weight.detach().clone())
        _refused(r.backward, r"\['fc.weight'\] of the wrapped model were replaced after wrap")

        # Submodules converted one by one (the root's _apply never runs): caught at the next gradient.
        r = Run(rank, world_size, schedule, update, None, scaling=False)
        r.step()
        r.model.sync()
        for child in r.model.children():
            child.double()
        _refused(r.backward, "dearcomm: parameter '.*' is Double but was Float when the buckets were planned")
    return each_schedule(rank, world_size, run)


def test_changes_a_live_engine_cannot_follow_are_refused():
    assert_no_failures(run_workers(refusals_worker, 2, deadline=300))
