"""The training loops people write around DDP, run with dearcomm: GradScaler,
torch's clip_grad_norm_, EMA, torch.compile, rank-0-only checkpoints and eval,
BatchNorm buffers, a dropped model. Each against a single-process reference on
the global batch (or torch DDP where buffers make that the yardstick), after a
normal loop: no sync() between steps."""
import copy
import dataclasses
import datetime
import gc
import io
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dearcomm
from tests.models import MixedNet, batches, local_slice, step_on_global_batch, step_on_slice
from tests.multiprocess import run_workers
from tests.test_parity import make_optimizer
from tests.test_training_features import TOL, assert_same_parameters, averaged_in_grad, each_schedule

GLOBAL_BATCH = 12
BUCKETS = (0, 25.0)  # one bucket per tensor, and the default


def assert_no_failures(results):
    """Every rank's failures, since the first one may be a consequence of another rank's."""
    report = [f"rank {rank}:\n" + "\n".join(f"--- {k}:\n{v}" for k, v in failures.items())
              for rank, failures in enumerate(results) if failures]
    assert not report, "\n".join(report)


def each_schedule_and_bucket(rank, world_size, fn):
    return each_schedule(rank, world_size, lambda schedule, update: [fn(schedule, update, b) for b in BUCKETS])


def wrapped_pair(schedule, update, bucket_mb, optim="adamw", **options):
    torch.manual_seed(0)
    model = MixedNet()
    reference = copy.deepcopy(model)
    optimizer, ref_opt = make_optimizer(optim, model), make_optimizer(optim, reference)
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=bucket_mb, schedule=schedule, update=update,
                                     **options)
    return model, optimizer, reference, ref_opt


def local_loss(model, x, y, rank, world_size):
    return F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))


# ---- item 2: torch.amp.GradScaler -----------------------------------------------

def grad_scaler_worker(rank, world_size):
    """GradScaler's recipe, with a step where only rank 1's loss overflows: every
    rank must skip that step and back off the scale together, and the others
    must apply unscaled gradients (a scale of 2^10 left in would show at once).
    "optimizer-clip": torch's recipe with dearcomm's clip, scaler.unscale_ then
    optimizer.clip_grad_norm_: with dear what step() applies is still scaled
    when it is called, yet its norm (read after step(), as the first step
    learns of the scaler only then) and its clipping must be the unscaled ones.
    "two-backwards": the same with the local batch in two halves, a scaled
    backward each before step() (the overflow in rank 1's second)."""
    def run(schedule, update, bucket_mb):
        for variant in ("plain", "unscale_", "clip", "optimizer-clip", "two-backwards"):
            if variant == "clip" and not averaged_in_grad(schedule, update):
                options = dict(max_grad_norm=0.3)  # dear, bytescheduler: clip inside step(), after unscaling
            else:
                options = {}
            model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, bucket_mb, **options)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
            ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
            for step, (x, y) in enumerate(batches(5, GLOBAL_BATCH)):
                overflow = step == 2
                halves = 2 if variant == "two-backwards" else 1
                xs = local_slice(x, rank, world_size).chunk(halves)
                ys = local_slice(y, rank, world_size).chunk(halves)
                for i in range(halves):
                    loss = F.cross_entropy(model(xs[i]), ys[i]) / halves
                    if overflow and rank == 1 and i == halves - 1:
                        loss = loss * float("inf")
                    scaler.scale(loss).backward()
                torch_clip = variant == "clip" and averaged_in_grad(schedule, update)
                optimizer_clip = variant in ("optimizer-clip", "two-backwards")
                if variant == "unscale_" or optimizer_clip or torch_clip:
                    scaler.unscale_(optimizer)
                if torch_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
                if optimizer_clip:
                    norm = optimizer.clip_grad_norm_(0.3)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()

                ref_loss = F.cross_entropy(reference(x), y) * (float("inf") if overflow else 1.0)
                ref_scaler.scale(ref_loss).backward()
                ref_scaler.unscale_(ref_opt)
                if variant in ("clip", "optimizer-clip", "two-backwards"):
                    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)
                if optimizer_clip and not overflow:
                    assert ref_norm > 0.3, "the test must actually clip"
                    torch.testing.assert_close(norm, ref_norm, **TOL, msg=lambda m: f"step {step} norm: {m}")
                ref_scaler.step(ref_opt)
                ref_scaler.update()
                ref_opt.zero_grad()
                assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale(), ref_scaler.get_scale())
            model.sync()
            assert_same_parameters(model, reference, f"{variant}, bucket_mb={bucket_mb}")
    return each_schedule_and_bucket(rank, world_size, run)


