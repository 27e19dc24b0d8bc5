"""Partitions of a layer chain into stages, and the synchronous estimate they
are ranked by.

Synchronous estimate of one iteration (DAPPLE's form):
    latency of one micro-batch through every stage and boundary, forward and back
  + (micro-batches a stage replica or a link carries − 1) × its per-micro-batch time,
    for the slowest of them (the pipeline's bottleneck)
  + the part of a replicated stage's gradient all-reduce that the backward
    drain of the stages before it does not hide.

`sync_dp` minimises it over partitions and replications for one device order:
for a cap C on the bottleneck it finds the partition of least latency whose
bottleneck is ≤ C (a DP over (layers placed, devices used)); trying a ladder
of caps trades the two terms. `pipedream_dp` is PipeDream's planner.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from .memory import DEFAULT_OPTIMIZER_SLOTS
from .profile import ModelProfile
from .simulate import Costs
from .topology import Topology

Candidate = Tuple[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]  # (bounds, devices per stage)


def sync_estimate(costs: Costs, num_microbatches: int) -> float:
    """The synchronous estimate above for one partition and mapping. Links
    count by their shared resources: a NIC that carries a device's
    activations forward and its gradients back is one bottleneck."""
    M, S = num_microbatches, len(costs.fwd)
    topo, devices = costs.topology, costs.devices
    latency = sum(costs.fwd) + sum(costs.bwd)
    blocks = [0.0]
    for s in range(S):
        r = len(devices[s])
        blocks.append((math.ceil(M / r) - 1) * (costs.fwd[s] + costs.bwd[s]))
        if s < S - 1:
            latency += 2 * costs.worst_transfer(s)
    load: Dict = {}
    for s in range(S - 1):
        for m in range(M):
            a, b = devices[s][m % len(devices[s])], devices[s + 1][m % len(devices[s + 1])]
            for src, dst in ((a, b), (b, a)):
                occupancy = topo.transfer_ms(src, dst, costs.cut[s])[0]
                for res in topo.resources(src, dst):
                    load[res] = load.get(res, 0.0) + occupancy
    if load:
        blocks.append(max(load.values()) * (M - 1) / M)
    drain, exposed = 0.0, 0.0
    for s in range(S):  # backward drain after stage s's last backward: the stages before it
        exposed = max(exposed, costs.allreduce[s] - drain)
        drain += costs.bwd[s] + (costs.worst_transfer(s) if s < S - 1 else 0.0)
    return latency + max(blocks) + max(exposed, 0.0)


class _OrderTables:
    """Everything the DP needs about one device order, precomputed."""

    def __init__(self, profile: ModelProfile, topology: Topology, order: Sequence[int],
                 optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS) -> None:
        n = len(profile)
        self.order = tuple(order)
        self.work = [0.0]   # prefix of f + b
        self.back = [0.0]   # prefix of b
        self.params = [0.0]
        self.acts = [0.0]   # prefix of the layers' outputs (memory.stash_bytes)
        for l in profile.layers:
            self.work.append(self.work[-1] + l.forward_ms + l.backward_ms)
            self.back.append(self.back[-1] + l.backward_ms)
            self.params.append(self.params[-1] + l.param_bytes)
            self.acts.append(self.acts[-1] + l.activation_bytes)
        self.cut = [0.0] + [profile.boundary_bytes(b) for b in range(1, n)]
        self.slots = optimizer_slots
        D = len(order)
        # memory[k, r]: the least capacity in the group order[k:k+r] (inf: no limit)
        self.limited = bool(topology.memory_bytes)
        self.memory = {(k, r): min(topology.memory_of(d) for d in order[k:k + r])
                       for k in range(D) for r in range(1, D - k + 1)}
        # ring[k][r]: (bandwidth, latency) of the ring over order[k:k+r]
        self.ring: Dict[Tuple[int, int], Tuple[float, float]] = {}
        for k in range(D):
            for r in range(2, D - k + 1):
                g = list(order[k:k + r])
                pairs = list(zip(g, g[1:] + g[:1]))
                self.ring[k, r] = (min(topology.link_bandwidth(a, b) for a, b in pairs),
                                   max(topology.link_latency(a, b) for a, b in pairs))
        # into[k][r]: (ms per byte, latency ms) from order[k-1] into the group order[k:k+r], worst member
        self.into: Dict[Tuple[int, int], Tuple[float, float]] = {}
        for k in range(1, D):
            for r in range(1, D - k + 1):
                g = order[k:k + r]
                self.into[k, r] = (max(1e3 / topology.link_bandwidth(order[k - 1], d) for d in g),
                                   max(topology.link_latency(order[k - 1], d) * 1e3 for d in g))

    def fits(self, j: int, j2: int, k: int, r: int) -> bool:
        """Layers [j, j2) fit on the group order[k:k+r] with one micro-batch in flight."""
        need = (self.params[j2] - self.params[j]) * (2.0 + self.slots) + self.cut[j] + self.acts[j2] - self.acts[j]
        return need <= self.memory[k, r]

    def allreduce(self, j: int, j2: int, k: int, r: int) -> float:
        if r < 2:
            return 0.0
        bw, alpha = self.ring[k, r]
        n = self.params[j2] - self.params[j]
        return (2 * (r - 1) * alpha + 2 * (r - 1) / r * n / bw) * 1e3 if n > 0 else 0.0


def sync_dp(profile: ModelProfile, topology: Topology, order: Sequence[int], num_microbatches: int,
            num_caps: int = 12, max_stages: Optional[int] = None,
            optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS) -> List[Candidate]:
    """Candidates (one per cap of the ladder, duplicates removed) for the
    device order `order`: stages take consecutive devices of the order. With
    a memory limit, only stages that fit with one micro-batch in flight."""
    t = _OrderTables(profile, topology, order, optimizer_slots)
    M, L, D = num_microbatches, len(profile), len(order)
    max_stages = min(max_stages or L, L, D)
    top = (M - 1) * t.work[L] * 1.0001
    if not 0 < top < math.inf:  # one micro-batch or no compute (nothing to trade), or beyond floats
        caps = [math.inf]
    else:
        low = top / (4.0 * D)
        caps = [top * (low / top) ** (i / max(num_caps - 1, 1)) for i in range(num_caps)] + [math.inf]
    out: List[Candidate] = []
    for cap in caps:
        c = _dp_with_cap(t, L, D, M, cap, max_stages)
        if c is not None and c not in out:
            out.append(c)
    return out


def _dp_with_cap(t: _OrderTables, L: int, D: int, M: int, cap: float, max_stages: int) -> Optional[Candidate]:
    # best[(j, k)] = (latency, stages, parent) with j layers placed on the first k devices
    best: Dict[Tuple[int, int], Tuple[float, int, Optional[Tuple[int, int]]]] = {(0, 0): (0.0, 0, None)}
    for j in range(L):
        for k in range(D):
            state = best.get((j, k))
            if state is None or state[1] >= max_stages:
                continue
            base = state[0]
            for r in range(1, D - k + 1):
                per = math.ceil(M / r) - 1
                if j > 0:
                    per_byte, lat = t.into[k, r]
                    # 0 bytes cost nothing even over a link too slow to price (0 * inf is NaN).
                    x = 2 * ((t.cut[j] * per_byte if t.cut[j] > 0 else 0.0) + lat)
                    if per * x > cap and M > 1:
                        continue
                else:
                    x = 0.0
                for j2 in range(j + 1, L + 1):
                    w = t.work[j2] - t.work[j]
                    if per * w > cap or (t.limited and not t.fits(j, j2, k, r)):
                        break  # work and memory only grow with j2
                    exposed = max(0.0, t.allreduce(j, j2, k, r) - t.back[j])
                    value = base + w + x + exposed
                    key = (j2, k + r)
                    old = best.get(key)
                    if old is None or value < old[0] - 1e-12:
                        best[key] = (value, state[1] + 1, (j, k))
    ends = [(v[0], k) for (j, k), v in best.items() if j == L]
    if not ends:
        return None
    _, k = min(ends)
    bounds, groups, key = [L], [], (L, k)
    while best[key][2] is not None:  # parents place fewer layers: j falls to 0
        pj, pk = best[key][2]
        bounds.append(pj)
        groups.append(tuple(t.order[pk:key[1]]))
        key = (pj, pk)
    return tuple(reversed(bounds)), tuple(reversed(groups))


def balanced_bounds(profile: ModelProfile, num_stages: int) -> Tuple[int, ...]:
    """The partition into num_stages stages whose slowest stage (f + b) is the
    least (GPipe's and 1F1B's usual partition), by DP."""
    L = len(profile)
    S = min(num_stages, L)
    work = [0.0]
    for l in profile.layers:
        work.append(work[-1] + l.forward_ms + l.backward_ms)
    INF = math.inf
    best = [[INF] * (L + 1) for _ in range(S + 1)]
    parent = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for j2 in range(s, L + 1):
            for j in range(s - 1, j2):
                v = max(best[s - 1][j], work[j2] - work[j])
                if v < best[s][j2] - 1e-12:
                    best[s][j2], parent[s][j2] = v, j
    bounds, j = [L], L
    for s in range(S, 0, -1):
        j = parent[s][j]
        bounds.append(j)
    return tuple(reversed(bounds))


def pipedream_dp(profile: ModelProfile, num_devices: int, bandwidth: float) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """PipeDream's planner (asynchronous steady state): A(j, m) = the least
    time per micro-batch of the slowest stage when layers [0, j) run on m
    devices, a stage of r replicas costing max(compute, its weight sync) / r and
    a boundary 2 × activation / bandwidth. One flat bandwidth: PipeDream's
    planner assumes a uniform level. Returns (bounds, replicas per stage)."""
    L, D = len(profile), num_devices
    work = [0.0]
    params = [0.0]
    for l in profile.layers:
        work.append(work[-1] + l.forward_ms + l.backward_ms)
        params.append(params[-1] + l.param_bytes)

    def stage(j: int, j2: int, r: int) -> float:
        sync = 4 * (r - 1) * (params[j2] - params[j]) / (r * bandwidth) * 1e3 if r > 1 else 0.0
        return max(work[j2] - work[j], sync) / r

    A: Dict[Tuple[int, int], Tuple[float, Optional[Tuple[int, int, int]]]] = {}
    for j2 in range(1, L + 1):
        for m in range(1, D + 1):
            bestv, arg = stage(0, j2, m), (0, 0, m)
            for j in range(1, j2):
                comm = 2 * profile.boundary_bytes(j) / bandwidth * 1e3
                for r in range(1, m):
                    prev = A[j, m - r][0]
                    v = max(prev, comm, stage(j, j2, r))
                    if v < bestv - 1e-12:
                        bestv, arg = v, (j, m - r, r)
            A[j2, m] = (bestv, arg)
    _, m = min((A[L, m][0], m) for m in range(1, D + 1))
    bounds, reps, key = [L], [], (L, m)
    while True:  # each stage's start j is below its end: j falls to 0
        j, pm, r = A[key][1]
        bounds.append(j)
        reps.append(r)
        if j == 0:
            break
        key = (j, pm)
    return tuple(reversed(bounds)), tuple(reversed(reps))
