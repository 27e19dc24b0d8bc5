"""Measure this job's network in place: time the three collectives the
schedules use on the training process group at a few sizes and fit the
simulator's α–β line to them (dearcomm.fit_network, unweighted: the
largest sizes decide the bandwidth), in about two seconds on a 1 Gbit/s
link. wrap()'s "auto" options start with it. On a CPU they are dearcomm's
own collectives over the group (the engine's: gloo's
reduce-scatter and all-gather cost far more than dearcomm's, which are built
from point-to-point transfers), and a fourth, the all-reduce the backend
keeps in issue order for deft (Network's "ordered_all_reduce": dearcomm's
exchanges, not gloo's allreduce); on a GPU torch's over NCCL.

    fit = probe_network(group, torch.device("cpu"))
    print(fit.table())

Every rank takes part (these are collectives); every rank gets the fit of
rank 0's timings, so all ranks hold the same Network, with its
all_reduce_lanes read from the group (all_reduce_lanes()) and, on a CPU,
its host_ms: the CPU time (this process, every thread) a HOST_BYTES call of
each kind took, the lower quartile of HOST_REPEATS, times dearcomm.host_cost's
cores_share; and its host_ms_per_mib: the slope of each kind's CPU time
against its bytes over those calls and the timed sizes, times the same share
(rank 0's, kept as its cores_share).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._cpu_switches import cpu_backend
from ._rank0 import rank0s
from ._torch_collectives import all_gather_single, reduce_scatter_single
from .host_cost import cores_share, fit_host_cpu
from .prediction import KINDS, ORDERED_ALL_REDUCE

if TYPE_CHECKING:
    from .network_fit import NetworkFit

PROBE_TRIES = 3
"""Timings whose fit fails (a stall made a small size slower than a large
one) are taken again, up to this many times in all."""


class NetworkNotFitted(ValueError):
    """probe_network's timings could not be fitted in PROBE_TRIES tries
    (raised on every rank alike)."""


PROBE_BYTES = (256 * 1024, 2 * 1024 * 1024, 16 * 1024 * 1024)
"""Buffer sizes timed: they bracket the bucket sizes the planner tries (1–64
MiB), and the smallest shows the per-step latency α."""


def _collective(kind: str, full: torch.Tensor, shard: torch.Tensor, group, backend) -> None:
    """``backend``: dearcomm's CPU backend, or None (torch's); for
    ORDERED_ALL_REDUCE, one told to keep issue order."""
    if backend is not None:  # dearcomm's, as the engine issues them on a CPU
        if kind in ("all_reduce", ORDERED_ALL_REDUCE):
            _C.all_reduce(backend, full).wait()
        elif kind == "reduce_scatter":
            _C.reduce_scatter(backend, full, shard).wait()
        else:
            _C.all_gather(backend, shard, full).wait()
    elif kind == "all_reduce":
        dist.all_reduce(full, group=group)
    elif kind == "reduce_scatter":
        reduce_scatter_single(shard, full, group=group)
    else:
        all_gather_single(full, shard, group=group)


def _buffers(nbytes: int, world_size: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """A full fp32 buffer of about ``nbytes`` and its shard (divisible: the shard is numel / p)."""
    numel = max(world_size, nbytes // 4 // world_size * world_size)
    return (torch.zeros(numel, dtype=torch.float32, device=device),
            torch.zeros(numel // world_size, dtype=torch.float32, device=device))


def _timed(kind: str, full: torch.Tensor, shard: torch.Tensor, group, backend,
           repeats: int, cpu_statistic: Callable[[List[float]], float] = statistics.median) -> Tuple[float, float]:
    """Median µs of wall time, and ``cpu_statistic`` of this process's CPU
    time (every thread), of ``repeats`` calls, after one untimed call
    (connection set-up, allocation)."""
    cuda = full.is_cuda
    times, cpu = [], []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(full.device)
        start, start_cpu = time.perf_counter(), time.process_time()
        _collective(kind, full, shard, group, backend)
        if cuda:
            torch.cuda.synchronize(full.device)
        if i:
            times.append((time.perf_counter() - start) * 1e6)
            cpu.append((time.process_time() - start_cpu) * 1e6)
    return statistics.median(times), cpu_statistic(cpu)


def lower_quartile(values: Sequence[float]) -> float:
    """The value a quarter of the way up (of 15, the 4th smallest)."""
    if not values:
        raise ValueError("dearcomm: lower_quartile of no values")
    return sorted(values)[len(values) // 4]


HOST_BYTES = 16 * 1024
"""The collective timed for its CPU per call (Network.host_ms): small enough
that its bytes cost next to nothing. A fit through PROBE_BYTES' CPU times
instead moved with the 16 MiB calls' noise: at 4 ranks on 2 cores three
probes in a row fitted an all-reduce's 1.78, 2.84 and 6.68 ms and an
all-gather's 0.65, 2.30 and 2.59, where a 16 KiB all-gather's CPU read
0.33-0.43 ms each time."""
HOST_REPEATS = 15
"""Calls of HOST_BYTES timed per kind (after an untimed one)."""
HOST_STATISTIC = lower_quartile
"""Which of their CPU times counts. A call's CPU time
takes one of two values: 16 KiB all-reduces at 2 ranks on the 1 Gbit/s
link took 0.25-0.6 ms, or 3-4 ms in about a third of the calls (the wall
time as long: a thread polling while the link's shaper holds the data,
which κ charges where it overlaps compute). The median of 15 landed on the
long value in 1 of 8 probes (3.68 ms; over 3 calls in 2 of 4), the mean
moved the short kinds' cost 3x between probes; the lower quartile lands on
it only where 12 of 15 calls do."""

GLOO_DEFAULT_THREADS = 2
"""torch's gloo process group's worker threads unless its options say otherwise."""


def all_reduce_lanes(group: Optional[dist.ProcessGroup], device: torch.device) -> int:
    """How many all-reduces the group's backend runs at once
    (Network.all_reduce_lanes): on a CPU, gloo's worker threads, unless
    DEARCOMM_CPU_ORDERED=1 makes the CPU backend order every all-reduce;
    elsewhere (one NCCL stream) 1."""
    if device.type != "cpu" or os.environ.get("DEARCOMM_CPU_ORDERED") == "1":
        return 1
    try:
        return max(1, int((group or dist.group.WORLD)._get_backend(device).options._threads))
    except (AttributeError, RuntimeError):  # not gloo, or a torch that hides its options
        return GLOO_DEFAULT_THREADS


def probe_network(group: Optional[dist.ProcessGroup], device: torch.device, *,
                  sizes: Sequence[int] = PROBE_BYTES, repeats: int = 3) -> NetworkFit:
    """Times reduce-scatter, all-gather and all-reduce (on a CPU also the
    ordered all-reduce) of each size in ``sizes`` (bytes of fp32, the full
    buffer) on ``group`` and returns rank 0's timings fitted (the same fit
    on every rank)."""
    group = group or dist.group.WORLD
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    backends = {kind: None for kind in KINDS}  # torch's, over NCCL: issue order changes nothing there
    if device.type == "cpu":
        plain, ordered = cpu_backend(group), cpu_backend(group)
        _C.keep_issue_order(ordered)
        backends = {**{kind: plain for kind in KINDS}, ORDERED_ALL_REDUCE: ordered}
    # Not at import: `python -m dearcomm.network_fit` would run a second copy.
    from .network_fit import TimesDoNotGrow, fit_network

    for attempt in range(1, PROBE_TRIES + 1):
        rows = []
        for nbytes in sizes:
            full, shard = _buffers(nbytes, world_size, device)
            for kind, backend in backends.items():
                time_us, cpu_us = _timed(kind, full, shard, group, backend, repeats)
                rows.append(dict(op=kind, bytes=full.numel() * 4, world_size=world_size, time_us=time_us,
                                 cpu_us=cpu_us))
        full, shard = _buffers(HOST_BYTES, world_size, device)
        host_cpu_ms = {kind: _timed(kind, full, shard, group, backend, HOST_REPEATS, HOST_STATISTIC)[1] / 1e3
                       for kind, backend in backends.items()}
        host_bytes = full.numel() * 4
        # Rank 0's share too: every rank holds the same Network, hosts of other core counts included.
        rows, host_cpu_ms, share = rank0s((rows, host_cpu_ms, cores_share(device)) if rank == 0 else None, group,
                                          what="the network probe's measurements")
        # Absolute weights: the planner sums the times of 1-64 MiB buckets, and a
        # link's burst allowance passes the smallest size faster than its rate.
        try:  # every rank fits rank 0's rows: all of them fail, and time again, alike
            fit = fit_network([{k: v for k, v in r.items() if k != "cpu_us"} for r in rows], weights="absolute")
            break
        except TimesDoNotGrow as e:  # any other error of the fit is no matter of timing: raised as it is
            if attempt == PROBE_TRIES:
                raise NetworkNotFitted(
                    f"dearcomm: the network probe's timings could not be fitted in {PROBE_TRIES} tries: {e}") from None
    host_ms = {kind: share * cpu_ms for kind, cpu_ms in host_cpu_ms.items()}
    _, host_ms_per_mib = fit_host_cpu({kind: [(1, host_bytes, cpu_ms)] + [(1, r["bytes"], r["cpu_us"] / 1e3)
                                                                           for r in rows if r["op"] == kind]
                                       for kind, cpu_ms in host_cpu_ms.items()}, share)
    return dataclasses.replace(fit, network=dataclasses.replace(fit.network, host_ms=host_ms,
                                                                host_ms_per_mib=host_ms_per_mib, cores_share=share,
                                                                all_reduce_lanes=all_reduce_lanes(group, device)))
