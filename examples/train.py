"""Trains a small CNN data-parallel on CPU, with dearcomm or torch DDP.

    torchrun --nproc_per_node=2 examples/train.py                 # dearcomm, schedule=dear
    torchrun --nproc_per_node=2 examples/train.py --schedule ddp  # torch DistributedDataParallel
    torchrun --nproc_per_node=2 examples/train.py --compare       # DDP, then dearcomm, same seed

The data are made here: 16x16 gratings whose orientation is the class, with
noise; the network learns them in a few hundred steps.
"""
import argparse
import copy
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import dearcomm

CLASSES = 8


def make_dataset(samples: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (samples,), generator=g)
    angle = labels.float() * math.pi / CLASSES + 0.1 * torch.randn(samples, generator=g)
    freq = 0.8 + 0.4 * torch.rand(samples, generator=g)
    phase = 2 * math.pi * torch.rand(samples, generator=g)
    ys, xs = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    proj = xs * torch.cos(angle)[:, None, None] + ys * torch.sin(angle)[:, None, None]
    images = torch.sin(freq[:, None, None] * proj + phase[:, None, None])
    images = images + 0.5 * torch.randn(images.shape, generator=g)
    return TensorDataset(images.unsqueeze(1), labels)


class Net(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 16, 256), nn.LayerNorm(256), nn.ReLU(), nn.Linear(256, CLASSES))

    def forward(self, x):
        return self.classifier(self.features(x))


def train(args, schedule: str, log: bool):
    """Trains from the same seed; returns (iteration times, model, eval accuracy)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = Net(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    if schedule == "ddp":
        model = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    else:
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=args.bucket_mb,
                                         schedule=schedule, update=args.update, partition_mb=args.partition_mb)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    data = make_dataset(args.samples, seed=args.seed)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, drop_last=True)

    times, step, epoch = [], 0, 0
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            scheduler.step()
            times.append(time.perf_counter() - start)
            step += 1
            if log and rank == 0 and (step % args.log_every == 0 or step == args.steps):
                print(f"[{schedule}] step {step:4d}  loss {loss.item():.4f}  "
                      f"median iteration {1e3 * statistics.median(times[-args.log_every:]):.1f} ms", flush=True)
            if step == args.steps:
                break
        epoch += 1

    accuracy = evaluate(model, make_dataset(1024, seed=args.seed + 1))
    return times, model, accuracy


@torch.no_grad()
def evaluate(model, data: TensorDataset) -> float:
    model.eval()  # dearcomm finishes the last step's all-gathers here
    images, labels = data.tensors
    correct = (model(images).argmax(1) == labels).float().mean()
    model.train()
    return correct.item()


def parameters_of(model):
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", choices=[*dearcomm.SCHEDULES, "ddp"], default="dear")
    parser.add_argument("--update", choices=["sharded", "replicated"], default=None,
                        help="dearcomm's update (default: sharded for dear, replicated for the others)")
    parser.add_argument("--partition-mb", type=float, default=None,
                        help="split tensors larger than this into several buckets (default: the schedule's)")
    parser.add_argument("--compare", action="store_true", help="train with DDP, then with --schedule, and compare")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # torchrun's ranks share the cores
    rank = dist.get_rank()
    if rank == 0:
        print(f"world size {dist.get_world_size()}, dearcomm {dearcomm.build_info()}", flush=True)

    if not args.compare:
        times, _, accuracy = train(args, args.schedule, log=True)
        if rank == 0:
            print(f"[{args.schedule}] done: median iteration {1e3 * statistics.median(times):.1f} ms, "
                  f"eval accuracy {accuracy:.3f}")
    else:
        schedule = "dear" if args.schedule == "ddp" else args.schedule
        ddp_times, ddp_model, ddp_acc = train(args, "ddp", log=True)
        dear_times, dear_model, dear_acc = train(args, schedule, log=True)
        ddp_params, dear_params = parameters_of(ddp_model), parameters_of(dear_model)
        diff = max((ddp_params[k] - dear_params[k]).abs().max().item() for k in ddp_params)
        warm = max(1, len(ddp_times) // 10)  # the first iterations build buckets and warm caches
        ddp_med, dear_med = statistics.median(ddp_times[warm:]), statistics.median(dear_times[warm:])
        if rank == 0:
            print(f"\n{'run':<12}{'median ms':>10}{'eval acc':>10}")
            print(f"{'ddp':<12}{1e3 * ddp_med:>10.1f}{ddp_acc:>10.3f}")
            print(f"{schedule:<12}{1e3 * dear_med:>10.1f}{dear_acc:>10.3f}")
            print(f"{schedule}/ddp iteration time ratio: {dear_med / ddp_med:.3f}")
            print(f"largest parameter difference after {args.steps} steps: {diff:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
