"""A timeline of a few iterations on one rank: compute spans and collectives,
for Chrome trace JSON (Perfetto) and PNG Gantt charts. Off unless attached;
when on it costs a clock read per module forward and per collective.

    timeline = Timeline()
    timeline.attach(model)                # a dearcomm model, or any nn.Module
    ddp.register_comm_hook(None, timeline.ddp_comm_hook)   # torch DDP's all-reduces
    with timeline.span("compute", "backward"):
        loss.backward()
    timeline.collect()                    # pulls the engine's collectives
    write_chrome_trace("trace.json", {"dear": gather_events(timeline)})  # every rank's events

Lanes: "compute" (forward per module, backward, step), "reduce" (reduce-scatter
or all-reduce) and "gather" (all-gather). A collective spans launch to
completion (gloo reports it), or to the end of its wait where completion is
unknown (NCCL).
"""

import contextlib
import json
import time
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

LANES = ("compute", "reduce", "gather")
_LANE_OF = {"reduce_scatter": "reduce", "all_reduce": "reduce", "all_gather": "gather"}


class Timeline:
    def __init__(self) -> None:
        self.events: List[Dict] = []  # lane, name, start_ns, end_ns
        self._runtime = None
        self._open: Dict[nn.Module, int] = {}

    # ---- recording ------------------------------------------------------------

    def add(self, lane: str, name: str, start_ns: int, end_ns: int) -> None:
        self.events.append(dict(lane=lane, name=name, start_ns=start_ns, end_ns=end_ns))

    @contextlib.contextmanager
    def span(self, lane: str, name: str) -> Iterator[None]:
        start = time.perf_counter_ns()  # CLOCK_MONOTONIC, as C++'s steady_clock
        try:
            yield
        finally:
            self.add(lane, name, start, time.perf_counter_ns())

    def attach(self, model: nn.Module) -> "Timeline":
        """Forward spans of every module that owns parameters; for a dearcomm
        model also the engine's collectives (see collect())."""
        module = model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
        for name, sub in module.named_modules():
            if any(True for _ in sub.parameters(recurse=False)):
                sub.register_forward_pre_hook(lambda m, a: self._open.__setitem__(m, time.perf_counter_ns()))
                sub.register_forward_hook(
                    lambda m, a, o, name=name: self.add("compute", f"fwd {name}", self._open.pop(m, 0),
                                                        time.perf_counter_ns()))
        runtime = getattr(model, "_dear", None)
        if runtime is not None:
            self._runtime = runtime
            runtime.overlap.give_trace_away("a dearcomm.timeline.Timeline took the engine's trace")
            if runtime.engine is not None:
                runtime.engine.set_tracing(True)
            else:
                runtime.on_engine_built.append(lambda engine: engine.set_tracing(True))
        return self

    def collect(self) -> None:
        """Moves the engine's recorded collectives into this timeline."""
        if self._runtime is None or self._runtime.engine is None:
            return
        for e in self._runtime.engine.take_trace():
            end = e["completed_ns"] if e["completed_ns"] >= 0 else e["wait_end_ns"]
            self.add(_LANE_OF[e["kind"]], f"{e['kind']}[bucket {e['bucket']}]", e["launched_ns"], end)

    def ddp_comm_hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP communication hook: DDP's own all-reduce (average), timed."""
        start = time.perf_counter_ns()
        buffer = bucket.buffer()
        world = dist.get_world_size()
        future = dist.all_reduce(buffer, async_op=True).get_future()

        def done(f):
            self.add("reduce", f"all_reduce[bucket {bucket.index()}]", start, time.perf_counter_ns())
            return f.value()[0].div_(world)
        return future.then(done)

    def clear(self) -> None:
        self.events.clear()
        if self._runtime is not None and self._runtime.engine is not None:
            self._runtime.engine.take_trace()


# ---- export ----------------------------------------------------------------------

def write_chrome_trace(path: str, runs: Dict[str, Sequence[Sequence[Dict]]]) -> None:
    """runs: {label: [events of rank 0, events of rank 1, ...]} -> Chrome trace
    JSON (chrome://tracing, ui.perfetto.dev): one process per label and rank,
    one thread per lane."""
    t0 = min((e["start_ns"] for ranks in runs.values() for events in ranks for e in events), default=0)
    trace = []
    for p, (label, ranks) in enumerate(runs.items()):
        for rank, events in enumerate(ranks):
            pid = p * 100 + rank
            trace.append(dict(ph="M", name="process_name", pid=pid, args=dict(name=f"{label} rank {rank}")))
            for tid, lane in enumerate(LANES):
                trace.append(dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=lane)))
            for e in events:
                trace.append(dict(ph="X", name=e["name"], pid=pid, tid=LANES.index(e["lane"]),
                                  ts=(e["start_ns"] - t0) / 1e3, dur=max(e["end_ns"] - e["start_ns"], 0) / 1e3))
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def plot_gantt(path: str, runs: Dict[str, Sequence[Dict]], title: str = "") -> None:
    """runs: {label: events of one rank}; one panel per label, lanes as rows,
    each panel's time measured from its own first event."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"compute": "#4C72B0", "reduce": "#DD8452", "gather": "#55A868"}
    shades = {"fwd": "#8FB3DE", "forward+loss": "#6C8EBF", "backward": "#2F4B7C", "step": "#8172B3"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.3 + 1.1 * len(runs)), squeeze=False, sharex=True)
    for ax, (label, events) in zip(axes[:, 0], runs.items()):
        t0 = min((e["start_ns"] for e in events), default=0)
        for row, lane in enumerate(LANES):
            mine = [e for e in events if e["lane"] == lane]
            spans = [((e["start_ns"] - t0) / 1e6, max(e["end_ns"] - e["start_ns"], 1) / 1e6) for e in mine]
            faces = [shades.get(e["name"].split(" ")[0].split("[")[0], colors[lane]) for e in mine]
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=faces, edgecolors="white", linewidth=0.3)
        ax.set_yticks(range(len(LANES)), LANES)
        ax.set_ylim(-0.6, len(LANES) - 0.4)
        ax.invert_yaxis()
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontweight="bold")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time (ms)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gather_events(timeline: Timeline, group: Optional[dist.ProcessGroup] = None) -> List[List[Dict]]:
    """Every rank's events, on every rank (a collective)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, timeline.events, group=group)
    return everyone
