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

If the topology is contended (Topology.compute_slowdown κ, comm_slowdown λ:
the data-parallel simulator's measured factors), a device's task runs at
1/κ of full speed while a transfer at the device is on the link, and a
transfer at 1/λ while a device at one of its ends computes
(cores.Contention; an all-reduce runs when its devices have nothing left to
compute, so neither factor changes it, though on a shared host it would
still take cores from other stages). Transfers then end when their work
does, so a transfer waiting for a resource starts when the resources free
up, in the order the transfers became ready (what the fixed times'
reservations give too).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import validate
from .cores import Contention, SharedCores
from .plan import BACKWARD, FORWARD, Plan, Task, check_sizes, check_stages
from .profile import ModelProfile
from .topology import Topology


class SimulationStuck(RuntimeError, ValueError):
    """The simulated iteration cannot finish: an order deadlocks, or no event
    can make progress. A ValueError too, because a deadlocking order is a bad
    argument to simulate() (what it raised before the event loop had a guard)."""


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
    """Runs the plan's orders; raises SimulationStuck (a RuntimeError and a
    ValueError) if they deadlock."""
    validate.instance(plan, Plan, "plan", "simulate()")
    validate.problem(profile, topology, "simulate()")
    plan.validate(len(profile), topology.size)
    return _run(Costs(profile, topology, plan.bounds, plan.devices), plan.num_microbatches, plan.orders, None)


def list_schedule(profile: ModelProfile, topology: Topology, bounds: Sequence[int],
                  devices: Sequence[Sequence[int]], num_microbatches: int,
                  priority: Optional[Callable[[Task], Tuple]] = None,
                  max_in_flight: Optional[Dict[int, int]] = None) -> SimResult:
    """Whenever a device is idle it starts its ready task of best priority
    (default: longest remaining path), without exceeding max_in_flight[device]
    forwards whose backward has not run. The result's orders replay exactly."""
    where = "list_schedule()"
    validate.problem(profile, topology, where)
    check_sizes(len(profile), topology.size, None, num_microbatches, where)
    check_stages(bounds, devices, len(profile), topology.size, where)
    if priority is not None and not callable(priority):
        raise TypeError(f"dearcomm: {where}: priority must be a callable (task -> sort key), got {priority!r:.80}")
    if max_in_flight is not None:
        validate.instance(max_in_flight, Mapping, "max_in_flight", where)
        for d, cap in max_in_flight.items():  # 0 would never let a forward start
            validate.positive_int(cap, f"max_in_flight[{d!r}]", where)
    costs = Costs(profile, topology, bounds, devices)
    return _run(costs, num_microbatches, None, priority or longest_remaining_path(costs), max_in_flight)


def _run(costs: Costs, M: int, orders: Optional[Dict[int, Sequence[Task]]],
         priority: Optional[Callable[[Task], Tuple]], max_in_flight: Optional[Dict[int, int]] = None) -> SimResult:
    topo, devices = costs.topology, costs.devices
    S = len(devices)

    def device_of(s: int, m: int) -> int:
        return devices[s][m % len(devices[s])]

    # Every device of a stage, even a replica with no micro-batch (more
    # replicas than micro-batches): it still takes part in the all-reduce.
    mine: Dict[int, List[Task]] = {d: [] for group in devices for d in group}
    for s in range(S):
        for m in range(M):
            for kind in (FORWARD, BACKWARD):
                mine[device_of(s, m)].append(Task(kind, s, m))
    if orders is not None:
        mine = {d: list(orders.get(d, ())) for d in mine}
    # Inputs still missing per task: the activation (F, s > 0), the local
    # forward and the gradient from the next stage (B).
    pending = {}
    for tasks in mine.values():
        for t in tasks:
            pending[t] = int(t.stage > 0) if t.kind == FORWARD else 1 + (t.stage < S - 1)
    arrivals: Dict[Task, float] = {}
    left_in_stage = [M] * S
    position = {d: 0 for d in mine}          # fixed orders: index of the next task
    todo = {d: list(ts) for d, ts in mine.items()}
    idle = {d: True for d in mine}
    cpu_work: Dict[int, deque] = {d: deque() for d in mine}   # queued (ms, task fed, peer) to run first
    cpu = topo.transfer_cpu
    contention = Contention(topo.compute_slowdown, topo.comm_slowdown) if topo.contended else None
    cores = contention or (SharedCores(topo.host_cores) if topo.host_cores else None)
    waiting_transfers: List[_Transfer] = []   # contended: ready, waiting for a resource, in ready order
    held = set()                              # contended: resources a running transfer holds
    running: Dict = {}    # shared cores: item -> (when it started, what it is)
    version = 0           # shared cores: only the newest "cores" event is live
    cores_changed = True  # shared cores: something started or ended since the live "cores" event was set
    in_flight = {d: 0 for d in mine}
    ran: Dict[int, List[Task]] = {d: [] for d in mine}
    resource_free: Dict = {}
    spans: List[Span] = []
    heap: List = []
    seq = itertools.count()
    end_time = 0.0

    def push(when: float, what: str, payload) -> None:
        # A NaN or infinite time would never be reached (a NaN is not even
        # equal to itself), so the loop below could never pass it.
        if not math.isfinite(when):
            raise SimulationStuck(f"dearcomm: simulated time left the finite numbers: a {what!r} event "
                                  f"({_describe(payload)}) falls at t = {when} ms; the profile's times and the "
                                  "topology's links must add up to finite times")
        heapq.heappush(heap, (when, next(seq), what, payload))

    def reserve(resources, t: float, occupancy: float) -> float:
        start = max([t] + [resource_free.get(r, 0.0) for r in resources])
        for r in resources:
            resource_free[r] = start + occupancy
        return start

    def send(src: int, dst: int, nbytes: float, t: float, target: Task, kind: str) -> None:
        occupancy, latency = topo.transfer_ms(src, dst, nbytes)
        if contention is not None and occupancy > 0:
            queue_transfer(t, _Transfer(kind, (src, dst), topo.resources(src, dst), occupancy, latency, target))
            return
        start = reserve(topo.resources(src, dst), t, occupancy) if occupancy > 0 else t
        if occupancy > 0:
            spans.append(Span("comm", src, kind, start, start + occupancy, target, dst))
        if cpu and src != dst and nbytes > 0:
            gated = cores is not None and cpu.recv_ms(nbytes) > 0
            if gated:  # the receiver's work must end too before the data are usable
                pending[target] += 1
            push(start, "charge", (src, cpu.send_ms(nbytes), target, dst, False))
            push(start, "charge", (dst, cpu.recv_ms(nbytes), target, src, gated))
        push(start + occupancy + latency, "arrive", target)

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
                if contention is not None:
                    queue_transfer(t, _Transfer("allreduce", tuple(group), topo.allreduce_resources(group),
                                                costs.allreduce[s], 0.0, None))
                    return
                start = reserve(topo.allreduce_resources(group), t, costs.allreduce[s])
                for d in group:
                    spans.append(Span("comm", d, "allreduce", start, start + costs.allreduce[s]))
                    if cpu:  # every ring step sends and receives one chunk of the gradients
                        chunk, steps = costs.params[s] / len(group), 2 * (len(group) - 1)
                        ms = steps * (cpu.send_ms(chunk) + cpu.recv_ms(chunk))
                        push(start, "charge", (d, ms, None, None, False))
                end_time = max(end_time, start + costs.allreduce[s])

    def queue_transfer(t: float, transfer: "_Transfer") -> None:
        waiting_transfers.append(transfer)
        start_transfers(t)

    def start_transfers(t: float) -> None:
        # In ready order; one waiting for a resource keeps it from the later ones.
        claimed = set()
        for x in list(waiting_transfers):
            if held.isdisjoint(x.resources) and claimed.isdisjoint(x.resources):
                waiting_transfers.remove(x)
                held.update(x.resources)
                start_on_cores(t, ("transfer", next(seq)), x.occupancy_ms, x)
            claimed.update(x.resources)

    def transfer_done(start: float, t: float, x: "_Transfer") -> None:
        nonlocal end_time
        held.difference_update(x.resources)
        if x.target is None:  # an all-reduce: every member's link lane
            for d in x.ends:
                spans.append(Span("comm", d, "allreduce", start, t))
            end_time = max(end_time, t)
        else:
            spans.append(Span("comm", x.ends[0], x.kind, start, t, x.target, x.ends[1]))
            push(t + x.latency_ms, "arrive", x.target)
        start_transfers(t)

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
                push(t + ms, "cpu done", d)
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
                start_on_cores(t, (task, d), duration, None)
                continue
            spans.append(Span("compute", d, task.kind, t, t + duration, task))
            push(t + duration, "done", (task, d))

    def charge(t: float, device: int, ms: float, target: Optional[Task], peer: Optional[int], gated: bool) -> None:
        if cores is None:
            if ms > 0:
                cpu_work[device].append((ms, target, peer))
        elif ms > 0:
            start_on_cores(t, ("cpu", next(seq)), ms, (device, target, peer, gated))

    def start_on_cores(t: float, key, ms: float, what) -> None:
        nonlocal cores_changed
        if contention is None:
            cores.start(t, key, ms)
        elif isinstance(what, _Transfer):
            contention.start_transfer(t, key, ms, what.ends)
        else:  # a task
            contention.start_task(t, key, ms, key[1])
        running[key] = (t, what)
        cores_changed = True

    def cores_done(t: float) -> None:
        # The live event is the first end retime() predicted, and nothing ended
        # since, so an item ends now: due=True rounds a sliver of work that
        # rounding left to done instead of waiting for it again and again.
        nonlocal end_time, cores_changed
        cores_changed = True
        for key in cores.finished(t, due=True):
            start, what = running.pop(key)
            if what is None:  # a task
                task, d = key
                spans.append(Span("compute", d, task.kind, start, t, task))
                finish(t, task, d)
            elif isinstance(what, _Transfer):
                transfer_done(start, t, what)
            else:
                device, target, peer, gated = what
                spans.append(Span("cpu", device, "cpu", start, t, target, peer))
                end_time = max(end_time, t)
                if gated:
                    arrive(t, target)

    def retime(t: float) -> None:
        # What runs on the shared cores changed: only the newest end event counts.
        # Unchanged, the live event still holds (and no event is pushed, which
        # bounds the "cores" events by the starts and ends on the cores).
        nonlocal version, cores_changed
        if cores is not None and cores_changed:
            cores_changed = False
            version += 1
            end = cores.next_end()
            if end is not None:
                push(max(end, t), "cores", version)

    def handle(t: float, what: str, payload) -> None:
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

    def waiting() -> Dict[int, Task]:
        """Each device's next task that has not started."""
        if orders is not None:
            return {d: todo[d][position[d]] for d in mine if position[d] < len(todo[d])}
        return {d: todo[d][0] for d in mine if todo[d]}

    # Termination: every round pops at least one event, and events have
    # bounded causes (T tasks, G devices in stages): a "done" per task start
    # (T); per task end at most one transfer, an "arrive" and two "charge"s
    # (3T); per stage all-reduce a "charge" per replica (G); per "charge" a
    # "cpu done" or a start on the shared cores (2T + G); a "cores" event only
    # after a start there (at most 3T + G) or a live "cores" event, each of
    # which ends an item (3T + G). Contended, a transfer or an all-reduce
    # starts on the cores in place of the charges (T + G of the 2T + G items).
    # That is at most 12T + 4G + 1 events, so
    # passing max_rounds means this accounting broke, never a long run.
    T, G = sum(len(ts) for ts in mine.values()), sum(len(g) for g in devices)
    max_rounds = 13 * T + 4 * G + 16
    rounds = 0
    dispatch(0.0)
    retime(0.0)
    while heap:
        rounds += 1
        if rounds > max_rounds:
            busy = sorted(d for d in mine if not idle[d])
            raise SimulationStuck(f"dearcomm: the simulation makes no progress ({len(heap)} events left after "
                                  f"{max_rounds} rounds; busy device(s) {busy}): "
                                  f"{_waits(waiting(), pending, 'missing')}")
        t, _, what, payload = heapq.heappop(heap)  # one event per round at least, whatever its time
        handle(t, what, payload)
        while heap and heap[0][0] == t:
            _, _, what, payload = heapq.heappop(heap)
            handle(t, what, payload)
        dispatch(t)
        retime(t)
    stuck = waiting()
    if stuck or running:
        detail = _waits(stuck, pending, "never come")
        if running:
            detail += f"; {len(running)} item(s) on the shared cores never end"
        raise SimulationStuck(f"dearcomm: the plan deadlocks: {detail}. Each device's order must let every "
                              "micro-batch's forward reach the last stage and its backward come back")
    return SimResult(end_time, spans, {d: tuple(ts) for d, ts in ran.items()}, arrivals)


@dataclass(frozen=True, eq=False)
class _Transfer:
    """A contended transfer (or all-reduce: target None) from its ready time
    to its end: the devices at its ends (sender first), what it holds."""
    kind: str
    ends: Tuple[int, ...]
    resources: Tuple
    occupancy_ms: float
    latency_ms: float
    target: Optional[Task]


def _waits(stuck: Dict[int, Task], pending: Dict[Task, int], inputs: str) -> str:
    return "; ".join(f"device {d} waits to run {t} ({pending[t]} input(s) {inputs})"
                     for d, t in sorted(stuck.items())) or "no device waits for a task"


def _describe(payload) -> str:
    """An event's payload in words, for errors."""
    if isinstance(payload, Task):
        return f"task {payload}"
    if isinstance(payload, tuple) and payload and isinstance(payload[0], Task):
        return f"task {payload[0]} on device {payload[1]}"
    if isinstance(payload, tuple):  # a charge: (device, ms, task fed, peer, gated)
        return f"transfer CPU work of {payload[1]} ms on device {payload[0]}"
    return f"device {payload}" if isinstance(payload, int) else repr(payload)
