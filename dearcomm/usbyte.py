"""The US-Byte planner (Gao et al., "US-Byte: An Efficient Communication
Framework for Scheduling Unequal-Sized Tensor Blocks in Distributed Deep
Learning", TPDS 2024), as a pure-Python offline plan: which gradient elements
go in which all-reduce, when, and what iteration time that predicts.

    from dearcomm.usbyte import Layer, plan
    p = plan([Layer(1_000_000, 1.0, 2.0), Layer(4_000, 0.5, 1.0)], unit=65_536,
             allreduce_ms=lambda n: 0.05 + n * 4e-7)
    p.blocks, p.layer_blocks(), p.iteration_ms

Model. Layers l = 0 … L-1 in forward order (0 nearest the input). Backward
runs L-1 … 0 from time 0, so layer l's gradient is ready at
ready(l) = Σ_{k ≥ l} backward_ms[k]; backward ends at T_bwd = ready(0). A
layer of M elements is cut into m = ⌈M/S⌉ units of S elements; only its last
unit may be short (M - (m-1)·S), so every block of a layer but its last holds a
multiple of S elements. A layer's blocks cover it front to back in issue
order. One collective at a time runs on the channel.

Phase 1 (during backward). Whenever the channel is free and some ready layer
has unsent units, the most urgent one (lowest rank) sends the most units that
end by the time the next gradient becomes ready: at least one, all of them if
they fit. If the layer whose block just ended is still the most urgent, that
block grows instead of a second one starting: the layer was whole and ready
when the block started, so this is a valid plan that pays the per-collective
cost once, and the grown block holds the units of both (the public reference
code kept only the new ones). So a block that would end short of the next
gradient takes one unit more: a gap whose cost lies in (c(k-1 units),
c(k units)] yields a block of k units. The channel idles until the next
gradient when nothing ready is left. No block starts at or after T_bwd; one
started before runs to completion.

Phase 2 (after backward, beside the next forward). What is left of each
layer goes as one block, layer 0 first, from when both backward and phase 1's
last block have ended.

Forward. It starts at T_bwd + step_ms (the optimizer step, 0 by default; the
channel keeps running through it). Layer l's forward starts at
max(end of layer l-1's forward, end of layer l's last block, phase 1 or 2).

iteration_ms = the time layer L-1's forward ends, counted from the start of
backward: backward + step + forward + whatever the forward waits for the
channel. In steady state this is the period of the training loop.

Priorities. The search starts from input-first ranks (layer l has rank l).
For each layer whose first block starts after its gradient is ready (most
delayed first), it tries moving the layer up to the rank of the layer whose
backward is running when that block would end had it started on time (the
top rank if that is after backward); it keeps the first change that lowers
iteration_ms and starts over. It stops when no such move helps or after L²
simulations; it is deterministic and never returns a plan slower than the
input-first one.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .prediction import ModuleProfile, Network, check_network

__all__ = ["Layer", "Block", "USBytePlan", "plan", "plan_for_profile", "layers_from_profile",
           "ring_allreduce_ms"]


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_ms(name: str, value) -> None:
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"dearcomm: {name} must be a finite number >= 0 (ms), got {value!r}")


def _check_count(name: str, value, least: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"dearcomm: {name} must be an int >= {least}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One gradient tensor, in forward order: its element count and the
    forward and backward time (ms) attributed to it."""
    numel: int
    forward_ms: float
    backward_ms: float

    def __post_init__(self):
        _check_count("Layer numel", self.numel)
        _check_ms("Layer forward_ms", self.forward_ms)
        _check_ms("Layer backward_ms", self.backward_ms)


@dataclasses.dataclass(frozen=True)
class Block:
    """One planned all-reduce: ``numel`` consecutive elements of ``layer``,
    on the channel from ``start_ms`` to ``end_ms`` (from backward start)."""
    layer: int
    numel: int
    phase: int
    start_ms: float
    end_ms: float


