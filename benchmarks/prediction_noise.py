"""How much of a row's prediction error this machine's noise accounts for,
from train_bench.py --json files (meant for the loopback rows, where the
ranks' compute and the collectives share the cores).

    python benchmarks/prediction_noise.py docs/results/schedules/loopback-*/*-loopback-2.json

Three measurements, every one from the files alone:
  1. How closely each run's measured iteration follows its process's CPU
     per iteration (each run stores both): the iteration predicted as the
     run's own CPU times the median ratio over all the runs given. Where
     that fits every run, what a prediction has to get right is the CPU.
  2. The noise of one measured quantity, from two measurements of it:
     runs timed twice in one row ('X/again'), DDP against wfbp (the same
     schedule and layout in the simulator, different code: an upper
     bound), and the profile's compute (forward + backward + step) against
     DDP's own on-CPU compute in the same rounds (its phases; per model, the
     deviations from that model's mean ratio over the files).
  3. What an exact model would score under that noise: per row one error
     all its runs share (the profile's, sigma_profile) plus one of each run
     (sigma_run), drawn many times; the expected runs within 10% and rows
     with every run within 10%, against what the files' predictions scored.
     With --rounds-factor F, also for F times the rounds (the noise's
     variance taken as falling with the rounds, as a median's does).
  4. Where the contention measurement records the whole machine's CPU:
     each row's iteration over CPU against 1 / the share of the cores
     neither idle nor in softirq while collectives ran beside compute.
  5. Where a file records the machine's CPU per iteration and every rank's
     CPU per iteration: what the wall beyond the CPU is made of. The
     machine's cores over an iteration split into the ranks' CPU, softirq,
     idle and the rest (other processes); and the iteration against the
     slowest rank's CPU that iteration (the ranks meet every iteration),
     with how far that slowest rank's lies above the ranks' mean.
  6. Where a file stores each run's predicted CPU (the simulated device's
     bound, predicted_cpu_ms): that against the run's measured CPU, per row,
     so a change of the model's CPU can be checked against the CPU itself.
  7. What is left once a row's level is known: every prediction of a row
     times its DDP run's measured over predicted iteration (the level a
     launch's one measured run gives), scored as in 3, against an exact
     model whose only errors are the runs' own noise (DDP's, shared by the
     row, and each run's). Close to that, what the model misses is the
     level alone; short of it, it also spaces a row's schedules otherwise
     than the runs do.
"""
import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prediction_summary import is_candidate, repeats, resimulate  # noqa: E402

WITHIN = 0.10
DRAWS = 20000


def load(paths):
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows.append((Path(path), data))
    return rows


def cpu_following(rows):
    """Per row (iteration / CPU of every run with both), and the ratio over all."""
    per_row = {}
    for path, data in rows:
        ratios = {n: r["median_ms"] / r["cpu_ms"] for n, r in data["runs"].items()
                  if r.get("cpu_ms") and r.get("median_ms")}
        if ratios:
            per_row[path] = ratios
    pooled = statistics.median(x for ratios in per_row.values() for x in ratios.values()) if per_row else None
    return per_row, pooled


def on_cpu_compute(phases) -> float:
    return sum(phases[k] - phases.get(f"{k} off-CPU", 0.0) for k in ("forward", "backward", "step"))


def sd_of_differences(logs):
    """The standard deviation of two measurements' log ratio (None under 2)."""
    return statistics.stdev(logs) if len(logs) >= 2 else None


def pairs(rows):
    """Log ratios of the two medians of one configuration ('X/again'), and of wfbp over ddp."""
    again, ddp_wfbp = [], []
    for _, data in rows:
        runs = data["runs"]
        again += [math.log1p(x) for x in repeats(runs).values()]
        if runs.get("ddp", {}).get("median_ms") and runs.get("wfbp", {}).get("median_ms"):
            ddp_wfbp.append(math.log(runs["wfbp"]["median_ms"] / runs["ddp"]["median_ms"]))
    return again, ddp_wfbp


