"""Which estimator of κ (compute's slowdown beside collectives) predicts a
row best, from train_bench.py --json files that store every round's
contention timings (contention.rounds: alone_s, beside, per round).

    python benchmarks/kappa_estimators.py docs/results/schedules/loopback-rounds/*.json

Per file and estimator: κ, then every run re-simulated with it (this
checkout's simulator, prediction_summary.py --resimulate's inputs): the
median and worst error and the runs within 10%. The estimators:
  median of rounds   the median of the rounds' κ (what train_bench.py keeps;
                     each round's κ the median of its iterations' estimates)
  pooled median      dearcomm.fit_compute_slowdown over every round's timings
  pooled ratio       the time the rounds' covered iterations spent covered over
                     the work they did in it (one ratio of sums, iterations
                     covered for at least half their time)
  mean of rounds     the mean of the rounds' κ
"""
import argparse
import copy
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prediction_summary import is_candidate, resimulate  # noqa: E402

from dearcomm.contention import MIN_COVERAGE, fit_compute_slowdown  # noqa: E402


def pooled_ratio(rounds) -> float:
    covered_s = work_s = 0.0
    for r in rounds:
        alone = statistics.median(r["alone_s"])
        for wall, covered in r["beside"]:
            if covered >= MIN_COVERAGE:
                covered_s += wall * covered
                work_s += alone - wall * (1 - covered)
    return max(1.0, covered_s / work_s) if work_s > 0 else float("nan")


def estimators(rounds) -> dict:
    kappas = [r["compute_slowdown"] for r in rounds]
    return {"median of rounds": statistics.median(kappas),
            "pooled median": fit_compute_slowdown(alone_s=[a for r in rounds for a in r["alone_s"]],
                                                  beside=[tuple(b) for r in rounds for b in r["beside"]]).slowdown,
            "pooled ratio": pooled_ratio(rounds),
            "mean of rounds": statistics.mean(kappas)}


def errors(data, kappa) -> dict:
    data = copy.deepcopy(data)
    data["contention"]["compute_slowdown"] = kappa
    resimulate(data)
    return {n: r["predicted_ms"] / r["median_ms"] - 1 for n, r in data["runs"].items()
            if "skipped" not in r and is_candidate(n) and r.get("predicted_ms")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    print("| row | estimator | κ | median error | worst error | runs within 10% |")
    print("|---|---|---|---|---|---|")
    for path in args.files:
        data = json.loads(path.read_text())
        rounds = data.get("contention", {}).get("rounds") or []
        if not rounds or "alone_s" not in rounds[0]:
            print(f"| {path.stem} | (no per-round timings in the file) | | | | |")
            continue
        for name, kappa in estimators(rounds).items():
            e = errors(data, kappa)
            worst = max(e.values(), key=abs)
            print(f"| {path.stem} | {name} | {kappa:.2f} | {statistics.median(e.values()):+.1%} | {worst:+.1%} "
                  f"| {sum(abs(x) <= 0.10 for x in e.values())} of {len(e)} |")


if __name__ == "__main__":
    main()