@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_scaler_recipe_unscales_and_skips_together(world_size):
    assert_no_failures(run_workers(grad_scaler_worker, world_size, deadline=300))


# ---- item 3: torch.nn.utils.clip_grad_norm_ ---------------------------------------

def torch_clip_worker(rank, world_size):
    """wfbp: .grad holds the average after backward, so torch's clip gives
    DDP's norm and result. dear: step() refuses a .grad changed after backward."""
    def run(schedule, update, bucket_mb):
        model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, bucket_mb)
        for step, (x, y) in enumerate(batches(3, GLOBAL_BATCH)):
            local_loss(model, x, y, rank, world_size).backward()
            F.cross_entropy(reference(x), y).backward()
            if averaged_in_grad(schedule, update):
                for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}.grad: {m}")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)
            assert ref_norm > 0.3, "the test must actually clip"
            if not averaged_in_grad(schedule, update):
                with pytest.raises(RuntimeError, match="changed after backward.*optimizer.clip_grad_norm_"):
                    optimizer.step()
                return
            torch.testing.assert_close(norm, ref_norm, **TOL)
            optimizer.step()
            optimizer.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        model.sync()
        assert_same_parameters(model, reference, f"bucket_mb={bucket_mb}")
    return each_schedule_and_bucket(rank, world_size, run)


def test_torch_clip_grad_norm_matches_ddp_with_wfbp_and_is_refused_with_dear():
    assert_no_failures(run_workers(torch_clip_worker, 2))


# ---- skipping a step after backward -------------------------------------------------

def skip_worker(rank, world_size):
    """The loop that skips a step whose gradient norm is not finite, as under
    DDP: backward, the global norm, then zero_grad() and on to the next batch
    instead of step(). Rank 1's loss is inf at step 2 only, so every rank sees
    an inf norm there; the reference skips the same step. Each way of
    zeroing: optimizer.zero_grad() (set_to_none either way) and model.zero_grad().
    A step() right after such a zero_grad() has nothing to apply and says why.
    The update hook runs for the steps taken only (an EMA skips the step too)."""
    def run(schedule, update, bucket_mb):
        for zero in ("optimizer", "optimizer-keep", "model"):
            model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, bucket_mb)
            reported = []
            model.register_update_hook(lambda params: reported.extend(name for name, _ in params))
            for step, (x, y) in enumerate(batches(5, GLOBAL_BATCH)):
                bad = step == 2
                loss = local_loss(model, x, y, rank, world_size)
                (loss * float("inf") if bad and rank == 1 else loss).backward()
                norm = optimizer.clip_grad_norm_(1e6)
                ref_loss = F.cross_entropy(reference(x), y)
                (ref_loss * float("inf") if bad else ref_loss).backward()
                ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e6)
                assert torch.isfinite(norm) == torch.isfinite(ref_norm) == (not bad), (step, norm, ref_norm)
                if not torch.isfinite(norm):
                    if zero == "model":
                        model.zero_grad()
                    else:
                        optimizer.zero_grad(set_to_none=zero == "optimizer")
                    ref_opt.zero_grad()
                    if zero == "model":
                        with pytest.raises(RuntimeError, match="zero_grad\\(\\) between a backward and step\\(\\) skips"):
                            optimizer.step()
                    continue
                optimizer.step()
                optimizer.zero_grad()
                ref_opt.step()
                ref_opt.zero_grad()
            model.sync()
            assert_same_parameters(model, reference, f"{zero}, bucket_mb={bucket_mb}")
            trainable = sum(p.requires_grad for p in model.parameters())
            assert len(reported) == 4 * trainable, f"{zero}: {len(reported)} updates reported for 4 steps"
    return each_schedule_and_bucket(rank, world_size, run)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_grad_after_backward_skips_the_step_on_every_rank(world_size):
    assert_no_failures(run_workers(skip_worker, world_size, deadline=300))


