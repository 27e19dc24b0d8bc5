"""Trains a small classifier with Lightning's Trainer, data-parallel with dearcomm.

    python examples/lightning_train.py                      # Lightning starts 2 CPU processes
    python examples/lightning_train.py --strategy ddp       # the same with Lightning's DDP
    python examples/lightning_train.py --schedule wfbp --devices 3
    torchrun --nproc_per_node=2 examples/lightning_train.py # or let torchrun start them

The change from a DDP script is the strategy: ``strategy=DearStrategy()``
where it said ``strategy="ddp"``. The data are made here: points around 8
centres, the class is the centre.
"""
import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dearcomm.integrations.lightning import DearStrategy

CLASSES = 8


def make_loader(samples: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (samples,), generator=g)
    points = centres[labels] + 0.7 * torch.randn(samples, 32, generator=g)
    return DataLoader(TensorDataset(points, labels), batch_size=32)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("dear", "ddp"), default="dear")
    parser.add_argument("--schedule", default="dear", help="dearcomm's schedule: dear, wfbp or bytescheduler")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu (one process per GPU)")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed (GPU)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Classifier()
    trainer = L.Trainer(
        strategy=DearStrategy(schedule=args.schedule) if args.strategy == "dear" else "ddp",
        accelerator=args.accelerator, devices=args.devices, precision=args.precision, max_epochs=args.epochs,
        accumulate_grad_batches=2, gradient_clip_val=1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, make_loader(4096, seed=1), make_loader(1024, seed=2))
    metrics = trainer.callback_metrics
    if trainer.is_global_zero:
        label = f"dear (schedule={args.schedule})" if args.strategy == "dear" else args.strategy
        print(f"{label}: {trainer.world_size} processes, {trainer.global_step} steps, "
              f"val_loss {metrics['val_loss']:.3f}, val_acc {metrics['val_acc']:.3f}")
    return metrics


if __name__ == "__main__":
    main()
