"""How far two runs of the same rows lie apart: each configuration's median
in run A and in run B (train_bench.py --json files of the same names in two
directories), B over A; auto and dear-bo left out (they choose anew each run).
What a prediction error of a few percent has to be read against.

    python benchmarks/run_to_run.py docs/results/schedules/loopback-4-ranks \
        docs/results/schedules/loopback-4-ranks-shared-cores
"""
import argparse
import json
import statistics
from pathlib import Path

CHOOSING = ("auto", "dear-bo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the first run's directory")
    parser.add_argument("b", type=Path, help="the second run's directory")
    args = parser.parse_args()
    rows = []
    for path in sorted(args.b.glob("*.json")):
        first = args.a / path.name
        b = json.loads(path.read_text())
        if not first.exists() or not isinstance(b, dict) or "runs" not in b:
            continue
        a = json.loads(first.read_text())["runs"]
        for name, run in b["runs"].items():
            if name in a and name not in CHOOSING and "median_ms" in run and "median_ms" in a[name]:
                rows.append((path.stem, name, a[name]["median_ms"], run["median_ms"]))
    if not rows:
        raise SystemExit(f"no configuration measured in both {args.a} and {args.b}")
    print(f"| row | run | {args.a.name} ms | {args.b.name} ms | B / A |")
    print("|---|---|---|---|---|")
    for row, name, ma, mb in rows:
        print(f"| {row} | {name} | {ma:.1f} | {mb:.1f} | {mb / ma - 1:+.1%} |")
    apart = [abs(mb / ma - 1) for *_, ma, mb in rows]
    print(f"\n{len(rows)} configurations: median |B / A - 1| {statistics.median(apart):.1%}, largest {max(apart):.1%}, "
          f"{sum(x > 0.10 for x in apart)} more than 10% apart")


if __name__ == "__main__":
    main()