def skip_with_scaler_worker(rank, world_size):
    """The same loop with a GradScaler that the user unscales: at the skipped
    step only rank 1's gradient is inf, which under dear only its .grad
    shows; scaler.update() must still back off the scale on every rank (as
    DDP's averaged .grad makes it), or the ranks would sum gradients scaled
    differently from then on."""
    def run(schedule, update, bucket_mb):
        model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, bucket_mb)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for step, (x, y) in enumerate(batches(5, GLOBAL_BATCH)):
            bad = step == 2
            loss = local_loss(model, x, y, rank, world_size)
            scaler.scale(loss * float("inf") if bad and rank == 1 else loss).backward()
            scaler.unscale_(optimizer)
            norm = optimizer.clip_grad_norm_(1e6)
            ref_loss = F.cross_entropy(reference(x), y)
            ref_scaler.scale(ref_loss * float("inf") if bad else ref_loss).backward()
            ref_scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e6)
            if bad:
                assert not torch.isfinite(norm), (step, norm)
                optimizer.zero_grad()
                ref_opt.zero_grad()
            else:
                scaler.step(optimizer)
                optimizer.zero_grad()
                ref_scaler.step(ref_opt)
                ref_opt.zero_grad()
            scaler.update()
            ref_scaler.update()
            assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale(), ref_scaler.get_scale())
        model.sync()
        assert_same_parameters(model, reference, f"bucket_mb={bucket_mb}")
    return each_schedule_and_bucket(rank, world_size, run)


def test_a_skipped_step_backs_the_grad_scaler_off_on_every_rank():
    assert_no_failures(run_workers(skip_with_scaler_worker, 2, deadline=300))


def lone_skip_worker(rank, world_size):
    """A loop mistake: rank 1 alone zeroes its gradients after backward at
    step 2 (its own verdict, not a global one) while the others step. Under
    dear its skipped step still issues the all-gathers theirs do, so nothing
    aborts and no reduce-scatter pairs with an all-gather: with update=sharded
    every rank ends with the same parameters (rank 1's shards missed one
    update); elsewhere the ranks that stepped agree, and rank 1 drifts from
    them as under DDP."""
    def run(schedule, update, bucket_mb):
        model, optimizer, _, _ = wrapped_pair(schedule, update, bucket_mb)
        for step, (x, y) in enumerate(batches(5, GLOBAL_BATCH)):
            local_loss(model, x, y, rank, world_size).backward()
            if step == 2 and rank == 1:
                optimizer.zero_grad()
                continue
            optimizer.step()
            optimizer.zero_grad()
        model.sync()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)
        agree = range(world_size) if (schedule, update) == ("dear", "sharded") else \
            [r for r in range(world_size) if r != 1]
        for r in agree:
            torch.testing.assert_close(everyone[r], everyone[agree[0]], rtol=0, atol=0,
                                       msg=lambda m: f"rank {r} against rank {agree[0]}, bucket_mb={bucket_mb}: {m}")
        assert torch.isfinite(flat).all()
    return each_schedule_and_bucket(rank, world_size, run)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_skips_alone_issues_the_collectives_of_the_others(world_size):
    assert_no_failures(run_workers(lone_skip_worker, world_size, deadline=300))


