"""Device orders for the partition DP: stage after stage takes the next
devices of the order, so the order decides which boundaries cross which
links and which devices a replicated stage's all-reduce rings over.

Exhaustive where it is cheap: every permutation, keeping one per distinct
view of the links and of the devices' memory (orders that look the same to
the planner give the same plans) when there are at most `exhaustive_limit`
of them. Otherwise a
heuristic: greedy chains that always step to the widest free link (from
every start device), their reverses, then pairwise swaps of the best order
while they improve the estimate.
"""
from __future__ import annotations

import itertools
from typing import Callable, List, Sequence, Tuple

from .topology import Topology

Order = Tuple[int, ...]


def _signature(view, order: Sequence[int]) -> Tuple:
    links, memory = view
    return tuple(links[a][b] for a in order for b in order) + tuple(memory[d] for d in order)


def _link_views(topology: Topology):
    n = topology.size
    # Bandwidth, latency and the kind of shared resource: enough to tell orders apart.
    links = [[(topology.link_bandwidth(a, b), topology.link_latency(a, b),
               tuple(str(r[0]) if isinstance(r, tuple) else str(r) for r in topology.resources(a, b)))
              if a != b else None for b in range(n)] for a in range(n)]
    # And each device's memory: the DP gives stage s the devices at its place
    # in the order, so the same links with a smaller device first plan otherwise.
    return links, [topology.memory_of(d) for d in range(n)]


def distinct_orders(topology: Topology, limit: int) -> List[Order]:
    """Every device order up to link-and-memory equivalence, or [] if there are
    more than `limit` (or the devices are too many to enumerate, > 8)."""
    n = topology.size
    if n > 8:
        return []
    view = _link_views(topology)
    seen, out = set(), []
    for order in itertools.permutations(range(n)):
        sig = _signature(view, order)
        if sig not in seen:
            seen.add(sig)
            out.append(order)
            if len(out) > limit:
                return []
    return out


def greedy_chains(topology: Topology) -> List[Order]:
    n = topology.size
    view = _link_views(topology)
    out, seen = [], set()
    for start in range(n):
        order, left = [start], set(range(n)) - {start}
        while left:
            here = order[-1]
            nxt = max(sorted(left), key=lambda d: (topology.link_bandwidth(here, d), -topology.link_latency(here, d)))
            order.append(nxt)
            left.remove(nxt)
        for o in (tuple(order), tuple(reversed(order))):
            sig = _signature(view, o)
            if sig not in seen:
                seen.add(sig)
                out.append(o)
    return out


def search_orders(topology: Topology, score: Callable[[Order], float], exhaustive_limit: int = 48,
                  max_rounds: int = 3) -> List[Tuple[float, Order]]:
    """(score, order) of every order tried, best first. `score` runs the
    partition DP for one order and returns its best estimate."""
    orders = distinct_orders(topology, exhaustive_limit)
    if orders:
        return sorted((score(o), o) for o in orders)
    view = _link_views(topology)
    tried = {}
    for o in greedy_chains(topology):
        tried[_signature(view, o)] = (score(o), o)
    for _ in range(max_rounds):
        best_score, best = min(tried.values())
        improved = False
        for i, j in itertools.combinations(range(len(best)), 2):
            o = list(best)
            o[i], o[j] = o[j], o[i]
            o = tuple(o)
            sig = _signature(view, o)
            if sig in tried:
                continue
            tried[sig] = (score(o), o)
            improved |= tried[sig][0] < best_score - 1e-9
        if not improved:
            break
    return sorted(tried.values())
