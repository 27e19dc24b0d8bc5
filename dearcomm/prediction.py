"""Predict a schedule's iteration time without running it: the executor and
the schedule policy that train (csrc/core/, csrc/schedule/) run on a simulated
device with a virtual clock (csrc/sim/): one compute stream timed by a
per-module profile, one communication channel timed by an α–β cost model.

    from dearcomm import ModuleProfile, Network, simulate
    profile = [ModuleProfile("embed", 0.4, 0.8, [4_000_000]),
               ModuleProfile("block0", 2.0, 4.0, [2_359_296, 768]), ...]
    p = simulate(profile, schedule="dear", world_size=8, network=Network(alpha_us=20, gbit_s=10), step_ms=3.0)
    p.iteration_ms, p.ops[:3]
    write_chrome_trace("predicted.json", {"dear (predicted)": [p.timeline_events()]})

Options (bucket_mb, partition_mb, credit_mb, comm_dtype, update) are wrap()'s,
validated the same way, and the buckets are planned by the same planner.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
import os
from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import _C
from ._options import WrapOptions, checked_delay
from ._delays import bucket_delays
from ._priorities import bucket_priorities

KINDS = ("reduce_scatter", "all_gather", "all_reduce")
ORDERED_ALL_REDUCE = "ordered_all_reduce"
"""Network's key for an all-reduce the backend keeps in issue order (what
schedule="deft" asks for): on a CPU another collective than gloo's
allreduce, dearcomm's reduce-scatter and all-gather exchanges pipelined
piece by piece. Where a Network gives it no figures it costs what
"all_reduce" costs (NCCL runs one all-reduce either way)."""
COST_KINDS = KINDS + (ORDERED_ALL_REDUCE,)
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class ModuleProfile:
    """One module, in forward order: its forward and backward time on one rank
    and the element counts of the parameters its forward reads (each
    parameter belongs to exactly one module), all of ``dtype`` unless
    ``param_dtypes`` gives each its own (buckets hold one dtype each, so a
    module of mixed dtypes lays out otherwise). ``grad_ready_ms``: per
    parameter, how far into the module's backward its gradient is ready (0
    to ``backward_ms``; a TrainingProfile carries what it measured); empty:
    every gradient at the end of the module's backward."""
    name: str
    forward_ms: float
    backward_ms: float
    param_numels: Sequence[int] = ()
    dtype: torch.dtype = torch.float32
    param_dtypes: Sequence[torch.dtype] = ()
    grad_ready_ms: Sequence[float] = ()

    def dtypes(self) -> List[torch.dtype]:
        """Each parameter's dtype."""
        return list(self.param_dtypes) if self.param_dtypes else [self.dtype] * len(self.param_numels)


def _known_kinds(field: str, by_kind: Mapping) -> None:
    unknown = sorted(set(by_kind) - set(COST_KINDS), key=str)
    if unknown:
        raise ValueError(f"dearcomm: Network.{field} names {unknown}; expected some of {list(COST_KINDS)}")


def _per_kind(field: str, by_kind: Mapping[str, float], scale: float) -> Dict[str, float]:
    """A Network field of {kind: figure}, checked, times ``scale``, for every
    kind of COST_KINDS ("ordered_all_reduce": the "all_reduce"'s unless
    given; any other kind not given: 0)."""
    _known_kinds(field, by_kind)
    out = {}
    for kind in COST_KINDS:
        value = by_kind.get(kind, by_kind.get("all_reduce", 0.0) if kind == ORDERED_ALL_REDUCE else 0.0)
        _check_number(f"{kind} {field}", value, allow_zero=True)
        out[kind] = value * scale
    return out


def check_network(network) -> None:
    """A TypeError unless ``network`` is a Network (a preset's name points to network_preset)."""
    if not isinstance(network, Network):
        from .network_fit import NETWORK_PRESETS  # network_fit imports this module

        hint = (f"; for a preset, network=dearcomm.network_preset({network!r})" if network in NETWORK_PRESETS
                else f"; a preset's name goes to dearcomm.network_preset() (one of {sorted(NETWORK_PRESETS)})"
                if isinstance(network, str) else "")
        raise TypeError(f"dearcomm: network must be a dearcomm.Network, got {type(network).__name__}{hint}")


