"""How often "auto"'s confirmation keeps the faster of a contender and the
reference, with three rounds and with rounds that go on while undecided
(CONFIRM_CERTAINTY, CONFIRM_MAX_ROUNDS), under the noise stored runs
measured: each stored confirmation round's ratio (contender over
reference) against the ratio of the two candidates' fixed runs in the
same file, drawn at random around a true ratio and fed to AutoPlan's own
rule.

    python benchmarks/confirmation_rounds.py docs/results/schedules/*/*.json
"""
import argparse
import json
import math
import random
import statistics
from pathlib import Path

from auto_summary import fixed_runs, twin

from dearcomm import _auto


def round_errors(paths):
    """{"loopback"/"1gbit": [log(round's ratio / fixed runs' ratio), ...]}."""
    errors = {"loopback": [], "1gbit": []}
    for path in paths:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "runs" not in data:
            continue
        runs = {n: r for n, r in data["runs"].items() if "skipped" not in r}
        fixed = fixed_runs(runs)
        link = "loopback" if "loopback" in path.stem else "1gbit"
        for name, run in runs.items():
            confirmations = [tuple(c) for c in run.get("auto_confirmations") or ()]
            if name.split("/")[0] != "auto" or not confirmations:
                continue
            shortlist = run["auto_shortlist"]
            order = list(dict.fromkeys(i for i, _ in confirmations))
            reference = run.get("auto_reference", order[-1])
            times = {i: [ms for j, ms in confirmations if j == i] for i in order}
            reference_twin = twin(shortlist[reference][0], fixed, data["args"]["bucket_mb"])
            for c in order:
                contender_twin = twin(shortlist[c][0], fixed, data["args"]["bucket_mb"])
                if c == reference or not (contender_twin and reference_twin):
                    continue
                truth = fixed[contender_twin]["median_ms"] / fixed[reference_twin]["median_ms"]
                errors[link] += [math.log(a / b / truth) for a, b in zip(times[c], times[reference])]
    return errors


def confirm(truth: float, errors, rng: random.Random):
    """(whether the contender replaced the reference, rounds measured)."""
    plan = _auto.AutoPlan(options={}, predicted_ms=100.0, default_ms=100.0, candidates=2, step=0, reason="replay",
                          network=None, profile=None, shortlist=(({"c": 0}, 100.0), ({"c": 1}, 100.0)),
                          refined=True, measured_ms=(90.0, 100.0), reference=1)
    while (index := plan.next_trial()) is not None:
        if index == 0:
            ratio = truth * math.exp(rng.choice(errors))
        plan = plan.with_trial(100.0 * ratio if index == 0 else 100.0)
    return plan.choice()[0] == 0, len(plan.confirmations) // 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--draws", type=int, default=4000)
    args = parser.parse_args()
    errors = round_errors(args.files)
    rules = {"three rounds": _auto.CONFIRM_ROUNDS, "until decided": _auto.CONFIRM_MAX_ROUNDS}
    for link, drawn in errors.items():
        if len(drawn) < 2:
            continue
        spread = 1.4826 * statistics.median(abs(e - statistics.median(drawn)) for e in drawn)
        print(f"\n{link}: {len(drawn)} stored rounds, robust spread of a round's ratio {spread:.1%}")
        print("| true ratio | " + " | ".join(f"{r}: replaced | rounds" for r in rules) + " |")
        print("|---|" + "---|---|" * len(rules))
        for truth in (0.85, 0.90, 0.93, 0.95, 0.97, 1.00, 1.03, 1.08):
            cells = []
            for most in rules.values():
                _auto.CONFIRM_MAX_ROUNDS = most
                rng = random.Random(0)
                results = [confirm(truth, drawn, rng) for _ in range(args.draws)]
                cells.append(f"{sum(r for r, _ in results) / len(results):.2f} | "
                             f"{statistics.mean(n for _, n in results):.1f}")
            print(f"| {truth:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
