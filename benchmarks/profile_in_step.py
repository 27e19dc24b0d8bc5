"""What a profile for predicting training should measure, against training
itself: dearcomm.profile() of each rank alone (rank 0's, as one process
would), dearcomm.profile(group=) of the ranks in step (each iteration the
slowest rank's), and the forward and optimizer step of torch DDP training the
same model (no communication in either phase; the slowest rank's median).

    .venv/bin/torchrun --nproc_per_node=2 benchmarks/profile_in_step.py --model widein --batch 128

Rounds alternate the three, so that the machine's drift falls on all alike.
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import init, model_rounds_parser, slowest, write_json  # noqa: E402
from models import MODELS, fresh  # noqa: E402
from train_bench import PHASES, iteration  # noqa: E402

import dearcomm  # noqa: E402


def main():
    args = model_rounds_parser(__doc__, MODELS, model="widein", batch=128, rounds=6, iters=5).parse_args()
    init("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    alone, in_step = fresh(args.model), fresh(args.model)
    ddp = DistributedDataParallel(fresh(args.model))
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (alone, in_step, ddp)}
    x, y = alone.batch(args.batch, torch.Generator().manual_seed(rank))
    loss_fn = lambda out, batch: F.cross_entropy(out, batch[1])  # noqa: E731
    profiles = {"alone": [], "in step": []}
    phases = {}  # train_bench's phases of DDP's iterations: forward+loss, backward, zero_grad+step
    for _ in range(2):
        iteration(ddp, optimizers[ddp], x, y)
    for _ in range(args.rounds):
        dist.barrier()
        profiles["alone"].append(dearcomm.profile(alone, (x, y), optimizers[alone], loss_fn=loss_fn,
                                                  iterations=args.iters))
        dist.barrier()
        profiles["in step"].append(dearcomm.profile(in_step, (x, y), optimizers[in_step], loss_fn=loss_fn,
                                                    iterations=args.iters, group=dist.group.WORLD))
        dist.barrier()
        for _ in range(args.iters):
            iteration(ddp, optimizers[ddp], x, y, phases=phases)
    rows = {}
    for name, ps in profiles.items():
        p = dearcomm.TrainingProfile.median_of(ps)
        rows[f"profile, {name}" + (" (rank 0's)" if name == "alone" else " (slowest rank)")] = dict(
            forward=p.forward_ms, backward=p.backward_ms, step=p.step_ms)
    rows["DDP training (slowest rank)"] = {k: 1e3 * slowest(statistics.median(phases[k])) for k in PHASES}
    if rank == 0:
        print(f"# {args.model}, batch {args.batch}/rank, {world} ranks, {torch.get_num_threads()} thread(s)/rank, "
              f"medians of {args.rounds} rounds x {args.iters} iterations")
        print(f"{'':32}{'forward':>9}{'backward':>10}{'step':>8}   (ms; DDP's backward includes its all-reduce)")
        for name, r in rows.items():
            print(f"{name:32}{r['forward']:>9.1f}{r['backward']:>10.1f}{r['step']:>8.1f}")
        ddp_row = rows["DDP training (slowest rank)"]
        for name in list(rows)[:2]:
            print(f"DDP / {name}: forward {ddp_row['forward'] / rows[name]['forward']:.3f}x, "
                  f"step {ddp_row['step'] / rows[name]['step']:.3f}x")
    write_json(args.json, dict(model=args.model, batch=args.batch, world_size=world, rows=rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