def _alpha_beta(kind: str, alpha_us, gbit_s) -> Tuple[float, float]:
    """(alpha seconds, beta seconds per byte) of a kind's figures, checked."""
    _check_number(f"{kind} alpha_us", alpha_us, allow_zero=True)
    _check_number(f"{kind} gbit_s", gbit_s, allow_zero=False, allow_inf=True)
    return alpha_us * 1e-6, 8.0 / (gbit_s * 1e9)


@dataclasses.dataclass(frozen=True)
class Network:
    """α–β cost of a ring collective: ``alpha_us`` per ring step, ``gbit_s``
    of bandwidth. ``per_kind`` overrides both for "reduce_scatter",
    "all_gather", "all_reduce" or "ordered_all_reduce" (an all-reduce the
    backend keeps in issue order, as deft asks: on a CPU dearcomm's own
    exchanges, not gloo's allreduce; unset, it costs what "all_reduce"
    does) as {kind: (alpha_us, gbit_s)}.
    ``compute_slowdown``: how many times longer compute takes while a
    collective runs beside it, where both share the cores (gloo on a CPU:
    measure it with benchmarks/contention.py); 1 where they do not.
    ``comm_slowdown``: how many times longer a collective takes while compute
    runs beside it (the other direction of the same sharing; the same
    benchmark measures it).
    ``all_reduce_lanes``: how many all-reduces the backend runs at once,
    sharing the link equally: 2 for torch's gloo (two worker threads take the
    posted all-reduces in turn, so one posted behind a large one finishes
    first), 1 where they run one at a time (one NCCL stream). A schedule that
    asks the backend for issue order (deft) runs one at a time whatever this
    says; dearcomm.network_probe sets it from the training group.
    ``host_ms``: {kind: ms} the compute stream loses per collective of that
    kind, where the collectives' CPU work takes the cores compute runs on
    (gloo on a CPU whose cores all compute): a fixed cost per collective,
    which many small ones add up and compute_slowdown (measured beside large
    ones) leaves out. The simulated device owes it to the compute stream from
    the collective's issue and pays it at its next compute, unless a wait
    leaves the stream idle long enough; it also counts in the bound below. 0
    where the collectives run elsewhere (a GPU); dearcomm.network_probe
    measures it on a CPU ("ordered_all_reduce": the "all_reduce"'s unless
    given).
    ``host_ms_per_mib``: {kind: ms} of host CPU per MiB of a collective's
    buffer (gloo's summing and copies), in the compute-stream milliseconds of
    ``host_ms``. It does not stretch the timeline (compute_slowdown carries
    the collectives' effect on compute); it bounds the iteration: where the
    ranks fill the cores, an iteration takes at least its compute work plus
    its collectives' CPU, comm_cpu_slowdown times what they take alone
    (Prediction.cpu_ms). 0 where collectives run elsewhere (a GPU) or on
    cores the compute leaves free ("ordered_all_reduce": the "all_reduce"'s
    unless given).
    ``comm_cpu_slowdown``: the factor that bound charges the collectives'
    CPU at: their CPU beside compute over alone (ν,
    dearcomm.fit_comm_cpu_slowdown; 1.0-1.5 on loopback, where
    comm_slowdown read 1.2-2.1); None (the default): comm_slowdown, the wall
    they take beside compute, which stands in for ν and iteration_cv
    together where they were not measured.
    ``compute_cpu_slowdown``: how many times its work the bound counts the
    compute the simulated device runs beside a collective (μ, its CPU beside
    collectives over alone, dearcomm.fit_compute_cpu_slowdown); 1 by default.
    ``iteration_cv``: how much one rank's compute iteration varies, its
    standard deviation over its median (dearcomm.fit_iteration_cv); 0 by
    default. The ranks meet every iteration, so where the cores bound it an
    iteration takes the slowest rank's: the bound times 1 + cv x the
    expected largest of world_size standard normal draws (0.56 at 2 ranks,
    1.03 at 4, 2.3 at 64; expected_slowest_of).
    ``cores_share``: the ranks on a host over its cores, where their compute
    fills every core (dearcomm.host_cost.cores_share; 0, the default: not so,
    or a GPU). Above 1 the ranks take turns on the cores: the one that meets
    first hands its core to a slower one, so the spread costs nothing and the
    bound is taken as it is (4 ranks on 2 cores: docs/benchmarks.md);
    dearcomm.network_probe sets it."""
    alpha_us: float
    gbit_s: float
    per_kind: Mapping[str, Tuple[float, float]] = dataclasses.field(default_factory=dict)
    compute_slowdown: float = 1.0
    comm_slowdown: float = 1.0
    all_reduce_lanes: int = 1
    host_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    host_ms_per_mib: Mapping[str, float] = dataclasses.field(default_factory=dict)
    comm_cpu_slowdown: Optional[float] = None
    compute_cpu_slowdown: float = 1.0
    iteration_cv: float = 0.0
    cores_share: float = 0.0

    def __post_init__(self) -> None:
        """Every figure checked where the Network is made (presets, fits and
        dataclasses.replace included), not first in simulate()."""
        self.costs()
        self.host_costs()
        self.host_costs_per_byte()
        for name in ("compute_slowdown", "comm_slowdown", "comm_cpu_slowdown", "compute_cpu_slowdown"):
            factor = getattr(self, name)
            if name == "comm_cpu_slowdown" and factor is None:
                continue  # comm_slowdown stands in for it
            if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not math.isfinite(factor) \
                    or factor < 1:
                raise ValueError(f"dearcomm: Network.{name} must be a finite factor >= 1, got {factor!r}")
        _check_number("Network.iteration_cv", self.iteration_cv, allow_zero=True)
        _check_number("Network.cores_share", self.cores_share, allow_zero=True)
        lanes = self.all_reduce_lanes
        if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
            raise ValueError(f"dearcomm: Network.all_reduce_lanes must be an int >= 1, got {lanes!r}")

    @property
    def bound_comm_cpu_slowdown(self) -> float:
        """The factor the CPU bound charges the collectives' CPU at:
        comm_cpu_slowdown, or comm_slowdown where it is unset."""
        return self.comm_slowdown if self.comm_cpu_slowdown is None else self.comm_cpu_slowdown

    def host_costs(self) -> Dict[str, float]:
        """{kind: seconds the compute stream loses per collective} for every
        kind of COST_KINDS, checked."""
        return _per_kind("host_ms", self.host_ms, 1e-3)

    def host_costs_per_byte(self) -> Dict[str, float]:
        """{kind: seconds of host CPU per byte of a collective's buffer} for
        every kind of COST_KINDS, checked."""
        return _per_kind("host_ms_per_mib", self.host_ms_per_mib, 1e-3 / MIB)

    def costs(self) -> Dict[str, Tuple[float, float]]:
        """{kind: (alpha seconds, beta seconds per byte)} for every kind of COST_KINDS"""
        _known_kinds("per_kind", self.per_kind)
        if any(kind not in self.per_kind for kind in KINDS):  # the kinds without their own take these
            _alpha_beta("Network", self.alpha_us, self.gbit_s)
        for kind, figures in self.per_kind.items():
            try:
                ordered = not isinstance(figures, (str, bytes, AbstractSet, Mapping))
                alpha_us, gbit_s = figures if ordered else ()
            except (TypeError, ValueError):
                ordered = False
            if not ordered:
                raise ValueError(f"dearcomm: Network.per_kind[{kind!r}] must be (alpha_us, gbit_s), got {figures!r}")
        out = {kind: _alpha_beta(kind, *self.per_kind.get(kind, (self.alpha_us, self.gbit_s))) for kind in KINDS}
        ordered = self.per_kind.get(ORDERED_ALL_REDUCE)
        out[ORDERED_ALL_REDUCE] = out["all_reduce"] if ordered is None else _alpha_beta(ORDERED_ALL_REDUCE, *ordered)
        return out

    @classmethod
    def preset(cls, name: str) -> "Network":
        """A common interconnect's figures ("10gbe", "25gbe", "100gb-ib",
        "nvlink"): see dearcomm.network_fit.NETWORK_PRESETS for their sources."""
        from .network_fit import network_preset  # network_fit imports this module
        return network_preset(name)

    @classmethod
    def fit(cls, measurements, world_size: Optional[int] = None, impl: str = "dearcomm",
            dtype: Optional[str] = None) -> "Network":
        """α and bandwidth per kind fitted to ``benchmarks/collectives.py
        --json`` files or row dicts; dearcomm.fit_network takes the same
        arguments and also returns the fit quality (R², largest error),
        which is worth a look before trusting a prediction."""
        from .network_fit import fit_network  # network_fit imports this module
        return fit_network(measurements, world_size=world_size, impl=impl, dtype=dtype).network