def profile_against_training(rows):
    """model -> log(profile's compute / DDP's on-CPU compute) of each file that has both."""
    out = {}
    for _, data in rows:
        phases = data["runs"].get("ddp", {}).get("phases_ms")
        profile = data.get("profile")
        if not isinstance(phases, dict) or "backward off-CPU" not in phases or not profile:
            continue
        compute = profile["forward_ms"] + profile["backward_ms"] + profile["step_ms"]
        out.setdefault(data["model"], []).append(math.log(compute / on_cpu_compute(phases)))
    return out


def within_model_sd(by_model):
    """The standard deviation of the deviations from each model's mean (n - models degrees of freedom)."""
    deviations = [x - statistics.mean(xs) for xs in by_model.values() for x in xs]
    dof = len(deviations) - len(by_model)
    return math.sqrt(sum(d * d for d in deviations) / dof) if dof > 0 else None


def exact_model_scores(sizes, sigma_profile, sigma_run, seed=0):
    """Expected runs within 10% and rows with every run within 10%, for rows of
    `sizes` runs, with errors = a row's shared draw + each run's own."""
    rng = np.random.default_rng(seed)
    runs = rows_met = 0.0
    for n in sizes:
        err = rng.normal(0.0, sigma_profile, (DRAWS, 1)) + rng.normal(0.0, sigma_run, (DRAWS, n))
        ok = np.abs(np.expm1(err)) <= WITHIN
        runs += ok.mean() * n
        rows_met += ok.all(axis=1).mean()
    return runs, rows_met


def observed_scores(rows):
    sizes, runs, rows_met = [], 0, 0
    for _, data in rows:
        errors = [r["predicted_ms"] / r["median_ms"] - 1 for n, r in data["runs"].items()
                  if is_candidate(n) and "skipped" not in r and r.get("predicted_ms") and r.get("median_ms")]
        if not errors:
            continue
        within = sum(abs(e) <= WITHIN for e in errors)
        sizes.append(len(errors))
        runs += within
        rows_met += within == len(errors)
    return sizes, runs, rows_met


def scores_with_ddp_level(rows):
    """observed_scores with every row's predictions scaled by its DDP run's
    measured over predicted iteration (rows without both are left out)."""
    scaled = []
    for path, data in rows:
        ddp = data["runs"].get("ddp", {})
        if not ddp.get("predicted_ms") or not ddp.get("median_ms"):
            continue
        level = ddp["median_ms"] / ddp["predicted_ms"]
        runs = {n: dict(r, predicted_ms=r["predicted_ms"] * level) if r.get("predicted_ms") else r
                for n, r in data["runs"].items()}
        scaled.append((path, dict(data, runs=runs)))
    return observed_scores(scaled)


def cpu_predicted(rows):
    """Per row with predicted_cpu_ms: {run: predicted CPU / measured CPU - 1}."""
    return {path: {n: r["predicted_cpu_ms"] / r["cpu_ms"] - 1 for n, r in data["runs"].items()
                   if r.get("predicted_cpu_ms") and r.get("cpu_ms")}
            for path, data in rows
            if any(r.get("predicted_cpu_ms") for r in data["runs"].values())}


def machine_share(rows):
    """Per row whose contention rounds record the machine's CPU: (the runs'
    median iteration over CPU, the median over rounds of 1 / the share of
    the machine's cores neither idle nor in softirq while collectives ran
    beside compute)."""
    out = {}
    for path, data in rows:
        rounds = [r for r in data.get("contention", {}).get("rounds", []) if r.get("beside_machine_s", {}).get("busy")]
        ratios = [r["median_ms"] / r["cpu_ms"] for r in data["runs"].values() if r.get("cpu_ms") and r.get("median_ms")]
        if not rounds or not ratios:
            continue
        lost = [(m["idle"] + m["softirq"]) / (m["busy"] + m["idle"]) for m in (r["beside_machine_s"] for r in rounds)]
        out[path] = (statistics.median(ratios), statistics.median(1 / (1 - x) for x in lost))
    return out


