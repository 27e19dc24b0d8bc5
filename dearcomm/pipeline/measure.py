"""The links of a running process group, measured: every pair of ranks
ping-pongs a small message (latency) and a large one (bandwidth), one pair
at a time, and every rank gets the same Topology to plan on. Planning a
gloo job on a preset's links (uniform()'s 10 GB/s and 5 µs) predicts
transfers a CPU backend does not reach, and picks splits that run slower
than one device."""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from .topology import Topology

SMALL_BYTES, LARGE_BYTES = 4, 4 << 20


def measure_topology(group: Optional[dist.ProcessGroup] = None, repeats: int = 10,
                     large_bytes: int = LARGE_BYTES, name: str = "measured") -> Topology:
    """Collective: every rank of ``group`` calls it. Returns the Topology of
    the group's ranks (device i = rank i of the group): per pair, the one-way
    latency of a 4-byte message and the bandwidth of a ``large_bytes`` one,
    each the median of ``repeats`` round trips."""
    if not dist.is_initialized():
        raise RuntimeError("dearcomm: measure_topology() needs torch.distributed to be initialised first")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"dearcomm: measure_topology(): repeats must be a positive integer, got {repeats!r}")
    if isinstance(large_bytes, bool) or not isinstance(large_bytes, int) or large_bytes <= SMALL_BYTES:
        raise ValueError(f"dearcomm: measure_topology(): large_bytes must be an integer above {SMALL_BYTES}, "
                         f"got {large_bytes!r}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    latency = torch.zeros(world, world, dtype=torch.float64)
    bandwidth = torch.zeros(world, world, dtype=torch.float64)
    small, large = torch.zeros(SMALL_BYTES, dtype=torch.uint8), torch.zeros(large_bytes, dtype=torch.uint8)
    for i in range(world):
        for j in range(i + 1, world):
            dist.barrier(group=group)  # one pair at a time: pairs measured at once would share the cores
            if rank not in (i, j):
                continue
            peer = j if rank == i else i
            if group is not None:
                peer = dist.get_global_rank(group, peer)
            one_way = [_round_trip(small, peer, rank == i, group) / 2 for _ in range(repeats + 1)][1:]
            lat = statistics.median(one_way)
            bulk = [_round_trip(large, peer, rank == i, group) / 2 for _ in range(repeats + 1)][1:]
            if rank == i:
                latency[i, j] = latency[j, i] = lat
                bandwidth[i, j] = bandwidth[j, i] = large_bytes / max(statistics.median(bulk) - lat, 1e-9)
    dist.all_reduce(latency, group=group)  # only rank i of each pair wrote it
    dist.all_reduce(bandwidth, group=group)
    return Topology(tuple(map(tuple, bandwidth.tolist())), tuple(map(tuple, latency.tolist())), name)


def _round_trip(buffer: torch.Tensor, peer: int, first: bool, group) -> float:
    """Seconds for ``buffer`` to go to ``peer`` and back (the first of the
    pair sends first); the first exchange of each size warms the connection."""
    start = time.perf_counter()
    if first:
        dist.send(buffer, peer, group=group)
        dist.recv(buffer, peer, group=group)
    else:
        dist.recv(buffer, peer, group=group)
        dist.send(buffer, peer, group=group)
    return time.perf_counter() - start
