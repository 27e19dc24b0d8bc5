"""Where the ranks outnumber the cores: each run's measured iteration against
the prediction, against the simulated device's CPU bound alone (the
prediction's cpu_ms: the compute as profiled in step plus each collective's
host CPU at the cores' share; no timeline, no slowest-rank spread), and
against the process's CPU per iteration times the ranks per core.

    python benchmarks/cpu_bound_check.py docs/results/schedules/loopback-4-ranks/*.json
"""
import argparse
import json
import os
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="train_bench.py --json files")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores the ranks shared (default: these)")
    args = parser.parse_args()
    rows = []
    for path in args.files:
        d = json.load(open(path))
        share = d["world_size"] / args.cores
        for name, r in d["runs"].items():
            if not isinstance(r, dict) or r.get("predicted_ms") is None or r.get("predicted_cpu_ms") is None:
                continue
            m = r["median_ms"]
            rows.append((os.path.basename(path)[:-5], name, m, r["predicted_ms"] / m - 1,
                         r["predicted_cpu_ms"] / m - 1, share * r["cpu_ms"] / m))
    print("| row | run | measured ms | prediction | CPU bound alone | ranks per core x process CPU / measured |")
    print("|---|---|---|---|---|---|")
    for row, run, m, pred, bound, cpu in rows:
        print(f"| {row} | {run} | {m:.1f} | {pred * 100:+.1f}% | {bound * 100:+.1f}% | {cpu:.3f} |")
    print()
    for k, label in ((3, "prediction"), (4, "CPU bound alone")):
        errors = [r[k] for r in rows]
        print(f"{label}: {sum(abs(e) <= 0.10 for e in errors)} of {len(errors)} runs within 10%, "
              f"median {statistics.median(errors) * 100:+.1f}%")
    ratios = sorted(r[5] for r in rows)
    print(f"ranks per core x process CPU / measured: median {statistics.median(ratios):.3f} "
          f"({ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