@dataclasses.dataclass
class Prediction:
    iteration_ms: float
    """Steady state: the longer of ``timeline_ms`` and ``cpu_ms`` times the
    ranks' meeting (Network.iteration_cv; 1 where they share cores,
    Network.cores_share)."""
    ops: List[Dict] = dataclasses.field(repr=False)
    """Every collective: kind, bucket, iteration, issued/start/end/wait_begin/wait_end in ms."""
    spans: List[Dict] = dataclasses.field(repr=False)
    """Compute: name, iteration, start/end in ms."""
    records: List[Dict] = dataclasses.field(repr=False)
    """The executor's state changes (what the real engine's take_records() gives)."""
    layout: object = dataclasses.field(repr=False)
    """The bucket layout (dearcomm._C.BucketLayout) the run used."""
    timeline_ms: float = 0.0
    """From the start of the last iteration's forward to the start of the next, on the simulated device."""
    cpu_ms: float = 0.0
    """The host CPU that iteration needs: its compute work (as alone;
    Network.compute_cpu_slowdown times that beside a collective) and its
    collectives' CPU (Network.host_ms and host_ms_per_mib, comm_cpu_slowdown
    times). Where it is the longer, the ranks' cores bound the iteration."""

    def buckets(self, iteration: Optional[int] = None) -> List[Dict]:
        """Per bucket, the start and end (ms) of its reduction and of its
        gather in ``iteration`` (default: the last full one)."""
        last = max(op["iteration"] for op in self.ops) - 1 if iteration is None else iteration
        rows = [dict(bucket=b) for b in range(len(self.layout.buckets))]
        for op in self.ops:
            if op["kind"] == "all_gather" and op["iteration"] == last:
                rows[op["bucket"]].update(gather_start_ms=op["start_ms"], gather_end_ms=op["end_ms"])
            elif op["kind"] != "all_gather" and op["iteration"] == last:
                rows[op["bucket"]].update(reduction=op["kind"], reduction_start_ms=op["start_ms"],
                                          reduction_end_ms=op["end_ms"])
        return rows

    def timeline_events(self) -> List[Dict]:
        """The run as dearcomm.timeline events (lane, name, start_ns, end_ns):
        write_chrome_trace and plot_gantt draw it like a measured timeline."""
        lanes = {"reduce_scatter": "reduce", "all_reduce": "reduce", "all_gather": "gather"}
        events = [dict(lane="compute", name=s["name"], start_ns=round(s["start_ms"] * 1e6),
                       end_ns=round(s["end_ms"] * 1e6)) for s in self.spans]
        events += [dict(lane=lanes[op["kind"]], name=f"{op['kind']}[bucket {op['bucket']}]",
                        start_ns=round(op["start_ms"] * 1e6), end_ns=round(op["end_ms"] * 1e6)) for op in self.ops]
        return sorted(events, key=lambda e: e["start_ns"])


