"""Every partition and mapping of a small problem, and the bound that lets
the searches over them skip most: the planner (small problems), the
brute force over rules and the exhaustive optimum all walk them in order of
that bound."""
from __future__ import annotations

import functools
import itertools
import math
from typing import Iterator, List, Tuple

from .partition import Candidate
from .profile import ModelProfile
from .simulate import Costs
from .topology import Topology


def all_bounds(num_layers: int) -> Iterator[Tuple[int, ...]]:
    """Every partition of the layers into consecutive stages."""
    for k in range(num_layers):
        for cuts in itertools.combinations(range(1, num_layers), k):
            yield (0, *cuts, num_layers)


def all_groups(devices: Tuple[int, ...], stages: int) -> Iterator[Tuple[Tuple[int, ...], ...]]:
    """Ordered sequences of `stages` disjoint, non-empty, ordered device tuples."""
    if stages == 0:
        yield ()
        return
    for r in range(1, len(devices) - stages + 2):
        for group in itertools.permutations(devices, r):
            rest = tuple(d for d in devices if d not in group)
            for tail in all_groups(rest, stages - 1):
                yield (group, *tail)


def count_candidates(num_layers: int, num_devices: int, max_stages: int) -> int:
    """How many (bounds, groups) all_candidates yields, without making them."""
    @functools.lru_cache(maxsize=None)  # without it the count of 32 devices took hours
    def groups(n: int, s: int) -> int:  # ordered device tuples for s stages out of n devices
        if s == 0:
            return 1
        return sum(math.perm(n, r) * groups(n - r, s - 1) for r in range(1, n - s + 2))
    return sum(math.comb(num_layers - 1, s - 1) * groups(num_devices, s) for s in range(1, max_stages + 1))


def compute_bound(costs: Costs, num_microbatches: int) -> float:
    """No order of this partition and mapping is shorter: the busiest
    replica's compute, and one micro-batch's compute through every stage."""
    M = num_microbatches
    busiest = max(math.ceil(M / len(g)) * (f + b) for g, f, b in zip(costs.devices, costs.fwd, costs.bwd))
    return max(busiest, sum(costs.fwd) + sum(costs.bwd))


def all_candidates(profile: ModelProfile, topology: Topology, num_microbatches: int, max_stages: int
                   ) -> List[Tuple[float, Candidate, Costs]]:
    """(bound, candidate, its costs) of every partition and mapping with at
    most max_stages stages, smallest bound first (ties: enumeration order)."""
    out = []
    for bounds in all_bounds(len(profile)):
        if len(bounds) - 1 > max_stages:
            continue
        for groups in all_groups(tuple(range(topology.size)), len(bounds) - 1):
            costs = Costs(profile, topology, bounds, groups)
            out.append((compute_bound(costs, num_microbatches), (bounds, groups), costs))
    out.sort(key=lambda c: c[0])
    return out
