"""What a device holds while it runs its part of a plan, against the
topology's per-device capacity (Topology.memory_bytes):

  static    = the stage's parameter bytes × (2 + optimizer_slots): the
              weights, their gradients, and optimizer_slots copies of state
              (Adam keeps 2, SGD with momentum 1, plain SGD 0);
  stash     = what one micro-batch leaves behind from its forward until its
              backward: the stage's input (the cut into it) and every
              layer's output;
  peak      = static + stash × the most micro-batches in flight (forwards
              whose backward has not run) anywhere in the device's order.

So the order decides the memory: GPipe keeps every micro-batch in flight,
1F1B at most S - s on stage s, strict alternation one. The runtime frees a
micro-batch's saved tensors at its backward, as this model assumes.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

from . import validate
from .plan import FORWARD, Plan, Task
from .profile import ModelProfile
from .topology import Topology

DEFAULT_OPTIMIZER_SLOTS = 2.0  # Adam's two moments


def static_bytes(profile: ModelProfile, a: int, b: int, optimizer_slots: float) -> float:
    """Weights, gradients and optimizer state of layers [a, b)."""
    return profile.param_bytes(a, b) * (2.0 + optimizer_slots)


def stash_bytes(profile: ModelProfile, a: int, b: int) -> float:
    """One micro-batch's saved tensors in layers [a, b): the input and every output."""
    received = profile.boundary_bytes(a) if a > 0 else 0.0
    return received + sum(l.activation_bytes for l in profile.layers[a:b])


