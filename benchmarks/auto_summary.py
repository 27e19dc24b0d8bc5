"""wrap()'s "auto" against the best fixed configuration of each row, the
default, torch DDP and DeAR's own tuner (dear-bo), from train_bench.py --json
files whose runs include auto and dear-bo (benchmarks/run_schedules.sh):

    python benchmarks/auto_summary.py results/schedules/*.json

Per row: DDP's median; the default (dear-sharded) and the best fixed run
(every run of the row but auto, dear-bo, DDP and deft, whose
delayed gradients change what training computes) as speedups over DDP;
auto's speedup, its time against the best fixed run's, what it chose and
what choosing cost (rank 0's probing, profiling and simulation, then the
training steps that measured its shortlist); where auto chose the options of
one of the row's fixed runs, that run's speedup beside it ("= dear-sharded/p4
1.15x"): two runs of one configuration in one process, so their difference is
this machine's noise, not auto's choice; the same for dear-bo (its 10
trials). Targets: auto within 5% of the best fixed run, >= 1.15x DDP on a
communication-bound row (all-reduce alone longer than backward), and no
more than 5% slower than DDP on a compute-bound one.
"""
import argparse
import json
from pathlib import Path

from train_bench import parse_run

# deft trains on delayed gradients (another computation): "auto" considers it
# only when given max_delay, which the auto run here is not; so it is no
# fixed configuration auto is held to.
NOT_FIXED = ("ddp", "auto", "dear-bo", "fsdp2", "ddp+gather", "deft")


def fixed_runs(runs: dict) -> dict:
    """The row's fixed configurations auto is held to; a second timing of
    a run ('X/again') is the same configuration, not another candidate."""
    return {n: r for n, r in runs.items() if n.split("/")[0] not in NOT_FIXED and not n.endswith("/again")}


def twin(chosen: dict, fixed: dict, bucket_mb: float):
    """The fixed run whose options auto chose, if any (usbyte and deft plan
    their own blocks and delays, so no run of theirs is auto's twin)."""
    for name in fixed:
        schedule, update, partition, credit = parse_run(name)
        if schedule in ("usbyte", "deft"):
            continue
        if (chosen.get("schedule"), chosen.get("update"), chosen.get("bucket_mb"), chosen.get("partition_mb"),
                chosen.get("credit_mb")) == (schedule, update, bucket_mb, partition, credit):
            return name
    return None


def first_trials(auto: dict) -> str:
    """The first candidate's two trials against its prediction (measured ÷
    predicted), where it was measured twice (the second counts)."""
    first = auto.get("auto_first_trial_ms")
    if first is None or not auto.get("auto_shortlist"):
        return "-"
    predicted = auto["auto_shortlist"][0][1]
    return f"{first / predicted:.2f}, {auto['auto_measured_ms'][0] / predicted:.2f}"


def row(path: Path):
    data = json.loads(path.read_text())
    runs = {n: r for n, r in data.get("runs", {}).items() if "skipped" not in r}
    if "auto" not in runs or "ddp" not in runs:
        return None
    ddp = runs["ddp"]["median_ms"]
    fixed = fixed_runs(runs)
    best = min(fixed, key=lambda n: fixed[n]["median_ms"])
    auto, bo = runs["auto"], runs.get("dear-bo")
    comm_bound = runs["ddp"]["comm_ms"]["ar"] > data["pieces_ms"]["bwd"]
    speedup = ddp / auto["median_ms"]
    vs_best = auto["median_ms"] / fixed[best]["median_ms"]
    met = vs_best <= 1.05 and (speedup >= 1.15 if comm_bound else speedup >= 1 / 1.05)
    planned = {"blocks": "parameters in blocks", "priorities": "parameters ranked", "delays": "parameters delayed"}
    chosen = " ".join(f"{k}=<{len(v)} {planned[k]}>" if k in planned else f"{k}={v}"
                      for k, v in auto["auto_options"].items() if v is not None)
    same = twin(auto["auto_options"], fixed, data["args"]["bucket_mb"])
    if same:
        chosen += f" (= {same} {ddp / fixed[same]['median_ms']:.2f}x)"
    return dict(row=path.stem, kind="comm" if comm_bound else "compute", ddp=ddp,
                default=ddp / runs["dear-sharded"]["median_ms"] if "dear-sharded" in runs else None,
                best=best, best_x=ddp / fixed[best]["median_ms"], auto_x=speedup, vs_best=vs_best, chosen=chosen,
                cost=f"{auto['auto_planning_s']:.1f} s + {auto['auto_trials_s']:.1f} s "
                     f"({len(auto['auto_measured_ms'])} candidates)",
                first=first_trials(auto),
                bo_x=ddp / bo["median_ms"] if bo else None,
                bo_vs_best=bo["median_ms"] / fixed[best]["median_ms"] if bo else None,
                bo_cost=f"{bo['bo_tuning_s']:.1f} s, bucket_mb={bo['bo_bucket_mb']:.1f}" if bo else "-", met=met)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    rows = [r for r in map(row, parser.parse_args().files) if r]
    print("| row | bound | DDP ms | default dear | best fixed | auto | auto vs best | auto chose | auto's cost "
          "(plan + trials) | first candidate ÷ predicted (1st, 2nd trial) | dear-bo | dear-bo vs best | dear-bo's cost "
          "| auto's targets |")
    print("|---" * 14 + "|")
    for r in rows:
        default = f"{r['default']:.2f}x" if r["default"] else "-"
        bo = f"{r['bo_x']:.2f}x | {r['bo_vs_best']:.3f}" if r["bo_x"] else "- | -"
        print(f"| {r['row']} | {r['kind']} | {r['ddp']:.0f} | {default} | {r['best']} {r['best_x']:.2f}x | "
              f"**{r['auto_x']:.2f}x** | {r['vs_best']:.3f} | {r['chosen']} | {r['cost']} | {r['first']} | {bo} | {r['bo_cost']} | "
              f"{'met' if r['met'] else '**missed**'} |")
    if rows:
        print(f"\nauto met its targets on {sum(r['met'] for r in rows)} of {len(rows)} rows; within 5% of the best "
              f"fixed run on {sum(r['vs_best'] <= 1.05 for r in rows)}; dear-bo within 5% on "
              f"{sum(r['bo_vs_best'] is not None and r['bo_vs_best'] <= 1.05 for r in rows)}")


if __name__ == "__main__":
    main()