def rollback_after_skip_worker(rank, world_size):
    """A skipped step, then a rollback: every rank skips (zero_grad() after
    an inf norm, or GradScaler's inf) and writes the parameters back to a
    saved copy. The write must survive the next forward: under dear the skip
    issued all-gathers that write the parameters, and they must be done by
    the time the skip returns."""
    def run(schedule, update, bucket_mb):
        for how in ("zero_grad", "scaler"):
            model, optimizer, _, _ = wrapped_pair(schedule, update, bucket_mb)
            scaler = torch.amp.GradScaler("cpu", enabled=how == "scaler")
            first = next(model.parameters())
            for step, (x, y) in enumerate(batches(4, GLOBAL_BATCH)):
                if step == 1:
                    saved = first.detach().clone()
                loss = local_loss(model, x, y, rank, world_size)
                bad = step == 2
                scaler.scale(loss * float("inf") if bad else loss).backward()
                if bad and how == "zero_grad":
                    optimizer.zero_grad()
                else:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                if bad:
                    with torch.no_grad():
                        first.copy_(saved)
                    model(local_slice(x, rank, world_size))
                    torch.testing.assert_close(first.detach(), saved, rtol=0, atol=0,
                                               msg=lambda m: f"{how}, bucket_mb={bucket_mb}: the rollback was lost: {m}")
            model.sync()
    return each_schedule_and_bucket(rank, world_size, run)


def test_a_parameter_written_after_a_skipped_step_keeps_the_write():
    assert_no_failures(run_workers(rollback_after_skip_worker, 2, deadline=300))


# ---- item 4: EMA from the update hook ----------------------------------------------

def ema_worker(rank, world_size):
    def run(schedule, update, bucket_mb):
        model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, bucket_mb)
        decay = 0.5
        ema = {n: p.detach().clone() for n, p in model.named_parameters()}
        ref_ema = {n: p.detach().clone() for n, p in reference.named_parameters()}
        calls = []

        def update_ema(named_params):
            calls.append(len(named_params))
            for name, param in named_params:
                ema[name].lerp_(param.detach(), 1 - decay)

        model.register_update_hook(update_ema)
        for x, y in batches(4, GLOBAL_BATCH):
            step_on_slice(model, optimizer, x, y, rank, world_size)
            step_on_global_batch(reference, ref_opt, x, y)
            for name, param in reference.named_parameters():  # DDP's recipe: after every step
                ref_ema[name].lerp_(param.detach(), 1 - decay)
        model.sync()  # the last step's hooks run here
        assert sum(calls) == 4 * len(ema), calls
        torch.testing.assert_close(ema, ref_ema, **TOL)
    return each_schedule_and_bucket(rank, world_size, run)


def test_ema_from_update_hook_equals_ddp_ema():
    assert_no_failures(run_workers(ema_worker, 2))


# ---- two wrapped models: a GAN ------------------------------------------------------

def gan_worker(rank, world_size):
    """torch's DCGAN loop as written, both models wrapped: the
    discriminator's two backwards (real, then fake samples) before its step
    add up, as under DDP; the generator's backward reaches the
    discriminator's parameters, whose zero_grad() at the next iteration drops
    those gradients (a skipped step)."""
    bce = nn.BCEWithLogitsLoss()
    results = {}
    for name in ("ddp", "dear", "wfbp", "bytescheduler"):
        torch.manual_seed(0)
        generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
        discriminator = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        g_opt = torch.optim.Adam(generator.parameters(), lr=1e-2, betas=(0.5, 0.999))
        d_opt = torch.optim.Adam(discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999))
        if name == "ddp":
            generator = nn.parallel.DistributedDataParallel(generator)
            discriminator = nn.parallel.DistributedDataParallel(discriminator)
        else:
            generator, g_opt = dearcomm.wrap(generator, g_opt, schedule=name)
            discriminator, d_opt = dearcomm.wrap(discriminator, d_opt, schedule=name)
        data = torch.Generator().manual_seed(rank)
        for _ in range(5):
            real, noise = torch.randn(8, 6, generator=data), torch.randn(8, 4, generator=data)
            ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
            discriminator.zero_grad()
            fake = generator(noise)
            bce(discriminator(real), ones).backward()
            bce(discriminator(fake.detach()), zeros).backward()
            d_opt.step()
            generator.zero_grad()
            bce(discriminator(fake), ones).backward()
            g_opt.step()
        if name != "ddp":
            generator.sync()
            discriminator.sync()
        results[name] = [p.detach().clone() for m in (generator, discriminator) for p in m.parameters()]
    return results


