"""The published baselines, planned on the same inputs and simulated by the
same simulator:

- gpipe:     S = min(devices, layers) stages balanced by compute, device s
             holds stage s, GPipe order;
- 1f1b:      the same partition, 1F1B order (PipeDream-flush);
- pipedream: PipeDream's DP partition with replication (one flat bandwidth,
             the mean over device pairs: its planner sees one level), stages on
             consecutive devices, 1F1B order (flushed, for synchronous training);
- dapple:    the partition and replication of least synchronous estimate
             (DAPPLE's formula) on consecutive devices (no mapping search),
             1F1B order (DAPPLE's early backward).
"""
from __future__ import annotations

from typing import Dict

from . import validate
from .order import gpipe_orders, one_f_one_b_orders
from .partition import balanced_bounds, pipedream_dp, sync_dp, sync_estimate
from .plan import Plan, check_sizes
from .profile import ModelProfile
from .simulate import Costs, simulate
from .topology import Topology


def _finish(plan: Plan, profile: ModelProfile, topology: Topology) -> Plan:
    return Plan(plan.bounds, plan.devices, plan.orders, plan.num_microbatches, plan.name,
                simulate(plan, profile, topology).makespan_ms)


def _check(profile: ModelProfile, topology: Topology, num_microbatches: int, where: str) -> None:
    validate.problem(profile, topology, where)
    check_sizes(len(profile), topology.size, None, num_microbatches, where)


def _one_stage_per_device(profile: ModelProfile, topology: Topology, num_microbatches: int, orders, name: str,
                          where: str) -> Plan:
    """Balanced stages, stage s on device s, tasks in the given order rule."""
    _check(profile, topology, num_microbatches, where)
    bounds = balanced_bounds(profile, min(topology.size, len(profile)))
    devices = tuple((s,) for s in range(len(bounds) - 1))
    return _finish(Plan(bounds, devices, orders(devices, num_microbatches), num_microbatches, name), profile, topology)


def gpipe_plan(profile: ModelProfile, topology: Topology, num_microbatches: int) -> Plan:
    return _one_stage_per_device(profile, topology, num_microbatches, gpipe_orders, "gpipe", "gpipe_plan()")


def one_f_one_b_plan(profile: ModelProfile, topology: Topology, num_microbatches: int) -> Plan:
    return _one_stage_per_device(profile, topology, num_microbatches, one_f_one_b_orders, "1f1b",
                                 "one_f_one_b_plan()")


def pipedream_plan(profile: ModelProfile, topology: Topology, num_microbatches: int) -> Plan:
    _check(profile, topology, num_microbatches, "pipedream_plan()")
    n = topology.size
    pairs = [topology.link_bandwidth(a, b) for a in range(n) for b in range(n) if a != b]
    bandwidth = sum(pairs) / len(pairs) if pairs else 1e12
    bounds, replicas = pipedream_dp(profile, n, bandwidth)
    devices, k = [], 0
    for r in replicas:
        devices.append(tuple(range(k, k + r)))
        k += r
    devices = tuple(devices)
    orders = one_f_one_b_orders(devices, num_microbatches, profile, topology, bounds)
    return _finish(Plan(bounds, devices, orders, num_microbatches, "pipedream"), profile, topology)


def dapple_plan(profile: ModelProfile, topology: Topology, num_microbatches: int) -> Plan:
    _check(profile, topology, num_microbatches, "dapple_plan()")
    order = tuple(range(topology.size))
    # Its stages fit with one micro-batch in flight where any do (sync_dp); else memory is left to check_memory.
    cands = sync_dp(profile, topology, order, num_microbatches) or \
        sync_dp(profile, topology.with_memory(None), order, num_microbatches)
    bounds, devices = min(cands, key=lambda c: (sync_estimate(Costs(profile, topology, *c), num_microbatches), c))
    orders = one_f_one_b_orders(devices, num_microbatches, profile, topology, bounds)
    return _finish(Plan(bounds, devices, orders, num_microbatches, "dapple"), profile, topology)


BASELINES = {"gpipe": gpipe_plan, "1f1b": one_f_one_b_plan, "pipedream": pipedream_plan, "dapple": dapple_plan}


def all_plans(profile: ModelProfile, topology: Topology, num_microbatches: int, **planner_args) -> Dict[str, Plan]:
    """{name: plan} for the planner and every baseline."""
    from .planner import plan_pipeline
    out = {"planner": plan_pipeline(profile, topology, num_microbatches, **planner_args)}
    out.update({name: fn(profile, topology, num_microbatches) for name, fn in BASELINES.items()})
    return out


def baseline_candidates(profile: ModelProfile, topology: Topology, num_microbatches: int):
    """(bounds, devices) of the GPipe / 1F1B, PipeDream and DAPPLE plans,
    without their orders (the planner schedules them its own ways)."""
    n = topology.size
    bounds = balanced_bounds(profile, min(n, len(profile)))
    out = [(bounds, tuple((s,) for s in range(len(bounds) - 1)))]
    pairs = [topology.link_bandwidth(a, b) for a in range(n) for b in range(n) if a != b]
    pd_bounds, replicas = pipedream_dp(profile, n, sum(pairs) / len(pairs) if pairs else 1e12)
    devices, k = [], 0
    for r in replicas:
        devices.append(tuple(range(k, k + r)))
        k += r
    out.append((pd_bounds, tuple(devices)))
    cands = sync_dp(profile, topology, tuple(range(n)), num_microbatches) or \
        sync_dp(profile, topology.with_memory(None), tuple(range(n)), num_microbatches)
    out.append(min(cands, key=lambda c: (sync_estimate(Costs(profile, topology, *c), num_microbatches), c)))
    return out
