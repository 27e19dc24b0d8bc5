"""How much a collective in flight slows the compute beside it, as one
measured factor for the simulator (Network.compute_slowdown).

On a CPU, gloo's transport and dearcomm's summing run on the cores that
compute: a forward+backward that takes w seconds alone takes longer while a
collective runs. The simulator models that as compute running κ times slower
while its channel is busy. benchmarks/contention.py times compute iterations
alone and beside a stream of collectives, and records for each iteration the
fraction c of its wall time the channel was busy; an iteration of work w
that took `wall` then spent wall·(1-c) alone and did the rest of its work at
1/κ speed:

    w = wall·(1-c) + wall·c/κ   =>   κ = wall·c / (w - wall·(1-c))

fit_compute_slowdown() solves that per iteration (w: the median alone) and
takes the median over iterations the channel covered for at least half.

The other direction (Network.comm_slowdown, λ): the same benchmark times the
collective alone and back to back beside the compute loop, which covers it
whole; fit_comm_slowdown() takes the ratio of the medians (at least 1).

And the CPU each takes beside the other: the collectives' (ν: the
process's CPU per all-reduce beside compute, all of it less the compute's,
over its CPU alone; fit_comm_cpu_slowdown()) and the compute's (μ: the
compute thread's CPU per iteration beside collectives over alone;
fit_compute_cpu_slowdown()), each at least 1, and the whole machine's CPU
over the phases. Neither is its wall factor: on loopback, 2 ranks on 2
cores, an all-reduce's wall stretched 1.2-2.1x beside compute where its CPU
grew 1.0-1.3x. The simulator's CPU bound charges each part at them
(Network.comm_cpu_slowdown, compute_cpu_slowdown).

And how much a compute iteration varies (fit_iteration_cv: the standard
deviation of the iterations alone over their median, robustly): the ranks meet every
iteration, so one takes the slowest rank's (Network.iteration_cv).
with_contention() puts every factor measured into a Network: what wrap()'s
"auto" and the benchmarks predict with. Charged at ν and μ with that
spread, the bound put 305 of 320 loopback runs and 24 of 32 rows within
10% over eight runs; charged at λ without it, 291 and 23
(docs/benchmarks.md).

    fit = dearcomm.fit_compute_slowdown("results/contention.json")
    network = dataclasses.replace(dearcomm.network_preset("10gbe"), compute_slowdown=fit.slowdown)

measure_contention() takes those measurements on a process group (the
benchmark and wrap()'s "auto" call it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ._cpu_switches import cpu_backend
from ._lockstep import Lockstep
from .prediction import _check_number

MIN_COVERAGE = 0.5  # below it, κ's estimate divides by a small difference: too noisy to use


@dataclasses.dataclass(frozen=True)
class SlowdownFit:
    slowdown: float
    """κ >= 1: compute takes κ times longer while a collective runs."""
    alone_ms: float
    """Median compute iteration alone."""
    used: int
    """Iterations beside collectives that entered the estimate."""
    spread: Tuple[float, float]
    """The lowest and highest per-iteration estimate used."""

    def __str__(self) -> str:
        return (f"compute_slowdown {self.slowdown:.3f} (median of {self.used} iterations, "
                f"range {self.spread[0]:.3f}-{self.spread[1]:.3f}; compute alone {self.alone_ms:.2f} ms)")


def _positive(value, what: str) -> float:
    _check_number(what, value, allow_zero=False)
    return float(value)


def fit_compute_slowdown(measurements: Union[str, Path, dict, None] = None, *,
                         alone_s: Optional[Sequence[float]] = None,
                         beside: Optional[Sequence[Tuple[float, float]]] = None) -> SlowdownFit:
    """κ from benchmarks/contention.py's JSON (a path or its dict), or from
    `alone_s` (compute iterations alone, seconds) and `beside` ((wall seconds,
    fraction of it the channel was busy) per iteration beside collectives)."""
    if measurements is not None:
        data = measurements
        if not isinstance(data, dict):
            try:
                data = json.loads(Path(measurements).read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"dearcomm: {measurements} is not JSON: {e}") from None
        try:
            alone_s, beside = data["alone_s"], [tuple(x) for x in data["beside"]]
        except (KeyError, TypeError):
            raise ValueError(f"dearcomm: {measurements if not isinstance(measurements, dict) else 'the dict'} "
                             "has no 'alone_s' and 'beside' lists (benchmarks/contention.py --json writes them)"
                             ) from None
    if not alone_s or not beside:
        raise ValueError("dearcomm: fit_compute_slowdown needs compute iterations alone and beside collectives")
    alone = [_positive(t, "a compute time alone") for t in alone_s]
    w = statistics.median(alone)
    estimates = []
    for wall, covered in beside:
        wall = _positive(wall, "a compute time beside collectives")
        ok = isinstance(covered, (int, float)) and not isinstance(covered, bool) and 0 <= covered <= 1
        if not ok:
            raise ValueError(f"dearcomm: the busy fraction of an iteration must be in [0, 1], got {covered!r}")
        if covered < MIN_COVERAGE:
            continue
        alone_part = wall * (1 - covered)
        if w - alone_part <= 0:  # took no longer than alone: no slowdown, within noise
            estimates.append(1.0)
            continue
        estimates.append(max(1.0, wall * covered / (w - alone_part)))
    if not estimates:
        raise ValueError(f"dearcomm: no iteration beside collectives was covered for at least {MIN_COVERAGE:.0%} "
                         "of its time; run longer collectives (benchmarks/contention.py --mib)")
    return SlowdownFit(slowdown=statistics.median(estimates), alone_ms=w * 1e3, used=len(estimates),
                       spread=(min(estimates), max(estimates)))


def fit_comm_slowdown(alone_s: Sequence[float], beside_s: Sequence[float]) -> float:
    """λ >= 1: how many times longer a collective takes while compute runs
    beside it, from its times alone and beside compute (seconds; the
    ``comm_alone_s`` and ``comm_beside_s`` lists of benchmarks/contention.py)."""
    if not alone_s or not beside_s:
        raise ValueError("dearcomm: fit_comm_slowdown needs collective times alone and beside compute")
    alone = statistics.median(_positive(t, "a collective's time alone") for t in alone_s)
    beside = statistics.median(_positive(t, "a collective's time beside compute") for t in beside_s)
    return max(1.0, beside / alone)


def fit_comm_cpu_slowdown(alone_cpu_s: Sequence[float], beside_cpu_s: float, beside_count: int) -> float:
    """ν >= 1: how many times its CPU alone a collective's CPU takes beside
    compute, from the process's CPU of single all-reduces alone (seconds; the
    ``comm_alone_cpu_s`` list) and the CPU the collectives took over
    ``beside_count`` of them beside compute (``beside_comm_cpu_s``)."""
    return _cpu_ratio("fit_comm_cpu_slowdown", "a collective's CPU alone", "the collectives' CPU beside compute",
                      alone_cpu_s, beside_cpu_s, beside_count)


def fit_compute_cpu_slowdown(alone_cpu_s: Sequence[float], beside_cpu_s: float, beside_iterations: int) -> float:
    """μ >= 1: how many times its CPU alone compute takes beside collectives,
    from the compute thread's CPU of iterations alone (seconds; the
    ``alone_cpu_s`` list) and its CPU over ``beside_iterations`` iterations
    beside collectives (``beside_compute_cpu_s``)."""
    return _cpu_ratio("fit_compute_cpu_slowdown", "a compute iteration's CPU alone",
                      "the compute's CPU beside collectives", alone_cpu_s, beside_cpu_s, beside_iterations)


def fit_iteration_cv(alone_s: Sequence[float]) -> float:
    """How much one rank's compute iteration varies: the standard deviation
    of its times alone (seconds; the ``alone_s`` list, every rank starting
    each iteration together) over their median, the deviation estimated as
    1.4826 x the median absolute deviation (a normal's): one slow first
    iteration among six does not move it; 0 under two."""
    times = [_positive(t, "a compute time alone") for t in alone_s]
    if len(times) < 2:
        return 0.0
    middle = statistics.median(times)
    return 1.4826 * statistics.median(abs(t - middle) for t in times) / middle


# What measure_contention() measures that a Network takes, by its field names:
# κ, λ, ν, μ and the compute's cv.
FACTORS = ("compute_slowdown", "comm_slowdown", "comm_cpu_slowdown", "compute_cpu_slowdown", "iteration_cv")


def with_contention(network, measured: dict):
    """``network`` (a dearcomm.Network) with the factors measure_contention()
    (or the medians of several) gave: every one of FACTORS."""
    return dataclasses.replace(network, **{name: measured[name] for name in FACTORS})


def _cpu_ratio(fit: str, alone_what: str, beside_what: str, alone_cpu_s: Sequence[float], beside_cpu_s: float,
               count: int) -> float:
    """CPU per call beside over the median alone, at least 1."""
    if not alone_cpu_s or not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"dearcomm: {fit} needs CPU times alone and the count of calls beside "
                         f"(got {len(alone_cpu_s or [])} alone, count {count!r})")
    alone = statistics.median(_positive(t, alone_what) for t in alone_cpu_s)
    _check_number(beside_what, beside_cpu_s, allow_zero=True)
    return max(1.0, beside_cpu_s / count / alone)


# ---- measuring ------------------------------------------------------------------

def _busy_fraction(start: float, end: float, busy) -> float:
    covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
    return covered / (end - start)


def machine_cpu_s() -> Optional[dict]:
    """The whole machine's CPU seconds so far (every core, from /proc/stat):
    busy (user, system, interrupts), of that softirq (the kernel's packet
    work, loopback TCP's receive side, charged to no process), and idle;
    None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    return dict(busy=(user + nice + system + irq + softirq + steal) * tick, softirq=(irq + softirq) * tick,
                idle=(idle + iowait) * tick)


def _machine_since(start: Optional[dict]) -> Optional[dict]:
    now = machine_cpu_s()
    return None if start is None or now is None else {k: now[k] - start[k] for k in start}


def _timed(compute: Callable[[], None]) -> float:
    start = time.perf_counter()
    compute()
    return time.perf_counter() - start


def _alone(compute: Callable[[], None], lockstep: Lockstep, iters: int, cpu: list, process_cpu: list) -> list:
    """``iters`` compute iterations timed alone, every rank starting each one
    together, as in training: where ranks share cores (4 ranks on 2), one
    that ran ahead would time its iteration beside fewer busy ranks (a wide
    MLP read 46 to 132 ms). Appends each one's CPU to `cpu` (this thread's)
    and `process_cpu` (every thread's: torch's intra-op pool too).
    A last meeting: a rank whose last iteration failed tells the others there."""
    times = []
    for _ in range(iters):
        lockstep.meet()
        start, process_start = time.thread_time(), time.process_time()
        times.append(_timed(compute))
        cpu.append(time.thread_time() - start)
        process_cpu.append(time.process_time() - process_start)
    lockstep.meet()
    return times


class NotFitted(ValueError):
    """The timings were taken, on every rank in step, but a factor could
    not be fitted from this rank's (collectives too short beside compute)."""


def measure_contention(compute: Callable[[], None], group: Optional[dist.ProcessGroup] = None, *,
                       nbytes: int = 64 * 2**20, iters: int = 3) -> dict:
    """Times ``compute()`` (one forward+backward, no communication) alone,
    then beside back-to-back all-reduces of ``nbytes`` on dearcomm's backend
    of ``group`` run by a second thread, then alone again; and the all-reduce
    alone and beside. Every rank of the group calls it together, with the
    same ``iters``; where ``compute()`` raises on one rank, every rank raises
    (the others a ValueError naming that rank and its error) instead of
    waiting for it. Returns the timings (seconds) and the factors fitted
    (compute_slowdown κ, comm_slowdown λ, comm_cpu_slowdown ν,
    compute_cpu_slowdown μ, and iteration_cv: the compute iterations'
    spread alone, fit_iteration_cv); NotFitted where this rank's timings fit no κ
    or λ, once every rank is done with the collectives (ν and μ are 1 where
    a CPU clock read 0).
    Also the CPU each part took (seconds): each compute iteration alone
    (``alone_cpu_s``, its thread's), each all-reduce alone
    (``comm_alone_cpu_s``, the process's), and over the time they ran beside
    each other the compute's thread (``beside_compute_cpu_s``, over
    ``beside_compute_wall_s`` of compute) and the collectives
    (``beside_comm_cpu_s`` over ``beside_comm_count`` all-reduces: the
    process's less the compute's, which with torch's intra-op pool is the
    compute thread's times the process's over the thread's CPU alone,
    ``alone_process_cpu_s``; the process's whole, ``beside_process_cpu_s``).
    And the whole machine's CPU (machine_cpu_s(): busy, softirq, idle, and
    the phase's wall) over the first iterations alone (``alone_machine_s``)
    and over the phase beside (``beside_machine_s``): where the ranks fill
    the cores, what they get of them.

    ``iters`` compute iterations are timed alone before the collectives and
    as many after, and κ's fit takes the median of both: a model's first
    iterations can run far slower than the rest (a wide MLP's took 82 ms
    twice after two warm-ups, then 46 ms), and an "alone" made only of those
    hides the slowdown being measured (κ read 1.00). A start slower than all
    ``iters`` iterations before still moves the median halfway."""
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    lockstep = Lockstep(group, torch.device("cpu"), what="measure_contention()")
    backend = cpu_backend(group)
    buffer = torch.zeros(max(world, nbytes // 4 // world * world))
    try:
        timings = _measure(compute, group, lockstep, backend, buffer, iters)
    except BaseException as e:  # the others learn it at the meeting they wait at, and raise too
        lockstep.fail(e)
        raise
    try:
        factors = dict(compute_slowdown=fit_compute_slowdown(alone_s=timings["alone_s"],
                                                             beside=timings["beside"]).slowdown,
                       comm_slowdown=fit_comm_slowdown(timings["comm_alone_s"], timings["comm_beside_s"]))
    except ValueError as e:
        raise NotFitted(str(e)) from None
    try:
        factors.update(comm_cpu_slowdown=fit_comm_cpu_slowdown(timings["comm_alone_cpu_s"],
                                                               timings["beside_comm_cpu_s"],
                                                               timings["beside_comm_count"]),
                       compute_cpu_slowdown=fit_compute_cpu_slowdown(timings["alone_cpu_s"],
                                                                     timings["beside_compute_cpu_s"],
                                                                     len(timings["beside"])))
    except ValueError:  # a CPU clock that read 0: the bound then charges each as alone
        factors.update(comm_cpu_slowdown=1.0, compute_cpu_slowdown=1.0)
    factors.update(iteration_cv=fit_iteration_cv(timings["alone_s"]))
    return dict(timings, **factors)


def _measure(compute: Callable[[], None], group, lockstep: Lockstep, backend, buffer: torch.Tensor,
             iters: int) -> dict:
    """measure_contention's timings. Every phase in which a rank computes
    ends at a meeting: a rank that fails in it tells the others there."""
    from . import _C

    for _ in range(2):
        compute()
    alone_cpu, alone_process_cpu, comm_alone, comm_alone_cpu = [], [], [], []
    machine, wall = machine_cpu_s(), time.perf_counter()
    alone = _alone(compute, lockstep, iters, alone_cpu, alone_process_cpu)
    alone_machine = dict(_machine_since(machine) or {}, wall=time.perf_counter() - wall)
    for _ in range(3):
        start = time.process_time()  # every thread: the backend's do the work
        comm_alone.append(_timed(lambda: _C.all_reduce(backend, buffer).wait()))
        comm_alone_cpu.append(time.process_time() - start)
    # Enough all-reduces to outlast the compute iterations on the slowest
    # rank; every rank runs the same count (same collectives, same order).
    needed = torch.tensor([iters * statistics.median(alone) / statistics.median(comm_alone) + 2])
    dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    busy, lock = [], threading.Lock()

    def all_reduces() -> None:
        for _ in range(int(needed.item()) + 1):
            start = time.perf_counter()
            _C.all_reduce(backend, buffer).wait()  # the wait releases the GIL
            with lock:
                busy.append((start, time.perf_counter()))

    thread = threading.Thread(target=all_reduces)
    lockstep.meet()
    process_cpu, compute_cpu = time.process_time(), time.thread_time()
    machine, wall = machine_cpu_s(), time.perf_counter()
    thread.start()
    spans = []
    try:
        while thread.is_alive():
            start = time.perf_counter()
            compute()
            spans.append((start, time.perf_counter()))
    finally:  # the other ranks' threads run as many all-reduces: this one must too
        thread.join()
    compute_cpu = time.thread_time() - compute_cpu
    process_cpu = time.process_time() - process_cpu
    beside_machine = dict(_machine_since(machine) or {}, wall=time.perf_counter() - wall)
    alone += _alone(compute, lockstep, iters, alone_cpu, alone_process_cpu)
    beside = [(end - start, _busy_fraction(start, end, busy)) for start, end in spans]
    comm_beside = [b - a for a, b in busy[1:-1]] or [b - a for a, b in busy]
    return dict(alone_s=alone, beside=beside, comm_alone_s=comm_alone, comm_beside_s=comm_beside,
                alone_cpu_s=alone_cpu, alone_process_cpu_s=alone_process_cpu, comm_alone_cpu_s=comm_alone_cpu,
                beside_compute_cpu_s=compute_cpu,
                beside_comm_cpu_s=collectives_cpu(process_cpu, compute_cpu, alone_process_cpu, alone_cpu),
                beside_compute_wall_s=sum(end - start for start, end in spans), beside_comm_count=len(busy),
                beside_process_cpu_s=process_cpu, alone_machine_s=alone_machine, beside_machine_s=beside_machine)


def collectives_cpu(process_cpu: float, compute_thread_cpu: float, alone_process_cpu: Sequence[float],
                    alone_thread_cpu: Sequence[float]) -> float:
    """The collectives' part of the process's CPU while they ran beside
    compute: the rest once the compute's is taken out, the compute's being its
    thread's times the process's over the thread's CPU alone (torch's
    intra-op pool works for the compute thread; 1 with one thread)."""
    thread = statistics.median(alone_thread_cpu)
    pool = max(1.0, statistics.median(alone_process_cpu) / thread) if thread > 0 else 1.0
    return max(0.0, process_cpu - compute_thread_cpu * pool)
