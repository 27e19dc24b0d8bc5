"""Synchronous pipeline planning: the planner against GPipe, 1F1B, PipeDream
and DAPPLE plans on the shared profiles (simulated), the planner's distance to
the brute-force optimum, and (under netlab) the runtime's measured iteration
time against the simulator's prediction.

    python benchmarks/pipeline_bench.py plans [--quick]          # tables + plots
    python benchmarks/pipeline_bench.py optimality               # worst planner / brute-force ratio
    sudo python benchmarks/pipeline_bench.py netlab --rates 200mbit,200mbit,50mbit   # measured vs predicted

Outputs go to --out (default results/): pipeline-plans.txt/.json, one bar
chart per topology preset and a timeline picture; docs/benchmarks.md quotes them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dearcomm.pipeline import (PRESETS, all_plans, coarsen, draw_timeline, load_shared_profile,  # noqa: E402
                               preset, simulate)

MODELS = {"VGG-16": "pipedream/vgg16", "ResNet-50": "pipedream/resnet50", "BERT-large": "dapple/bert-24-pbs-6",
          "GNMT": "pipedream/gnmt"}
NAMES = ("planner", "gpipe", "1f1b", "pipedream", "dapple")


def cmd_plans(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    devices = [4, 8] if args.quick else [4, 8, 16]
    rows, lines = [], []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    emit(f"# iteration time (ms, simulated), {args.microbatches} micro-batches, profiles coarsened to "
         f"{args.blocks} blocks")
    for pre in PRESETS:
        emit(f"\n## {pre}")
        emit(f"{'model':<11} {'dev':>3} " + " ".join(f"{n:>10}" for n in NAMES) +
             f" {'best base':>10} {'speedup':>8} {'plan s':>7}  planner's plan")
        for label, key in MODELS.items():
            profile = coarsen(load_shared_profile(key), args.blocks)
            for n in devices:
                topo = preset(pre, n)
                t0 = time.perf_counter()
                plans = all_plans(profile, topo, args.microbatches)
                seconds = time.perf_counter() - t0
                times = {k: plans[k].predicted_ms for k in NAMES}
                base = min((times[k], k) for k in NAMES[1:])
                speedup = base[0] / times["planner"]
                emit(f"{label:<11} {n:>3} " + " ".join(f"{times[k]:>10.1f}" for k in NAMES) +
                     f" {base[1]:>10} {speedup:>7.2f}x {seconds:>7.1f}  {plans['planner'].describe().split(': ', 1)[1]}")
                rows.append(dict(preset=pre, model=label, profile=key, devices=n, times=times, best_baseline=base[1],
                                 speedup=speedup, plans={k: p.describe() for k, p in plans.items()}))
                if pre == PRESETS[0] and label == "BERT-large" and n == 8:
                    draw_timeline(os.path.join(args.out, "pipeline-timeline-bert-8.png"),
                                  {k: simulate(plans[k], profile, topo) for k in ("planner", "dapple", "1f1b")},
                                  f"BERT-large, 8 devices, {pre}, {args.microbatches} micro-batches (simulated)")
    speedups = [r["speedup"] for r in rows]
    emit(f"\nplanner vs the best baseline of each case: min {min(speedups):.2f}x, "
         f"geomean {_geomean(speedups):.2f}x, max {max(speedups):.2f}x over {len(rows)} cases")
    with open(os.path.join(args.out, "pipeline-plans.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "pipeline-plans.json"), "w") as f:
        json.dump(dict(microbatches=args.microbatches, blocks=args.blocks, rows=rows), f, indent=1)
    _plot(rows, devices, args.out)
    return 0


def _geomean(xs) -> float:
    import math
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _plot(rows, devices, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"planner": "#C44E52", "gpipe": "#8FB3DE", "1f1b": "#4C72B0", "pipedream": "#55A868",
              "dapple": "#DD8452"}
    for pre in PRESETS:
        mine = [r for r in rows if r["preset"] == pre]
        fig, axes = plt.subplots(1, len(MODELS), figsize=(4 * len(MODELS), 3.4), squeeze=False)
        for ax, label in zip(axes[0], MODELS):
            rs = [r for r in mine if r["model"] == label]
            width = 0.8 / len(NAMES)
            for i, name in enumerate(NAMES):
                ax.bar([x + i * width for x in range(len(rs))], [r["times"][name] for r in rs], width,
                       label=name, color=colors[name])
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rs))], [f"{r['devices']} dev" for r in rs])
            ax.set_title(label, fontsize=10)
            ax.set_ylabel("iteration (ms)")
            ax.grid(axis="y", alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"simulated iteration time, preset {pre}")
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"pipeline-plans-{pre}.png"), dpi=110)
        plt.close(fig)


def cmd_optimality(args) -> int:
    from dearcomm.pipeline import brute_force, plan_pipeline
    from tests.pipeline_cases import random_profile, topologies
    ratios = []
    print(f"{'layers':>6} {'dev':>3} {'M':>3} {'seed':>4} {'topology':<14} {'brute ms':>9} {'planner ms':>10} {'ratio':>7}")
    for L, D, M in [(4, 2, 4), (6, 3, 4), (5, 4, 3), (6, 4, 6), (8, 4, 4), (8, 4, 8)]:
        for seed in range(args.seeds):
            profile = random_profile(L, seed + 10 * L)
            for topo in topologies(D):
                best = brute_force(profile, topo, M)
                plan = plan_pipeline(profile, topo, M)
                ratios.append(plan.predicted_ms / best.predicted_ms)
                print(f"{L:>6} {D:>3} {M:>3} {seed:>4} {topo.name:<14} {best.predicted_ms:>9.1f} "
                      f"{plan.predicted_ms:>10.1f} {ratios[-1]:>7.4f}", flush=True)
    print(f"\nplanner / brute force over {len(ratios)} cases: worst {max(ratios):.4f}, "
          f"mean {sum(ratios) / len(ratios):.4f}, optimal in {sum(r < 1 + 1e-9 for r in ratios)}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plans", help="planner vs baselines on the shared profiles (simulated)")
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--blocks", type=int, default=24, help="coarsen every profile to at most this many blocks")
    p.add_argument("--quick", action="store_true", help="4 and 8 devices only")
    p.add_argument("--out", default="results")
    p.set_defaults(fn=cmd_plans)
    o = sub.add_parser("optimality", help="planner vs brute force on small random cases")
    o.add_argument("--seeds", type=int, default=2)
    o.set_defaults(fn=cmd_optimality)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
