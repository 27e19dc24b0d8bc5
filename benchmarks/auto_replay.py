"""Which stored "auto" runs this checkout's rule would decide otherwise:
replays AutoPlan.choice() on the trials and confirmations that
train_bench.py --json files recorded for their auto runs (auto/again too),
and prints each choice that differs from the one the run trained with,
beside the row's fixed runs of both choices where the row has them:

    python benchmarks/auto_replay.py docs/results/schedules/*/*.json

A changed choice with both twins measured says which rule chose the faster
run; without them, only that the choice moved.
"""
import argparse
import json
from pathlib import Path

from auto_summary import fixed_runs, twin

from dearcomm import _auto


def replayed(run: dict):
    """(index the run chose, index this checkout chooses, shortlist), or None
    where the run confirmed nothing or confirmed another set of contenders
    (files from before two contenders were confirmed)."""
    confirmations = [tuple(c) for c in run.get("auto_confirmations") or ()]
    if not confirmations:
        return None
    shortlist = tuple((options, predicted) for options, predicted in run["auto_shortlist"])
    # Each round measures the contenders, then the reference (stored as such in newer files).
    order = list(dict.fromkeys(i for i, _ in confirmations))
    plan = _auto.AutoPlan(options=run["auto_options"], predicted_ms=run["auto_predicted_ms"],
                          default_ms=run["auto_default_ms"], candidates=len(shortlist), step=0, reason="replay",
                          network=None, profile=None, shortlist=shortlist, refined=True,
                          measured_ms=tuple(run["auto_measured_ms"]),
                          reference=run.get("auto_reference", order[-1]),
                          confirmations=tuple(confirmations))
    if tuple(order[:-1]) != plan.contenders():
        return None
    chose = next(i for i, (options, _) in enumerate(shortlist) if options == run["auto_options"])
    return chose, plan.choice()[0], shortlist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    replays = changed = 0
    for path in args.files:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "runs" not in data:
            continue
        runs = {n: r for n, r in data["runs"].items() if "skipped" not in r}
        fixed = fixed_runs(runs)
        ddp = runs.get("ddp", {}).get("median_ms")
        for name, run in runs.items():
            if name.split("/")[0] != "auto" or not (result := replayed(run)):
                continue
            replays += 1
            chose, now, shortlist = result
            if chose == now:
                continue
            changed += 1

            def measured(i: int) -> str:
                fixed_twin = twin(shortlist[i][0], fixed, data["args"]["bucket_mb"])
                if fixed_twin is None or not ddp:
                    return f"{_auto._describe(shortlist[i][0])} (predicted {shortlist[i][1]:.1f} ms; no fixed run)"
                return (f"{_auto._describe(shortlist[i][0])} (predicted {shortlist[i][1]:.1f} ms; fixed {fixed_twin} "
                        f"{ddp / fixed[fixed_twin]['median_ms']:.3f}x DDP)")
            print(f"{path} {name}:\n  chose {measured(chose)}\n  now   {measured(now)}")
    print(f"{replays} auto runs with confirmations replayed; {changed} would choose otherwise")


if __name__ == "__main__":
    main()