@dataclasses.dataclass(frozen=True)
class USBytePlan:
    unit: int
    """S, elements per unit."""
    priorities: Tuple[int, ...]
    """Per layer, its phase-1 rank (0 = most urgent), after the search."""
    blocks: Tuple[Block, ...]
    """In issue order (which is also channel order)."""
    iteration_ms: float
    """When the last layer's forward ends, from backward start (module docstring)."""

    def layer_blocks(self) -> List[List[int]]:
        """Per layer, the element counts of its blocks in element order."""
        out: List[List[int]] = [[] for _ in self.priorities]
        for b in self.blocks:
            out[b.layer].append(b.numel)
        return out


class _Cost:
    """The user's all-reduce cost, checked and memoized: the search calls it
    with the same block sizes many times."""

    def __init__(self, fn: Callable[[int], float]):
        if not callable(fn):
            raise ValueError(f"dearcomm: allreduce_ms must be callable (elements -> ms), got {fn!r}")
        self._fn = fn
        self._memo: Dict[int, float] = {}

    def __call__(self, numel: int) -> float:
        ms = self._memo.get(numel)
        if ms is None:
            ms = self._fn(numel)
            if not _is_real(ms) or not math.isfinite(ms) or ms < 0:
                raise ValueError(f"dearcomm: allreduce_ms({numel}) returned {ms!r}; expected a finite number >= 0")
            self._memo[numel] = ms = float(ms)
        return ms


