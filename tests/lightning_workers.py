"""Rank bodies for tests/test_integrations_parity.py: each rank runs
Lightning Trainers in-process, as under torchrun (Lightning's TorchElastic
environment finds the ranks and the process group already made)."""
import logging
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLIP = 0.05  # well under the gradient norms below: every step clips
MAX_EPOCHS = 2
TOL = dict(rtol=1e-5, atol=1e-6)
MIXED_TOL = dict(rtol=2e-3, atol=2e-4)  # autocast: bf16/fp16 rounding differs with the order of the sums


def as_torchrun_rank(rank, world_size):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and loggers
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def loader(seed, samples):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=g)
    y = torch.randn(samples, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def lightning_module(init_seed=0):
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(init_seed)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
            self.seen_by_validation = []  # parameters as validation_step first reads them (no forward yet)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                self.seen_by_validation.append(torch.cat([p.detach().flatten().clone() for p in self.parameters()]))
            x, y = batch
            self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Regression()


def fit(strategy, world_size, tmp, max_epochs=MAX_EPOCHS, init_seed=0, ckpt_path=None, every_epoch_to=None,
        **trainer_args):
    """Trains (saving a checkpoint after every epoch into `every_epoch_to`, and
    one after fit), then tests; returns the final state, what validation saw,
    the test loss and the checkpoint saved after fit."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = lightning_module(init_seed)
    args = dict(accumulate_grad_batches=2, gradient_clip_val=CLIP, enable_checkpointing=False)
    if every_epoch_to is not None:
        args.update(enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=every_epoch_to, filename="{epoch}", save_top_k=-1)])
    args.update(trainer_args)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=max_epochs,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=tmp, **args)
    samples = 16 * world_size  # 4 batches of 4 per rank: 2 optimizer steps per epoch
    trainer.fit(model, loader(1, samples), loader(2, 4 * world_size), ckpt_path=ckpt_path)
    assert type(model).__name__ == "Regression" and not hasattr(model, "_dear"), "the strategy left its wrapper"
    final = os.path.join(tmp, "after-fit.ckpt")
    trainer.save_checkpoint(final)  # every rank; rank 0 writes
    saved = torch.load(final, weights_only=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    test_loss = trainer.test(model, loader(3, 4 * world_size), verbose=False)[0]["test_loss"]
    return dict(state=state, seen=model.seen_by_validation, test_loss=test_loss, step=trainer.global_step,
                saved={"state_dict": saved["state_dict"], "optimizer": saved["optimizer_states"][0]["state"]})


def assert_same_run(run, reference, what, tol=TOL):
    assert run["step"] == reference["step"], f"{what}: {run['step']} steps, DDP {reference['step']}"
    torch.testing.assert_close(run["state"], reference["state"], **tol, msg=lambda m: f"{what}, final state: {m}")
    seen = reference["seen"][-len(run["seen"]):]  # a resumed run validates only after the epochs it trains
    torch.testing.assert_close(run["seen"], seen, **tol,
                               msg=lambda m: f"{what}, parameters as validation saw them: {m}")
    torch.testing.assert_close(run["test_loss"], reference["test_loss"], **tol, msg=lambda m: f"{what}, test: {m}")
    torch.testing.assert_close(run["saved"], reference["saved"], **tol,
                               msg=lambda m: f"{what}, checkpoint saved after fit: {m}")


def parity_worker(rank, world_size, tmp, saved_by, resumed_by, mixed):
    """Against Lightning's own DDP with the same Trainer: the default schedule;
    `saved_by`, whose checkpoint after the first epoch (ModelCheckpoint, while
    training) `resumed_by` resumes (other buckets, another seed); with
    `mixed`, also checkpoints moved between DDP and dearcomm both ways, and
    bf16-mixed and 16-mixed (GradScaler)."""
    as_torchrun_rank(rank, world_size)
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    from dearcomm.integrations.lightning import DearStrategy

    by_ddp, by_dear = os.path.join(tmp, "ddp"), os.path.join(tmp, "dear")
    reference = fit(DDPStrategy(), world_size, tmp, every_epoch_to=by_ddp)
    assert_same_run(fit(DearStrategy(), world_size, tmp), reference, "default schedule")
    assert_same_run(fit(DearStrategy(schedule=saved_by), world_size, tmp, every_epoch_to=by_dear), reference,
                    saved_by)
    first_epoch = os.path.join(by_dear, "epoch=0.ckpt")
    resumed = fit(DearStrategy(schedule=resumed_by, bucket_mb=0.0005), world_size, tmp, init_seed=1,
                  ckpt_path=first_epoch)
    assert_same_run(resumed, reference, f"saved by {saved_by} after epoch 1, resumed by {resumed_by}")
    if mixed:
        assert_same_run(fit(DDPStrategy(), world_size, tmp, init_seed=1, ckpt_path=first_epoch), reference,
                        f"saved by {saved_by}, resumed by Lightning's DDP")
        assert_same_run(fit("dear", world_size, tmp, init_seed=1, ckpt_path=os.path.join(by_ddp, "epoch=0.ckpt")),
                        reference, "saved by Lightning's DDP, resumed by strategy='dear'")
        for precision in ("bf16-mixed", "16-mixed"):
            def plugin():  # on CPU, Trainer(precision="16-mixed") would fall back to bf16
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if precision == "16-mixed" else None
                return [MixedPrecision(precision, "cpu", scaler)]
            run = fit("dear", world_size, tmp, plugins=plugin())
            assert_same_run(run, fit(DDPStrategy(), world_size, tmp, plugins=plugin()), precision, MIXED_TOL)
            assert not torch.equal(run["state"]["net.0.weight"], lightning_module(0).net[0].weight), \
                f"{precision}: no step was applied"


def errors_worker(rank, world_size, tmp):
    """Bad options fail at construction; what dearcomm cannot do fails with its reason."""
    import pytest

    from dearcomm.integrations.lightning import DearStrategy

    with pytest.raises(ValueError, match="^dearcomm: bucket_mb must be >= 0"):
        DearStrategy(bucket_mb=-1)
    with pytest.raises(ValueError, match="^dearcomm: unknown schedule 'ring'"):
        DearStrategy(schedule="ring")
    for options, named in ((dict(schedule="usbyte"), "schedule='usbyte' without its plan"),
                           (dict(bucket_mb="auto"), "bucket_mb='auto'")):
        with pytest.raises(ValueError, match=f"^dearcomm: DearStrategy cannot take {named}: these plan at the first"):
            DearStrategy(**options)
    as_torchrun_rank(rank, world_size)
    with pytest.raises(NotImplementedError, match="^dearcomm: DearStrategy clips by norm only"):
        fit(DearStrategy(), world_size, tmp, max_epochs=1, gradient_clip_algorithm="value")


def manual_and_averaging_worker(rank, world_size, tmp):
    """Against Lightning's DDP: manual optimization clipping with
    self.clip_gradients() (it clipped a copy of the optimizer and stepped
    unclipped), also with two manual_backward() calls before the step (each
    communicates; the gradients add up), and EMAWeightAveraging, which reads
    every parameter after each step (the ranks' averages parted)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
    from lightning.pytorch.strategies import DDPStrategy

    from dearcomm.integrations.lightning import DearStrategy

    as_torchrun_rank(rank, world_size)

    def manual_module(backwards=1):
        module = lightning_module()
        module.automatic_optimization = False

        def training_step(batch, batch_idx):
            optimizer = module.optimizers()
            for x, y in zip(*(t.chunk(backwards) for t in batch)):
                module.manual_backward(F.mse_loss(module(x), y) / backwards)
            module.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
        module.training_step = training_step
        return module

    def train(strategy, module, **args):
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=3, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             num_sanity_val_steps=0, default_root_dir=tmp, **args)
        trainer.fit(module, loader(1, 16 * world_size))
        return {k: v.clone() for k, v in module.state_dict().items()}

    averaging = {"EMAWeightAveraging": lambda: [EMAWeightAveraging(decay=0.5)],
                 "StochasticWeightAveraging": lambda: [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)]}
    cases = [("manual optimization, self.clip_gradients()", manual_module, lambda: None),
             ("manual optimization, two manual_backward() a step", lambda: manual_module(backwards=2), lambda: None)]
    cases += [(name, lightning_module, callbacks) for name, callbacks in averaging.items()]
    for what, make, callbacks in cases:
        def args():  # callbacks of their own for each Trainer
            return {} if callbacks() is None else dict(callbacks=callbacks(), gradient_clip_val=CLIP)
        reference = train(DDPStrategy(), make(), **args())
        torch.testing.assert_close(train(DearStrategy(), make(), **args()), reference, **TOL,
                                   msg=lambda m: f"{what}: {m}")


