"""What the ranks' vote on skipping a step costs on a CPU: one all-reduce
of world-size int32 per step on the training group, issued as step()
begins and read at its end (dearcomm/_skip_votes.py). Each step here is 5 ms
of sleep standing in for compute, --gap-ms of it between the vote's issue
and its read (the update; 0: a blocking round trip, as under bytescheduler,
whose step() updates nothing); the vote's cost is the CPU and wall per step
beyond the same loop without it, per rank, over 3 rounds.

    .venv/bin/torchrun --nproc_per_node=4 benchmarks/skip_vote_cost.py
"""
import argparse
import time

import torch
import torch.distributed as dist


def per_step(vote: bool, steps: int, world: int, gap_s: float):
    """(CPU ms, wall ms) per step of the loop, with or without the vote."""
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        if vote:
            work = dist.all_reduce(torch.zeros(world, dtype=torch.int32), async_op=True)
        time.sleep(gap_s)  # the update, between the vote's issue and its read
        if vote:
            work.wait()
        time.sleep(0.005 - gap_s)  # the rest of the iteration
    return (time.process_time() - cpu) / steps * 1e3, (time.perf_counter() - wall) / steps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="the update between issue and read, 0 to 5")
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    if not 0 <= args.gap_ms <= 5:
        parser.error("--gap-ms must be between 0 and 5")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    extra = []
    for _ in range(args.rounds):
        (c0, w0), (c1, w1) = (per_step(vote, args.steps, world, args.gap_ms / 1e3) for vote in (False, True))
        extra.append((c1 - c0, w1 - w0))
    everyone = [None] * world
    dist.all_gather_object(everyone, extra)
    if dist.get_rank() == 0:
        print(f"# {world} ranks, {args.gap_ms:g} ms between issue and read: the vote's extra CPU / wall per step "
              "(ms), each round")
        for rank, rounds in enumerate(everyone):
            print(f"rank {rank}: " + "  ".join(f"{c:.3f}/{w:.3f}" for c, w in rounds))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
