"""One rank of a short dearcomm job that trains a few steps and exits, for
tests/test_exit.py. Launched like torchrun does (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment); all that matters is its exit code.

    python tests/exit_worker.py --schedule wfbp [--update replicated] [--steps 3] [--sync] [--destroy] [--profile]
                                [--ddp] [--scaler] [--drop]
"""
import argparse
import copy
import datetime
import gc

import torch
import torch.distributed as dist
from torch import nn

import dearcomm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=list(dearcomm.SCHEDULES), default="dear")
    parser.add_argument("--update", choices=["sharded", "replicated"], default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sync", action="store_true", help="model.sync() before exiting")
    parser.add_argument("--destroy", action="store_true", help="dist.destroy_process_group() before exiting")
    parser.add_argument("--profile", action="store_true",
                        help="wider layers, and torch.profiler sessions that end with all-gathers in flight")
    parser.add_argument("--ddp", action="store_true", help="train a torch DDP copy beside it, each step after dearcomm's")
    parser.add_argument("--scaler", action="store_true", help="torch.amp.GradScaler('cpu') on both")
    parser.add_argument("--drop", action="store_true", help="del the model and optimizer, and collect, before exiting")
    parser.add_argument("--profile-in-step", action="store_true",
                        help="no training: dearcomm.profile(group=) of a small model on every rank, then exit")
    parser.add_argument("--compare", action="store_true",
                        help="a user's first comparison script instead: a small MLP wrapped with --schedule beside "
                             "torch DDP, two GradScaler steps each, sync(), print the largest difference")
    args = parser.parse_args()
    if args.compare:
        compare(args.schedule, args.update)
        return
    if args.profile_in_step:
        profile_in_step(args.destroy)
        return

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Many small tensors and one bucket per tensor: many collectives in flight
    # at the end of the last step, the moment the process starts to exit.
    width = 1024 if args.profile else 32
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(width, width), nn.Tanh())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=1.0 if args.profile else 0,
                                     schedule=args.schedule, update=args.update)

    scaler = torch.amp.GradScaler("cpu", enabled=args.scaler)
    ddp = ddp_optimizer = ddp_scaler = None
    if args.ddp:
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        ddp_scaler = torch.amp.GradScaler("cpu", enabled=args.scaler)

    def train(net, opt, scale, x):
        opt.zero_grad()
        scale.scale(net(x).square().mean()).backward()
        scale.step(opt)
        scale.update()

    def step():
        x = torch.randn(8, width)
        train(model, optimizer, scaler, x)
        if ddp is not None:
            train(ddp, ddp_optimizer, ddp_scaler, x)

    for _ in range(args.steps):
        step()
    if args.profile:
        # Each session ends right after a step(): its all-gathers finish after
        # the profiler stopped (the Works must not hold its records).
        for _ in range(3):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(4):
                    step()
            model.sync()  # the Works end after the session: their records are the profiler's no more
            del prof
            gc.collect()
        step()
    if args.sync:
        model.sync()
    if args.drop:
        del model, optimizer
        gc.collect()
    if args.destroy:
        dist.destroy_process_group()
    # and exit straight away: no sleep, no barrier


def compare(schedule, update) -> None:
    """A user's first comparison script, which aborted at exit under torchrun
    in 8 of 100 runs before dearcomm/_exit.py (torch DDP alone did too): it
    ends within milliseconds of DDP's last backward, with no
    destroy_process_group(). scripts/exit_stress.sh runs it many times."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(net))
    model, optimizer = dearcomm.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), schedule=schedule, update=update)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler, ddp_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for _ in range(2):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        for m, opt, scale in ((model, optimizer, scaler), (ddp, ddp_optimizer, ddp_scaler)):
            opt.zero_grad()
            scale.scale(nn.functional.mse_loss(m(x), y)).backward()
            scale.step(opt)
            scale.update()
    model.sync()
    print(dist.get_rank(), max((a - b).abs().max().item() for a, b in zip(model.parameters(), ddp.parameters())))


def profile_in_step(destroy: bool) -> None:
    """The ranks profiled in step (dearcomm.profile(group=), as a script
    comparing its predictions does) and nothing else: its meetings are torch
    collectives, launched by the profiling thread: under torchrun it aborted
    at exit in 4 of 30 runs before dearcomm/_lockstep.py installed the exit
    handler (scripts/exit_stress.sh 30 --profile-in-step)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    dearcomm.profile(model, torch.randn(16, 64), torch.optim.AdamW(model.parameters()), iterations=3,
                     group=dist.group.WORLD)
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