def test_a_gan_with_both_models_wrapped_trains_like_ddp():
    for rank, r in enumerate(run_workers(gan_worker, 2, deadline=180)):
        for schedule in ("dear", "wfbp", "bytescheduler"):
            torch.testing.assert_close(r[schedule], r["ddp"], **TOL,
                                       msg=lambda m: f"rank {rank} {schedule}: {m}")


# ---- item 5: torch.compile -----------------------------------------------------------

def compile_worker(rank, world_size, backend):
    torch._dynamo.config.cache_size_limit = 64

    def run(schedule, update):
        model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, 0)
        compiled = torch.compile(model, backend=backend)
        for step, (x, y) in enumerate(batches(4, GLOBAL_BATCH)):
            step_on_slice(compiled, optimizer, x, y, rank, world_size)
            step_on_global_batch(reference, ref_opt, x, y)
            if step == 1:
                model.sync()
            if step == 2:
                with torch.no_grad():
                    compiled.eval()
                    torch.testing.assert_close(compiled(x[:2]), reference(x[:2]), **TOL)
                    compiled.train()
                model.state_dict()
        model.sync()
        assert_same_parameters(model, reference, f"compiled ({backend})")
    return each_schedule(rank, world_size, run)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_after_wrap_trains_correctly(backend):
    assert_no_failures(run_workers(compile_worker, 2, backend, deadline=600))


# ---- item 6: rank-0-only checkpoint and eval -----------------------------------------

def rank0_only_worker(rank, world_size):
    """The DDP idioms `if rank == 0: save / eval` then dist.barrier(), right
    after step(), with no sync() on the other ranks."""
    def run(schedule, update, bucket_mb):
        model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, bucket_mb)
        for step, (x, y) in enumerate(batches(3, GLOBAL_BATCH)):
            step_on_slice(model, optimizer, x, y, rank, world_size)
            step_on_global_batch(reference, ref_opt, x, y)
            if rank == 0:
                if step == 0:
                    buffer = io.BytesIO()
                    torch.save(model.state_dict(), buffer)
                    saved = torch.load(io.BytesIO(buffer.getvalue()))
                    torch.testing.assert_close(saved, dict(reference.state_dict()), **TOL)
                else:
                    with torch.no_grad():
                        model.eval()
                        torch.testing.assert_close(model(x), reference(x), **TOL)
                        model.train()
            dist.barrier()
        model.sync()
        assert_same_parameters(model, reference, f"bucket_mb={bucket_mb}")
    return each_schedule_and_bucket(rank, world_size, run)


def test_rank0_only_state_dict_and_eval_then_barrier_do_not_hang():
    assert_no_failures(run_workers(rank0_only_worker, 2, deadline=120))


# ---- item 9: a dropped model is freed --------------------------------------------------

