"""What bytescheduler's link model agrees on, and the issue order it gives.

Run under netlab (root), one bytescheduler model; rank 0 prints, per
iteration, the bytes the link was taken to drain before each tick of that
backward (engine.link_model) and the order in which the previous iteration's
all-reduces were launched:

    sudo .venv/bin/python benchmarks/netlab.py --ranks 2 --rate 1gbit -- \\
        benchmarks/link_model_probe.py --model mlp --partition-mb 4 --credit-mb 8 --batch 256
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MODELS  # noqa: E402

import dearcomm  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="mlp")
    parser.add_argument("--batch", type=int, default=256, help="per rank")
    parser.add_argument("--partition-mb", type=float, default=4.0)
    parser.add_argument("--credit-mb", type=float, default=8.0)
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS[args.model]()
    x, y = model.batch(args.batch, torch.Generator().manual_seed(dist.get_rank()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = dearcomm.wrap(model, optimizer, schedule="bytescheduler",
                                     partition_mb=args.partition_mb, credit_mb=args.credit_mb)
    for it in range(args.iters):
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        engine = model._dear.engine
        engine.set_tracing(True)
        optimizer.step()
        if dist.get_rank() == 0:
            drained = [round(d / 2**20, 2) for d in engine.link_model]
            launched = [e["bucket"] for e in sorted(engine.take_trace(), key=lambda e: e["launched_ns"])]
            print(f"iteration {it}: {(time.perf_counter() - start) * 1e3:.0f} ms; "
                  f"MiB drained before each tick: {drained or 'no model yet'}")
            print(f"    previous iteration's all-reduces, in launch order: {launched}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