def failure_worker(rank, world_size, tmp):
    """One rank's training_step raises: that rank leaves fit() at once, and
    the other fails when it goes (its teardown gathered the optimizer's state,
    a collective the failed rank never joined: the group's timeout)."""
    import lightning.pytorch as pl

    from dearcomm.integrations.lightning import DearStrategy

    as_torchrun_rank(rank, world_size)
    module = lightning_module()
    plain_step = module.training_step

    def training_step(batch, batch_idx):
        if batch_idx == 2 and module.global_rank == 1:
            raise RuntimeError("a bug on rank 1")
        return plain_step(batch, batch_idx)
    module.training_step = training_step
    trainer = pl.Trainer(strategy=DearStrategy(), accelerator="cpu", devices=world_size, max_epochs=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, default_root_dir=tmp)
    try:
        trainer.fit(module, loader(1, 16 * world_size))
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        # Detached all the same (a retry in this process wraps it again), and the user's optimizer back.
        assert type(module).__name__ == "Regression" and not hasattr(module, "_dear"), type(module)
        assert not type(trainer.strategy.optimizers[0]).__module__.startswith("dearcomm"), trainer.strategy.optimizers
        return f"{type(e).__name__}: {e}"
    return None


def example_worker(rank, world_size):
    """examples/lightning_train.py as torchrun would start it on this rank."""
    from examples.lightning_train import main

    as_torchrun_rank(rank, world_size)  # a Trainer's teardown takes WORLD_SIZE out of the environment
    metrics = main(["--epochs", "1", "--devices", str(world_size)])
    assert metrics["val_acc"] > 0.9, f"the example did not learn: {metrics}"
