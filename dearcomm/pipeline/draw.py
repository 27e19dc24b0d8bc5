"""Pictures of simulated pipeline iterations, in the style of
dearcomm.timeline's Gantt charts: one panel per plan, for every device a
compute row (forward light, backward dark, micro-batch numbers inside) and a
comm row (activation / gradient sends, the replicas' all-reduce); a
transfer's CPU work on its endpoints (Topology.transfer_cpu) shows in the
compute row, grey."""
from __future__ import annotations

import json
from typing import Dict

from .simulate import SimResult

_FACE = {"F": "#8FB3DE", "B": "#2F4B7C", "act": "#55A868", "grad": "#8C613C", "allreduce": "#DD8452",
         "cpu": "#A0A0A0"}


def _row(span) -> str:
    # CPU work of a transfer occupies the device's compute.
    return "compute" if span.lane == "cpu" else span.lane


def draw_timeline(path: str, runs: Dict[str, SimResult], title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [2 * len({s.device for s in r.spans}) for r in runs.values()]
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 1.2 + 0.32 * sum(heights) + 0.4 * len(runs)),
                             squeeze=False, sharex=True, gridspec_kw=dict(height_ratios=[max(h, 2) for h in heights]))
    for ax, (label, result) in zip(axes[:, 0], runs.items()):
        devices = sorted({s.device for s in result.spans})
        rows = [(d, lane) for d in devices for lane in ("compute", "comm")]
        for row, (d, lane) in enumerate(rows):
            mine = [s for s in result.spans if s.device == d and _row(s) == lane]
            ax.broken_barh([(s.start_ms, max(s.end_ms - s.start_ms, 1e-3)) for s in mine], (row - 0.4, 0.8),
                           facecolors=[_FACE[s.kind] for s in mine], edgecolors="white", linewidth=0.3)
            if lane == "compute":
                for s in mine:
                    if s.kind in ("F", "B") and s.end_ms - s.start_ms > result.makespan_ms / 120:
                        ax.text((s.start_ms + s.end_ms) / 2, row, str(s.task.microbatch), ha="center",
                                va="center", fontsize=6, color="white" if s.kind == "B" else "black")
        ax.set_yticks(range(len(rows)), [f"dev {d} {lane}" for d, lane in rows], fontsize=7)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.invert_yaxis()
        ax.set_title(f"{label}: {result.makespan_ms:.1f} ms", fontsize=9, loc="left", fontweight="bold")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in _FACE.items()], loc="upper right", ncol=5, fontsize=7)
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_chrome_trace(path: str, runs: Dict[str, SimResult]) -> None:
    """The same spans as Chrome trace JSON (ui.perfetto.dev): one process per
    plan and device, threads compute / comm."""
    trace = []
    for p, (label, result) in enumerate(runs.items()):
        for d in sorted({s.device for s in result.spans}):
            pid = p * 1000 + d
            trace.append(dict(ph="M", name="process_name", pid=pid, args=dict(name=f"{label} dev {d}")))
            for tid, lane in enumerate(("compute", "comm")):
                trace.append(dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=lane)))
        for s in result.spans:
            name = f"{s.kind} {s.task}" if s.task is not None else s.kind
            trace.append(dict(ph="X", name=name, pid=p * 1000 + s.device, tid=0 if _row(s) == "compute" else 1,
                              ts=s.start_ms * 1e3, dur=(s.end_ms - s.start_ms) * 1e3))
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
