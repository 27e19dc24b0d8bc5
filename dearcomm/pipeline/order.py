"""Per-device orders of the micro-batches' forward and backward tasks:
GPipe, 1F1B (PipeDream-flush) and list scheduling on the task graph."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from . import validate
from .plan import BACKWARD, FORWARD, Task
from .profile import ModelProfile
from .simulate import list_schedule
from .topology import Topology

Orders = Dict[int, Tuple[Task, ...]]


def _check(devices: Sequence[Sequence[int]], num_microbatches: int, where: str) -> None:
    validate.positive_int(num_microbatches, "num_microbatches", where)
    validate.stage_devices(devices, where)


def gpipe_orders(devices: Sequence[Sequence[int]], num_microbatches: int) -> Orders:
    """All of a device's forwards, then all its backwards, in micro-batch order."""
    _check(devices, num_microbatches, "gpipe_orders()")
    orders = {}
    for s, group in enumerate(devices):
        for j, d in enumerate(group):
            ms = [m for m in range(num_microbatches) if m % len(group) == j]
            orders[d] = tuple([Task(FORWARD, s, m) for m in ms] + [Task(BACKWARD, s, m) for m in ms])
    return orders


def one_f_one_b_orders(devices: Sequence[Sequence[int]], num_microbatches: int,
                       profile: Optional[ModelProfile] = None, topology: Optional[Topology] = None,
                       bounds: Optional[Sequence[int]] = None) -> Orders:
    """1F1B (PipeDream-flush): stage s of S runs S - s forwards before its
    first backward (S - s - 1 warm-ups and the first of the steady state),
    then alternates one backward and one forward, then drains the backwards.
    With replicated stages a fixed alternation can deadlock, so there (and
    only there; profile, topology and bounds are then needed) it is list
    scheduling with the same memory rule per device: at most S - s forwards
    in flight on each replica, backwards first, earlier micro-batches first."""
    _check(devices, num_microbatches, "one_f_one_b_orders()")
    S = len(devices)
    if any(len(g) > 1 for g in devices):
        if profile is None or topology is None or bounds is None:
            raise ValueError("dearcomm: 1F1B with replicated stages needs profile, topology and bounds")
        caps = {d: S - s for s, g in enumerate(devices) for d in g}
        return list_schedule(profile, topology, bounds, devices, num_microbatches,
                             priority=lambda t: (t.kind == FORWARD, t.microbatch), max_in_flight=caps).orders
    orders = {}
    for s, group in enumerate(devices):
        for j, d in enumerate(group):
            ms = [m for m in range(num_microbatches) if m % len(group) == j]
            warm = min(len(ms), S - s)  # the warm-up and the first steady forward
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


def warmup_orders(devices: Sequence[Sequence[int]], num_microbatches: int, warmups: Dict[int, int]) -> Orders:
    """Per device: warmups[d] forwards, then one backward and one forward in
    turn, then the remaining backwards, micro-batches in order. warmups[d] is
    the most micro-batches d keeps in flight: its share gives GPipe, S - s
    gives 1F1B, 1 strict alternation; each device may have its own."""
    _check(devices, num_microbatches, "warmup_orders()")
    orders = {}
    for s, group in enumerate(devices):
        for j, d in enumerate(group):
            ms = [m for m in range(num_microbatches) if m % len(group) == j]
            validate.positive_int(warmups.get(d), f"warmups[{d}]", "warmup_orders()")
            warm = min(len(ms), warmups[d])
            seq: List[Task] = [Task(FORWARD, s, m) for m in ms[:warm]]
            for b, m in enumerate(ms):
                seq.append(Task(BACKWARD, s, m))
                if warm + b < len(ms):
                    seq.append(Task(FORWARD, s, ms[warm + b]))
            orders[d] = tuple(seq)
    return orders
