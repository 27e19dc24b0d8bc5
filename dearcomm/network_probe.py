"""Measure this job's network in place: time the three collectives the
schedules use on the training process group at a few sizes and fit the
simulator's α–β line to them (dearcomm.fit_network), in about a second on a
1 Gbit/s link. wrap()'s "auto" options start with it.

    fit = probe_network(group, torch.device("cpu"))
    print(fit.table())

Every rank takes part (these are collectives); every rank gets the fit of
rank 0's timings, so all ranks hold the same Network.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .network_fit import NetworkFit, fit_network

PROBE_BYTES = (256 * 1024, 2 * 1024 * 1024, 16 * 1024 * 1024)
"""Buffer sizes timed: they bracket the bucket sizes the planner tries (1–64
MiB), and the smallest shows the per-step latency α."""


def _collective(kind: str, full: torch.Tensor, shard: torch.Tensor, group) -> None:
    if kind == "all_reduce":
        dist.all_reduce(full, group=group)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_single(shard, full, group=group)
    else:
        dist.all_gather_single(full, shard, group=group)


def _timed(kind: str, full: torch.Tensor, shard: torch.Tensor, group, repeats: int) -> float:
    """Median µs of ``repeats`` calls after one untimed call (connection set-up, allocation)."""
    cuda = full.is_cuda
    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(full.device)
        start = time.perf_counter()
        _collective(kind, full, shard, group)
        if cuda:
            torch.cuda.synchronize(full.device)
        if i:
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def probe_network(group: Optional[dist.ProcessGroup], device: torch.device, *,
                  sizes: Sequence[int] = PROBE_BYTES, repeats: int = 3) -> NetworkFit:
    """Times reduce-scatter, all-gather and all-reduce of each size in
    ``sizes`` (bytes of fp32, the full buffer) on ``group`` and returns rank
    0's timings fitted (the same fit on every rank)."""
    group = group or dist.group.WORLD
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    rows = []
    for nbytes in sizes:
        numel = max(world_size, nbytes // 4 // world_size * world_size)  # divisible: the shard is numel / p
        full = torch.zeros(numel, dtype=torch.float32, device=device)
        shard = torch.zeros(numel // world_size, dtype=torch.float32, device=device)
        for kind in ("reduce_scatter", "all_gather", "all_reduce"):
            rows.append(dict(op=kind, bytes=numel * 4, world_size=world_size,
                             time_us=_timed(kind, full, shard, group, repeats)))
    shared = [rows if rank == 0 else None]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    return fit_network(shared[0])
