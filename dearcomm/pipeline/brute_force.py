"""The reference optimum for small problems (≤ 8 layers, ≤ 4 devices): every
partition × every assignment of ordered, disjoint device groups to the stages
(unused devices allowed), each scheduled by list scheduling, 1F1B and GPipe
and simulated; the shortest wins. Candidates whose lower bound (the busiest
replica's compute, or one micro-batch's way through every stage) already
reaches the best found are skipped. Per-device orders are not enumerated
beyond those three rules (that search is a job shop, exponential in M)."""
from __future__ import annotations

import itertools
import math
from typing import Iterator, List, Tuple

from . import validate
from .partition import sync_estimate
from .plan import Plan, check_sizes
from .planner import best_scheduled
from .profile import ModelProfile
from .simulate import Costs
from .topology import Topology

MAX_LAYERS, MAX_DEVICES = 8, 4


def _bounds(L: int) -> Iterator[Tuple[int, ...]]:
    for k in range(L):
        for cuts in itertools.combinations(range(1, L), k):
            yield (0, *cuts, L)


def _groups(devices: Tuple[int, ...], stages: int) -> Iterator[Tuple[Tuple[int, ...], ...]]:
    """Ordered sequences of `stages` disjoint, non-empty, ordered device tuples."""
    if stages == 0:
        yield ()
        return
    for r in range(1, len(devices) - stages + 2):
        for group in itertools.permutations(devices, r):
            rest = tuple(d for d in devices if d not in group)
            for tail in _groups(rest, stages - 1):
                yield (group, *tail)


def brute_force(profile: ModelProfile, topology: Topology, num_microbatches: int) -> Plan:
    validate.problem(profile, topology, "brute_force()")
    L, D, M = len(profile), topology.size, num_microbatches
    check_sizes(L, D, None, M, "brute_force()")
    if L > MAX_LAYERS or D > MAX_DEVICES:
        raise ValueError(f"dearcomm: brute_force() is for at most {MAX_LAYERS} layers and {MAX_DEVICES} devices, "
                         f"got {L} layers and {D} devices")
    cands: List[Tuple[float, float, tuple, tuple]] = []
    for bounds in _bounds(L):
        S = len(bounds) - 1
        if S > D:
            continue
        for groups in _groups(tuple(range(D)), S):
            costs = Costs(profile, topology, bounds, groups)
            lower = max(max(math.ceil(M / len(g)) * (f + b) for g, f, b in zip(groups, costs.fwd, costs.bwd)),
                        sum(costs.fwd) + sum(costs.bwd))
            cands.append((sync_estimate(costs, M), lower, bounds, groups))
    cands.sort()
    best = None
    for _, lower, bounds, groups in cands:
        if best is not None and lower >= best.predicted_ms - 1e-9:
            continue
        plan = best_scheduled(profile, topology, [(bounds, groups)], M, "brute-force")
        if best is None or plan.predicted_ms < best.predicted_ms - 1e-9:
            best = plan
    return best