class _Model:
    """What every simulation of one problem shares."""

    def __init__(self, layers: Sequence[Layer], unit: int, cost: _Cost, step_ms: float):
        self.numel = [x.numel for x in layers]
        self.fwd = [float(x.forward_ms) for x in layers]
        self.unit, self.cost, self.step_ms = unit, cost, float(step_ms)
        self.units = [-(-n // unit) for n in self.numel]
        self.ready = [0.0] * (len(layers) + 1)  # ready[L] = 0: backward starts
        for l in range(len(layers) - 1, -1, -1):
            self.ready[l] = self.ready[l + 1] + float(layers[l].backward_ms)
        self.ready.pop()

    def size(self, layer: int, first: int, count: int) -> int:
        """Elements in units [first, first + count) of ``layer``: only the
        layer's last unit may be short."""
        return min(self.numel[layer], (first + count) * self.unit) - first * self.unit

    def most_units(self, blk: list, left: int, horizon: float) -> int:
        """How many more units (1 … left) extend ``blk`` so that it still
        ends by ``horizon``; 1 when even one does not fit (assumes the cost
        grows with the size, as an all-reduce's does)."""
        layer, first, have, start = blk[0], blk[1], blk[2], blk[4]
        limit = horizon + 1e-9 * max(1.0, abs(horizon))  # float residue of the sums

        def fits(k: int) -> bool:
            return start + self.cost(self.size(layer, first, have + k)) <= limit
        if fits(left):
            return left
        lo, hi = 1, left  # fits(hi) is False; find the largest k < hi that fits, else 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def simulate(self, ranks: Sequence[int]) -> Tuple[List[list], float]:
        """Blocks as [layer, first unit, units, phase, start, end], in issue
        order, and iteration_ms, for phase-1 ranks ``ranks``."""
        L, ready = len(self.numel), self.ready
        t_bwd = ready[0]
        sent = [0] * L
        blocks: List[list] = []
        urgent: List[Tuple[int, int]] = []  # (rank, layer) of the ready layers
        nxt = L - 1  # the next layer to become ready (backward order)
        t = ready[L - 1]  # the channel is free from the first gradient on
        last: Optional[list] = None  # the block that ends at t, while the channel has not idled

        while t < t_bwd:  # phase 1; t < ready[0] keeps nxt >= 0 below
            while nxt >= 0 and ready[nxt] <= t:
                heapq.heappush(urgent, (ranks[nxt], nxt))
                nxt -= 1
            while urgent and sent[urgent[0][1]] == self.units[urgent[0][1]]:
                heapq.heappop(urgent)
            if not urgent:  # idle until the next gradient
                t, last = ready[nxt], None
                continue
            layer = urgent[0][1]
            if last is None or last[0] != layer:
                last = [layer, sent[layer], 0, 1, t, t]
                blocks.append(last)
            k = self.most_units(last, self.units[layer] - sent[layer], ready[nxt])
            self._grow(last, k, sent)
            t = last[5]

        # Phase 2: the rest, input side first. No merge with phase 1's last
        # block: layer 0, first here, is only ready when phase 1 ends.
        t = max(t, t_bwd)
        for layer in range(L):
            if sent[layer] < self.units[layer]:
                blk = [layer, sent[layer], 0, 2, t, t]
                blocks.append(blk)
                self._grow(blk, self.units[layer] - sent[layer], sent)
                t = blk[5]

        done = [0.0] * L
        for b in blocks:
            done[b[0]] = b[5]
        f = t_bwd + self.step_ms
        for layer in range(L):
            f = max(f, done[layer]) + self.fwd[layer]
        return blocks, f

    def _grow(self, blk: list, k: int, sent: List[int]) -> None:
        blk[2] += k
        sent[blk[0]] += k
        blk[5] = blk[4] + self.cost(self.size(blk[0], blk[1], blk[2]))

    def search(self, ranks: List[int]) -> Tuple[List[int], List[list], float]:
        L, ready = len(ranks), self.ready
        blocks, best = self.simulate(ranks)
        seen = {tuple(ranks)}
        tries = 1
        improved = True
        while improved and tries < L * L:
            improved = False
            first: Dict[int, list] = {}
            for b in blocks:
                first.setdefault(b[0], b)
            late = sorted((l for l in range(L) if first[l][4] > ready[l] + 1e-9 * max(1.0, ready[l])),
                          key=lambda l: (ready[l] - first[l][4], l))
            for l in late:
                b = first[l]
                would_end = ready[l] + self.cost(self.size(l, 0, b[2]))
                # The layer whose backward runs at would_end: the last (largest) k with ready[k] > it.
                k = max((j for j in range(l) if ready[j] > would_end), default=0)
                if ranks[k] >= ranks[l]:
                    continue
                order = sorted(range(L), key=ranks.__getitem__)
                order.remove(l)
                order.insert(ranks[k], l)
                trial = [0] * L
                for r, j in enumerate(order):
                    trial[j] = r
                if tuple(trial) in seen:
                    continue
                seen.add(tuple(trial))
                tries += 1
                trial_blocks, ms = self.simulate(trial)
                if ms < best - 1e-12 * max(1.0, best):
                    ranks, blocks, best, improved = trial, trial_blocks, ms, True
                    break
                if tries >= L * L:
                    break
        return ranks, blocks, best


def plan(layers: Sequence[Layer], unit: int, allreduce_ms: Callable[[int], float], *, search: bool = True,
         step_ms: float = 0.0) -> USBytePlan:
    """The US-Byte plan of ``layers`` (forward order) in units of ``unit``
    elements; ``allreduce_ms(n)``: the ms an all-reduce of n elements takes
    (nondecreasing in n); ``search``: run the priority search (else
    input-first ranks); ``step_ms``: the optimizer step between backward and
    forward. See the module docstring for the model."""
    layers = list(layers)
    if not layers:
        raise ValueError("dearcomm: layers is empty; a plan needs at least one layer")
    for i, x in enumerate(layers):
        if not isinstance(x, Layer):
            raise TypeError(f"dearcomm: layers[{i}] is a {type(x).__name__}; expected a dearcomm.usbyte.Layer")
    _check_count("unit", unit)
    _check_ms("step_ms", step_ms)
    model = _Model(layers, unit, _Cost(allreduce_ms), step_ms)
    ranks = list(range(len(layers)))
    if search:
        ranks, blocks, ms = model.search(ranks)
    else:
        blocks, ms = model.simulate(ranks)
    return USBytePlan(unit=unit, priorities=tuple(ranks), iteration_ms=ms,
                      blocks=tuple(Block(layer=b[0], numel=model.size(b[0], b[1], b[2]), phase=b[3],
                                         start_ms=b[4], end_ms=b[5]) for b in blocks))


def layers_from_profile(profile: Sequence[ModuleProfile]) -> List[Layer]:
    """One Layer per parameter, in forward order, from per-module times.

    A module's parameters are ready together when its backward ends, so its
    backward time goes to its last parameter (the first in backward order)
    and 0 to the others. Its forward reads all of them, so its forward time
    also goes to its last parameter: that forward then waits for every one of
    its parameters' blocks (on the first, it could start before the others
    arrive). A module without parameters folds into the layer before it (the
    last parameter of the nearest earlier module with some): its forward runs
    right after that one and waits for nothing new, its backward runs just
    before it and delays its gradient, both exactly as the simulator runs
    them. Modules without parameters before the first with some fold into
    layer 0, which is conservative: their forward then waits for layer 0's
    block and layer 0's gradient counts as ready only after their backward.
    """
    rows: List[List[float]] = []  # [numel, forward_ms, backward_ms]
    lead_f = lead_b = 0.0
    for i, m in enumerate(profile):
        if not isinstance(m, ModuleProfile):
            raise TypeError(f"dearcomm: profile[{i}] is a {type(m).__name__}; expected a ModuleProfile")
        _check_ms(f"module {m.name!r} forward_ms", m.forward_ms)
        _check_ms(f"module {m.name!r} backward_ms", m.backward_ms)
        numels = list(m.param_numels)
        for n in numels:
            _check_count(f"a parameter's element count in module {m.name!r}", n)
        if not numels:
            if rows:
                rows[-1][1] += m.forward_ms
                rows[-1][2] += m.backward_ms
            else:
                lead_f += m.forward_ms
                lead_b += m.backward_ms
            continue
        rows += [[n, 0.0, 0.0] for n in numels]
        rows[-1][1], rows[-1][2] = float(m.forward_ms), float(m.backward_ms)
    if not rows:
        raise ValueError("dearcomm: the profile has no parameter; nothing to communicate")
    rows[0][1] += lead_f
    rows[0][2] += lead_b
    return [Layer(int(n), f, b) for n, f, b in rows]


def ring_allreduce_ms(network: Network, world_size: int, bytes_per_element: int) -> Callable[[int], float]:
    """The simulator's all-reduce time (csrc/sim/cost_model.cpp), per element
    count: a ring all-reduce is a reduce-scatter plus an all-gather,
    2·((p-1)·α + (p-1)/p·bytes·β) with the all_reduce figures of
    ``network.costs()`` (per_kind overrides included), times
    ``network.comm_slowdown``: the simulator slows a collective by that while
    compute runs beside it, which is nearly always the case in a US-Byte plan
    (phase 1 overlaps backward, phase 2 the forward). compute_slowdown is not
    applied: the planner takes compute times as given."""
    check_network(network)
    _check_count("world_size", world_size, least=2)
    _check_count("bytes_per_element", bytes_per_element)
    slow = network.comm_slowdown
    if not _is_real(slow) or not math.isfinite(slow) or slow < 1:
        raise ValueError(f"dearcomm: Network.comm_slowdown must be a finite factor >= 1, got {slow!r}")
    alpha_s, beta_s = network.costs()["all_reduce"]
    p = float(world_size)

    def allreduce_ms(numel: int) -> float:
        return 1e3 * slow * 2.0 * ((p - 1) * alpha_s + (p - 1) / p * (numel * bytes_per_element) * beta_s)
    return allreduce_ms


def plan_for_profile(profile: Sequence[ModuleProfile], network: Network, world_size: int, unit: int, *,
                     bytes_per_element: Optional[int] = None, step_ms: float = 0.0,
                     search: bool = True) -> USBytePlan:
    """plan() over dearcomm's per-module profile: one layer per parameter
    (layers_from_profile), all-reduces timed as the simulator times them
    (ring_allreduce_ms). ``bytes_per_element``: default, the element size of
    the profile's dtype (the parameters must share one; pass it to override,
    e.g. for a narrower communication dtype). The plan's layer_blocks() and
    priorities are per parameter, in the profile's order; to train or
    simulate with them (blocks=, priorities=), ``unit`` must be a multiple of
    dearcomm._C.partition_unit(world_size, dtype)."""
    profile = list(profile)
    layers = layers_from_profile(profile)
    if bytes_per_element is None:
        import torch

        sizes = {torch.empty(0, dtype=d).element_size() for m in profile for d in m.dtypes()}
        if len(sizes) != 1:
            raise ValueError(f"dearcomm: the profile's parameters have element sizes {sorted(sizes)} bytes; "
                             f"pass bytes_per_element")
        bytes_per_element = sizes.pop()
    return plan(layers, unit, ring_allreduce_ms(network, world_size, bytes_per_element), search=search,
                step_ms=step_ms)


UNITS_MB = (0.25, 1.0, 4.0, 16.0, 64.0, 256.0)
"""Unit sizes tried by plan_job (US-Byte tunes S; these span its reported range)."""


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """A US-Byte plan for a job, in the terms wrap() and simulate() take.

    The planner's layers are the engine's buckets: a parameter of at least
    half a unit is a layer of its own (its blocks are wrap()'s ``blocks``);
    smaller ones fuse with their neighbours in forward order into buckets of
    at most one unit (wrap()'s ``bucket_mb``), one layer each, never split.
    One all-reduce per tensor would pay the per-collective cost hundreds of
    times on models of many small tensors."""
    plan: USBytePlan
    names: Tuple[str, ...]
    """The profile's parameters, in its (forward) order."""
    groups: Tuple[Tuple[int, ...], ...]
    """Per planner layer, the parameters (positions) it holds."""
    alone: Tuple[bool, ...]
    """Per parameter: a layer of its own, in the plan's blocks (else fused)."""
    bucket_mb: float
    """wrap()'s bucket_mb for the fused small parameters."""
    predicted_ms: float = 0.0
    """The simulator's iteration time with these blocks and priorities (the
    engine's own schedule code on a virtual clock), not the planner's."""
    tried: Tuple[Tuple[int, float], ...] = ()
    """(unit, predicted_ms) of every unit tried."""
    align: int = 1
    """Every piece of a parameter but its last is a multiple of this many
    elements (the partition unit of every dtype present)."""

    def blocks_by_position(self) -> List[List[int]]:
        """Per parameter, its pieces ([] for a fused one), back to front:
        backward reports a parameter's pieces last first, so the block the
        plan sends first is the parameter's last piece. The short tail of the
        plan's last block (less than ``align`` elements) moves to that last
        piece, where an uneven size is allowed."""
        out: List[List[int]] = [[] for _ in self.names]
        for group, blocks in zip(self.groups, self.plan.layer_blocks()):
            if not self.alone[group[0]]:
                continue
            pieces = blocks[::-1]
            tail = pieces[0] % self.align if len(pieces) > 1 else 0
            pieces[0] -= tail
            pieces[-1] += tail
            out[group[0]] = [n for n in pieces if n > 0]
        return out

    def priorities_by_position(self) -> List[int]:
        out = [0] * len(self.names)
        for group, rank in zip(self.groups, self.plan.priorities):
            for p in group:
                out[p] = rank
        return out

    def wrap_options(self) -> Dict[str, object]:
        """``bucket_mb``, ``blocks`` and ``priorities`` for dearcomm.wrap(schedule="usbyte")."""
        blocks = {n: b for n, b in zip(self.names, self.blocks_by_position()) if b}
        return dict(bucket_mb=self.bucket_mb, blocks=blocks,
                    priorities=dict(zip(self.names, self.priorities_by_position())))

    def simulate_options(self) -> Dict[str, object]:
        """The same for dearcomm.simulate (by position)."""
        return dict(bucket_mb=self.bucket_mb, blocks=self.blocks_by_position(),
                    priorities=self.priorities_by_position())

    def describe(self) -> str:
        split = sum(len(b) > 1 for b in self.plan.layer_blocks())
        return (f"usbyte plan: unit {self.plan.unit} elements, {len(self.plan.blocks)} blocks over "
                f"{len(self.names)} parameters in {len(self.groups)} layers ({split} split), "
                f"{self.predicted_ms:.2f} ms per iteration predicted")


def plan_job(profile, network: Network, world_size: int, *, units_mb: Sequence[float] = UNITS_MB,
             comm_dtype=None, search: bool = True) -> JobPlan:
    """The US-Byte plan for a measured job (a dearcomm.TrainingProfile): one
    plan per unit size in ``units_mb`` (rounded to whole partition units of
    every dtype present), each simulated with the engine's usbyte schedule;
    the fastest predicted wins."""
    names = tuple(p.name for m in profile.modules for p in m.params)
    return plan_modules(profile.for_simulation(), network, world_size, step_ms=profile.step_ms, names=names,
                        units_mb=units_mb, comm_dtype=comm_dtype, search=search)


def plan_modules(modules: Sequence[ModuleProfile], network: Network, world_size: int, *, step_ms: float = 0.0,
                 names: Optional[Sequence[str]] = None, units_mb: Sequence[float] = UNITS_MB, comm_dtype=None,
                 search: bool = True) -> JobPlan:
    """plan_job over a list of ModuleProfile (``names``: the parameters',
    in order; default p0, p1, ...)."""
    import torch

    from . import _C
    from .prediction import simulate

    modules = list(modules)
    per_param = layers_from_profile(modules)
    numels = [layer.numel for layer in per_param]
    dtypes = [d for m in modules for d in m.dtypes()]
    names = tuple(names) if names is not None else tuple(f"p{i}" for i in range(len(numels)))
    element = torch.empty(0, dtype=comm_dtype).element_size() if comm_dtype is not None else \
        max(torch.empty(0, dtype=d).element_size() for d in set(dtypes))
    step = 1
    for d in set(dtypes):
        step = math.lcm(step, _C.partition_unit(world_size, d))
    cost = ring_allreduce_ms(network, world_size, element)
    tried, best = [], None
    for mb in units_mb:
        unit = max(1, int(mb * 2**20 / element) // step) * step
        if any(u == unit for u, _ in tried):
            continue
        # The engine's buckets for this unit: parameters of half a unit or more alone, the rest fused
        # into buckets that close once they hold half a unit (so at most one unit each).
        half_mb = unit * element / 2 / 2**20
        alone = tuple(2 * n >= unit for n in numels)
        layout = _C.plan_buckets(numels, dtypes, int(half_mb * 2**20), world_size, 2**63 - 1,
                                 [[n] if a else [] for n, a in zip(numels, alone)])
        groups = tuple(tuple(range(b.first_param, b.first_param + b.num_params)) for b in layout.buckets)
        layers = [Layer(sum(numels[p] for p in g), sum(per_param[p].forward_ms for p in g),
                        sum(per_param[p].backward_ms for p in g)) for g in groups]
        job = JobPlan(plan(layers, unit, cost, search=search, step_ms=step_ms), names, groups, alone, half_mb,
                      align=step)
        ms = simulate(modules, world_size=world_size, network=network, schedule="usbyte", step_ms=step_ms,
                      comm_dtype=comm_dtype, **job.simulate_options()).iteration_ms
        tried.append((unit, ms))
        if best is None or ms < best.predicted_ms:
            best = dataclasses.replace(job, predicted_ms=ms)
    return dataclasses.replace(best, tried=tuple(tried))
