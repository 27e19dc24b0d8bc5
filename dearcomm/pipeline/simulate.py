"""Event-driven simulation of one synchronous pipeline iteration on the task
graph:

  F(s,m) -> [activation transfer] -> F(s+1,m)      F(S-1,m) -> B(S-1,m)
  B(s,m) -> [gradient transfer]   -> B(s-1,m)      F(s,m)   -> B(s,m)
  every B of a replicated stage  -> all-reduce of its gradients (ring)

A device runs one task at a time, in its plan's order (or, for list
scheduling, the ready task of best priority). A transfer starts when its
producer ends and holds the resources of its route (links, NIC sides) for
bytes/bandwidth; transfers that share a resource queue in the order they
became ready. Its data arrive one latency after it ends. The iteration ends
when the last task and the last all-reduce end (the synchronous update).

If the topology charges transfers CPU time (Topology.transfer_cpu), a
transfer that starts also queues its sending cost on the sender and its
receiving cost on the receiver (an all-reduce: both, per ring step, on every
member). A device runs its queued CPU work before its next task, never
interrupting one, so transfers take compute away from their endpoints.

If the devices share a host's cores (Topology.host_cores), tasks and the
transfers' CPU work (gloo's threads) instead run side by side on those cores
by processor sharing (cores.py): n busy items on C cores each progress at
min(1, C/n). A transfer's data are then usable once they have arrived and
its receiving work is done.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .cores import SharedCores
from .plan import BACKWARD, FORWARD, Plan, Task
from .profile import ModelProfile
from .topology import Topology


@dataclass(frozen=True)
class Span:
    lane: str            # "compute", "comm" or "cpu" (a transfer's CPU work on an endpoint)
    device: int
    kind: str            # "F", "B", "act", "grad", "allreduce", "cpu"
    start_ms: float
    end_ms: float
    task: Optional[Task] = None      # compute: the task; transfers: the task they feed
    peer: Optional[int] = None       # transfers: the receiving device


@dataclass
class SimResult:
    makespan_ms: float
    spans: List[Span]
    orders: Dict[int, Tuple[Task, ...]]   # what each device actually ran, in order
    arrivals: Dict[Task, float] = field(default_factory=dict)  # when a task's last input arrived

    def busy_ms(self, device: int) -> float:
        """Time the device computed: its tasks and the transfers' CPU work."""
        return sum(s.end_ms - s.start_ms for s in self.spans if s.device == device and s.lane in ("compute", "cpu"))


class Costs:
    """Per-stage task times and per-boundary transfer times of one partition
    and mapping (shared by the simulator and the priorities)."""

    def __init__(self, profile: ModelProfile, topology: Topology, bounds: Sequence[int],
                 devices: Sequence[Sequence[int]]) -> None:
        self.profile, self.topology = profile, topology
        self.bounds, self.devices = tuple(bounds), tuple(tuple(g) for g in devices)
        stages = list(zip(self.bounds, self.bounds[1:]))
        self.fwd = [profile.forward_ms(a, b) for a, b in stages]
        self.bwd = [profile.backward_ms(a, b) for a, b in stages]
        self.cut = [profile.boundary_bytes(b) for b in self.bounds[1:-1]]  # cut[s]: between s and s+1
        self.params = [profile.param_bytes(a, b) for a, b in stages]
        self.allreduce = [topology.allreduce_ms(list(g), p) for p, g in zip(self.params, self.devices)]

    def worst_transfer(self, s: int) -> float:
        """Slowest occupancy + latency of boundary s over the replica pairs it uses."""
        a, b = self.devices[s], self.devices[s + 1]
        pairs = {(a[m % len(a)], b[m % len(b)]) for m in range(len(a) * len(b))}
        return max(sum(self.topology.transfer_ms(x, y, self.cut[s])) for x, y in pairs)


def longest_remaining_path(costs: Costs) -> Callable[[Task], Tuple]:
    """List-scheduling priority: the longest chain of work (tasks, transfers,
    the all-reduce) from the start of a task to the end of the iteration;
    ties go to the earlier micro-batch."""
    S = len(costs.fwd)
    rank_b = [0.0] * S
    for s in range(S):
        after = costs.worst_transfer(s - 1) + rank_b[s - 1] if s > 0 else 0.0
        rank_b[s] = costs.bwd[s] + max(after, costs.allreduce[s])
    rank_f = [0.0] * S
    for s in reversed(range(S)):
        rank_f[s] = costs.fwd[s] + (costs.worst_transfer(s) + rank_f[s + 1] if s < S - 1 else rank_b[s])

    def key(task: Task) -> Tuple:
        rank = rank_f[task.stage] if task.kind == FORWARD else rank_b[task.stage]
        return (-rank, task.microbatch, task.kind == FORWARD)
    return key


