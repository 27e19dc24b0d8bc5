"""How well the simulator predicts, and what choosing by prediction would give,
from train_bench.py --json files (each run's measured median and its
prediction: dearcomm.profile() of the model, collectives measured alone,
compute slowed by the factor measured beside an all-reduce).

    python benchmarks/prediction_summary.py results/validation/*.json

Per row: the prediction error of every dearcomm run (median of |error| and
the worst); the run the simulator ranks fastest among the runs measured
("pick": what dearcomm.plan() would choose from those candidates), its
measured time against the measured best and against DDP; the default
(dear-sharded) against DDP.
"""
import argparse
import json
import statistics
from pathlib import Path

CONTROLS = ("ddp", "fsdp2")  # not dearcomm runs: not candidates


def is_candidate(name: str) -> bool:
    return name.split("/")[0] not in CONTROLS and "@" not in name and not name.endswith("/sync")


def summarise(path: Path):
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "runs" not in data:
        return None  # not a train_bench.py file (a timeline)
    runs = {n: r for n, r in data["runs"].items() if "skipped" not in r}
    candidates = {n: r for n, r in runs.items() if is_candidate(n) and r.get("predicted_ms")}
    if not candidates:
        return None
    errors = {n: r["predicted_ms"] / r["median_ms"] - 1 for n, r in candidates.items()}
    worst = max(errors, key=lambda n: abs(errors[n]))
    pick = min(candidates, key=lambda n: candidates[n]["predicted_ms"])
    best = min(candidates, key=lambda n: candidates[n]["median_ms"])
    ddp = runs.get("ddp", {}).get("median_ms")
    default = candidates.get("dear-sharded", {}).get("median_ms")
    return dict(row=path.stem, network=data.get("network"), world=data["world_size"],
                slowdown=data.get("contention", {}).get("compute_slowdown"),
                median_abs_error=statistics.median(abs(e) for e in errors.values()), worst=worst,
                worst_error=errors[worst], within_10=sum(abs(e) <= 0.10 for e in errors.values()), runs=len(errors),
                pick=pick, pick_vs_best=candidates[pick]["median_ms"] / candidates[best]["median_ms"], best=best,
                pick_speedup=ddp / candidates[pick]["median_ms"] if ddp else None,
                best_speedup=ddp / candidates[best]["median_ms"] if ddp else None,
                default_speedup=ddp / default if ddp and default else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    rows = [r for r in map(summarise, args.files) if r]
    fmt = lambda x: f"{x:.3f}x" if x else "-"  # noqa: E731
    print("| row | κ | runs within 10% | median \\|error\\| | worst error | pick (by prediction) | "
          "pick's measured time vs best | pick vs DDP | best measured (vs DDP) | default dear vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['slowdown']:.2f} | {r['within_10']} of {r['runs']} | {r['median_abs_error']:.1%} | "
              f"{r['worst']} {r['worst_error']:+.1%} | {r['pick']} | {r['pick_vs_best']:.3f} | "
              f"{fmt(r['pick_speedup'])} | {r['best']} ({fmt(r['best_speedup'])}) | {fmt(r['default_speedup'])} |")
    if rows:
        errors = [abs(r["worst_error"]) for r in rows]
        print(f"\n{sum(r['within_10'] for r in rows)} of {sum(r['runs'] for r in rows)} runs predicted within 10%; "
              f"worst {max(errors):.1%}; the pick is within 5% of the measured best in "
              f"{sum(r['pick_vs_best'] <= 1.05 for r in rows)} of {len(rows)} rows")


if __name__ == "__main__":
    main()
