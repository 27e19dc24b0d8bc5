"""Per-device orders of the micro-batches' forward and backward tasks:
GPipe, 1F1B (PipeDream-flush) and list scheduling on the task graph."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .plan import BACKWARD, FORWARD, Task
from .profile import ModelProfile
from .simulate import list_schedule
from .topology import Topology

Orders = Dict[int, Tuple[Task, ...]]


def gpipe_orders(devices: Sequence[Sequence[int]], num_microbatches: int) -> Orders:
    """All of a device's forwards, then all its backwards, in micro-batch order."""
    orders = {}
    for s, group in enumerate(devices):
        for j, d in enumerate(group):
            ms = [m for m in range(num_microbatches) if m % len(group) == j]
            orders[d] = tuple([Task(FORWARD, s, m) for m in ms] + [Task(BACKWARD, s, m) for m in ms])
    return orders


def one_f_one_b_orders(devices: Sequence[Sequence[int]], num_microbatches: int) -> Orders:
    """1F1B: stage s first runs the forwards of the micro-batches numbered
    below S - s (its warm-up; with replicas, those of them it owns, at least
    one), then alternates one backward and one forward, then drains."""
    S = len(devices)
    orders = {}
    for s, group in enumerate(devices):
        for j, d in enumerate(group):
            ms = [m for m in range(num_microbatches) if m % len(group) == j]
            warm = max(1, sum(1 for m in ms if m < S - s))
            seq: List[Task] = [Task(FORWARD, s, m) for m in ms[:warm]]
            f, b = warm, 0
            while b < len(ms):
                seq.append(Task(BACKWARD, s, ms[b]))
                b += 1
                if f < len(ms):
                    seq.append(Task(FORWARD, s, ms[f]))
                    f += 1
            orders[d] = tuple(seq)
    return orders


def list_orders(profile: ModelProfile, topology: Topology, bounds: Sequence[int],
                devices: Sequence[Sequence[int]], num_microbatches: int) -> Orders:
    """List scheduling with the longest-remaining-path priority (simulate.py)."""
    return list_schedule(profile, topology, bounds, devices, num_microbatches).orders
