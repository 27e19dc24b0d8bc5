"""How well the simulator predicts, and what choosing by prediction would give,
from train_bench.py --json files (each run's measured median and its
prediction: dearcomm.profile() of the model, collectives measured alone,
compute slowed by the factor measured beside an all-reduce).

    python benchmarks/prediction_summary.py results/validation/*.json
    python benchmarks/prediction_summary.py --resimulate docs/results/schedules/every-row-predicted/*.json

--resimulate predicts every run again with this checkout's simulator from the
measurements the file holds (rank 0's profile, each layout's collectives
alone, both contention factors: compute beside collectives and collectives
beside compute; the CPU bound charges the collectives' CPU at ν and the
compute beside them at μ, their CPU beside the other over alone, and
takes the slowest rank's iteration from the compute's spread alone, where
the ranks have cores of their own; with
--lambda, and for files from before each part's CPU was recorded, the model
before: the collectives' CPU at λ, no spread); usbyte's and deft's plans where the file has them; each
collective's host CPU per call and per MiB, for older files from their
layouts' CPU), instead
of reading the prediction the run made: a change of the model is then
checked against measurements already taken. Files written before the plans
were stored replay usbyte and deft without them (their errors are then not
the model's).

Runs timed twice ('X/again') are listed apart: how far the same
configuration's two medians lie apart in one row.

Per row: the prediction error of every dearcomm run (median of |error| and
the worst); the run the simulator ranks fastest among the runs measured, deft's
delayed gradients aside ("pick": what dearcomm.plan() would choose from
those candidates), its
measured time against the measured best and against DDP; the default
(dear-sharded) against DDP.
"""
import argparse
import json
import os
import statistics
import sys
import types
from pathlib import Path

CONTROLS = ("ddp", "fsdp2", "auto", "dear-bo")  # not fixed dearcomm runs: not candidates


def is_candidate(name: str) -> bool:
    return (name.split("/")[0] not in CONTROLS and "@" not in name and not name.endswith("/sync")
            and not name.endswith("/again"))


def repeats(runs) -> dict:
    """train_bench.py's 'X/again' runs (X timed a second time in the same
    row): X -> the second median over the first, minus 1."""
    firsts = {name: name.removesuffix("/again") for name in runs if name.endswith("/again")}
    return {first: runs[name]["median_ms"] / runs[first]["median_ms"] - 1
            for name, first in firsts.items() if first in runs}


