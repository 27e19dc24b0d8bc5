"""Tabulate an A/B of two builds from train_bench.py --json files named
ROW-BUILD-N.json (N: the repetition; builds alternate between repetitions).

    python benchmarks/ab_summary.py docs/results/executor-ab/four-ranks --a before --b after

Per row and run: each build's speedups over DDP (measured in the same
process as the run, so a slow process slows both), and a ÷ b of their
medians (> 1: b is slower). Per row: the median of those ratios over the
row's runs, which is what a "no row more than x% slower" target reads.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List


def load(directory: Path, build: str) -> Dict[str, Dict[str, List[float]]]:
    """{row: {run: [speedup over DDP per repetition]}} of one build."""
    pattern = re.compile(rf"^(?P<row>.+)-{re.escape(build)}-(?P<n>\d+)\.json$")
    rows: Dict[str, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(directory.glob("*.json"), key=lambda p: p.name):
        match = pattern.match(path.name)
        if not match:
            continue
        runs = json.loads(path.read_text())["runs"]
        for run, result in runs.items():
            if run != "ddp" and "speedup_vs_ddp" in result:
                rows[match["row"]][run].append(result["speedup_vs_ddp"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--a", default="before", help="the first build's name in the file names")
    parser.add_argument("--b", default="after", help="the second build's name in the file names")
    parser.add_argument("--limit", type=float, default=0.03, help="a row's allowed slow-down (default 3%%)")
    args = parser.parse_args()
    a, b = load(args.directory, args.a), load(args.directory, args.b)
    rows = sorted(set(a) & set(b))
    if not rows:
        raise SystemExit(f"ab_summary: no row has files of both builds in {args.directory}")
    print(f"| row | run | {args.a} (speedup over DDP) | {args.b} | {args.a} ÷ {args.b} |")
    print("|---|---|---|---|---|")
    verdicts = []
    for row in rows:
        ratios = []
        for run in a[row]:
            if run not in b[row]:
                continue
            ratio = statistics.median(a[row][run]) / statistics.median(b[row][run])
            ratios.append(ratio)
            fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
            print(f"| {row} | {run} | {fmt(a[row][run])} | {fmt(b[row][run])} | {ratio:.3f} |")
        row_ratio = statistics.median(ratios)
        verdicts.append((row, row_ratio, max(ratios)))
        print(f"| **{row}** | median of {len(ratios)} runs | | | **{row_ratio:.3f}** |")
    print()
    for row, ratio, worst in verdicts:
        status = "slower than allowed" if ratio > 1 + args.limit else "within"
        print(f"{row}: {args.a} ÷ {args.b} median {ratio:.3f} (worst run {worst:.3f}): {status} "
              f"{args.limit:.0%}")


if __name__ == "__main__":
    main()