def peak_in_flight(order: Sequence[Task]) -> int:
    """The most forwards whose backward has not run, over the order."""
    live = peak = 0
    for task in order:
        live += 1 if task.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def in_flight_caps(profile: ModelProfile, topology: Topology, bounds: Sequence[int],
                   devices: Sequence[Sequence[int]], num_microbatches: int,
                   optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS) -> Optional[Dict[int, int]]:
    """{device: micro-batches it may keep in flight} (at most its share of
    the micro-batches), or None if some stage does not fit even with one."""
    caps = {}
    for s, group in enumerate(devices):
        a, b = bounds[s], bounds[s + 1]
        static, stash = static_bytes(profile, a, b, optimizer_slots), stash_bytes(profile, a, b)
        for j, d in enumerate(group):
            share = len(range(j, num_microbatches, len(group)))  # micro-batch m runs on replica m % r
            room = topology.memory_of(d) - static
            if room < stash or room < 0:
                return None
            caps[d] = max(1, share if stash <= 0 or math.isinf(room) else int(min(share, room // stash)))
    return caps


def device_memory(plan: Plan, profile: ModelProfile, optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS
                  ) -> Dict[int, float]:
    """{device: its peak bytes under the plan's orders}."""
    validate.finite_nonnegative(optimizer_slots, "optimizer_slots", "device_memory()")
    out = {}
    for s, group in enumerate(plan.devices):
        a, b = plan.stage_layers(s)
        for d in group:
            out[d] = static_bytes(profile, a, b, optimizer_slots) + \
                stash_bytes(profile, a, b) * peak_in_flight(plan.orders.get(d, ()))
    return out


def check_memory(plan: Plan, profile: ModelProfile, topology: Topology,
                 optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS) -> None:
    """Raises ValueError naming the first device whose peak exceeds its capacity."""
    validate.instance(plan, Plan, "plan", "check_memory()")
    validate.problem(profile, topology, "check_memory()")
    plan.validate(len(profile), topology.size)
    for d, need in sorted(device_memory(plan, profile, optimizer_slots).items()):
        if need > topology.memory_of(d):
            s = plan.stage_of_device(d)[0]
            a, b = plan.stage_layers(s)
            raise ValueError(f"dearcomm: plan {plan.name!r} does not fit: device {d} (stage {s}, layers [{a}, {b})) "
                             f"{describe_need(profile, a, b, peak_in_flight(plan.orders.get(d, ())), optimizer_slots)}"
                             f", but holds {topology.memory_of(d):.4g}")


def describe_need(profile: ModelProfile, a: int, b: int, in_flight: int, optimizer_slots: float) -> str:
    static, stash = static_bytes(profile, a, b, optimizer_slots), stash_bytes(profile, a, b)
    return (f"needs {static + in_flight * stash:.4g} bytes (parameters, gradients and optimizer state "
            f"{static:.4g}, {in_flight} micro-batch(es) of activations at {stash:.4g} each)")


_FALLBACK_WORK = 4e6  # DP steps the fallback may take; more distinct capacities are grouped


def _capacity_classes(topology: Topology, layers: int, most: int):
    """The devices in classes of one capacity each (largest first), and each
    class's capacity. Where the DP over devices used per class would take
    more than _FALLBACK_WORK steps, the two neighbouring classes closest in
    capacity merge, counted at the smaller: a split found to fit then fits."""
    by_size = sorted(range(topology.size), key=lambda d: (-topology.memory_of(d), d))
    pools: list = []
    for d in by_size:
        if pools and topology.memory_of(pools[-1][-1]) == topology.memory_of(d):
            pools[-1].append(d)
        else:
            pools.append([d])

    def work() -> float:
        return layers * layers / 2 * len(pools) * math.prod(min(len(p), most) + 1 for p in pools)

    while len(pools) > 1 and work() > _FALLBACK_WORK:
        k = max(range(len(pools) - 1), key=lambda k: topology.memory_of(pools[k + 1][0]) /
                topology.memory_of(pools[k][-1]))
        pools[k:k + 2] = [pools[k] + pools[k + 1]]
    return pools, [topology.memory_of(p[-1]) for p in pools]


def least_memory_split(profile: ModelProfile, topology: Topology,
                       optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS, max_stages: Optional[int] = None):
    """The split whose stages fit best, each on one device with one
    micro-batch in flight: the partition into at most max_stages stages and
    the devices for them of least worst need / capacity (a DP over layers
    placed and devices used of each capacity; fewer stages on a tie). The
    least largest need alone would put a heavy stage on a small device.
    Returns (bounds, devices, (worst need / capacity, stage, need, device));
    the planner's last resort and the error when nothing fits."""
    L = len(profile)
    params, acts = [0.0], [0.0]
    for l in profile.layers:
        params.append(params[-1] + l.param_bytes)
        acts.append(acts[-1] + l.activation_bytes)

    def need(a: int, b: int) -> float:
        return (params[b] - params[a]) * (2.0 + optimizer_slots) + (profile.boundary_bytes(a) if a else 0.0) + \
            acts[b] - acts[a]

    S_max = min(L, topology.size, max_stages or L)
    pools, capacity = _capacity_classes(topology, L, S_max)
    found = _fewest_ratio_split(need, L, S_max, pools, capacity, topology)
    if len(pools) < len({topology.memory_of(d) for d in range(topology.size)}):
        # Classes were merged, so the DP may miss: the split of least largest need may do better.
        found = min(found, _least_need_split(need, L, S_max, topology), key=lambda f: f[0])
    worst, bounds, devices = found
    s = worst[1]
    return bounds, tuple((d,) for d in devices), (worst[0], s, need(bounds[s], bounds[s + 1]), devices[s])


def _fewest_ratio_split(need, L: int, S_max: int, pools, capacity, topology: Topology):
    """((worst ratio, its stage), bounds, devices) of least worst ratio."""
    # best[j][used]: (worst ratio, layers before, class) of layers [0, j) on
    # used[k] devices of class k
    best = [dict() for _ in range(L + 1)]
    best[0][(0,) * len(pools)] = (0.0, None, None)
    for j in range(1, L + 1):
        for i in range(j):
            for used, (worst, _, _) in best[i].items():
                if sum(used) == S_max:
                    continue
                for k, pool in enumerate(pools):
                    if used[k] == len(pool):
                        continue
                    ratio = max(worst, need(i, j) / capacity[k])
                    key = used[:k] + (used[k] + 1,) + used[k + 1:]
                    if key not in best[j] or ratio < best[j][key][0]:
                        best[j][key] = (ratio, i, k)
    used = min(best[L], key=lambda u: (best[L][u][0], sum(u), tuple(-n for n in u)))
    stages, j = [], L
    while j:
        _, i, k = best[j][used]
        stages.append((i, j, k))
        used, j = used[:k] + (used[k] - 1,) + used[k + 1:], i
    stages.reverse()
    taken = [0] * len(pools)
    devices = []
    for _, _, k in stages:
        devices.append(pools[k][taken[k]])
        taken[k] += 1
    return _verdict(need, tuple(a for a, _, _ in stages) + (L,), devices, topology)


def _least_need_split(need, L: int, S_max: int, topology: Topology):
    """For every stage count, the partition of least largest need, its
    stages paired largest-first with the largest devices; the least worst ratio."""
    by_size = sorted(range(topology.size), key=lambda d: (-topology.memory_of(d), d))
    best = None
    for S in range(1, S_max + 1):
        # least[s][j]: (the least peak stage, parent) of layers [0, j) in s stages
        least = [[(math.inf, 0)] * (L + 1) for _ in range(S + 1)]
        least[0][0] = (0.0, 0)
        for s in range(1, S + 1):
            for j in range(s, L - (S - s) + 1):
                least[s][j] = min((max(least[s - 1][i][0], need(i, j)), i) for i in range(s - 1, j))
        bounds, j = [L], L
        for s in range(S, 0, -1):
            j = least[s][j][1]
            bounds.append(j)
        bounds = tuple(reversed(bounds))
        stages = sorted(range(S), key=lambda s: (-need(bounds[s], bounds[s + 1]), s))
        device_of = {s: by_size[i] for i, s in enumerate(stages)}
        found = _verdict(need, bounds, [device_of[s] for s in range(S)], topology)
        if best is None or found[0][0] < best[0][0]:
            best = found
    return best


def _verdict(need, bounds, devices, topology: Topology):
    """((worst need / capacity, its stage), bounds, devices) of a split, stage s on devices[s]."""
    worst = max((need(bounds[s], bounds[s + 1]) / topology.memory_of(d), s) for s, d in enumerate(devices))
    return worst, tuple(bounds), tuple(devices)


def no_fit_error(profile: ModelProfile, topology: Topology, optimizer_slots: float, where: str,
                 max_stages: Optional[int] = None, split=None) -> ValueError:
    """The error for a problem no plan fits: the stage of the best-fitting
    split (of at most max_stages stages) that overflows; ``split``: that
    split, where the caller found it already (least_memory_split)."""
    bounds, _, (_, s, need, device) = split or least_memory_split(profile, topology, optimizer_slots, max_stages)
    a, b = bounds[s], bounds[s + 1]
    capped = max_stages is not None and max_stages < min(len(profile), topology.size)
    within = f" within max_stages={max_stages}" if capped else ""
    remedy = "raise max_stages, add devices or memory" if capped else "add devices or memory"
    return ValueError(f"dearcomm: {where}: no plan fits in memory{within}; the split that fits best "
                      f"({len(bounds) - 1} stage{'s' if len(bounds) > 2 else ''} at layers {bounds}) still overflows: "
                      f"stage {s} (layers [{a}, {b})) "
                      f"{describe_need(profile, a, b, 1, optimizer_slots)}, more than the "
                      f"{topology.memory_of(device):.4g} bytes of device {device}; {remedy}, or use an "
                      "optimizer with less state")
