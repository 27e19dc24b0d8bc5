"""Where the time goes in train_bench.py's timelines (Chrome JSON from
--timeline): per run, rank 0, medians over the three traced iterations of the
forward (with its waits and, for replicated/bytescheduler, the updates),
backward and step spans, and the channel's busy time per iteration (union of
every collective's launch-to-completion span), against the collectives alone.

    python benchmarks/trace_stats.py docs/results/schedules/shared-cores/timeline-mlp-1gbit-2.json [--bench mlp-1gbit-2.json]
"""
import argparse
import json
import statistics
from collections import defaultdict


def union_ms(spans):
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--bench", help="train_bench JSON of the same run: comm alone for comparison")
    args = parser.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    per = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.get("ph") != "X" or not names[e["pid"]].endswith(" rank 0"):
            continue
        run = names[e["pid"]][: -len(" rank 0")]
        lane = lanes[(e["pid"], e["tid"])]
        key = e["name"] if lane == "compute" and not e["name"].startswith("fwd ") else lane
        per[run][key].append((e["ts"], e["ts"] + e["dur"]))
    alone = {}
    if args.bench:
        with open(args.bench) as f:
            bench = json.load(f)
        alone = {n: r["comm_ms"] for n, r in bench["runs"].items()}
    print(f"{'run':<24}{'fwd':>8}{'bwd':>8}{'step':>7}{'iter':>8}{'comm busy':>10}{'comm alone':>11}  (ms per iteration, rank 0)")
    for run, lanes_ in per.items():
        fwd = [e - s for s, e in lanes_["forward+loss"]]
        bwd = [e - s for s, e in lanes_["backward"]]
        step = [e - s for s, e in lanes_["step"]]
        starts = sorted(s for s, _ in lanes_["forward+loss"])
        ends = sorted(e for _, e in lanes_["step"])
        it = (ends[-1] - starts[0]) / len(starts) / 1e3 if starts and ends else float("nan")
        comm = union_ms(lanes_["reduce"] + lanes_["gather"]) / max(1, len(starts))
        c = alone.get(run)
        ref = (c["rs"] + c["ag"]) if c and run.startswith("dear") else (c["ar"] if c else float("nan"))
        med = lambda xs: statistics.median(xs) / 1e3 if xs else float("nan")  # noqa: E731
        print(f"{run:<24}{med(fwd):>8.1f}{med(bwd):>8.1f}{med(step):>7.1f}{it:>8.1f}{comm:>10.1f}{ref:>11.1f}")


if __name__ == "__main__":
    main()
