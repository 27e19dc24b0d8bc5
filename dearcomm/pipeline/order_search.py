"""Every device's order for one partition and mapping, beyond a single rule
for all devices. Three steps, each scored by the simulator:

1. the rules: list scheduling (longest remaining path), 1F1B and GPipe,
   each kept within the devices' memory (in-flight caps, memory.py), and
   mixed rules: GPipe on the first k stages, strict alternation on the rest;
2. per-device warm-ups: device d runs w_d forwards before its first backward
   and then alternates (order.warmup_orders), so GPipe on the first stages
   and strict alternation on the last is one point of the space; coordinate
   descent changes one device's w_d at a time while the iteration shortens;
3. adjacent swaps: from the best orders so far, exchange two neighbouring
   tasks of one device (any two a valid order allows) while that shortens it.

Steps 2 and 3 share an evaluation budget, so the time is bounded and the
result deterministic. Orders over a device's in-flight cap are never tried.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from .memory import peak_in_flight
from .order import Orders, gpipe_orders, one_f_one_b_orders, warmup_orders
from .plan import BACKWARD, FORWARD, Task
from .profile import ModelProfile
from .simulate import Costs, SimulationStuck, _run, list_schedule
from .topology import Topology


def rule_orders(profile: ModelProfile, topology: Topology, bounds: Sequence[int], devices: Sequence[Sequence[int]],
                num_microbatches: int, caps: Dict[int, int]) -> List[Orders]:
    """List scheduling, 1F1B and GPipe, in that order, each within `caps`
    (GPipe over a cap becomes "as many forwards as fit, then alternate")."""
    M, S = num_microbatches, len(devices)
    share = {d: len(range(j, M, len(g))) for g in devices for j, d in enumerate(g)}
    replicated = any(len(g) > 1 for g in devices)
    capped = any(caps[d] < share[d] for d in caps)
    lrp = list_schedule(profile, topology, bounds, devices, M, max_in_flight=caps if capped else None).orders
    one_f = {d: min(caps[d], S - s) for s, g in enumerate(devices) for d in g}
    if all(one_f[d] >= min(S - s, share[d]) for s, g in enumerate(devices) for d in g):
        f1b = one_f_one_b_orders(devices, M, profile, topology, bounds)
    elif not replicated:
        f1b = warmup_orders(devices, M, one_f)
    else:
        f1b = _list_with(profile, topology, bounds, devices, M, backward_first=True, caps=one_f)
    if not capped:
        gp = gpipe_orders(devices, M)
    elif not replicated:
        gp = warmup_orders(devices, M, caps)
    else:
        gp = _list_with(profile, topology, bounds, devices, M, backward_first=False, caps=caps)
    return [lrp, f1b, gp]


def mixed_orders(devices: Sequence[Sequence[int]], num_microbatches: int, caps: Dict[int, int]) -> List[Orders]:
    """Mixed rules, one warm-up per stage: GPipe (as many forwards as fit)
    on the first k stages and strict alternation on the rest, k = 0 .. S - 1."""
    return [warmup_orders(devices, num_microbatches, {d: caps[d] if s < k else 1 for s, g in enumerate(devices)
                                                      for d in g}) for k in range(len(devices))]


def _list_with(profile, topology, bounds, devices, M, backward_first: bool, caps: Dict[int, int]) -> Orders:
    """List scheduling that prefers backwards (1F1B-like) or forwards
    (GPipe-like), earlier micro-batches first, within the caps; it cannot
    deadlock where a fixed alternation over replicas could."""
    key = (lambda t: (t.kind == FORWARD, t.microbatch)) if backward_first else \
        (lambda t: (t.kind == BACKWARD, t.microbatch))
    return list_schedule(profile, topology, bounds, devices, M, priority=key, max_in_flight=caps).orders


class OrderSearch:
    """Scores orders for one partition and mapping; remembers the best."""

    def __init__(self, profile: ModelProfile, topology: Topology, bounds: Sequence[int],
                 devices: Sequence[Sequence[int]], num_microbatches: int, caps: Dict[int, int]) -> None:
        self.costs = Costs(profile, topology, bounds, devices)
        self.devices, self.M, self.caps = tuple(tuple(g) for g in devices), num_microbatches, caps
        self.best: Optional[Orders] = None
        self.best_ms = math.inf
        self.evaluations = 0

    def score(self, orders: Orders) -> float:
        """The simulated iteration (infinite if the orders deadlock)."""
        self.evaluations += 1
        try:
            ms = _run(self.costs, self.M, orders, None).makespan_ms
        except SimulationStuck:
            return math.inf
        if ms < self.best_ms - 1e-9:
            self.best, self.best_ms = dict(orders), ms
        return ms

    def warmup_descent(self, budget: int) -> None:
        """Step 2, from 1F1B's and GPipe's warm-ups (within the caps): first
        a stage's replicas together, then each device alone."""
        S = len(self.devices)
        starts = [{d: min(self.caps[d], S - s) for s, g in enumerate(self.devices) for d in g}, dict(self.caps)]
        scored = [(self.score(warmup_orders(self.devices, self.M, w)), i) for i, w in enumerate(starts)]
        current_ms, i = min(scored)
        current = starts[i]
        moves = [g for g in self.devices if len(g) > 1] + [(d,) for d in sorted(current)]
        stop = self.evaluations + budget
        improved = True
        while improved and self.evaluations < stop:
            improved = False
            for group in moves:
                for w in range(1, max(self.caps[d] for d in group) + 1):
                    trial = {**current, **{d: min(w, self.caps[d]) for d in group}}
                    if trial == current or self.evaluations >= stop:
                        continue
                    ms = self.score(warmup_orders(self.devices, self.M, trial))
                    if ms < current_ms - 1e-9:
                        current, current_ms, improved = trial, ms, True

    def swap_descent(self, budget: int) -> None:
        """Step 3, from the best orders found so far: the same swap on all of a
        stage's replicas, then on each device alone."""
        if self.best is None:
            return
        current = {d: list(o) for d, o in self.best.items()}
        current_ms = self.best_ms
        moves = [g for g in self.devices if len(g) > 1] + [(d,) for d in sorted(current)]
        stop = self.evaluations + budget
        improved = True
        while improved and self.evaluations < stop:
            improved = False
            for group in moves:
                for i in range(min(len(current[d]) for d in group) - 1):
                    if self.evaluations >= stop:
                        return
                    swapped = [d for d in group if self._swap(current[d], i)]
                    if len(swapped) == len(group) and all(peak_in_flight(current[d]) <= self.caps[d] for d in group):
                        ms = self.score({k: tuple(v) for k, v in current.items()})
                        if ms < current_ms - 1e-9:
                            current_ms, improved = ms, True
                            continue
                    for d in swapped:  # undo
                        self._swap(current[d], i)

    def _swap(self, seq: List[Task], i: int) -> bool:
        """Exchanges seq[i] and seq[i + 1] if the order stays valid and the
        two are not interchangeable micro-batches; says whether it did."""
        a, b = seq[i], seq[i + 1]
        if a.microbatch == b.microbatch or (a.kind == b.kind and _same_path(a, b, self.devices)):
            return False  # F_m before B_m; interchangeable micro-batches gain nothing from a swap
        seq[i], seq[i + 1] = b, a
        return True


def _same_path(a: Task, b: Task, devices: Tuple[Tuple[int, ...], ...]) -> bool:
    """Micro-batches that meet the same device at every stage are interchangeable."""
    return all(a.microbatch % len(g) == b.microbatch % len(g) for g in devices)


def best_orders(profile: ModelProfile, topology: Topology, bounds: Sequence[int], devices: Sequence[Sequence[int]],
                num_microbatches: int, caps: Dict[int, int], budget: int) -> Tuple[Orders, float]:
    """(orders, simulated ms): the best of the rules and the mixed rules,
    then, with budget > 0, of the warm-up and swap descents (half the budget
    each)."""
    search = OrderSearch(profile, topology, bounds, devices, num_microbatches, caps)
    for orders in rule_orders(profile, topology, bounds, devices, num_microbatches, caps) + \
            mixed_orders(devices, num_microbatches, caps):
        search.score(orders)
    if budget > 0:
        search.warmup_descent(budget // 2)
        search.swap_descent(budget - budget // 2)
    assert search.best is not None, "list scheduling within caps >= 1 cannot deadlock"
    return search.best, search.best_ms