def dropped_model_worker(rank, world_size):
    """Dropped right after step(), while its all-gathers are still in flight
    (rank 1 steps a second later): the model must wait for them before its
    buffers go, then be freed; the next model trains correctly."""
    import time

    def run(schedule, update):
        for explicit_close in (False, True):
            model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, 0)
            for step, (x, y) in enumerate(batches(2, GLOBAL_BATCH)):
                if step == 1 and rank == 1:
                    time.sleep(1.0)
                step_on_slice(model, optimizer, x, y, rank, world_size)
                step_on_global_batch(reference, ref_opt, x, y)
            expected = {n: p.detach().clone() for n, p in reference.named_parameters()}
            runtime, engine = model._dear, model._dear.engine
            refs = [weakref.ref(o) for o in (model, optimizer, runtime, engine)]
            if explicit_close:
                model.close()
                assert runtime.engine is None
                assert not any(m._forward_pre_hooks for m in model.modules())
                assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
                torch.testing.assert_close(dict(model.named_parameters()), expected, **TOL)
            del model, optimizer, runtime, engine
            gc.collect()
            alive = [r() for r in refs if r() is not None]
            assert not alive, f"close={explicit_close}: still alive: {[type(o).__name__ for o in alive]}"
        # The collectives of the next model are not disturbed by the dropped ones.
        model, optimizer, reference, ref_opt = wrapped_pair(schedule, update, 0)
        for x, y in batches(2, GLOBAL_BATCH):
            step_on_slice(model, optimizer, x, y, rank, world_size)
            step_on_global_batch(reference, ref_opt, x, y)
        model.sync()
        assert_same_parameters(model, reference, "a model wrapped after a dropped one")
    return each_schedule(rank, world_size, run)


def test_dropped_model_frees_runtime_and_engine():
    assert_no_failures(run_workers(dropped_model_worker, 2))


# ---- item 12: buffers, as DDP's broadcast_buffers --------------------------------------

class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def buffers_worker(rank, world_size):
    """Parameters and buffers equal torch DDP's, with the same broadcast_buffers."""
    def run(schedule, update):
        for broadcast in (True, False):
            torch.manual_seed(0)
            model = BatchNormNet()
            ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=broadcast)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0, schedule=schedule, update=update,
                                             broadcast_buffers=broadcast)
            g = torch.Generator().manual_seed(3)
            for _ in range(3):
                x = torch.randn(world_size * 4, 3, 6, 6, generator=g) * 2 + 1
                y = torch.randint(0, 3, (world_size * 4,), generator=g)
                for net, opt in ((model, optimizer), (ddp, ddp_opt)):
                    local_loss(net, x, y, rank, world_size).backward()
                    opt.step()
                    opt.zero_grad()
            model.sync()
            what = f"broadcast_buffers={broadcast}"
            if broadcast:  # the buffers DDP's next forward starts from; dearcomm broadcast them after its last one
                with torch.no_grad():
                    for buffer in ddp.module.buffers():
                        dist.broadcast(buffer, 0)
            assert_same_parameters(model, ddp.module, what)
            torch.testing.assert_close(dict(model.named_buffers()), dict(ddp.module.named_buffers()), **TOL,
                                       msg=lambda m: f"{what}: {m}")
    return each_schedule(rank, world_size, run)


def test_buffers_follow_ddp_broadcast_buffers():
    assert_no_failures(run_workers(buffers_worker, 2))


