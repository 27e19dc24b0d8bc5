"""The planner: partition × device mapping × micro-batch order, for the
shortest synchronous iteration. Pure and deterministic.

1. For each device order from the mapping search, the synchronous DP gives
   candidate partitions with replication (partition.sync_dp), ranked by the
   synchronous estimate.
2. The best few candidates over all orders, and the baselines' partitions
   and mappings (GPipe's, PipeDream's, DAPPLE's), are scheduled three ways (list
   scheduling by longest remaining path, 1F1B, GPipe) and simulated with
   link contention and the all-reduce.
3. From the best of them, a local search on the simulated time (refine.py)
   moves boundaries and devices while the iteration gets shorter.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from . import validate
from .order import gpipe_orders, list_orders, one_f_one_b_orders
from .partition import Candidate, sync_dp, sync_estimate
from .mapping import search_orders
from .plan import Plan, check_sizes
from .profile import ModelProfile
from .refine import hill_climb
from .simulate import Costs, simulate
from .topology import Topology


def plan_pipeline(profile: ModelProfile, topology: Topology, num_microbatches: int,
                  max_stages: Optional[int] = None, finalists: int = 10, num_caps: int = 10,
                  exhaustive_limit: int = 48, refine_budget: int = 400, starts: int = 4) -> Plan:
    """The planned Plan, its predicted_ms set by the simulator.

    max_stages: cap on pipeline stages (default: layers or devices, whichever
    is fewer); finalists: candidates simulated; num_caps: bottleneck caps per
    DP; exhaustive_limit: distinct device orders above which the mapping
    search turns heuristic; refine_budget: simulations the local search may
    spend (0: none), shared by `starts` climbs."""
    where = "plan_pipeline()"
    validate.problem(profile, topology, where)
    validate.optional_positive_int(max_stages, "max_stages", where)
    validate.nonnegative_int(finalists, "finalists", where)
    validate.positive_int(num_caps, "num_caps", where)
    validate.nonnegative_int(exhaustive_limit, "exhaustive_limit", where)
    validate.nonnegative_int(refine_budget, "refine_budget", where)
    validate.positive_int(starts, "starts", where)  # refine_budget is shared among them
    check_sizes(len(profile), topology.size, max_stages, num_microbatches, where)
    pool: List[Tuple[float, Candidate]] = []

    def score(order) -> float:
        found = [(sync_estimate(Costs(profile, topology, *c), num_microbatches), c)
                 for c in sync_dp(profile, topology, order, num_microbatches, num_caps, max_stages)]
        pool.extend(found)
        return min(e for e, _ in found)

    search_orders(topology, score, exhaustive_limit)
    # The baselines' partitions and mappings join the finalists: the planner
    # then never returns a plan slower than one it could have simulated.
    from .baselines import baseline_candidates
    ranked, seen = [], set()
    for cand in baseline_candidates(profile, topology, num_microbatches):
        if cand not in seen and len(cand[1]) <= min(max_stages or len(profile), len(profile), topology.size):
            seen.add(cand)
            ranked.append(cand)
    finalists += len(ranked)
    for est, cand in sorted(pool):
        if cand not in seen:
            seen.add(cand)
            ranked.append(cand)
        if len(ranked) == finalists:
            break
    scheduled = sorted((best_scheduled(profile, topology, [c], num_microbatches, "planner") for c in ranked),
                       key=lambda p: p.predicted_ms)
    best = scheduled[0]
    if refine_budget <= 0:
        return best
    S_max = min(max_stages or len(profile), len(profile), topology.size)

    def cost(cand: Candidate) -> float:
        if len(cand[1]) > S_max:
            return float("inf")
        return best_scheduled(profile, topology, [cand], num_microbatches, "planner").predicted_ms

    # Climb from the best few finalists (they often sit on different hills).
    for start in scheduled[:starts]:
        cand, _, _ = hill_climb((start.bounds, start.devices), cost, len(profile), topology.size,
                                refine_budget // starts, swaps=topology.size <= 8)
        refined = best_scheduled(profile, topology, [cand], num_microbatches, "planner")
        if refined.predicted_ms < best.predicted_ms - 1e-9:
            best = refined
    return best


def best_scheduled(profile: ModelProfile, topology: Topology, candidates: List[Candidate],
                   num_microbatches: int, name: str) -> Plan:
    """Simulates each candidate under the three orders; the shortest wins
    (ties: the earlier candidate, then list < 1F1B < GPipe)."""
    best: Optional[Plan] = None
    for bounds, devices in candidates:
        for orders in (list_orders(profile, topology, bounds, devices, num_microbatches),
                       one_f_one_b_orders(devices, num_microbatches, profile, topology, bounds), gpipe_orders(devices, num_microbatches)):
            plan = Plan(bounds, devices, orders, num_microbatches, name)
            t = simulate(plan, profile, topology).makespan_ms
            if best is None or t < best.predicted_ms - 1e-9:
                best = Plan(bounds, devices, plan.orders, num_microbatches, name, t)
    assert best is not None
    return best