def wall_parts(rows):
    """Per row whose runs record machine_ms and cpu_iterations_ms, the
    medians over its runs of: the shares of the machine's cores (busy + idle)
    over an iteration that were the ranks' CPU, softirq, idle and the rest;
    the iteration over the ranks' mean CPU; the slowest rank's CPU in each
    iteration over the ranks' mean (the spread the meeting costs); the
    iteration over that slowest rank's CPU."""
    out = {}
    for path, data in rows:
        parts = []
        for r in data["runs"].values():
            if not r.get("machine_ms") or not r.get("cpu_iterations_ms") or not r.get("iterations_ms"):
                continue
            ranks, walls, m = r["cpu_iterations_ms"], r["iterations_ms"], r["machine_ms"]
            n = min(len(walls), *map(len, ranks))
            wall, cores = statistics.fmean(walls), m["busy"] + m["idle"]
            mean_cpu = statistics.fmean(statistics.fmean(c) for c in ranks)
            slowest = statistics.fmean(max(c[i] for c in ranks) for i in range(n))
            cpu = mean_cpu * len(ranks)
            parts.append(dict(cpu=cpu / cores, softirq=m["softirq"] / cores, idle=m["idle"] / cores,
                              rest=(m["busy"] - m["softirq"] - cpu) / cores, over_mean=wall / mean_cpu,
                              slowest=slowest / mean_cpu, over_slowest=wall / slowest))
        if parts:
            out[path] = (len(parts), {k: statistics.median(p[k] for p in parts) for k in parts[0]})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--resimulate", action="store_true",
                        help="score this checkout's predictions (prediction_summary.py --resimulate), not the stored ones")
    parser.add_argument("--rounds-factor", type=float, default=None,
                        help="also score an exact model with this many times the rounds")
    args = parser.parse_args()
    rows = load(args.files)
    if args.resimulate:
        for _, data in rows:
            resimulate(data)

    per_row, ratio = cpu_following(rows)
    print("## The iteration against the process's CPU\n")
    if per_row:
        print(f"Each run's iteration predicted as its own CPU per iteration x {ratio:.3f} (the median ratio):\n")
        print("| row | runs | iteration / CPU, median (range) | within 10% | worst |")
        print("|---|---|---|---|---|")
        total = hits = 0
        for path, ratios in per_row.items():
            errors = [x / ratio - 1 for x in ratios.values()]
            ok = sum(abs(e) <= WITHIN for e in errors)
            total, hits = total + len(errors), hits + ok
            print(f"| {path.parent.name}/{path.stem} | {len(errors)} | {statistics.median(ratios.values()):.3f} "
                  f"({min(ratios.values()):.3f}-{max(ratios.values()):.3f}) | {ok} of {len(errors)} "
                  f"| {max(errors, key=abs):+.1%} |")
        print(f"\n{hits} of {total} runs within 10% of their own CPU x {ratio:.3f}.\n")
    else:
        print("(no run stores its CPU per iteration)\n")
    shares = machine_share(rows)
    if shares:
        print("## The iteration over the CPU against the machine's cores the ranks get\n")
        print("Beside collectives (the contention measurement), the machine's cores not idle and not in softirq "
              "(loopback TCP's receive side, charged to no process):\n")
        print("| row | iteration / CPU, median of the runs | 1 / that share, median of the rounds | difference |")
        print("|---|---|---|---|")
        for path, (ratio, share) in shares.items():
            print(f"| {path.parent.name}/{path.stem} | {ratio:.3f} | {share:.3f} | {share / ratio - 1:+.1%} |")
        print()

    parts = wall_parts(rows)
    if parts:
        print("## What the iteration's wall beyond the CPU is made of\n")
        print("Per iteration, the machine's cores (busy + idle) split into the ranks' CPU, softirq, idle and the "
              "rest; the iteration over the ranks' mean CPU, over the slowest rank's CPU that iteration, and "
              "that slowest rank's over the mean (medians of the row's runs):\n")
        print("| row | runs | ranks' CPU | softirq | idle | rest | iteration / mean CPU | slowest / mean "
              "| iteration / slowest |")
        print("|---|---|---|---|---|---|---|---|---|")
        for path, (n, p) in parts.items():
            print(f"| {path.parent.name}/{path.stem} | {n} | {p['cpu']:.1%} | {p['softirq']:.1%} | {p['idle']:.1%} "
                  f"| {p['rest']:+.1%} | {p['over_mean']:.3f} | {p['slowest']:.3f} | {p['over_slowest']:.3f} |")
        print()

    again, ddp_wfbp = pairs(rows)
    by_model = profile_against_training(rows)
    sd_again, sd_pair, sd_profile = sd_of_differences(again), sd_of_differences(ddp_wfbp), within_model_sd(by_model)
    print("## Two measurements of one quantity\n")
    print("| quantity | pairs | sd of the log ratio | one measurement's sd |")
    print("|---|---|---|---|")
    for label, logs, sd in (("a run timed twice in one row", again, sd_again),
                            ("wfbp against ddp (one schedule and layout, different code)", ddp_wfbp, sd_pair)):
        print(f"| {label} | {len(logs)} | {fmt(sd)} | {fmt(sd / math.sqrt(2) if sd is not None else None)} |")
    # A run's own noise: from the runs timed twice where there are any (the same code twice), else the pair.
    sd_run = sd_again if sd_again is not None else sd_pair
    sigma_run = sd_run / math.sqrt(2) if sd_run is not None else None
    sigma_profile = math.sqrt(max(0.0, sd_profile ** 2 - sigma_run ** 2)) \
        if sd_profile is not None and sigma_run is not None else None
    n_profile = sum(map(len, by_model.values()))
    print(f"| the profile's compute against DDP's on-CPU compute, per model "
          f"({', '.join(f'{m} {len(x)}: median {math.exp(statistics.median(x)):.3f}' for m, x in by_model.items())}) "
          f"| {n_profile} | {fmt(sd_profile)} | {fmt(sigma_profile)} (less the run's) |")
    print()
    if sigma_run is None or sigma_profile is None:
        print("Not enough pairs to size the noise.")
        return
    sizes, runs, rows_met = observed_scores(rows)
    print("## An exact model under that noise\n")
    print(f"sigma_profile {sigma_profile:.1%} (shared by a row's runs), sigma_run {sigma_run:.1%} (each run's own); "
          f"{DRAWS} draws per row.\n")
    print("| | runs within 10% | rows with every run within 10% |")
    print("|---|---|---|")
    print(f"| the files' predictions | {runs} of {sum(sizes)} | {rows_met} of {len(sizes)} |")
    expected = exact_model_scores(sizes, sigma_profile, sigma_run)
    print(f"| an exact model, expected | {expected[0]:.1f} of {sum(sizes)} | {expected[1]:.1f} of {len(sizes)} |")
    if args.rounds_factor:
        scale = 1 / math.sqrt(args.rounds_factor)
        more = exact_model_scores(sizes, sigma_profile * scale, sigma_run * scale)
        print(f"| an exact model, {args.rounds_factor:g}x the rounds, expected | {more[0]:.1f} of {sum(sizes)} "
              f"| {more[1]:.1f} of {len(sizes)} |")

    sizes, runs, rows_met = scores_with_ddp_level(rows)
    if sizes:
        print("\n## The level taken from each row's DDP run\n")
        print("Every prediction of a row times its DDP run's measured over predicted iteration:\n")
        print("| | runs within 10% | rows with every run within 10% |")
        print("|---|---|---|")
        print(f"| the files' predictions, at DDP's level | {runs} of {sum(sizes)} | {rows_met} of {len(sizes)} |")
        expected = exact_model_scores(sizes, sigma_run, sigma_run)
        print(f"| an exact model at DDP's level, expected (DDP's run noise and each run's) | {expected[0]:.1f} of "
              f"{sum(sizes)} | {expected[1]:.1f} of {len(sizes)} |")

    predicted = cpu_predicted(rows)
    if predicted:
        print("\n## The predicted CPU against the measured CPU\n")
        print("| row | runs | median | range | lowest | highest |")
        print("|---|---|---|---|---|---|")
        for path, errors in predicted.items():
            low, high = min(errors, key=errors.get), max(errors, key=errors.get)
            print(f"| {path.parent.name}/{path.stem} | {len(errors)} | {statistics.median(errors.values()):+.1%} "
                  f"| {errors[low]:+.1%} to {errors[high]:+.1%} | {low} | {high} |")


def fmt(x):
    return "-" if x is None else f"{x:.1%}"


if __name__ == "__main__":
    main()