def engine_group_worker(rank, world_size):
    """Ranks 0 and 1 train two models on a group of their own while rank 2
    never calls dearcomm. The CPU engine sends over connections of its own,
    so the training group carries only what the loop sends (here a logging
    all-reduce of the loss after each step, and the buffers' broadcast):
    nothing there waits behind the all-gathers step() issued. Each model's
    engine has its own, kept when its buckets are laid out again; made by
    the training group's ranks alone, they leave c10d's groups as they
    were: a group every rank makes afterwards still connects."""
    failures = {}
    group = dist.new_group([0, 1])  # every rank takes part in making it, as torch asks
    if rank < 2:
        torch.manual_seed(0)
        models = []
        for schedule in ("dear", "deft"):
            model = BatchNormNet()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            models.append(dearcomm.wrap(model, optimizer, schedule=schedule, process_group=group))
        g = torch.Generator().manual_seed(rank)

        def train(model, optimizer, steps):
            for step in range(steps):
                x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                logged = torch.stack([loss.detach(), torch.tensor(float(rank))])
                dist.all_reduce(logged, group=group)  # the all-gathers are in flight
                if logged[1].item() != 1.0:
                    failures[f"step {step}"] = f"the loss all-reduce summed the ranks to {logged[1].item()}, not 1"
        for model, optimizer in models:
            train(model, optimizer, 3)
        engines = [model._dear._engine_group for model, _ in models]
        try:
            for engine in engines:
                assert engine is not None and engine is not group, "the engine sends over the training group"
                assert (engine.rank(), engine.size()) == (rank, 2), (engine.rank(), engine.size())
                assert engine not in dist.distributed_c10d._world.pg_map, "the engine's group is in c10d's registry"
            assert engines[0] is not engines[1], "two models' engines share connections"
            model, optimizer = models[0]
            model._dear.reconfigure(dataclasses.replace(model._dear.options, bucket_mb=0.0))
            train(model, optimizer, 2)
            assert model._dear._engine_group is engines[0], "laying out the buckets again made new connections"
            model.sync()
            running = [torch.zeros_like(model.bn.running_mean) for _ in range(2)]
            dist.all_gather(running, model.bn.running_mean, group=group)
            # each rank's batch moved its own statistics; the end of every training forward broadcast rank 0's
            assert torch.equal(running[0], running[1]), "the buffers' broadcast over the training group is missing"
        except AssertionError as e:
            failures["engine group"] = str(e)
        for model, _ in models:
            model.close()
    everyone = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=30))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    if total.item() != 3:
        failures["new group"] = f"a group of every rank made after training summed to {total.item()}"
    return failures


def test_the_cpu_engine_sends_over_a_group_of_its_own():
    assert_no_failures(run_workers(engine_group_worker, 3))


# ---- item 1: parameters read without calling their module -----------------------------

