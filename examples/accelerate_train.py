"""Trains a small classifier with Hugging Face Accelerate, data-parallel with dearcomm.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --ddp
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16 \
        examples/accelerate_train.py --schedule wfbp

On CPU, ACCELERATE_USE_CPU=1 with --multi_gpu starts the processes
(`accelerate launch --cpu` starts one, or uses mpirun with a hostfile). On
GPUs, leave ACCELERATE_USE_CPU out (that path is written, not run on a GPU).

The change from an Accelerate script is one call:
``dear_accelerate.prepare(accelerator, model, optimizer, ...)`` where it said
``accelerator.prepare(model, optimizer, ...)``. The data are made here:
points around 8 centres, the class is the centre.
"""
import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dearcomm.integrations import accelerate as dear_accelerate

CLASSES = 8


def make_loader(samples: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (samples,), generator=g)
    points = centres[labels] + 0.7 * torch.randn(samples, 32, generator=g)
    return DataLoader(TensorDataset(points, labels), batch_size=32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp", action="store_true", help="Accelerate's own DDP instead of dearcomm")
    parser.add_argument("--schedule", default="dear", help="dearcomm's schedule: dear, wfbp or bytescheduler")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint", default=None, help="a directory: save_state() there after training")
    args = parser.parse_args(argv)

    accelerator = Accelerator(gradient_accumulation_steps=2)  # launch, device and mixed precision: accelerate launch's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_loader, val_loader = make_loader(4096, seed=1), make_loader(1024, seed=2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    if args.ddp:
        model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, val_loader, scheduler)
    else:
        model, optimizer, train_loader, val_loader, scheduler = dear_accelerate.prepare(
            accelerator, model, optimizer, train_loader, val_loader, scheduler, schedule=args.schedule)

    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            with accelerator.accumulate(model):  # the accumulating micro-batches run under no_sync()
                accelerator.backward(F.cross_entropy(model(x), y))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # dearcomm's clipping, for dearcomm's model
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = total = 0
        with torch.no_grad():  # an eval forward waits for the last step's all-gathers
            for x, y in val_loader:
                hits = accelerator.gather_for_metrics((model(x).argmax(1) == y).long())
                correct, total = correct + hits.sum().item(), total + hits.numel()
        accelerator.print(f"epoch {epoch}: val_acc {correct / total:.3f}")
    if args.checkpoint:
        accelerator.save_state(args.checkpoint)  # on every rank; rank 0 writes
    accelerator.print(f"{'ddp' if args.ddp else args.schedule}: {accelerator.num_processes} processes, "
                      f"val_acc {correct / total:.3f}")
    return correct / total


if __name__ == "__main__":
    main()
