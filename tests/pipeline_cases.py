"""Small pipeline problems shared by the pipeline tests: random profiles and
topologies (seeded), and an independent checker of a simulated schedule."""
from __future__ import annotations

import random
from typing import List

from dearcomm.pipeline import (BACKWARD, FORWARD, LayerProfile, ModelProfile, Plan, SimResult, Task, Topology, chain,
                               servers, switched, uniform)


def random_profile(layers: int, seed: int) -> ModelProfile:
    rng = random.Random(seed)
    return chain(f"rand{seed}", [LayerProfile(f"l{i}", rng.uniform(1, 10), rng.uniform(2, 20),
                                              rng.choice([1e5, 1e6, 5e6, 2e7]), rng.uniform(0, 4e7))
                                 for i in range(layers)])


def topologies(n: int) -> List[Topology]:
    out = [uniform(n, 5.0), switched([1e9 * (0.5 + (i % 2)) for i in range(n)])]
    if n >= 2:
        out.append(servers(n, 2, True, intra_gbps=10, nvlink_gbps=50, nic_gbps=0.5))
    return out


def check_schedule(plan: Plan, result: SimResult, topology: Topology) -> None:
    """Every task once on its device, no device runs two tasks (or a task and
    a transfer's CPU work) at once, every
    dependency (with its transfer) respected, transfers that share a resource
    never overlap, and the devices ran the plan's orders."""
    eps = 1e-6
    compute = {}
    for s in result.spans:
        if s.lane == "compute":
            assert s.task not in compute, f"{s.task} ran twice"
            assert s.device == plan.device_of(s.task.stage, s.task.microbatch), f"{s.task} on device {s.device}"
            compute[s.task] = s
    S, M = plan.num_stages, plan.num_microbatches
    want = {Task(k, st, m) for k in (FORWARD, BACKWARD) for st in range(S) for m in range(M)}
    assert set(compute) == want, f"missing tasks {sorted(map(str, want - set(compute)))}"
    for d in {s.device for s in compute.values()}:
        mine = sorted((s for s in compute.values() if s.device == d), key=lambda s: (s.start_ms, s.end_ms))
        for a, b in zip(mine, mine[1:]):
            assert b.start_ms >= a.end_ms - eps, f"device {d} runs {a.task} and {b.task} at once"
        assert tuple(s.task for s in mine) == plan.orders[d], f"device {d} did not follow its order"
        # A transfer's CPU work shares the device's processor, unless the
        # devices share host cores, where it runs in threads beside the tasks.
        busy = sorted((s for s in result.spans if s.device == d and s.lane in ("compute", "cpu")
                       and (s.lane == "compute" or not topology.host_cores)), key=lambda s: (s.start_ms, s.end_ms))
        for a, b in zip(busy, busy[1:]):
            assert b.start_ms >= a.end_ms - eps, f"device {d} runs {a.kind} {a.task} and {b.kind} {b.task} at once"
    transfers = {(s.kind, s.task): s for s in result.spans if s.kind in ("act", "grad")}
    for st in range(S):
        for m in range(M):
            f, b = compute[Task(FORWARD, st, m)], compute[Task(BACKWARD, st, m)]
            assert b.start_ms >= f.end_ms - eps, f"B before F: stage {st} mb {m}"
            if st > 0:
                prev = compute[Task(FORWARD, st - 1, m)]
                x = transfers.get(("act", f.task))
                lat = topology.transfer_ms(prev.device, f.device, 1)[1]
                ready = prev.end_ms if x is None else x.end_ms + lat
                assert x is None or x.start_ms >= prev.end_ms - eps
                assert f.start_ms >= ready - eps, f"{f.task} starts before its activation arrives"
            if st < S - 1:
                nxt = compute[Task(BACKWARD, st + 1, m)]
                x = transfers.get(("grad", b.task))
                lat = topology.transfer_ms(nxt.device, b.device, 1)[1]
                ready = nxt.end_ms if x is None else x.end_ms + lat
                assert x is None or x.start_ms >= nxt.end_ms - eps
                assert b.start_ms >= ready - eps, f"{b.task} starts before its gradient arrives"
    comm = [s for s in result.spans if s.kind in ("act", "grad")]
    for i, a in enumerate(comm):
        ra = set(topology.resources(a.device, a.peer))
        for b in comm[i + 1:]:
            if ra & set(topology.resources(b.device, b.peer)):
                assert a.end_ms <= b.start_ms + eps or b.end_ms <= a.start_ms + eps, \
                    f"transfers {a.task} and {b.task} overlap on a shared resource"
    assert result.makespan_ms >= max(s.end_ms for s in result.spans) - eps


def asymmetric_topology(n: int, seed: int) -> Topology:
    """Links of different speeds, seeded: per-direction bandwidths 0.2-8 GB/s
    and latencies 5-50 µs (kind 0), NICs of 0.3-3 GB/s into a switch (kind
    1), or servers of two with random NVLink, bus and NIC rates (kind 2)."""
    rng = random.Random(seed)
    kind = seed % 3
    if kind == 0:
        bw = tuple(tuple(0.0 if i == j else rng.uniform(0.2, 8.0) * 1e9 for j in range(n)) for i in range(n))
        lat = tuple(tuple(0.0 if i == j else rng.uniform(5, 50) * 1e-6 for j in range(n)) for i in range(n))
        return Topology(bw, lat, f"random-{seed}")
    if kind == 1:
        return switched([rng.uniform(0.3, 3.0) * 1e9 for _ in range(n)], name=f"switched-{seed}")
    return servers(n, 2, True, intra_gbps=rng.uniform(2, 12), nvlink_gbps=rng.uniform(20, 100),
                   nic_gbps=rng.uniform(0.3, 2), name=f"servers-{seed}")


def optimality_cases(count: int, seed: int = 0):
    """(profile, topology, micro-batches) of `count` random small problems
    (4-8 layers, 3-4 devices, 4-6 micro-batches, at most 5 on 4 devices,
    where the exhaustive search can take an hour at 6), reproducible from seed."""
    rng = random.Random(seed)
    for i in range(count):
        layers, devices, microbatches = rng.randint(4, 8), rng.choice([3, 4]), rng.randint(4, 6)
        microbatches = min(microbatches, 5) if devices == 4 else microbatches
        yield random_profile(layers, 1000 * seed + i), asymmetric_topology(devices, 1000 * seed + i), microbatches