class ReadsChildWeights(nn.Module):
    """nn.MultiheadAttention reads out_proj's parameters without calling out_proj;
    this forward also reads a child's weight with F.linear and never calls it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(MixedNet.VOCAB, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True), num_layers=2)
        self.projection = nn.Linear(8, 8)
        self.head = nn.Linear(8, MixedNet.CLASSES)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.attention(x, x, x, need_weights=False)[0]
        x = self.encoder(x)
        x = torch.tanh(F.linear(x, self.projection.weight, self.projection.bias))
        return self.head(x.mean(1))


def child_weights_worker(rank, world_size):
    def run(schedule, update, bucket_mb):
        torch.manual_seed(0)
        model = ReadsChildWeights()
        reference = copy.deepcopy(model)
        # SGD: the key bias of attention gets a zero gradient up to rounding,
        # which Adam would blow up to lr-sized noise.
        optimizer, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=bucket_mb, schedule=schedule, update=update)
        for step, (x, y) in enumerate(batches(4, GLOBAL_BATCH)):
            loss = local_loss(model, x, y, rank, world_size)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ref_loss = F.cross_entropy(reference(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            # Each forward saw current parameters: the same loss as the reference's.
            torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"step {step} loss: {m}")
        model.sync()
        assert_same_parameters(model, reference, f"bucket_mb={bucket_mb}")
    return each_schedule_and_bucket(rank, world_size, run)


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_read_without_calling_their_module_are_current(world_size):
    assert_no_failures(run_workers(child_weights_worker, world_size))


def rank0_only_optimizer_state_worker(rank, world_size, after_another):
    """update='sharded': optimizer.state_dict() gathers every rank's shard, so
    the DDP idiom of calling it on rank 0 alone cannot work; it must fail fast
    with an error that says what to do, not wait out the collective timeout.
    after_another: an earlier wrapped optimizer's state_dict() ran on every
    rank first (as auto's change of update does), which once let the second's
    rendezvous pass at once and the gather wait out the group's timeout."""
    import time

    from dearcomm._update import sharded_state
    sharded_state.ARRIVAL_SECONDS = 3.0
    if after_another:
        model, optimizer, _, _ = wrapped_pair("dear", "sharded", 0)
        for x, y in batches(1, GLOBAL_BATCH):
            step_on_slice(model, optimizer, x, y, rank, world_size)
        optimizer.state_dict()
        model.close()
    model, optimizer, _, _ = wrapped_pair("dear", "sharded", 0)
    for x, y in batches(2, GLOBAL_BATCH):
        step_on_slice(model, optimizer, x, y, rank, world_size)
    started = time.monotonic()
    if rank == 0:
        with pytest.raises(RuntimeError, match="gathers every rank's shard.*Call it on every rank"):
            optimizer.state_dict()
        assert time.monotonic() - started < 20
    dist.barrier()
    state = optimizer.state_dict()  # every rank: works
    return len(state["state"])


@pytest.mark.parametrize("after_another", [False, True])
def test_rank0_only_sharded_optimizer_state_dict_fails_fast(after_another):
    counts = run_workers(rank0_only_optimizer_state_worker, 2, after_another, deadline=120)
    assert counts[0] == counts[1] > 0


def late_rank_optimizer_state_worker(rank, world_size):
    """Every rank calls optimizer.state_dict(), one of them late (a
    rank-0-only evaluation first): within wrap(timeout=) it works (the fixed
    arrival limit failed it, saying not every rank called it)."""
    import datetime
    import time

    from dearcomm._update import sharded_state
    sharded_state.ARRIVAL_SECONDS = 2.0
    model, optimizer, _, _ = wrapped_pair("dear", "sharded", 0, timeout=datetime.timedelta(seconds=20))
    for x, y in batches(2, GLOBAL_BATCH):
        step_on_slice(model, optimizer, x, y, rank, world_size)
    if rank == 0:
        time.sleep(5)
    return len(optimizer.state_dict()["state"])


def test_a_late_rank_at_the_sharded_optimizer_state_dict_within_wraps_timeout():
    counts = run_workers(late_rank_optimizer_state_worker, 2, deadline=120)
    assert counts[0] == counts[1] > 0


# ---- torch.profiler around some iterations ----------------------------------------

def profiler_worker(rank, world_size, schedule, update):
    """Profiles a few iterations of a normal loop (the last step's all-gathers,
    4 MiB buckets, are still in flight when the profiler stops), three times
    over, then keeps training and collects garbage: the process must survive,
    train as one process would, and the profile must show dearcomm's collectives."""
    import gc
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    reference = copy.deepcopy(model)
    optimizer, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=1.0, schedule=schedule, update=update)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(GLOBAL_BATCH, 512, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
            for _ in range(14)]
    names = set()
    for session in range(3):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for x, y in data[4 * session:4 * session + 4]:
                step_on_slice(model, optimizer, x, y, rank, world_size)
        names |= {event.name for event in prof.events()}
        del prof
        gc.collect()
    for x, y in data[12:]:
        step_on_slice(model, optimizer, x, y, rank, world_size)
    gc.collect()
    for x, y in data:
        step_on_global_batch(reference, ref_opt, x, y)
    model.sync()
    # AdamW over 14 steps of 0.5 M-element layers: sums in another order round apart by ~1e-4.
    torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()),
                               rtol=1e-4, atol=1e-5)
    return sorted(n for n in names if n.startswith("dearcomm::"))


@pytest.mark.parametrize("schedule, update", [("dear", "sharded"), ("dear", "replicated"),
                                              ("bytescheduler", "replicated")])
def test_profiling_some_iterations_keeps_training_and_shows_the_collectives(schedule, update):
    """Guards against c10d Works holding the profiler's records past the end
    of its session: an all-gather launched in step() and finished by the next
    forward, after the profiler stopped, ended its record on a gloo thread in
    freed profiler state, and the process crashed at the next garbage
    collection (glibc "free(): invalid size")."""
    for names in run_workers(profiler_worker, 2, schedule, update, deadline=240):
        reduction = "reduce_scatter" if schedule == "dear" else "all_reduce"
        assert any(n.startswith(f"dearcomm::{reduction}[bucket") for n in names), names
