"""Local search on simulated time: from a plan's partition and mapping, try
the neighbours (a boundary moved, a device moved to another stage, an unused
device added or given a new stage, a device dropped, stages split or
merged, two devices swapped) and keep the best while it shortens the simulated iteration.
Deterministic: neighbours in a fixed order, a fixed budget of simulations."""
from __future__ import annotations

from typing import Callable, Iterator, Tuple

from .partition import Candidate

Group = Tuple[int, ...]


def neighbours(cand: Candidate, num_layers: int, num_devices: int, swaps: bool) -> Iterator[Candidate]:
    bounds, groups = cand
    S = len(groups)
    used = {d for g in groups for d in g}
    free = [d for d in range(num_devices) if d not in used]
    for s in range(1, S):  # a boundary moves anywhere between its neighbours
        for pos in sorted(range(bounds[s - 1] + 1, bounds[s + 1]), key=lambda p: (abs(p - bounds[s]), p)):
            if pos != bounds[s]:
                yield bounds[:s] + (pos,) + bounds[s + 1:], groups
    for s in range(S):
        g = groups[s]
        for t in range(S):  # a device to another stage
            if t != s and len(g) > 1:
                for d in g:
                    new = list(groups)
                    new[s] = tuple(x for x in g if x != d)
                    new[t] = groups[t] + (d,)
                    yield bounds, tuple(new)
        for d in free:  # an unused device joins
            new = list(groups)
            new[s] = g + (d,)
            yield bounds, tuple(new)
        if len(g) > 1:  # a device leaves
            for d in g:
                new = list(groups)
                new[s] = tuple(x for x in g if x != d)
                yield bounds, tuple(new)
        for j in range(bounds[s] + 1, bounds[s + 1]):  # a stage splits, a free device takes one part
            for d in free[:1]:
                yield bounds[:s + 1] + (j,) + bounds[s + 1:], groups[:s] + (g, (d,)) + groups[s + 1:]
                yield bounds[:s + 1] + (j,) + bounds[s + 1:], groups[:s] + ((d,), g) + groups[s + 1:]
        if len(g) > 1 and bounds[s + 1] - bounds[s] > 1:  # a replicated stage splits in two
            mid = (bounds[s] + bounds[s + 1]) // 2
            k = len(g) // 2
            yield (bounds[:s + 1] + (mid,) + bounds[s + 1:]), groups[:s] + (g[:k], g[k:]) + groups[s + 1:]
    for s in range(S - 1):  # two neighbouring stages merge
        yield bounds[:s + 1] + bounds[s + 2:], groups[:s] + (groups[s] + groups[s + 1],) + groups[s + 2:]
    if swaps:
        flat = [(s, i) for s, g in enumerate(groups) for i in range(len(g))]
        for x in range(len(flat)):
            for y in range(x + 1, len(flat)):
                (s1, i1), (s2, i2) = flat[x], flat[y]
                if s1 == s2:
                    continue
                new = [list(g) for g in groups]
                new[s1][i1], new[s2][i2] = new[s2][i2], new[s1][i1]
                yield bounds, tuple(map(tuple, new))
            for d in free:
                s1, i1 = flat[x]
                new = [list(g) for g in groups]
                new[s1][i1] = d
                yield bounds, tuple(map(tuple, new))


def hill_climb(start: Candidate, cost: Callable[[Candidate], float], num_layers: int, num_devices: int,
               budget: int, swaps: bool = True) -> Tuple[Candidate, float, int]:
    """(best candidate, its cost, evaluations used)."""
    seen = {start: cost(start)}
    current, current_cost, used = start, seen[start], 1
    while used < budget:  # a pass that moves has spent an evaluation; one that does not stops
        best, best_cost = None, current_cost
        for nb in neighbours(current, num_layers, num_devices, swaps):
            if nb in seen:
                continue
            if used >= budget:
                break
            seen[nb] = cost(nb)
            used += 1
            if seen[nb] < best_cost - 1e-9:
                best, best_cost = nb, seen[nb]
        if best is None:
            break
        current, current_cost = best, best_cost
    return current, current_cost, used
