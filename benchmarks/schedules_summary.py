"""Summary of train_bench.py JSONs: one line per (model, ranks, batch),
each run's median ms, speedup over DDP (DDP time / run time, > 1 = faster) and
efficiency (ideal / measured), and the targets: where communication exceeds
backward (T_AR > T_bwd) the best dearcomm run >= 1.15x DDP; elsewhere no run
more than 5% slower than DDP (speedup >= 1/1.05).

    python benchmarks/schedules_summary.py docs/results/schedules/quiet-machine/*.json [--markdown]
"""
import argparse
import json
import os
import re


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        if "runs" not in d or "pieces_ms" not in d:
            continue
        d["path"] = os.path.basename(path)
        rows.append(d)
    return rows


def dearcomm_runs(runs):
    """The runs the targets judge: every dearcomm schedule, not DDP nor the
    ddp+gather control."""
    return {n: r for n, r in runs.items() if not n.startswith("ddp")}


def first_module_ar(run):
    """T_AR of the input-side module's buckets; files older than that figure
    hold bucket 0's alone (marked so)."""
    comm = run["comm_ms"]
    return f"{comm['ar_m0']:.0f}" if "ar_m0" in comm else f"{comm['ar0']:.0f} (bucket 0)"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--wide", action="store_true", help="one markdown row per file: ms (speedup, efficiency) per run")
    args = parser.parse_args()
    if args.wide:
        return wide(load(args.paths))
    for d in load(args.paths):
        runs, pieces = d["runs"], d["pieces_ms"]
        ar = runs["ddp"]["comm_ms"]["ar"]
        ratio = ar / pieces["bwd"]
        bound = ratio > 1
        others = dearcomm_runs(runs)
        best = max(others, key=lambda n: others[n]["speedup_vs_ddp"])
        worst = min(others, key=lambda n: others[n]["speedup_vs_ddp"])
        if bound:
            verdict = f"comm-bound: best {best} {others[best]['speedup_vs_ddp']:.2f}x " + \
                      ("MET (>= 1.15x)" if others[best]["speedup_vs_ddp"] >= 1.15 else "MISSED (< 1.15x)")
        else:
            verdict = f"compute-bound: slowest {worst} {others[worst]['speedup_vs_ddp']:.2f}x " + \
                      ("MET (>= 0.95x)" if others[worst]["speedup_vs_ddp"] >= 1 / 1.05 else "MISSED (> 5% slower)")
        head = (f"{d['model']} {d['world_size']} ranks batch {d['args']['batch']}: T_fwd {pieces['fwd']:.0f} "
                f"T_bwd {pieces['bwd']:.0f} T_step {pieces['step']:.0f} T_AR {ar:.0f} ms, C/T_bwd {ratio:.2f}; "
                f"load {d.get('loadavg_start', [0])[0]:.1f}-{d.get('loadavg_end', [0])[0]:.1f}; {verdict}")
        if args.markdown:
            print(f"\n**{head}**\n")
            print("| run | median ms | p10–p90 | speedup vs DDP | ideal ms | efficiency | CPU ms/iter | T_AR(m0) |")
            print("|---|---|---|---|---|---|---|---|")
            for n, r in runs.items():
                print(f"| {n} | {r['median_ms']:.0f} | {r['p10_ms']:.0f}–{r['p90_ms']:.0f} | {r['speedup_vs_ddp']:.2f}x | "
                      f"{r['ideal_ms']:.0f} | {r['efficiency']:.2f} | {r['cpu_ms']:.0f} | {first_module_ar(r)} |")
        else:
            print(head)
            for n, r in runs.items():
                print(f"  {n:<24}{r['median_ms']:>8.0f} ms {r['speedup_vs_ddp']:>6.2f}x  eff {r['efficiency']:.2f}")


def wide(files):
    """Columns: runs with their partition size written /p (the row says which);
    /c64 is the default credit, so bytescheduler/pP/c64 is the bytescheduler/p column."""
    col = lambda n: re.sub(r"/p[0-9.]+", "/p", n).replace("/c64", "")  # noqa: E731
    names = []
    for d in files:
        names += [col(n) for n in d["runs"] if col(n) not in names]
    print("| row | /p = | C/T_bwd | load | " + " | ".join(names) + " | target |")
    print("|---" * (len(names) + 5) + "|")
    for d in files:
        runs, pieces = d["runs"], d["pieces_ms"]
        ratio = runs["ddp"]["comm_ms"]["ar"] / pieces["bwd"]
        others = {n: r["speedup_vs_ddp"] for n, r in dearcomm_runs(runs).items()}
        if ratio > 1:
            best = max(others, key=others.get)
            target = f"comm-bound: best {best} {others[best]:.2f}x: " + ("met" if others[best] >= 1.15 else "**missed**")
        else:
            worst = min(others, key=others.get)
            target = f"compute-bound: slowest {worst} {others[worst]:.2f}x: " + \
                ("met" if others[worst] >= 1 / 1.05 else "**missed**")
        cells = []
        by_col = {col(n): r for n, r in runs.items()}
        parts = sorted({m for n in runs for m in re.findall(r"/p([0-9.]+)", n)})
        for n in names:
            r = by_col.get(n)
            cells.append("–" if r is None else f"{r['median_ms']:.0f} / {r['speedup_vs_ddp']:.2f}x / {r['efficiency']:.2f}")
        load = f"{d.get('loadavg_start', [0])[0]:.1f}–{d.get('loadavg_end', [0])[0]:.1f}"
        print(f"| {d['path'][:-5]} | {','.join(parts)} MiB | {ratio:.2f} | {load} | " + " | ".join(cells) + f" | {target} |")


if __name__ == "__main__":
    main()