def _check_number(name: str, value, allow_zero: bool, allow_inf: bool = False) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)  # numpy's too
    ok = ok and (value >= 0 if allow_zero else value > 0) and (allow_inf or math.isfinite(value))
    if not ok:
        raise ValueError(f"dearcomm: {name} must be a {'non-negative' if allow_zero else 'positive'} "
                         f"{'' if allow_inf else 'finite '}number, got {value!r}")


def simulate(profile, *, world_size: int, network: Network, schedule: str = "dear",
             update: Optional[str] = None, step_ms: Optional[float] = None, bucket_mb: float = 25.0,
             partition_mb: Optional[float] = None, credit_mb: Optional[float] = None,
             comm_dtype: Optional[torch.dtype] = None, iterations: int = 3,
             blocks: Optional[Sequence[Sequence[int]]] = None,
             priorities: Optional[Sequence[Optional[int]]] = None,
             delays: Optional[Sequence[int]] = None, max_delay: Optional[int] = None,
             pack_ms_per_mib: Optional[float] = None, average_ms_per_mib: Optional[float] = None) -> Prediction:
    """Runs ``iterations`` iterations of ``schedule`` on the simulated device
    and returns the prediction. ``profile``: a dearcomm.TrainingProfile
    (dearcomm.profile() measures one) or a list of ModuleProfile.
    ``step_ms``: the optimizer over the whole model on one rank (a sharded
    update takes 1/world_size of it); default: the TrainingProfile's, else 0.
    ``blocks`` and ``priorities``: wrap()'s, by parameter position (the
    profile's parameters in order) instead of by name: per parameter its
    pieces ([] or absent: none) and its rank (None: after every ranked one);
    dearcomm.usbyte's plans give both. ``delays`` (schedule="deft"): per
    parameter, iterations late (dearcomm.deft's plans give them); the first
    ``max(delays)`` iterations then apply nothing of the delayed buckets, so
    simulate a few more iterations and read the last.
    ``pack_ms_per_mib`` and ``average_ms_per_mib``: what the host pays per
    MiB of a reduction's bucket, on the compute stream, to copy the
    gradients in at its issue and to divide the reduced bytes after its wait
    (a loop whose ``zero_grad()`` sets .grad to None, the default, packs
    every gradient; one that keeps .grad as the bucket view packs none);
    default: the TrainingProfile's (dearcomm.profile() measures both), else 0."""
    from .profiler import TrainingProfile

    if isinstance(profile, TrainingProfile):
        step_ms = profile.step_ms if step_ms is None else step_ms
        pack_ms_per_mib = profile.pack_ms_per_mib if pack_ms_per_mib is None else pack_ms_per_mib
        average_ms_per_mib = profile.average_ms_per_mib if average_ms_per_mib is None else average_ms_per_mib
    step_ms = 0.0 if step_ms is None else step_ms
    pack_ms_per_mib = 0.0 if pack_ms_per_mib is None else pack_ms_per_mib
    average_ms_per_mib = 0.0 if average_ms_per_mib is None else average_ms_per_mib
    options = WrapOptions(schedule=schedule, update=update, bucket_mb=bucket_mb, partition_mb=partition_mb,
                          credit_mb=credit_mb, comm_dtype=comm_dtype, max_delay=max_delay)
    _check_world_size(world_size)
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"dearcomm: iterations must be an int >= 1, got {iterations!r}")
    check_network(network)
    _check_number("step_ms", step_ms, allow_zero=True)
    _check_number("pack_ms_per_mib", pack_ms_per_mib, allow_zero=True)
    _check_number("average_ms_per_mib", average_ms_per_mib, allow_zero=True)
    numels, dtypes, modules, grad_ready_s = _modules(profile)
    per_param = [list(b) for b in blocks] if blocks is not None else []
    if per_param and len(per_param) != len(numels):
        raise ValueError(f"dearcomm: blocks has {len(per_param)} entries; the profile has {len(numels)} parameters")
    layout = _C.plan_buckets(numels, dtypes, options.bucket_cap_bytes, world_size, options.partition_bytes,
                             per_param)
    choice = options.choice
    if priorities is not None:
        if len(priorities) != len(numels):
            raise ValueError(f"dearcomm: priorities has {len(priorities)} entries; the profile has {len(numels)} "
                             f"parameters")
        choice = choice.with_bucket_priorities(bucket_priorities(layout, list(priorities)))
    if delays is not None:
        if len(delays) != len(numels):
            raise ValueError(f"dearcomm: delays has {len(delays)} entries; the profile has {len(numels)} parameters")
        delays = [checked_delay(d, options.effective_max_delay, f"delays[{i}]") for i, d in enumerate(delays)]
        choice = choice.with_bucket_delays(bucket_delays(layout, delays))
    costs = network.costs()  # the Network checked its figures when it was made
    cpu_factor = network.bound_comm_cpu_slowdown
    lanes = network.all_reduce_lanes
    raw = _C.simulate(layout, comm_dtype, modules, step_ms * 1e-3, numels, choice, costs, iterations,
                      float(network.compute_slowdown), float(network.comm_slowdown), lanes, grad_ready_s,
                      pack_ms_per_mib * 1e-3 / MIB, average_ms_per_mib * 1e-3 / MIB, network.host_costs(),
                      network.host_costs_per_byte(), float(cpu_factor),
                      float(network.compute_cpu_slowdown), float(network.iteration_cv),
                      float(network.cores_share))
    ms = 1e3

    def in_ms(d: Dict) -> Dict:
        return {(k[:-2] + "_ms" if k.endswith("_s") else k): (v * ms if k.endswith("_s") and v >= 0 else v)
                for k, v in d.items()}
    return Prediction(iteration_ms=raw["iteration_s"] * ms,
                      ops=[in_ms(op) for op in raw["ops"]],
                      spans=[in_ms(s) for s in raw["spans"]], records=raw["records"], layout=layout,
                      timeline_ms=raw["timeline_s"] * ms, cpu_ms=raw["cpu_s"] * ms)


