"""Does applying gradients late cost convergence? Two small jobs trained to a
target loss with every gradient on time (wfbp) and with deft's delays:
steps and wall time to the target, on the same data in the same order.

    torchrun --nproc_per_node=2 benchmarks/deft_convergence.py --json out.json
    sudo .venv/bin/python benchmarks/netlab.py --ranks 2 --rate 1gbit -- benchmarks/deft_convergence.py

Jobs (generated, never downloaded):
  cnn  a two-layer conv net on 16x16 images of 10 classes: each class a fixed
       random template, every sample its template plus Gaussian noise.
       Target: held-out cross-entropy <= 0.1.
  gpt  a two-block causal transformer on a synthetic language: a first-order
       Markov chain over 32 tokens where each token is followed by one of 3
       others (fixed random probabilities), so the best possible loss is the
       chain's entropy rate H. Target: held-out loss <= H + 0.05 nats.
Runs:
  wfbp         every gradient applied in its own step (DDP's schedule)
  deft         schedule="deft" as a user runs it: its planner's delays
               (planned at the first forward for this link; possibly none)
  deft-input   the half of the parameters nearest the input one step late (what
               the planner delays where only the end of backward is exposed)
  deft-all     every bucket one step late: the most staleness max_delay=1 allows
Wall time counts training steps only (the held-out loss is read every
--eval-every steps, outside the clock). One table row per job and run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dearcomm  # noqa: E402

VOCAB, CONTEXT = 32, 32


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class TinyGPT(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


class Images:
    """10 classes of 16x16 images: template + noise."""

    def __init__(self, seed: int = 0, noise: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(10, 1, 16, 16, generator=g)
        self.noise = noise

    def batch(self, n: int, g: torch.Generator):
        labels = torch.randint(0, 10, (n,), generator=g)
        return self.templates[labels] + self.noise * torch.randn(n, 1, 16, 16, generator=g), labels


class MarkovLanguage:
    """A first-order Markov chain: each token has 3 successors."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.transitions = torch.zeros(VOCAB, VOCAB)
        for t in range(VOCAB):
            successors = torch.randperm(VOCAB, generator=g)[:3]
            self.transitions[t, successors] = torch.softmax(torch.randn(3, generator=g), 0)
        stationary = torch.full((VOCAB,), 1.0 / VOCAB)
        for _ in range(500):
            stationary = stationary @ self.transitions
        logs = torch.where(self.transitions > 0, self.transitions.log(), torch.zeros(()))
        self.entropy = float(-(stationary[:, None] * self.transitions * logs).sum())

    def batch(self, n: int, g: torch.Generator):
        tokens = torch.empty(n, CONTEXT + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
        for i in range(CONTEXT):
            tokens[:, i + 1] = torch.multinomial(self.transitions[tokens[:, i]], 1, generator=g).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]


def job(name: str):
    """(model, optimizer, data, loss, target, max_steps)."""
    torch.manual_seed(0)
    if name == "cnn":
        model = ConvNet()
        data = Images()
        return (model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), data,
                lambda out, y: F.cross_entropy(out, y), 0.1, 400)
    model = TinyGPT()
    data = MarkovLanguage()
    return (model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0), data,
            lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)), data.entropy + 0.05, 1500)


def run(name: str, schedule_run: str, args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, data, loss_fn, target, max_steps = job(name)
    max_steps = args.max_steps or max_steps
    options = dict(schedule="wfbp") if schedule_run == "wfbp" else dict(schedule="deft")
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # forward order in these models
    if schedule_run == "deft-all":
        options.update(delays={n: 1 for n in names}, bucket_mb=0.0)
    if schedule_run == "deft-input":
        options.update(delays={n: 1 for n in names[:len(names) // 2]}, bucket_mb=0.0)
    model, optimizer = dearcomm.wrap(model, optimizer, **options)
    held_out = data.batch(512, torch.Generator().manual_seed(10_000))
    g = torch.Generator().manual_seed(1)
    clock, curve, reached = 0.0, [], None
    for step in range(1, max_steps + 1):
        x, y = data.batch(args.batch * world, g)
        n = args.batch
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        optimizer.step()
        clock += time.perf_counter() - start
        if step % args.eval_every == 0:
            with torch.no_grad():  # every rank alike: the model is replicated
                value = float(loss_fn(model(held_out[0]), held_out[1]))
            curve.append((step, value))
            if reached is None and value <= target:
                reached = (step, clock)
                if not args.full_curve:
                    break
    clocks = [None] * world
    dist.all_gather_object(clocks, clock)
    delays = model._dear.options.delays or {}
    return dict(job=name, run=schedule_run, target=target, steps_to_target=reached[0] if reached else None,
                seconds_to_target=max(clocks) if reached else None, ms_per_step=1e3 * max(clocks) / step,
                final_loss=curve[-1][1] if curve else None, steps=step, curve=curve,
                delayed=f"{len(delays)} of {sum(1 for _ in model.parameters())} parameters",
                guard_fired_at=model._dear.delayed.switched_off_at)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="cnn,gpt")
    parser.add_argument("--runs", default="wfbp,deft,deft-input,deft-all")
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=0, help="0: the job's own limit")
    parser.add_argument("--full-curve", action="store_true", help="train to --max-steps past the target")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = [run(name, r, args) for name in args.jobs.split(",") for r in args.runs.split(",")]
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, batch {args.batch} per rank, held-out loss every "
              f"{args.eval_every} steps")
        print(f"{'job':<5} {'run':<9} {'target':>7} {'steps':>6} {'seconds':>8} {'ms/step':>8} {'final':>7}  "
              f"delayed")
        for r in rows:
            steps = r["steps_to_target"] if r["steps_to_target"] is not None else f">{r['steps']}"
            seconds = f"{r['seconds_to_target']:.2f}" if r["seconds_to_target"] is not None else "-"
            print(f"{r['job']:<5} {r['run']:<9} {r['target']:>7.3f} {steps:>6} {seconds:>8} {r['ms_per_step']:>8.1f} "
                  f"{r['final_loss']:>7.3f}  {r['delayed']}"
                  + (f", guard fired at step {r['guard_fired_at']}" if r["guard_fired_at"] else ""))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world_size=dist.get_world_size(), batch=args.batch, rows=rows), f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