def resimulate(data, lam: bool = False) -> None:
    """Replaces every run's predicted_ms by this checkout's simulation of it
    (see the module's docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_bench import COMM_KEYS, host_cpu_of, is_timing, simulation

    import torch

    import dearcomm
    from dearcomm.contention import (fit_comm_cpu_slowdown, fit_comm_slowdown, fit_compute_cpu_slowdown,
                                     fit_iteration_cv)
    from dearcomm.host_cost import cores_share

    profile = dearcomm.TrainingProfile.from_dict(data["profile"])
    contention = data["contention"]
    # Measured once a round: the medians of the rounds' factors; once at the start: from its timings.
    comm_slowdown = contention["comm_slowdown"] if "rounds" in contention else \
        fit_comm_slowdown(contention["comm_alone_s"], contention["comm_beside_s"])
    # Each one's CPU beside the other over alone (ν, μ): fitted, or from the rounds' CPU where they
    # recorded it. Files from before: the model before (λ stood in for both ν and the spread).
    parts = [r for r in contention.get("rounds", []) if "beside_comm_cpu_s" in r]
    comm_cpu_slowdown = contention.get("comm_cpu_slowdown") or (statistics.median(
        fit_comm_cpu_slowdown(r["comm_alone_cpu_s"], r["beside_comm_cpu_s"], r["beside_comm_count"])
        for r in parts) if parts else None)
    compute_cpu_slowdown = contention.get("compute_cpu_slowdown") or (statistics.median(
        fit_compute_cpu_slowdown(r["alone_cpu_s"], r["beside_compute_cpu_s"], len(r["beside"]))
        for r in parts) if parts else None)
    # The compute's spread alone (the ranks meet every iteration), from the rounds' iterations alone.
    timed = [r for r in contention.get("rounds", []) if r.get("alone_s")] or \
        ([contention] if contention.get("alone_s") else [])
    iteration_cv = statistics.median(fit_iteration_cv(r["alone_s"]) for r in timed) if timed else \
        contention.get("iteration_cv", 0.0)  # as this checkout fits it, where the file has the timings
    lam = lam or comm_cpu_slowdown is None
    # The model before charged the collectives' CPU at λ (comm_cpu_slowdown None), with no spread.
    factors = dict(compute_slowdown=contention["compute_slowdown"], comm_slowdown=comm_slowdown,
                   comm_cpu_slowdown=None if lam else comm_cpu_slowdown,
                   compute_cpu_slowdown=1.0 if lam else compute_cpu_slowdown, iteration_cv=0.0 if lam else iteration_cv)
    args = types.SimpleNamespace(bucket_mb=data["args"]["bucket_mb"])
    layouts = {name: c for names, c in data["comm_ms"].items() for name in names.split(",")}
    names = [p.name for m in profile.modules for p in m.params]
    # Files from before runs recorded them: from their layouts' CPU, with this machine's cores.
    share = cores_share(torch.device("cpu"), local_ranks=data["world_size"], threads=data.get("threads") or 1)
    fitted = host_cpu_of(
        [{k: (v / 1e3 if is_timing(k) else v) for k, v in c.items()}
         for c in data["comm_ms"].values()], share)
    host_ms = data.get("host_ms") or fitted[0]
    host_ms_per_mib = data.get("host_ms_per_mib") or fitted[1]
    data["host_ms"], data["host_ms_per_mib"] = host_ms, host_ms_per_mib
    for name, run in data["runs"].items():
        if "skipped" in run or name not in layouts:
            continue
        comm = {k: (v / 1e3 if k in COMM_KEYS else v) for k, v in layouts[name].items()}
        planned = run.get("planned")
        if planned and "bucket_mb" not in planned and name.startswith("usbyte"):
            planned = dict(planned, bucket_mb=usbyte_bucket_mb(name, args, profile, comm, data["world_size"], planned,
                                                               names, run["buckets"]))
        prediction = simulation(name, args, profile, profile.step_ms, comm, data["world_size"], factors,
                                chosen=run.get("auto_options"), planned=planned, names=names, host_ms=host_ms,
                                host_ms_per_mib=host_ms_per_mib, cores_share=0.0 if lam else share)
        run["predicted_ms"], run["predicted_cpu_ms"] = prediction.iteration_ms, prediction.cpu_ms
        run["predicted_timeline_ms"] = prediction.timeline_ms
    contention.update(comm_slowdown=comm_slowdown, comm_cpu_slowdown=comm_cpu_slowdown,
                      compute_cpu_slowdown=compute_cpu_slowdown, iteration_cv=iteration_cv)


def usbyte_bucket_mb(name, args, profile, comm, world, planned, names, buckets: int) -> float:
    """The bucket_mb a usbyte run trained with, for files written before
    runs recorded it: a plan fuses the small parameters into buckets of half
    its unit, one of dearcomm.usbyte.UNITS_MB (to within a partition unit),
    so the one whose layout has as many buckets as the run measured."""
    from train_bench import simulation

    from dearcomm.usbyte import UNITS_MB

    for mb in UNITS_MB:
        layout = simulation(name, args, profile, profile.step_ms, comm, world, planned=dict(planned, bucket_mb=mb / 2),
                            names=names).layout
        if len(layout.buckets) == buckets:
            return mb / 2
    raise ValueError(f"{name}: no unit of {UNITS_MB} MiB lays out the run's {buckets} buckets")


def summarise(path: Path, again: bool = False, lam: bool = False):
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "runs" not in data:
        return None  # not a train_bench.py file (a timeline)
    if again:
        resimulate(data, lam)
    runs = {n: r for n, r in data["runs"].items() if "skipped" not in r}
    candidates = {n: r for n, r in runs.items() if is_candidate(n) and r.get("predicted_ms")}
    if not candidates:
        return None
    errors = {n: r["predicted_ms"] / r["median_ms"] - 1 for n, r in candidates.items()}
    worst = max(errors, key=lambda n: abs(errors[n]))
    # deft trains on delayed gradients (another computation): its error
    # counts, but it is neither picked nor the best, as plan() considers it
    # only when given max_delay (auto_summary.py's "best fixed" alike).
    same_training = [n for n in candidates if n.split("/")[0] != "deft"] or list(candidates)
    pick = min(same_training, key=lambda n: candidates[n]["predicted_ms"])
    best = min(same_training, key=lambda n: candidates[n]["median_ms"])
    ddp = runs.get("ddp", {}).get("median_ms")
    default = candidates.get("dear-sharded", {}).get("median_ms")
    return dict(row=path.stem, network=data.get("network"), world=data["world_size"],
                slowdown=data.get("contention", {}).get("compute_slowdown"),
                comm_slowdown=data.get("contention", {}).get("comm_slowdown"),
                comm_cpu_slowdown=data.get("contention", {}).get("comm_cpu_slowdown"),
                compute_cpu_slowdown=data.get("contention", {}).get("compute_cpu_slowdown"),
                median_abs_error=statistics.median(abs(e) for e in errors.values()), worst=worst,
                worst_error=errors[worst], within_10=sum(abs(e) <= 0.10 for e in errors.values()), runs=len(errors),
                pick=pick, pick_vs_best=candidates[pick]["median_ms"] / candidates[best]["median_ms"], best=best,
                pick_speedup=ddp / candidates[pick]["median_ms"] if ddp else None,
                best_speedup=ddp / candidates[best]["median_ms"] if ddp else None,
                default_speedup=ddp / default if ddp and default else None, repeats=repeats(runs))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--resimulate", action="store_true", help="predict again with this checkout's simulator")
    parser.add_argument("--lambda", dest="lam", action="store_true",
                        help="with --resimulate: the model before, the collectives' CPU charged at lambda (their "
                             "wall beside compute), the compute at 1, no spread of the ranks")
    args = parser.parse_args()
    if args.lam and not args.resimulate:
        parser.error("--lambda needs --resimulate")
    rows = [r for r in (summarise(f, args.resimulate, args.lam) for f in args.files) if r]
    fmt = lambda x: f"{x:.3f}x" if x else "-"  # noqa: E731
    print("| row | κ | λ | ν | μ | runs within 10% | median \\|error\\| | worst error | pick (by prediction) | "
          "pick's measured time vs best | pick vs DDP | best measured (vs DDP) | default dear vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    factor = lambda x: f"{x:.2f}" if x else "-"  # noqa: E731
    for r in rows:
        print(f"| {r['row']} | {r['slowdown']:.2f} | {factor(r['comm_slowdown'])} | {factor(r['comm_cpu_slowdown'])} | "
              f"{factor(r['compute_cpu_slowdown'])} | {r['within_10']} of {r['runs']} | {r['median_abs_error']:.1%} | "
              f"{r['worst']} {r['worst_error']:+.1%} | {r['pick']} | {r['pick_vs_best']:.3f} | "
              f"{fmt(r['pick_speedup'])} | {r['best']} ({fmt(r['best_speedup'])}) | {fmt(r['default_speedup'])} |")
    if rows:
        errors = [abs(r["worst_error"]) for r in rows]
        print(f"\n{sum(r['within_10'] for r in rows)} of {sum(r['runs'] for r in rows)} runs predicted within 10%, "
              f"every run of {sum(r['within_10'] == r['runs'] for r in rows)} of {len(rows)} rows; "
              f"worst {max(errors):.1%}; the pick is within 5% of the measured best in "
              f"{sum(r['pick_vs_best'] <= 1.05 for r in rows)} of {len(rows)} rows")
    timed_twice = [r for r in rows if r["repeats"]]
    if timed_twice:
        print("\nThe same configuration timed twice in one row (X and X/again, interleaved): the second "
              "median against the first")
        print("\n| row | configuration | second vs first |\n|---|---|---|")
        for r in timed_twice:
            for name, difference in r["repeats"].items():
                print(f"| {r['row']} | {name} | {difference:+.1%} |")
        largest = max((abs(d), r["row"], n) for r in timed_twice for n, d in r["repeats"].items())
        print(f"\nlargest difference {largest[0]:.1%} ({largest[2]}, {largest[1]})")


if __name__ == "__main__":
    main()
