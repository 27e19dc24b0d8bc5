"""Is my communication actually overlapped? model.overlap_report() answers from
a window of measured iterations.

The engine traces its collectives (launch, completion, and when the training
thread waited for each) over `WINDOW` iterations after `WARMUP` ones; an
iteration runs from one step() end to the next. Per iteration:

    communication  the time some collective was in flight (the union of
                   launch-to-completion intervals)
    exposed        the time the training thread waited for a collective,
                   finishing it included (averaging, unpacking)
    bound          max(compute, communication): perfect overlap

The report gives the medians of iteration, communication and exposed
communication, and compute = iteration - exposed (forward, backward, step
and Python, as slowed by anything beside them). DEARCOMM_OVERLAP_REPORT=1 logs it on
rank 0 when the window is complete.

The window measures one configuration: with wrap()'s "auto" options it starts
once auto trains with its choice (not while it tries candidates), and every
later change of the options (auto's re-plan, deft's guard turning delays off)
measures them again; the last report stays available until the new one is
complete.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger("dearcomm")

WARMUP = 3   # iterations before the window: the first builds the engine and the allocator warms up
WINDOW = 10


@dataclasses.dataclass(frozen=True)
class OverlapReport:
    iterations: int
    iteration_ms: float
    compute_ms: float
    communication_ms: float
    exposed_ms: float
    """Communication the training thread waited for."""
    schedule: str
    per_iteration: Tuple[Tuple[float, float, float], ...] = ()
    """(iteration, communication, exposed) ms of each measured iteration."""
    best_plan: str = ""
    """wrap()'s "auto": the plan it chose (the simulator's best); "" without "auto"."""
    best_plan_ms: Optional[float] = None
    """... and its predicted iteration time."""

    @property
    def hidden(self) -> float:
        """The share of communication that ran beside compute (1: all of it).
        Exposed time counts the finishing work after a collective completes
        (averaging, unpacking), so on a fast link it can exceed the time in
        flight: none of it was hidden then, not less than none."""
        return max(0.0, 1.0 - self.exposed_ms / self.communication_ms) if self.communication_ms > 0 else 1.0

    @property
    def bound_ms(self) -> float:
        """Perfect overlap: the longer of compute and communication."""
        return max(self.compute_ms, self.communication_ms)

    def __str__(self) -> str:
        if self.bound_ms <= 0:
            return f"dearcomm overlap ({self.schedule}): nothing measured"
        finishing = (" (more than in flight: the waits include averaging and unpacking)"
                     if self.exposed_ms > self.communication_ms else "")
        best = (f"; the predicted best plan ({self.best_plan}) {self.best_plan_ms:.2f} ms" if self.best_plan
                else "; dearcomm.plan() or wrap()'s \"auto\" options predict the best plan")
        return (f"dearcomm overlap ({self.schedule}, median of {self.iterations} iterations): iteration "
                f"{self.iteration_ms:.2f} ms = compute {self.compute_ms:.2f} ms + exposed communication "
                f"{self.exposed_ms:.2f} ms{finishing}; communication {self.communication_ms:.2f} ms, "
                f"{self.hidden:.0%} hidden; "
                f"perfect overlap would take {self.bound_ms:.2f} ms ({self.iteration_ms / self.bound_ms:.2f}x that)"
                + best)


def _union_ns(intervals: List[Tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def overlap_of(events: Sequence[Dict], boundaries: Sequence[int], schedule: str = "") -> OverlapReport:
    """The report of traced collectives (engine.take_trace() dicts, steady
    clock ns) over the iterations between consecutive `boundaries` (ns)."""
    if len(boundaries) < 2:
        raise ValueError("dearcomm: an overlap report needs at least one whole iteration (two step() ends)")
    per = []
    for start, end in zip(boundaries, boundaries[1:]):
        busy, waited = [], 0
        for e in events:
            done = e["completed_ns"] if e["completed_ns"] >= 0 else e["wait_end_ns"]
            a, b = max(start, e["launched_ns"]), min(end, done)
            if b > a:
                busy.append((a, b))
            if e["wait_begin_ns"] >= 0:
                a, b = max(start, e["wait_begin_ns"]), min(end, e["wait_end_ns"])
                waited += max(0, b - a)
        per.append(((end - start) * 1e-6, _union_ns(busy) * 1e-6, waited * 1e-6))
    iteration, communication, exposed = (statistics.median(p[i] for p in per) for i in range(3))
    return OverlapReport(iterations=len(per), iteration_ms=iteration, compute_ms=max(0.0, iteration - exposed),
                         communication_ms=communication, exposed_ms=exposed, schedule=schedule,
                         per_iteration=tuple(per))


def _trying(runtime) -> bool:
    """wrap()'s "auto" options are measuring candidates, not training with a choice."""
    return runtime.auto is not None and not runtime.auto.settled