def simulate(plan: Plan, profile: ModelProfile, topology: Topology) -> SimResult:
    """Runs the plan's orders; raises ValueError if they deadlock."""
    plan.validate(len(profile), topology.size)
    return _run(Costs(profile, topology, plan.bounds, plan.devices), plan.num_microbatches, plan.orders, None)


def list_schedule(profile: ModelProfile, topology: Topology, bounds: Sequence[int],
                  devices: Sequence[Sequence[int]], num_microbatches: int,
                  priority: Optional[Callable[[Task], Tuple]] = None,
                  max_in_flight: Optional[Dict[int, int]] = None) -> SimResult:
    """Whenever a device is idle it starts its ready task of best priority
    (default: longest remaining path), without exceeding max_in_flight[device]
    forwards whose backward has not run. The result's orders replay exactly."""
    costs = Costs(profile, topology, bounds, devices)
    return _run(costs, num_microbatches, None, priority or longest_remaining_path(costs), max_in_flight)


def _run(costs: Costs, M: int, orders: Optional[Dict[int, Sequence[Task]]],
         priority: Optional[Callable[[Task], Tuple]], max_in_flight: Optional[Dict[int, int]] = None) -> SimResult:
    topo, devices = costs.topology, costs.devices
    S = len(devices)

    def device_of(s: int, m: int) -> int:
        return devices[s][m % len(devices[s])]

    mine: Dict[int, List[Task]] = {}
    for s in range(S):
        for m in range(M):
            for kind in (FORWARD, BACKWARD):
                mine.setdefault(device_of(s, m), []).append(Task(kind, s, m))
    if orders is not None:
        mine = {d: list(orders.get(d, ())) for d in mine}
    # Inputs still missing per task: the activation (F, s > 0), the local
    # forward and the gradient from the next stage (B).
    pending = {}
    for tasks in mine.values():
        for t in tasks:
            pending[t] = (t.stage > 0) if t.kind == FORWARD else 1 + (t.stage < S - 1)
    arrivals: Dict[Task, float] = {}
    left_in_stage = [M] * S
    position = {d: 0 for d in mine}          # fixed orders: index of the next task
    todo = {d: list(ts) for d, ts in mine.items()}
    idle = {d: True for d in mine}
    cpu_work: Dict[int, deque] = {d: deque() for d in mine}   # queued (ms, task fed, peer) to run first
    cpu = topo.transfer_cpu
    cores = SharedCores(topo.host_cores) if topo.host_cores else None
    running: Dict = {}    # shared cores: item -> (when it started, what it is)
    version = 0           # shared cores: only the newest "cores" event is live
    in_flight = {d: 0 for d in mine}
    ran: Dict[int, List[Task]] = {d: [] for d in mine}
    resource_free: Dict = {}
    spans: List[Span] = []
    heap: List = []
    seq = itertools.count()
    end_time = 0.0

    def reserve(resources, t: float, occupancy: float) -> float:
        start = max([t] + [resource_free.get(r, 0.0) for r in resources])
        for r in resources:
            resource_free[r] = start + occupancy
        return start

    def send(src: int, dst: int, nbytes: float, t: float, target: Task, kind: str) -> None:
        occupancy, latency = topo.transfer_ms(src, dst, nbytes)
        start = reserve(topo.resources(src, dst), t, occupancy) if occupancy > 0 else t
        if occupancy > 0:
            spans.append(Span("comm", src, kind, start, start + occupancy, target, dst))
        if cpu and src != dst and nbytes > 0:
            gated = cores is not None and cpu.recv_ms(nbytes) > 0
            if gated:  # the receiver's work must end too before the data are usable
                pending[target] += 1
            heapq.heappush(heap, (start, next(seq), "charge", (src, cpu.send_ms(nbytes), target, dst, False)))
            heapq.heappush(heap, (start, next(seq), "charge", (dst, cpu.recv_ms(nbytes), target, src, gated)))
        heapq.heappush(heap, (start + occupancy + latency, next(seq), "arrive", target))

    def finish(t: float, task: Task, device: int) -> None:
        nonlocal end_time
        idle[device] = True
        end_time = max(end_time, t)
        s, m = task.stage, task.microbatch
        if task.kind == FORWARD:
            arrive(t, Task(BACKWARD, s, m))
            if s < S - 1:
                send(device, device_of(s + 1, m), costs.cut[s], t, Task(FORWARD, s + 1, m), "act")
        else:
            if s > 0:
                send(device, device_of(s - 1, m), costs.cut[s - 1], t, Task(BACKWARD, s - 1, m), "grad")
            left_in_stage[s] -= 1
            if left_in_stage[s] == 0 and costs.allreduce[s] > 0:
                group = devices[s]
                start = reserve(topo.allreduce_resources(group), t, costs.allreduce[s])
                for d in group:
                    spans.append(Span("comm", d, "allreduce", start, start + costs.allreduce[s]))
                    if cpu:  # every ring step sends and receives one chunk of the gradients
                        chunk, steps = costs.params[s] / len(group), 2 * (len(group) - 1)
                        ms = steps * (cpu.send_ms(chunk) + cpu.recv_ms(chunk))
                        heapq.heappush(heap, (start, next(seq), "charge", (d, ms, None, None, False)))
                end_time = max(end_time, start + costs.allreduce[s])

    def arrive(t: float, task: Task) -> None:
        pending[task] -= 1
        arrivals[task] = max(arrivals.get(task, 0.0), t)

    def dispatch(t: float) -> None:
        nonlocal end_time
        for d in sorted(mine):
            if not idle[d]:
                continue
            if cpu_work[d]:
                ms, target, peer = cpu_work[d].popleft()
                idle[d] = False
                spans.append(Span("cpu", d, "cpu", t, t + ms, target, peer))
                end_time = max(end_time, t + ms)
                heapq.heappush(heap, (t + ms, next(seq), "cpu done", d))
                continue
            if orders is not None:
                if position[d] >= len(todo[d]) or pending[todo[d][position[d]]] > 0:
                    continue
                task = todo[d][position[d]]
                position[d] += 1
            else:
                cap = max_in_flight.get(d, M) if max_in_flight else M
                ready = [x for x in todo[d] if pending[x] == 0 and (x.kind == BACKWARD or in_flight[d] < cap)]
                if not ready:
                    continue
                task = min(ready, key=priority)
                todo[d].remove(task)
            duration = costs.fwd[task.stage] if task.kind == FORWARD else costs.bwd[task.stage]
            idle[d] = False
            in_flight[d] += 1 if task.kind == FORWARD else -1
            ran[d].append(task)
            if cores is not None:
                cores.start(t, (task, d), duration)
                running[task, d] = (t, None)
                continue
            spans.append(Span("compute", d, task.kind, t, t + duration, task))
            heapq.heappush(heap, (t + duration, next(seq), "done", (task, d)))

    def charge(t: float, device: int, ms: float, target: Optional[Task], peer: Optional[int], gated: bool) -> None:
        if cores is None:
            if ms > 0:
                cpu_work[device].append((ms, target, peer))
        elif ms > 0:
            key = ("cpu", next(seq))
            cores.start(t, key, ms)
            running[key] = (t, (device, target, peer, gated))

    def cores_done(t: float) -> None:
        nonlocal end_time
        for key in cores.finished(t):
            start, what = running.pop(key)
            if what is None:  # a task
                task, d = key
                spans.append(Span("compute", d, task.kind, start, t, task))
                finish(t, task, d)
            else:
                device, target, peer, gated = what
                spans.append(Span("cpu", device, "cpu", start, t, target, peer))
                end_time = max(end_time, t)
                if gated:
                    arrive(t, target)

    def retime(t: float) -> None:
        # What runs on the shared cores may have changed: only the newest end event counts.
        nonlocal version
        if cores is not None:
            version += 1
            end = cores.next_end()
            if end is not None:
                heapq.heappush(heap, (max(end, t), next(seq), "cores", version))

    dispatch(0.0)
    retime(0.0)
    while heap:
        t = heap[0][0]
        while heap and heap[0][0] == t:
            _, _, what, payload = heapq.heappop(heap)
            if what == "done":
                finish(t, *payload)
            elif what == "cpu done":
                idle[payload] = True
            elif what == "charge":
                charge(t, *payload)
            elif what == "cores":
                if payload == version:
                    cores_done(t)
            else:
                arrive(t, payload)
        dispatch(t)
        retime(t)
    stuck = {d: (todo[d][position[d]] if orders is not None else todo[d][0])
             for d in mine if (position[d] < len(todo[d]) if orders is not None else todo[d])}
    if stuck:
        detail = "; ".join(f"device {d} waits to run {t} ({pending[t]} input(s) never come)"
                           for d, t in sorted(stuck.items()))
        raise ValueError(f"dearcomm: the plan deadlocks: {detail}. Each device's order must let every "
                         "micro-batch's forward reach the last stage and its backward come back")
    return SimResult(end_time, spans, {d: tuple(ts) for d, ts in ran.items()}, arrivals)