def expected_slowest_of(n: int) -> float:
    """The expected largest of ``n`` independent standard normal draws
    (0 for one; 1/sqrt(pi) for two): what the simulator multiplies
    Network.iteration_cv by for the slowest of ``n`` ranks."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"dearcomm: expected_slowest_of needs a count >= 1, got {n!r}")
    return _C.expected_slowest_of(n)


def _modules(profile) -> Tuple[List[int], List[torch.dtype], List[Tuple[str, float, float, List[int]]],
                               List[List[float]]]:
    """A profile's parameters (numels, dtypes, in forward order), modules
    (name, forward s, backward s, their parameters' positions) and per module
    its gradients' ready times (s into its backward; [] for all at its end),
    checked."""
    from .profiler import TrainingProfile

    if isinstance(profile, TrainingProfile):
        profile = profile.for_simulation()
    elif isinstance(profile, (str, os.PathLike)):
        raise TypeError(f"dearcomm: the profile is a dearcomm.TrainingProfile or a list of ModuleProfile, got a path "
                        f"({profile!r}); read a saved one with dearcomm.TrainingProfile.load(path)")
    elif not isinstance(profile, collections.abc.Sequence):
        raise TypeError(f"dearcomm: the profile is a dearcomm.TrainingProfile (dearcomm.profile() measures one) or a "
                        f"list of ModuleProfile, got {type(profile).__name__}")
    numels, dtypes, modules, grad_ready_s = [], [], [], []
    for m in profile:  # names are labels here (a published profile repeats a layer's)
        if not isinstance(m, ModuleProfile):
            raise TypeError(f"dearcomm: the profile holds ModuleProfile entries, got {type(m).__name__}")
        _check_number(f"module {m.name!r} forward_ms", m.forward_ms, allow_zero=True)
        _check_number(f"module {m.name!r} backward_ms", m.backward_ms, allow_zero=True)
        for n in m.param_numels:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"dearcomm: module {m.name!r} has a parameter of {n!r} elements; expected an int >= 1")
        if m.param_dtypes and len(m.param_dtypes) != len(m.param_numels):
            raise ValueError(f"dearcomm: module {m.name!r} has {len(m.param_numels)} parameters but "
                             f"{len(m.param_dtypes)} param_dtypes")
        for d in m.dtypes():
            if not isinstance(d, torch.dtype) or not d.is_floating_point:
                raise ValueError(f"dearcomm: module {m.name!r} has a parameter of dtype {d!r}; expected a "
                                 "floating-point torch.dtype")
        if m.grad_ready_ms and len(m.grad_ready_ms) != len(m.param_numels):
            raise ValueError(f"dearcomm: module {m.name!r} has {len(m.param_numels)} parameters but "
                             f"{len(m.grad_ready_ms)} grad_ready_ms")
        for at in m.grad_ready_ms:
            _check_number(f"module {m.name!r} grad_ready_ms", at, allow_zero=True)
            if at > m.backward_ms:
                raise ValueError(f"dearcomm: module {m.name!r} has a gradient ready {at} ms into its backward, "
                                 f"after its backward_ms ({m.backward_ms})")
        first = len(numels)
        numels += list(m.param_numels)
        dtypes += m.dtypes()
        modules.append((m.name, m.forward_ms * 1e-3, m.backward_ms * 1e-3, list(range(first, len(numels)))))
        grad_ready_s.append([at * 1e-3 for at in m.grad_ready_ms])
    if not numels:
        raise ValueError("dearcomm: the profile has no parameter; nothing to communicate")
    return numels, dtypes, modules, grad_ready_s


def bucket_layout(profile, *, world_size: int, schedule: str = "dear", update: Optional[str] = None,
                  bucket_mb: float = 25.0, partition_mb: Optional[float] = None,
                  credit_mb: Optional[float] = None):
    """The buckets (a dearcomm._C.BucketLayout) that simulate() and wrap()
    lay out with these options over the profile's parameters: options that
    lay out the same buckets train alike under one schedule (autotune.plan
    simulates one of them)."""
    _check_world_size(world_size)
    numels, dtypes, _, _ = _modules(profile)
    options = WrapOptions(schedule=schedule, update=update, bucket_mb=bucket_mb, partition_mb=partition_mb,
                          credit_mb=credit_mb)
    return _C.plan_buckets(numels, dtypes, options.bucket_cap_bytes, world_size, options.partition_bytes, [])


def _check_world_size(world_size) -> None:
    if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 2:
        raise ValueError(f"dearcomm: world_size must be an int >= 2, got {world_size!r}")
