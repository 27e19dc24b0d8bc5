"""What the ranks' vote on skipping a step costs on a CPU: one all-reduce
of world-size int32 per step on the training group, issued at step() and
read at the next forward (dearcomm/_skip_votes.py). Each step here is 5 ms
of sleep standing in for compute; the vote's cost is the CPU and wall per
step beyond the same loop without it, per rank, over 3 rounds.

    .venv/bin/torchrun --nproc_per_node=4 benchmarks/skip_vote_cost.py
"""
import argparse
import time

import torch
import torch.distributed as dist


def per_step(vote: bool, steps: int, world: int):
    """(CPU ms, wall ms) per step of the loop, with or without the vote."""
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        if vote:
            work = dist.all_reduce(torch.zeros(world, dtype=torch.int32), async_op=True)
        time.sleep(0.005)  # the iteration's compute
        if vote:
            work.wait()
    return (time.process_time() - cpu) / steps * 1e3, (time.perf_counter() - wall) / steps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    extra = []
    for _ in range(args.rounds):
        (c0, w0), (c1, w1) = per_step(False, args.steps, world), per_step(True, args.steps, world)
        extra.append((c1 - c0, w1 - w0))
    everyone = [None] * world
    dist.all_gather_object(everyone, extra)
    if dist.get_rank() == 0:
        print(f"# {world} ranks: the vote's extra CPU / wall per step (ms), each round")
        for rank, rounds in enumerate(everyone):
            print(f"rank {rank}: " + "  ".join(f"{c:.3f}/{w:.3f}" for c, w in rounds))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
