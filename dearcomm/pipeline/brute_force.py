"""The best plan under the three order rules for small problems (≤ 8 layers,
≤ 4 devices): every partition × every assignment of ordered, disjoint device
groups to the stages (unused devices allowed), each scheduled by list
scheduling, 1F1B and GPipe within the devices' memory and simulated; the
shortest wins (none fitting is an error). Candidates whose
lower bound (the busiest replica's compute, or one micro-batch's way through
every stage) already reaches the best found are skipped.

Not the optimum: orders beyond the three rules are not tried, and the
planner's order search often beats it. exhaustive.py searches every order."""
from __future__ import annotations

from . import validate
from .candidates import all_candidates
from .memory import DEFAULT_OPTIMIZER_SLOTS, no_fit_error
from .partition import sync_estimate
from .plan import Plan, check_sizes
from .planner import best_scheduled
from .profile import ModelProfile
from .topology import Topology

MAX_LAYERS, MAX_DEVICES = 8, 4


def brute_force(profile: ModelProfile, topology: Topology, num_microbatches: int) -> Plan:
    validate.problem(profile, topology, "brute_force()")
    L, D, M = len(profile), topology.size, num_microbatches
    check_sizes(L, D, None, M, "brute_force()")
    if L > MAX_LAYERS or D > MAX_DEVICES:
        raise ValueError(f"dearcomm: brute_force() is for at most {MAX_LAYERS} layers and {MAX_DEVICES} devices, "
                         f"got {L} layers and {D} devices")
    cands = sorted((sync_estimate(costs, M), lower, cand)
                   for lower, cand, costs in all_candidates(profile, topology, M, D))
    best = None
    for _, lower, (bounds, groups) in cands:
        if best is not None and lower >= best.predicted_ms - 1e-9:
            continue
        plan = best_scheduled(profile, topology, [(bounds, groups)], M, "brute-force")
        if plan is not None and (best is None or plan.predicted_ms < best.predicted_ms - 1e-9):
            best = plan  # None: it does not fit in memory
    if best is None:
        raise no_fit_error(profile, topology, DEFAULT_OPTIMIZER_SLOTS, "brute_force()")
    return best
