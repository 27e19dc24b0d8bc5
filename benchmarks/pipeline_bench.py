"""Synchronous pipeline planning: the planner against GPipe, 1F1B, PipeDream
and DAPPLE plans on the packaged profiles (simulated, with and without a
memory limit), the planner's distance to the exhaustive optimum, and (under netlab) the runtime's measured iteration
time against the simulator's prediction.

    python benchmarks/pipeline_bench.py plans [--quick] [--memory-gb 16]   # tables + plots
    python benchmarks/pipeline_bench.py optimality               # planner / exhaustive optimum, 48 cases
    sudo python benchmarks/pipeline_bench.py netlab --rates 200mbit,200mbit,50mbit   # measured vs predicted
    sudo python benchmarks/pipeline_bench.py netlab --transfer-cpu 0,8,0.2,6.8 --host-cores 2  # + the CPU model
    python benchmarks/pipeline_bench.py netlab-summary run1/*.json run2/*.json ...   # medians over runs

Outputs go to --out (default results/): pipeline-plans.txt/.json, one bar
chart per topology preset and a timeline picture; docs/benchmarks.md quotes them.
"""
from __future__ import annotations

import argparse
import dataclasses
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

    memory = f", {args.memory_gb:g} GB per device (Adam; 'oom': the plan does not fit)" if args.memory_gb else ""
    emit(f"# iteration time (ms, simulated), {args.microbatches} micro-batches, profiles coarsened to "
         f"{args.blocks} blocks{memory}")
    for pre in PRESETS:
        emit(f"\n## {pre}")
        emit(f"{'model':<11} {'dev':>3} " + " ".join(f"{n:>10}" for n in NAMES) +
             f" {'best base':>10} {'speedup':>8} {'plan s':>7}  planner's plan")
        for label, key in MODELS.items():
            profile = coarsen(load_shared_profile(key), args.blocks)
            for n in devices:
                topo = preset(pre, n)
                if args.memory_gb:
                    topo = topo.with_memory(args.memory_gb * 1e9)
                t0 = time.perf_counter()
                try:
                    plans = all_plans(profile, topo, args.microbatches)
                except ValueError as e:  # nothing fits
                    emit(f"{label:<11} {n:>3} {e}")
                    continue
                seconds = time.perf_counter() - t0
                times = {k: plans[k].predicted_ms if _fits(plans[k], profile, topo) else float("inf") for k in NAMES}
                base = min((times[k], k) for k in NAMES[1:])
                if base[0] == float("inf"):
                    base = (base[0], "none fits")
                speedup = base[0] / times["planner"]
                gain = f"{speedup:>7.2f}x" if speedup < float("inf") else f"{'-':>8}"
                emit(f"{label:<11} {n:>3} " + " ".join(f"{times[k]:>10.1f}" if times[k] < float("inf") else
                                                        f"{'oom':>10}" for k in NAMES) +
                     f" {base[1]:>10} {gain} {seconds:>7.1f}  {plans['planner'].describe().split(': ', 1)[1]}")
                rows.append(dict(preset=pre, model=label, profile=key, devices=n, times=times, best_baseline=base[1],
                                 plan_s=seconds,
                                 speedup=speedup, plans={k: p.describe() for k, p in plans.items()}))
                if pre == PRESETS[0] and label == "BERT-large" and n == 8 and not args.memory_gb:
                    draw_timeline(os.path.join(args.out, "pipeline-timeline-bert-8.png"),
                                  {k: simulate(plans[k], profile, topo) for k in ("planner", "dapple", "1f1b")},
                                  f"BERT-large, 8 devices, {pre}, {args.microbatches} micro-batches (simulated)")
    _summary(rows, emit)
    stem = "pipeline-plans" + (f"-{args.memory_gb:g}gb" if args.memory_gb else "")
    with open(os.path.join(args.out, f"{stem}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(dict(microbatches=args.microbatches, blocks=args.blocks, memory_gb=args.memory_gb, rows=rows), f,
                  indent=1)
    if not args.memory_gb:
        _plot(rows, devices, args.out)
    return 0


def _summary(rows, emit) -> None:
    """The table's last lines; rows may be none (a limit that nothing fits)."""
    if not rows:
        emit("")
        emit("no plan fits in any case")
        return
    speedups = [r["speedup"] for r in rows if r["speedup"] < float("inf")]
    emit(f"\nplanning time: mean {sum(r['plan_s'] for r in rows) / len(rows):.1f} s, "
         f"max {max(r['plan_s'] for r in rows):.1f} s (planner and baselines)")
    if len(speedups) < len(rows):
        emit(f"cases where no baseline fits: {len(rows) - len(speedups)}")
    if speedups:
        emit(f"planner vs the best baseline that fits, per case: min {min(speedups):.2f}x, "
             f"geomean {_geomean(speedups):.2f}x, max {max(speedups):.2f}x over {len(speedups)} cases")


def _fits(plan, profile, topology) -> bool:
    from dearcomm.pipeline import check_memory
    try:
        check_memory(plan, profile, topology)
    except ValueError:
        return False
    return True


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
    """The planner against the exhaustive optimum (every partition, mapping
    and per-device order; dearcomm/pipeline/exhaustive.py) on random small
    problems with links of different speeds (tests/pipeline_cases.py)."""
    from dearcomm.pipeline import brute_force, plan_pipeline
    from dearcomm.pipeline.exhaustive import exhaustive_plan
    from tests.pipeline_cases import optimality_cases
    lines, ratios, rule_ratios, plan_s, exact_s = [], [], [], [], []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    emit(f"{'case':>4} {'layers':>6} {'dev':>3} {'M':>3} {'topology':<14} {'optimum ms':>10} {'planner ms':>10} "
         f"{'ratio':>7} {'rules':>7} {'plan s':>6} {'exact s':>7}  planner's plan")
    for i, (profile, topo, M) in enumerate(optimality_cases(args.cases, args.seed)):
        t0 = time.perf_counter()
        plan = plan_pipeline(profile, topo, M)
        plan_s.append(time.perf_counter() - t0)
        stats = {}
        best = exhaustive_plan(profile, topo, M, start=plan, stats=stats)
        exact_s.append(stats["seconds"])
        rules = brute_force(profile, topo, M)  # the best plan under the three order rules
        ratios.append(plan.predicted_ms / best.predicted_ms)
        rule_ratios.append(rules.predicted_ms / best.predicted_ms)
        emit(f"{i:>4} {len(profile):>6} {topo.size:>3} {M:>3} {topo.name:<14} {best.predicted_ms:>10.2f} "
             f"{plan.predicted_ms:>10.2f} {ratios[-1]:>7.4f} {rule_ratios[-1]:>7.4f} {plan_s[-1]:>6.2f} "
             f"{exact_s[-1]:>7.1f}  {plan.describe().split(': ', 1)[1]}")
    n = len(ratios)
    emit(f"\nplanner / exhaustive optimum over {n} cases: worst {max(ratios):.4f}, mean {sum(ratios) / n:.4f}, "
         f"optimal in {sum(r < 1 + 1e-9 for r in ratios)}")
    emit(f"best plan under the three rules / optimum: worst {max(rule_ratios):.4f}, mean {sum(rule_ratios) / n:.4f}")
    emit(f"planning time: mean {sum(plan_s) / n:.2f} s, max {max(plan_s):.2f} s; exhaustive search: "
         f"mean {sum(exact_s) / n:.1f} s, max {max(exact_s):.1f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pipeline-optimality.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


# ---- netlab: the runtime measured against the simulator ---------------------------

def _rate_bytes(rate: str) -> float:
    units = {"gbit": 1e9 / 8, "mbit": 1e6 / 8, "kbit": 1e3 / 8}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"unknown rate {rate!r}")


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent in user and kernel code (not in
    softirq: that is mostly our own packets) since boot."""
    with open("/proc/stat") as f:
        user, nice, system = map(int, f.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def _transfer_cpu(spec: str, TransferCpu):
    """'SEND_MS_PER_MESSAGE,SEND_MS_PER_MIB,RECV_MS_PER_MESSAGE,RECV_MS_PER_MIB'
    (benchmarks/gloo_cpu_cost.py measures them); '' charges nothing."""
    if not spec:
        return TransferCpu()
    values = [float(v) for v in spec.split(",")]
    if len(values) != 4:
        raise SystemExit(f"--transfer-cpu wants 4 comma-separated numbers, got {spec!r}")
    return TransferCpu(*values)


def _netlab_model(width: int, blocks: int):
    """Wide blocks (width -> 64 -> width): big activations, modest compute,
    so that transfers matter on these 2 cores."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, width), nn.Tanh()) for _ in range(blocks)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _measure_contention(model, x, y, mib: float) -> dict:
    """benchmarks/contention.py's measurement on one micro-batch's
    forward+backward (every rank together). A fit that finds no iteration
    covered enough (it raises after the collectives, so every rank got that
    far) counts as no contention, as wrap()'s "auto" takes it."""
    from contention import measure
    try:
        return measure(model, x, y, mib, iters=8)
    except ValueError as e:
        print(f"contention not measured ({e}); factors of 1", flush=True)
        return dict(compute_slowdown=1.0, comm_slowdown=1.0)


def cmd_netlab(args) -> int:
    """Parent: build the emulated cluster (per-rank rates) and run the ranks."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from netlab import Cluster
    rates = args.rates.split(",")
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"pipeline-netlab-{'-'.join(rates)}.json")
    with Cluster(len(rates), args.rates, burst=args.burst) as cluster:
        code = cluster.launch([sys.executable, os.path.abspath(__file__), "_rank", "--rates", args.rates,
                               "--json", out, "--steps", str(args.steps), "--microbatches", str(args.microbatches),
                               "--batch", str(args.batch), "--width", str(args.width), "--blocks", str(args.blocks),
                               "--latency-us", str(args.latency_us), "--efficiency", str(args.efficiency),
                               "--transfer-cpu", args.transfer_cpu, "--host-cores", str(args.host_cores),
                               "--contention-mib", str(args.contention_mib)])
    if code == 0 and os.path.exists(out):
        with open(out) as f:
            rows = json.load(f)["rows"]
        print(f"\nrates {args.rates}, {args.microbatches} micro-batches of {args.batch // args.microbatches}:")
        columns = [("profile", "offline"), ("in situ", "insitu"), ("κ, λ", "contention")]
        if args.transfer_cpu or args.host_cores:
            columns += [("new, all cores", "new_all_cores"), ("new", "new"), ("new, in situ", "new_insitu")]
        print(f"{'plan':<10} {'measured':>9} " + " ".join(f"{c:>16} {'err':>6}" for c, _ in columns) + "  plan")
        for r in rows:
            print(f"{r['name']:<10} {r['measured_ms']:>9.1f} " +
                  " ".join(f"{r['predicted_' + k + '_ms']:>16.1f} {r['error_' + k]:>+6.1%}" for _, k in columns) +
                  f"  {r['plan']}")
    return code


def cmd_summary(args) -> int:
    """Medians over repeated netlab runs (one JSON each): per plan, the
    measured time and, per model, the prediction and the per-run errors."""
    import statistics
    runs = {}
    for path in args.files:
        with open(path) as f:
            d = json.load(f)
        for r in d["rows"]:
            runs.setdefault((d["rates"], r["name"]), []).append(r)
    models = [k[len("predicted_"):-len("_ms")] for k in runs[next(iter(runs))][0] if k.startswith("predicted_")]
    print(f"{'rates':<24} {'plan':<8} {'runs':>4} {'measured':>9}  " +
          "  ".join(f"{m + ' (median err, range)':>34}" for m in models))
    for (rates, name), rows in runs.items():
        cells = []
        for m in models:
            errs = sorted(r[f"error_{m}"] for r in rows)
            pred = statistics.median(r[f"predicted_{m}_ms"] for r in rows)
            cells.append(f"{pred:7.1f} {statistics.median(errs):+6.1%} [{errs[0]:+6.1%},{errs[-1]:+6.1%}]")
        print(f"{rates:<24} {name:<8} {len(rows):>4} {statistics.median(r['measured_ms'] for r in rows):>9.1f}  " +
              "  ".join(f"{c:>34}" for c in cells))
    return 0


def cmd_rank(args) -> int:
    """One rank under netlab: plan, run every plan, time it, predict it."""
    import statistics

    import torch
    import torch.distributed as dist
    from torch import nn

    from dearcomm.pipeline import (LayerProfile, ModelProfile, TransferCpu, one_f_one_b_plan, plan_pipeline,
                                   profile_sequential, simulate, switched)
    from dearcomm.pipeline.runtime import PipelineRuntime
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    rates = [_rate_bytes(r) * args.efficiency for r in args.rates.split(",")]
    topo = switched(rates, latency_us=args.latency_us, name="netlab")
    # Plans come from the free-transfer model (the planner's default) and from
    # the measured contention factors; the transfer-CPU model, if given, only predicts.
    charged = dataclasses.replace(topo, transfer_cpu=_transfer_cpu(args.transfer_cpu, TransferCpu),
                                  host_cores=args.host_cores)
    model = _netlab_model(args.width, args.blocks)
    M = args.microbatches
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    micro = x[: args.batch // M]
    # The data-parallel simulator's contention factors, measured here as wrap()'s
    # "auto" measures them (a micro-batch's forward+backward beside all-reduces
    # on this group): the one cost model both simulators take.
    contention = _measure_contention(model, micro, y[: len(micro)], args.contention_mib)
    contended = dataclasses.replace(topo, compute_slowdown=contention["compute_slowdown"],
                                    comm_slowdown=contention["comm_slowdown"])
    box = [None, None, None]
    if rank == 0:  # the offline profile: one process (the others wait), wall time and CPU time
        print(f"contention: compute_slowdown {contended.compute_slowdown:.3f}, "
              f"comm_slowdown {contended.comm_slowdown:.3f}", flush=True)
        profile = profile_sequential(model, micro, y[: len(micro)], nn.functional.cross_entropy, name="netlab-mlp")
        cpu_profile = profile_sequential(model, micro, y[: len(micro)], nn.functional.cross_entropy,
                                         name="netlab-mlp-cpu", clock=time.thread_time)
        # The planner with free transfers (its default) and with the measured factors.
        planned = plan_pipeline(profile, topo, M)
        aware = dataclasses.replace(plan_pipeline(profile, contended, M), name="planner-kl")
        box = [profile, [planned, aware, one_f_one_b_plan(profile, topo, M)], cpu_profile]
    dist.broadcast_object_list(box, src=0)
    profile, plans, cpu_profile = box
    rows = []
    for plan in plans:
        runtime = PipelineRuntime(_netlab_model(args.width, args.blocks), plan, nn.functional.cross_entropy,
                                  lambda p: torch.optim.SGD(p, lr=1e-3), micro)
        times, wall, cpu = [], {"F": [], "B": []}, {"F": [], "B": []}
        for step in range(args.steps + 2):
            dist.barrier()
            if step == 2:
                window = (time.perf_counter(), time.process_time(), _machine_busy_s())
            t0 = time.perf_counter()
            runtime.step(x, y)
            dist.barrier()  # the iteration ends when the slowest rank's update ends
            if step >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
                for (kind, _), v in getattr(runtime, "task_ms", {}).items():
                    wall[kind].append(v)
                for (kind, _), v in getattr(runtime, "task_cpu_ms", {}).items():
                    cpu[kind].append(v)
        # In-situ task times (all ranks computing at once on shared cores):
        # wall (what the task took, waiting for a core included) and this
        # thread's CPU time (the work, for the shared-cores model).
        mine = {} if runtime.stage is None else {
            (runtime.stage, k, clock): statistics.median(v[k]) for k in ("F", "B")
            for clock, v in (("wall", wall), ("cpu", cpu))}
        # Over the timed steps: this process's CPU seconds (all threads) and
        # the machine's, to tell how many cores other processes kept busy.
        mine["window"] = (time.perf_counter() - window[0], time.process_time() - window[1],
                          _machine_busy_s() - window[2])
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            merged = {}
            for d in everyone:
                for key, v in d.items():
                    merged.setdefault(key, []).append(v)
            seconds, machine = everyone[0]["window"][0], everyone[0]["window"][2]
            ours = sum(w[1] for w in merged.pop("window"))
            others = max(0.0, machine - ours) / seconds
            left = max(args.host_cores - others, 0.1 * args.host_cores) if args.host_cores else 0

            def staged_profile(clock: str) -> ModelProfile:
                stages = []
                for s in range(plan.num_stages):
                    a, b = plan.stage_layers(s)
                    stages.append(LayerProfile(f"stage{s}", statistics.median(merged[s, "F", clock]),
                                               statistics.median(merged[s, "B", clock]),
                                               sum(l.activation_bytes for l in profile.layers[a:b]),
                                               profile.param_bytes(a, b)))
                return ModelProfile(f"in-situ {clock}", tuple(stages),
                                    tuple(profile.boundary_bytes(b) for b in plan.bounds[1:-1]))
            insitu, insitu_cpu = staged_profile("wall"), staged_profile("cpu")
            staged = type(plan)(tuple(range(plan.num_stages + 1)), plan.devices, plan.orders, M, plan.name)
            measured = statistics.median(times)
            # old: free transfers, a processor per device, wall-time task
            # costs; new: tasks' CPU times, transfers' CPU, the host's cores
            # shared (all of them, or what the other processes left).
            leftover = dataclasses.replace(charged, host_cores=left)
            predicted = dict(offline=simulate(plan, profile, topo).makespan_ms,
                             contention=simulate(plan, profile, contended).makespan_ms,
                             insitu=simulate(staged, insitu, topo).makespan_ms,
                             new_all_cores=simulate(plan, cpu_profile, charged).makespan_ms,
                             new=simulate(plan, cpu_profile, leftover).makespan_ms,
                             new_insitu=simulate(staged, insitu_cpu, leftover).makespan_ms)
            row = dict(name=plan.name, plan=plan.describe(), measured_ms=measured, times_ms=times,
                       insitu_stages=[vars(l) for l in insitu.layers],
                       insitu_cpu_stages=[vars(l) for l in insitu_cpu.layers],
                       transfer_cpu=vars(charged.transfer_cpu), host_cores=charged.host_cores,
                       compute_slowdown=contended.compute_slowdown, comm_slowdown=contended.comm_slowdown,
                       others_cores=others, ours_cores=ours / seconds, cores_left=left,
                       orders={d: [str(t) for t in ts] for d, ts in plan.orders.items()})
            for k, v in predicted.items():
                row[f"predicted_{k}_ms"], row[f"error_{k}"] = v, v / measured - 1
            rows.append(row)
            print(f"{plan.name}: our ranks used {ours / seconds:.2f} cores, other processes {others:.2f}")
            print(f"{plan.name}: measured {measured:.1f} ms (p10 {sorted(times)[len(times) // 10]:.1f}), predicted "
                  + ", ".join(f"{v:.1f} ({k})" for k, v in predicted.items()), flush=True)
        dist.barrier()
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(dict(rates=args.rates, microbatches=M, batch=args.batch, width=args.width, rows=rows,
                           profile=[vars(l) for l in profile.layers],
                           cpu_profile=[vars(l) for l in cpu_profile.layers]), f, indent=1)
    dist.destroy_process_group()
    return 0


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (0 micro-batches or cases plans nothing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _nonnegative(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plans", help="planner vs baselines on the shared profiles (simulated)")
    p.add_argument("--microbatches", type=_positive_int, default=16)
    p.add_argument("--blocks", type=_positive_int, default=24, help="coarsen every profile to at most this many blocks")
    p.add_argument("--quick", action="store_true", help="4 and 8 devices only")
    p.add_argument("--memory-gb", type=_nonnegative, default=0.0, help="per-device memory limit (0: none)")
    p.add_argument("--out", default="results")
    p.set_defaults(fn=cmd_plans)
    o = sub.add_parser("optimality", help="planner vs the exhaustive optimum on small random cases")
    o.add_argument("--cases", type=_positive_int, default=48)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--out", default="results")
    o.set_defaults(fn=cmd_optimality)
    n = sub.add_parser("netlab-summary", help="medians over repeated netlab runs' JSON files")
    n.add_argument("files", nargs="+")
    n.set_defaults(fn=cmd_summary)
    for name, fn in (("netlab", cmd_netlab), ("_rank", cmd_rank)):
        n = sub.add_parser(name, help="measured vs predicted under netlab (root)" if name == "netlab" else None)
        n.add_argument("--rates", default="200mbit,200mbit,100mbit", help="tbf rate per rank")
        n.add_argument("--steps", type=_positive_int, default=8)
        n.add_argument("--microbatches", type=_positive_int, default=4)
        n.add_argument("--batch", type=_positive_int, default=256)
        n.add_argument("--width", type=_positive_int, default=4096)
        n.add_argument("--blocks", type=_positive_int, default=4)
        n.add_argument("--burst", default="64kb")
        n.add_argument("--latency-us", type=float, default=500.0, help="per-message latency the model assumes")
        n.add_argument("--efficiency", type=float, default=0.95,
                       help="payload share of the tbf rate (TCP/IP headers: 1448 of 1514 bytes per frame)")
        n.add_argument("--transfer-cpu", default="", metavar="SEND_MSG,SEND_MIB,RECV_MSG,RECV_MIB",
                       help="also predict with transfers charging this CPU time (ms) to their endpoints")
        n.add_argument("--host-cores", type=int, default=0,
                       help="... and with the ranks sharing this many cores (0: a processor per rank)")
        n.add_argument("--contention-mib", type=float, default=8.0,
                       help="all-reduce size for measuring the contention factors κ and λ")
        n.add_argument("--json", default="")
        n.add_argument("--out", default="results")
        n.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