class OverlapMonitor:
    """Records the window for one wrapped model (the runtime calls step_ended())."""

    def __init__(self, runtime, warmup: int = WARMUP, window: int = WINDOW):
        self._runtime = weakref.ref(runtime)  # the runtime owns this: no cycle that delays its release
        self._warmup, self._window = warmup, window
        self._steps = 0
        self._boundaries: List[int] = []
        self._events: List[Dict] = []
        self._tracing = False  # this monitor turned the engine's trace on
        self._measured = None  # the options the window measures (None: whatever trains next)
        self._done = False     # their window is complete
        self.report: Optional[OverlapReport] = None
        self.unavailable = ""  # why there is no report, where there cannot be one
        self._log = os.environ.get("DEARCOMM_OVERLAP_REPORT", "0") not in ("", "0")

    def _restart(self, runtime, options) -> None:
        """Measures ``options`` (what the runtime trains with now) from their first step."""
        if self._tracing:
            runtime.engine.set_tracing(False)  # an engine rebuilt since starts without a trace
            self._tracing = False
        self._steps, self._boundaries, self._events = 0, [], []
        self._measured, self._done = options, False

    def step_ended(self) -> None:
        if self.unavailable:
            return
        runtime = self._runtime()
        if _trying(runtime):
            self._restart(runtime, None)  # auto tries candidates: measure what it settles on
            return
        if runtime.options != self._measured:
            self._restart(runtime, runtime.options)  # built anew: the step that did it warms up
        elif self._done:
            return  # these options are reported
        self._steps += 1
        engine = runtime.engine
        now = time.perf_counter_ns()  # CLOCK_MONOTONIC, as the engine's steady_clock
        if self._steps == self._warmup:
            if engine.tracing:
                self.unavailable = "a dearcomm.timeline.Timeline holds the engine's trace"
                return
            engine.set_tracing(True)
            self._tracing = True
            self._boundaries = [now]
            return
        if self._steps < self._warmup:
            return
        self._boundaries.append(now)
        self._events += engine.take_trace()
        if len(self._boundaries) > self._window:
            engine.set_tracing(False)
            self._tracing, self._done = False, True
            options = runtime.options
            self.report = overlap_of(self._events, self._boundaries, f"{options.schedule}/{options.update}")
            plans = runtime.auto.plans if runtime.auto is not None else []
            if plans:
                self.report = dataclasses.replace(self.report, best_plan=plans[-1].describe(),
                                                  best_plan_ms=plans[-1].predicted_ms)
            self._events = []
            if self._log and runtime.rank == 0:
                logger.info("%s", self.report)

    def give_trace_away(self, reason: str) -> None:
        """Someone else (a Timeline) takes the engine's trace from now on: no
        window is measured after this (a complete report stays)."""
        if not self.unavailable:
            self.unavailable = reason
            self._events = []
            self._tracing = False

    def get(self) -> OverlapReport:
        if self.report is not None:
            return self.report
        if self.unavailable:
            raise RuntimeError(f"dearcomm: no overlap report: {self.unavailable}")
        if _trying(self._runtime()):
            raise RuntimeError(f"dearcomm: no overlap report yet: wrap()'s \"auto\" options are measuring candidates; "
                               f"the report measures its choice over {self._warmup + self._window} optimizer.step()s "
                               "once it trains with it")
        left = self._warmup + self._window - self._steps
        raise RuntimeError(f"dearcomm: the overlap report needs {left} more optimizer.step()s "
                           f"({self._warmup} warm-up iterations, then {self._window} measured)")
