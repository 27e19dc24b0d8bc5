"""Rank bodies for the Accelerate integration tests: each rank runs
Accelerate loops in-process, as `accelerate launch` starts them on CPU
(Accelerate finds the ranks in the environment and the process group
already made)."""
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLIP = 0.05  # well under the gradient norms below: every step clips
EPOCHS = 2
TOL = dict(rtol=1e-5, atol=1e-6)
MIXED_TOL = dict(rtol=2e-3, atol=2e-4)  # autocast: bf16 rounding differs with the order of the sums


def as_launched_rank(rank, world_size):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    warnings.filterwarnings("ignore")


def make_accelerator(mixed_precision):
    """A new Accelerator: one per run, so that save_state() saves only that run's objects."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state.get("_mixed_precision", mixed_precision) != mixed_precision:
        AcceleratorState._reset_state()  # another mixed precision in the same process; the process group stays
    return Accelerator(gradient_accumulation_steps=2, mixed_precision=mixed_precision)


def objects(world_size, init_seed):
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    samples = 16 * world_size  # 4 batches of 4 per rank: 2 optimizer steps per epoch
    data = TensorDataset(torch.randn(samples, 8, generator=g), torch.randn(samples, 4, generator=g))
    return model, optimizer, DataLoader(data, batch_size=4), scheduler


def train_epoch(accelerator, model, optimizer, loader, scheduler, norms):
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def run(world_size, options=None, mixed_precision="no", epochs=range(EPOCHS), init_seed=0, save_to=None,
        load_from=None):
    """The loop under Accelerate's DDP (options None) or dearcomm's prepare();
    returns the final parameters and the clipped norms."""
    from dearcomm.integrations import accelerate as dear_accelerate

    accelerator = make_accelerator(mixed_precision)
    made = objects(world_size, init_seed)
    if options is None:
        model, optimizer, loader, scheduler = accelerator.prepare(*made)
    else:
        model, optimizer, loader, scheduler = dear_accelerate.prepare(accelerator, *made, **options)
    if load_from is not None:
        accelerator.load_state(load_from)
    norms = []
    for _ in epochs:
        train_epoch(accelerator, model, optimizer, loader, scheduler, norms)
    if save_to is not None:
        accelerator.save_state(save_to)
    state = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return dict(state=state, norms=norms)


def assert_same_run(run, reference, what, tol=TOL):
    norms = reference["norms"][-len(run["norms"]):]  # a resumed run clips only in the steps it trains
    assert min(norms) > CLIP, f"{what}: the test must clip ({norms})"
    torch.testing.assert_close(run["norms"], norms, **tol, msg=lambda m: f"{what}, clipped norms: {m}")
    torch.testing.assert_close(run["state"], reference["state"], **tol, msg=lambda m: f"{what}, final state: {m}")


def parity_worker(rank, world_size, tmp, saved_by, resumed_by, mixed):
    """Against Accelerate's own DDP in the same loop: the default schedule
    uninterrupted; a run saved by one schedule after the first epoch and
    resumed by another (other buckets, another seed); with `mixed`, also bf16."""
    as_launched_rank(rank, world_size)
    reference = run(world_size)
    assert_same_run(run(world_size, {}), reference, "default schedule")
    checkpoint = os.path.join(tmp, "first-epoch")
    run(world_size, dict(schedule=saved_by), epochs=range(1), save_to=checkpoint)
    resumed = run(world_size, dict(schedule=resumed_by, bucket_mb=0.0005), epochs=range(1, EPOCHS), init_seed=1,
                  load_from=checkpoint)
    assert_same_run(resumed, reference, f"saved by {saved_by} after epoch 1, resumed by {resumed_by}")
    if mixed:
        assert_same_run(run(world_size, {}, "bf16"), run(world_size, None, "bf16"), "bf16", MIXED_TOL)


def errors_worker(rank, world_size, tmp):
    """A bad option fails before prepare() moves or wraps anything; clipping
    part of a dearcomm model fails with the reason."""
    import pytest

    from dearcomm.integrations import accelerate as dear_accelerate

    as_launched_rank(rank, world_size)
    model, optimizer, loader, scheduler = objects(world_size, 0)
    with pytest.raises(ValueError, match="^dearcomm: bucket_mb must be >= 0"):
        dear_accelerate.prepare(make_accelerator("no"), model, optimizer, bucket_mb=-1)
    assert not hasattr(model, "_dear"), "prepare() wrapped the model before validating its options"
    accelerator = make_accelerator("no")
    model, optimizer = dear_accelerate.prepare(accelerator, model, optimizer)
    with pytest.raises(ValueError, match="^dearcomm: accelerator.clip_grad_norm_ got some of a dearcomm model's"):
        accelerator.clip_grad_norm_(list(model.parameters())[:1], 1.0)
    with pytest.raises(TypeError, match="^dearcomm: unknown option bucket_cap_mb; dearcomm.wrap\\(\\)'s options are"):
        dear_accelerate.prepare(make_accelerator("no"), *objects(world_size, 0)[:2], bucket_cap_mb=4)
    # save_model() writes safetensors, which kept one parameter of each sharded bucket (the rest share its storage).
    model(torch.zeros(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    save_to = os.path.join(tmp, "save_model")
    accelerator.save_model(model, save_to)
    if rank == 0:
        from safetensors.torch import load_file
        saved = load_file(os.path.join(save_to, "model.safetensors"))
        want = {k: v.detach() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.testing.assert_close(saved, want, msg=lambda m: f"save_model() under the sharded update: {m}")
    accelerator.wait_for_everyone()


def ddp_kwargs_worker(rank, world_size):
    """Accelerate's DistributedDataParallelKwargs reach dearcomm as DDP would
    read them: an unused parameter trains with find_unused_parameters=True
    there, and a DDP hook with no counterpart is refused rather than ignored."""
    import pytest
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from dearcomm.integrations import accelerate as dear_accelerate

    as_launched_rank(rank, world_size)
    AcceleratorState._reset_state()
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])
    with pytest.raises(ValueError, match=r"^dearcomm: prepare\(\) replaces DDP, and "
                                         r"DistributedDataParallelKwargs\(comm_hook=...\) has no dearcomm counterpart"):
        dear_accelerate.prepare(accelerator, *objects(world_size, 0)[:2])
    AcceleratorState._reset_state()
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    class WithUnusedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.unused = objects(world_size, 0)[0], nn.Linear(4, 4)

        def forward(self, x):
            return self.net(x)
    model = WithUnusedHead()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, optimizer = dear_accelerate.prepare(accelerator, model, optimizer)
    for _ in range(2):  # without the kwargs: "got no gradient"
        accelerator.backward(F.mse_loss(model(torch.ones(4, 8)), torch.zeros(4, 4)))
        optimizer.step()
        optimizer.zero_grad()
    AcceleratorState._reset_state()


def example_worker(rank, world_size):
    """examples/accelerate_train.py as `accelerate launch` would start it on this rank."""
    from accelerate.state import AcceleratorState

    from examples.accelerate_train import main

    as_launched_rank(rank, world_size)
    AcceleratorState._reset_state()  # the example makes its own Accelerator, with the launcher's settings
    accuracy = main(["--epochs", "1"])
    assert accuracy > 0.9, f"the example did not learn: {accuracy}"
