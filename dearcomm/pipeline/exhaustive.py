"""The exact optimum for small problems: every partition × every ordered
assignment of disjoint device groups to the stages (replication, unused
devices) × every per-device order of the forward and backward tasks, each
scored by the simulator's rules; the shortest iteration wins.

Orders are searched by branch and bound over the simulator's own event loop
(`_OrderTree` replays simulate.py step by step, with free transfers and a
processor per device): whenever a device is idle and its next task is not yet
chosen, the search branches on each task it could run next. Two reductions
keep it exact:

- micro-batches that meet the same devices at every stage are
  interchangeable (same costs, same links), so among them a device runs
  forwards, and backwards, in micro-batch order; the other interleavings
  are all tried (every Dyck word of F and B without replication);
- a branch stops when a lower bound on its iteration (per device: the time it
  is free, plus its remaining tasks, plus the shortest way from them to the
  end of the iteration, Jackson-style; and every transfer in flight plus the
  way from its target) reaches the best iteration found.

The search starts from the planner's plan, so it only has to prove it or
beat it. Exponential in micro-batches and devices: for at most 8 layers, 4
devices and 8 micro-batches (tests/test_pipeline_exhaustive.py checks it
against plain enumeration of every order on tiny problems).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from typing import Dict, List, Optional, Tuple

from . import validate
from .brute_force import MAX_DEVICES, MAX_LAYERS
from .candidates import all_candidates
from .memory import DEFAULT_OPTIMIZER_SLOTS, check_memory, in_flight_caps
from .plan import BACKWARD, FORWARD, Plan, Task, check_sizes
from .profile import ModelProfile
from .simulate import Costs, simulate
from .topology import Topology

MAX_MICROBATCHES = 8
_DONE, _ARRIVE = 0, 1


class _OrderTree:
    """One partition and mapping: the simulator's event loop, forked at every
    choice of a device's next task. Tasks are numbered 2·(s·M + m) + (B ? 1 : 0)."""

    def __init__(self, costs: Costs, M: int, caps: Dict[int, int]) -> None:
        topo, groups = costs.topology, costs.devices
        S = len(groups)
        self.S, self.M, self.costs = S, M, costs
        self.devices = sorted(d for g in groups for d in g)
        index = {d: i for i, d in enumerate(self.devices)}
        n = 2 * S * M
        self.task = [Task(BACKWARD if x % 2 else FORWARD, x // 2 // M, x // 2 % M) for x in range(n)]
        self.dev = [index[groups[t.stage][t.microbatch % len(groups[t.stage])]] for t in self.task]
        self.dur = [costs.bwd[t.stage] if x % 2 else costs.fwd[t.stage] for x, t in enumerate(self.task)]
        self.cap = [caps[d] for d in self.devices]
        # transfer[x]: (occupancy, latency, resources, target) of what task x sends when it ends, or None
        self.transfer: List[Optional[Tuple[float, float, tuple, int]]] = []
        for x, t in enumerate(self.task):
            s, m = t.stage, t.microbatch
            if t.kind == FORWARD and s < S - 1:
                dst, nbytes, target = self.dev[self._id(FORWARD, s + 1, m)], costs.cut[s], self._id(FORWARD, s + 1, m)
            elif t.kind == BACKWARD and s > 0:
                dst, nbytes, target = self.dev[self._id(BACKWARD, s - 1, m)], costs.cut[s - 1], \
                    self._id(BACKWARD, s - 1, m)
            else:
                self.transfer.append(None)
                continue
            src, dst = self.devices[self.dev[x]], self.devices[dst]
            occupancy, latency = topo.transfer_ms(src, dst, nbytes)
            self.transfer.append((occupancy, latency, topo.resources(src, dst) if occupancy > 0 else (), target))
        # users[r]: the tasks whose transfer holds resource r
        self.users: Dict = {}
        for x, tr in enumerate(self.transfer):
            for r in tr[2] if tr else ():
                self.users.setdefault(r, []).append(x)
        self.allreduce = list(costs.allreduce)
        self.ring = [topo.allreduce_resources(list(g)) for g in groups]
        # tail[x]: the least time from the end of task x to the end of the iteration
        self.tail = [0.0] * n
        for s in range(S):  # backward chain, stage 0 first
            for m in range(M):
                x = self._id(BACKWARD, s, m)
                tr = self.transfer[x]
                after = tr[0] + tr[1] + self.dur[tr[3]] + self.tail[tr[3]] if tr else 0.0
                self.tail[x] = max(after, self.allreduce[s])
        for s in reversed(range(S)):
            for m in range(M):
                x = self._id(FORWARD, s, m)
                nxt = self.transfer[x]
                if nxt:
                    self.tail[x] = nxt[0] + nxt[1] + self.dur[nxt[3]] + self.tail[nxt[3]]
                else:
                    b = self._id(BACKWARD, s, m)
                    self.tail[x] = self.dur[b] + self.tail[b]
        # Per device: its micro-batches in classes of interchangeable ones, each in order.
        self.classes: List[List[List[int]]] = [[] for _ in self.devices]
        for s, g in enumerate(groups):
            for j, d in enumerate(g):
                by_path: Dict[Tuple[int, ...], List[int]] = {}
                for m in range(j, M, len(g)):
                    by_path.setdefault(tuple(m % len(h) for h in groups), []).append(m)
                self.classes[index[d]] = [(s, ms) for ms in by_path.values()]

    def _id(self, kind: str, s: int, m: int) -> int:
        return 2 * (s * self.M + m) + (kind == BACKWARD)

    def root(self) -> "_State":
        st = _State()
        st.heap, st.seq, st.free, st.end, st.now, st.at = [], 0, {}, 0.0, 0.0, 0
        st.pending = [(1 if x % 2 and self.task[x].stage == self.S - 1 else 2) if x % 2 else
                      int(self.task[x].stage > 0) for x in range(len(self.task))]
        D = len(self.devices)
        st.idle, st.next, st.running, st.busy = [True] * D, [-1] * D, [-1] * D, [0.0] * D
        st.fpos = [[0] * len(c) for c in self.classes]
        st.bpos = [[0] * len(c) for c in self.classes]
        st.live = [0] * D
        st.left = [self.M] * self.S
        st.orders = [[] for _ in range(D)]
        st.fin = [-1.0] * len(self.task)  # a started task's end
        return st

    # ---- the simulator's event loop (simulate._run without the CPU models) ----

    def advance(self, st: "_State") -> Optional[int]:
        """Runs st until a device must choose its next task (returns its
        index) or the iteration ends (returns None)."""
        while True:
            if st.at is not None:
                for i in range(st.at, len(self.devices)):
                    if not st.idle[i]:
                        continue
                    x = st.next[i]
                    if x < 0:
                        if self._has_work(st, i):
                            st.at = i
                            return i
                        continue
                    if st.pending[x] > 0:
                        continue
                    st.next[i], st.idle[i], st.running[i] = -1, False, x
                    st.busy[i] = st.fin[x] = st.now + self.dur[x]
                    self._push(st, st.busy[i], _DONE, x)
                st.at = None
            if not st.heap:
                return None
            t, _, what, x = heapq.heappop(st.heap)
            st.now = t
            self._handle(st, t, what, x)
            while st.heap and st.heap[0][0] == t:
                _, _, what, x = heapq.heappop(st.heap)
                self._handle(st, t, what, x)
            st.at = 0

    def _push(self, st: "_State", when: float, what: int, x: int) -> None:
        heapq.heappush(st.heap, (when, st.seq, what, x))
        st.seq += 1

    def _reserve(self, st: "_State", resources: tuple, t: float, occupancy: float) -> float:
        start = max([t] + [st.free.get(r, 0.0) for r in resources])
        for r in resources:
            st.free[r] = start + occupancy
        return start

    def _handle(self, st: "_State", t: float, what: int, x: int) -> None:
        if what == _ARRIVE:
            st.pending[x] -= 1
            return
        i = self.dev[x]
        st.idle[i], st.running[i] = True, -1
        st.end = max(st.end, t)
        if x % 2 == 0:
            st.pending[x + 1] -= 1  # its backward's local input
        tr = self.transfer[x]
        if tr:
            occupancy, latency, resources, target = tr
            start = self._reserve(st, resources, t, occupancy) if occupancy > 0 else t
            self._push(st, start + occupancy + latency, _ARRIVE, target)
        if x % 2:
            s = self.task[x].stage
            st.left[s] -= 1
            if st.left[s] == 0 and self.allreduce[s] > 0:
                start = self._reserve(st, self.ring[s], t, self.allreduce[s])
                st.end = max(st.end, start + self.allreduce[s])

    # ---- choices and bounds ----

    def _has_work(self, st: "_State", i: int) -> bool:
        return any(b < len(ms) for b, (_, ms) in zip(st.bpos[i], self.classes[i]))

    def choices(self, st: "_State", i: int) -> List[Tuple[int, int, str]]:
        """(class, task, kind) device i may run next: the next backward of a
        class whose forward it has chosen, or, within its in-flight cap, the
        next forward; backwards first."""
        out = []
        for c, (s, ms) in enumerate(self.classes[i]):
            f, b = st.fpos[i][c], st.bpos[i][c]
            if b < f:
                out.append((c, self._id(BACKWARD, s, ms[b]), BACKWARD))
        if st.live[i] < self.cap[i]:
            for c, (s, ms) in enumerate(self.classes[i]):
                if st.fpos[i][c] < len(ms):
                    out.append((c, self._id(FORWARD, s, ms[st.fpos[i][c]]), FORWARD))
        return out

    def choose(self, st: "_State", i: int, c: int, x: int, kind: str) -> None:
        st.next[i] = x
        st.orders[i].append(x)
        if kind == FORWARD:
            st.fpos[i][c] += 1
            st.live[i] += 1
        else:
            st.bpos[i][c] += 1
            st.live[i] -= 1

    def lower_bound(self, st: "_State") -> float:
        """No completion of st ends sooner: every unstarted task gets a head
        (the earliest its chain lets it start, links uncontended) and a tail;
        then, per device, its remaining tasks as a one-machine problem
        (Jackson's bounds over the tasks of the longest tails, and over those
        of the latest heads)."""
        bound, now, M = st.end, st.now, self.M
        arriving = {x: when for when, _, what, x in st.heap if what == _ARRIVE}
        ready = [st.busy[i] if st.running[i] >= 0 else now for i in range(len(self.devices))]
        head = [0.0] * len(self.task)
        for m in range(M):
            done_at = None  # when the previous task of the chain ends at the earliest
            chain = [2 * (s * M + m) for s in range(self.S)] + [2 * (s * M + m) + 1 for s in reversed(range(self.S))]
            for k, x in enumerate(chain):
                if st.fin[x] >= 0:  # started: its end is known
                    done_at = st.fin[x]
                    continue
                h = max(now, ready[self.dev[x]], arriving.get(x, now))
                if k > 0 and st.fin[chain[k - 1]] < 0:  # its input is not even being made yet
                    prev = chain[k - 1]
                    tr = self.transfer[prev]
                    h = max(h, done_at + (tr[0] + tr[1] if tr and tr[3] == x else 0.0))
                if x % 2 and st.fin[x - 1] < 0:  # a backward also waits for its own forward
                    h = max(h, head[x - 1] + self.dur[x - 1])
                head[x] = h
                done_at = h + self.dur[x]
            bound = max(bound, done_at + self.tail[chain[-1]])
        for r, users in self.users.items():  # a link or NIC side: the transfers it has yet to carry, one by one
            work, after = 0.0, math.inf
            for x in users:
                if st.fin[x] < 0 or st.fin[x] > now:  # not sent yet
                    occupancy, latency, _, target = self.transfer[x]
                    work += occupancy
                    after = min(after, latency + self.dur[target] + self.tail[target])
            if work > 0:
                bound = max(bound, max(now, st.free.get(r, 0.0)) + work + after)
        for i in range(len(self.devices)):
            x = st.running[i]
            if x >= 0:
                bound = max(bound, st.busy[i] + self.tail[x])
            rest = [] if st.next[i] < 0 else [st.next[i]]
            for c, (s, ms) in enumerate(self.classes[i]):
                rest += [2 * (s * M + m) for m in ms[st.fpos[i][c]:]]
                rest += [2 * (s * M + m) + 1 for m in ms[st.bpos[i][c]:]]
            if not rest:
                continue
            work, first = 0.0, math.inf  # the tasks of the longest tails
            for x in sorted(rest, key=lambda x: -self.tail[x]):
                work, first = work + self.dur[x], min(first, head[x])
                bound = max(bound, max(first, ready[i]) + work + self.tail[x])
            work, last = 0.0, math.inf  # the tasks of the latest heads
            for x in sorted(rest, key=lambda x: -head[x]):
                work, last = work + self.dur[x], min(last, self.tail[x])
                bound = max(bound, max(head[x], ready[i]) + work + last)
        return bound

    def orders(self, st: "_State") -> Dict[int, Tuple[Task, ...]]:
        return {d: tuple(self.task[x] for x in st.orders[i]) for i, d in enumerate(self.devices)}


class _State:
    __slots__ = ("heap", "seq", "free", "end", "now", "at", "pending", "idle", "next", "running", "busy", "fpos",
                 "bpos", "live", "left", "orders", "fin")

    def fork(self) -> "_State":
        st = _State()
        st.heap, st.seq, st.free, st.end, st.now, st.at = list(self.heap), self.seq, dict(self.free), self.end, \
            self.now, self.at
        st.pending, st.idle, st.next, st.running, st.busy = list(self.pending), list(self.idle), list(self.next), \
            list(self.running), list(self.busy)
        st.fpos, st.bpos = [list(p) for p in self.fpos], [list(p) for p in self.bpos]
        st.live, st.left, st.orders = list(self.live), list(self.left), [list(o) for o in self.orders]
        st.fin = list(self.fin)
        return st


def best_orders_exact(tree: _OrderTree, best_ms: float) -> Tuple[Optional[Dict[int, Tuple[Task, ...]]], float, int]:
    """(orders, ms, nodes): the orders of least iteration if one beats
    best_ms (else None and best_ms), by depth-first branch and bound."""
    found: List = [None, best_ms]
    nodes = 0
    stack = [tree.root()]
    while stack:
        st = stack.pop()
        nodes += 1
        i = tree.advance(st)
        if i is None:
            complete = all(x < 0 for x in st.next) and not any(tree._has_work(st, k) for k in range(len(st.next)))
            if complete and st.end < found[1] - 1e-9:  # else it deadlocked
                found[:] = [tree.orders(st), st.end]
            continue
        if tree.lower_bound(st) >= found[1] - 1e-9:
            continue
        options = tree.choices(st, i)
        for c, x, kind in reversed(options):  # pushed last, popped first: backwards first
            child = st.fork()
            tree.choose(child, i, c, x, kind)
            stack.append(child)
    return found[0], found[1], nodes


def exhaustive_plan(profile: ModelProfile, topology: Topology, num_microbatches: int,
                    start: Optional[Plan] = None, optimizer_slots: float = DEFAULT_OPTIMIZER_SLOTS,
                    stats: Optional[Dict] = None) -> Plan:
    """The optimal Plan over every partition, mapping and per-device order
    (see the module docstring). start: a plan to beat (default: the
    planner's); it is returned when nothing is strictly shorter. stats, if a
    dict, receives the candidates searched and the nodes visited."""
    where = "exhaustive_plan()"
    validate.problem(profile, topology, where)
    L, D, M = len(profile), topology.size, num_microbatches
    check_sizes(L, D, None, M, where)
    if L > MAX_LAYERS or D > MAX_DEVICES or M > MAX_MICROBATCHES:
        raise ValueError(f"dearcomm: {where} is for at most {MAX_LAYERS} layers, {MAX_DEVICES} devices and "
                         f"{MAX_MICROBATCHES} micro-batches, got {L}, {D} and {M}")
    if topology.transfer_cpu or topology.host_cores or topology.contended:
        raise ValueError(f"dearcomm: {where} models free transfers on a processor per device; topology "
                         f"{topology.name!r} sets transfer_cpu, host_cores or a compute/comm slowdown")
    if start is None:
        from .planner import plan_pipeline
        start = plan_pipeline(profile, topology, M, optimizer_slots=optimizer_slots)
    validate.instance(start, Plan, "start", where)
    best, t0 = _checked_start(start, profile, topology, M, optimizer_slots, where), time.perf_counter()
    cands = all_candidates(profile, topology, M, D)
    searched = nodes = 0
    for lower, (bounds, groups), costs in cands:
        if lower >= best.predicted_ms - 1e-9:
            break  # sorted: no later candidate can be shorter either
        caps = in_flight_caps(profile, topology, bounds, groups, M, optimizer_slots)
        if caps is None:
            continue
        orders, ms, n = best_orders_exact(_OrderTree(costs, M, caps), best.predicted_ms)
        searched, nodes = searched + 1, nodes + n
        if orders is not None:
            best = Plan(bounds, groups, orders, M, "exhaustive", ms)
    if stats is not None:
        stats.update(candidates=len(cands), searched=searched, nodes=nodes, seconds=time.perf_counter() - t0)
    return best


def _checked_start(start: Plan, profile: ModelProfile, topology: Topology, M: int, optimizer_slots: float,
                   where: str) -> Plan:
    """A plan to beat, for this problem: its layers, devices, micro-batches
    and memory, its time simulated here (a time from another problem would
    be a wrong bound)."""
    if start.num_microbatches != M:
        raise ValueError(f"dearcomm: {where}: start plan {start.name!r} has {start.num_microbatches} "
                         f"micro-batches, the problem {M}")
    try:
        ms = simulate(start, profile, topology).makespan_ms  # checks it against the profile and topology
        if topology.memory_bytes:
            check_memory(start, profile, topology, optimizer_slots)
    except ValueError as e:
        raise ValueError(f"dearcomm: {where}: start plan {start.name!r} does not fit this problem: "
                         f"{str(e).removeprefix('dearcomm: ')}") from e
    return dataclasses.replace(start, predicted_ms=ms)


def order_bound(costs: Costs, num_microbatches: int, caps: Dict[int, int]) -> float:
    """No order of this partition and mapping is shorter (the search's bound
    at its root: per-device work with heads and tails, every micro-batch's
    way through the stages, every link's load)."""
    tree = _OrderTree(costs, num_microbatches, caps)
    return tree.lower_bound(tree.root())
