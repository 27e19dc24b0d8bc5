"""The planner: partition × device mapping × every device's order, for the
shortest synchronous iteration that fits in memory. Pure and deterministic.

1. For each device order from the mapping search, the synchronous DP gives
   candidate partitions with replication (partition.sync_dp), ranked by the
   synchronous estimate; with a memory limit only stages that fit with one
   micro-batch in flight.
2. The best few candidates over all orders, and the baselines' partitions
   and mappings (GPipe's, PipeDream's, DAPPLE's), are scheduled three ways (list
   scheduling by longest remaining path, 1F1B, GPipe, each within the
   devices' in-flight caps, memory.py) and simulated with link contention
   and the all-reduce.
3. Small problems (at most enumerate_limit partitions × mappings): every
   candidate whose compute bound could still beat the best so far is
   scheduled too (candidates.py). Larger ones: from the best finalists, a
   local search on the simulated time (refine.py) moves boundaries and
   devices while the iteration gets shorter.
4. The best few partitions and mappings then get their own per-device
   orders (order_search.py): per-device warm-ups, then adjacent swaps,
   within a budget of simulations.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from . import validate
from .candidates import all_candidates, count_candidates
from .memory import DEFAULT_OPTIMIZER_SLOTS, in_flight_caps, least_memory_split, no_fit_error
from .order_search import best_orders, mixed_orders, rule_orders
from .partition import Candidate, sync_dp, sync_estimate
from .mapping import search_orders
from .plan import Plan, check_sizes
from .profile import ModelProfile
from .refine import hill_climb
from .simulate import Costs, SimulationStuck, _run
from .topology import Topology


def plan_pipeline(profile: ModelProfile, topology: Topology, num_microbatches: int,
                  max_stages: Optional[int] = None, finalists: int = 10, num_caps: int = 10,
                  exhaustive_limit: int = 48, refine_budget: int = 400, starts: int = 4,
                  order_budget: int = 800, enumerate_limit: int = 4000,
                  optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS) -> Plan:
    """The planned Plan, its predicted_ms set by the simulator.

    max_stages: cap on pipeline stages (default, and at most: layers or
    devices, whichever is fewer); finalists: candidates simulated; num_caps: bottleneck caps per
    DP; exhaustive_limit: distinct device orders above which the mapping
    search turns heuristic; refine_budget: simulations the local search may
    spend (0: none), shared by `starts` climbs; order_budget: simulations the
    order search may spend (0: the rules only), shared by the `starts`
    best partitions and mappings; enumerate_limit: partitions × mappings up
    to which every one is tried (pruned by a compute bound) instead of the
    local search; optimizer_slots: copies of optimizer state
    per parameter (memory.py: Adam 2, SGD with momentum 1, SGD 0), used only
    if the topology has a memory limit. Raises ValueError if no plan fits."""
    where = "plan_pipeline()"
    validate.problem(profile, topology, where)
    validate.optional_positive_int(max_stages, "max_stages", where)
    validate.nonnegative_int(finalists, "finalists", where)
    validate.positive_int(num_caps, "num_caps", where)
    validate.nonnegative_int(exhaustive_limit, "exhaustive_limit", where)
    validate.nonnegative_int(refine_budget, "refine_budget", where)
    validate.positive_int(starts, "starts", where)  # refine_budget and order_budget are shared among them
    validate.nonnegative_int(order_budget, "order_budget", where)
    validate.nonnegative_int(enumerate_limit, "enumerate_limit", where)
    validate.finite_nonnegative(optimizer_slots, "optimizer_slots", where)
    check_sizes(len(profile), topology.size, None, num_microbatches, where)  # max_stages is a cap: clamped below
    M = num_microbatches
    S_max = min(max_stages or len(profile), len(profile), topology.size)
    pool: List[Tuple[float, Candidate]] = []

    def score(order) -> float:
        found = [(sync_estimate(Costs(profile, topology, *c), M), c)
                 for c in sync_dp(profile, topology, order, M, num_caps, max_stages, optimizer_slots)]
        pool.extend(found)
        return min((e for e, _ in found), default=float("inf"))

    search_orders(topology, score, exhaustive_limit)
    # The baselines' partitions and mappings join the finalists: the planner
    # then never returns a plan slower than one it could have simulated.
    from .baselines import baseline_candidates
    ranked, seen = [], set()
    for cand in baseline_candidates(profile, topology, M):
        if cand not in seen and len(cand[1]) <= S_max:
            seen.add(cand)
            ranked.append(cand)
    finalists += len(ranked)
    for est, cand in sorted(pool):
        if cand not in seen:
            seen.add(cand)
            ranked.append(cand)
        if len(ranked) == finalists:
            break
    scheduled = [p for p in (best_scheduled(profile, topology, [c], M, "planner", optimizer_slots, True)
                                 for c in ranked)
                 if p is not None]
    if not scheduled and topology.memory_bytes:  # the split that fits best, if it fits at all
        split = least_memory_split(profile, topology, optimizer_slots, S_max)
        bounds, devices, (ratio, _, _, _) = split
        if ratio > 1:
            raise no_fit_error(profile, topology, optimizer_slots, where, max_stages, split)
        scheduled = [best_scheduled(profile, topology, [(bounds, devices)], M, "planner", optimizer_slots, True)]
    small = count_candidates(len(profile), topology.size, S_max) <= enumerate_limit
    if small:  # every partition and mapping whose compute alone could still beat the best so far
        known = {(p.bounds, p.devices) for p in scheduled}
        best_ms = min(p.predicted_ms for p in scheduled)
        from .exhaustive import order_bound  # it imports the planner's users
        for lower, cand, costs in all_candidates(profile, topology, M, S_max):
            if lower >= best_ms - 1e-9:
                break
            if cand in known:
                continue
            caps = in_flight_caps(profile, topology, *cand, M, optimizer_slots)
            if caps is None or order_bound(costs, M, caps) >= best_ms - 1e-9:
                continue
            plan = best_scheduled(profile, topology, [cand], M, "planner", optimizer_slots, True)
            if plan is not None:
                scheduled.append(plan)
                best_ms = min(best_ms, plan.predicted_ms)
    # Ties go to fewer devices, then fewer stages: a split that costs nothing more gains nothing.
    scheduled.sort(key=lambda p: (p.predicted_ms, sum(map(len, p.devices)), len(p.devices)))
    best = scheduled[0]
    tops = [(p.bounds, p.devices) for p in scheduled[:starts]]
    if refine_budget > 0 and not small:
        def cost(cand: Candidate) -> float:
            if len(cand[1]) > S_max:
                return float("inf")
            plan = best_scheduled(profile, topology, [cand], M, "planner", optimizer_slots)  # the rules: cheap
            return plan.predicted_ms if plan is not None else float("inf")

        # Climb from the best few finalists (they often sit on different hills).
        for start in scheduled[:starts]:
            cand, _, _ = hill_climb((start.bounds, start.devices), cost, len(profile), topology.size,
                                    refine_budget // starts, swaps=topology.size <= 8)
            refined = best_scheduled(profile, topology, [cand], M, "planner", optimizer_slots, True)
            if refined.predicted_ms < best.predicted_ms - 1e-9:
                best = refined
            if cand not in tops:
                tops.append(cand)
    if order_budget > 0:  # the most promising partitions and mappings, under the rules, get their own orders
        rank = {c: _rules_ms(profile, topology, c, M, optimizer_slots) for c in tops}
        for cand in sorted(tops, key=lambda c: (rank[c], tops.index(c)))[:starts]:
            caps = in_flight_caps(profile, topology, *cand, M, optimizer_slots)
            orders, ms = best_orders(profile, topology, *cand, M, caps, order_budget // starts)
            if ms < best.predicted_ms - 1e-9:
                best = Plan(*cand, orders, M, "planner", ms)
    return best


def _rules_ms(profile: ModelProfile, topology: Topology, cand: Candidate, M: int, optimizer_slots: float) -> float:
    plan = best_scheduled(profile, topology, [cand], M, "planner", optimizer_slots, True)
    return plan.predicted_ms if plan is not None else float("inf")


def best_scheduled(profile: ModelProfile, topology: Topology, candidates: List[Candidate],
                   num_microbatches: int, name: str, optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS,
                   mixed: bool = False) -> Optional[Plan]:
    """Simulates each candidate that fits in memory under the three rules
    (order_search.rule_orders) and, if mixed, the mixed rules; the shortest
    wins (ties: the earlier candidate, then list < 1F1B < GPipe < mixed).
    None if none fits."""
    best: Optional[Plan] = None
    for bounds, devices in candidates:
        caps = in_flight_caps(profile, topology, bounds, devices, num_microbatches, optimizer_slots)
        if caps is None:
            continue
        costs = Costs(profile, topology, bounds, devices)
        rules = rule_orders(profile, topology, bounds, devices, num_microbatches, caps)
        for orders in rules + (mixed_orders(devices, num_microbatches, caps) if mixed else []):
            try:
                t = _run(costs, num_microbatches, orders, None).makespan_ms
            except SimulationStuck:  # a fixed rule over replicas can deadlock; list scheduling cannot
                continue
            if best is None or t < best.predicted_ms - 1e-9:
                best = Plan(tuple(bounds), tuple(tuple(g) for g in devices), dict(orders), num_microbatches, name, t)
    return best
