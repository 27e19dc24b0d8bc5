"""Choose wrap()'s schedule and sizes by simulation: every schedule × update of
the registry over a grid of bucket, partition and credit sizes, each run on
the simulated device (dearcomm.simulate), the fastest predicted kept.

    prof = dearcomm.profile(model, batch, optimizer, loss_fn=...)
    choice = dearcomm.plan(prof, world_size=16, network=dearcomm.network_preset("25gbe"))
    print(choice)                      # the choice, its predicted time and gain over the default
    model, optimizer = dearcomm.wrap(model, optimizer, **choice.options)

The search is deterministic: the same profile and network give the same
choice on every rank (ties go to the earlier candidate in grid order, whose
first entry is wrap()'s default).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from . import _C
from ._options import PLANNED_SCHEDULES
from .prediction import Network, bucket_layout, check_network, simulate
from .profiler import TrainingProfile

BUCKET_MB = (25.0, 1.0, 4.0, 8.0, 64.0, math.inf)
PARTITION_MB = (None, 1.0, 4.0, 16.0)
CREDIT_MB = (None, 1.0, 4.0, 16.0)

_OPTION_ORDER = ("schedule", "update", "bucket_mb", "partition_mb", "credit_mb")
DEFAULT_OPTIONS = (("schedule", "dear"), ("update", "sharded"), ("bucket_mb", 25.0), ("partition_mb", None),
                   ("credit_mb", None))  # wrap()'s


@dataclasses.dataclass(frozen=True)
class Candidate:
    options: Dict[str, object]
    """wrap() keyword arguments."""
    predicted_ms: float
    timeline_ms: Optional[float] = None
    """The simulated timeline alone (Prediction.timeline_ms): where the host
    CPU bounds several candidates alike, the shorter timeline ranks first."""

    def __str__(self) -> str:
        return " ".join(f"{k}={self.options[k]}" for k in _OPTION_ORDER if self.options.get(k) is not None)


def _candidate(options: Dict[str, object], prediction) -> Candidate:
    return Candidate(options, prediction.iteration_ms, prediction.timeline_ms)


@dataclasses.dataclass(frozen=True)
class Plan:
    best: Candidate
    default: Candidate
    """wrap()'s defaults: dear, 25 MiB buckets, no partitions."""
    candidates: Sequence[Candidate]
    """Every candidate simulated, fastest first."""

    @property
    def options(self) -> Dict[str, object]:
        return dict(self.best.options)

    @property
    def predicted_ms(self) -> float:
        return self.best.predicted_ms

    @property
    def gain_over_default(self) -> float:
        return self.default.predicted_ms / self.best.predicted_ms

    def __str__(self) -> str:
        return (f"dearcomm plan: {self.best} -> {self.best.predicted_ms:.2f} ms per iteration predicted, "
                f"{self.gain_over_default:.3f}x the default ({self.default.predicted_ms:.2f} ms); "
                f"{len(self.candidates)} candidates simulated")


def _names(label: str, given) -> Optional[List[str]]:
    """plan()'s ``schedules`` or ``updates`` as a list (None: all); a string
    or an empty or non-iterable value raises, naming it."""
    if given is None:
        return None
    names = list(given) if isinstance(given, Iterable) and not isinstance(given, str) else []
    if not names:
        raise ValueError(f"dearcomm: plan()'s {label} must be a non-empty list of names (or None: all), got {given!r}")
    return names


def _grid(schedules: Optional[Sequence[str]], updates: Optional[Sequence[str]], bucket_mb: Sequence[float],
          partition_mb: Sequence[Optional[float]], credit_mb: Sequence[Optional[float]],
          credit_given: bool = True) -> List[Dict[str, object]]:
    registry = {entry["name"]: entry for entry in _C.schedules()}
    schedules, updates = _names("schedules", schedules), _names("updates", updates)
    # Schedules a planner sets the pieces of are searched only when asked
    # for: without their plans (dearcomm.usbyte, dearcomm.deft) usbyte is
    # bytescheduler with one block in flight and deft is wfbp.
    names = list(schedules) if schedules is not None else ["dear"] + [n for n in registry
                                                                      if n != "dear" and n not in PLANNED_SCHEDULES]
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"dearcomm: plan() got unknown schedule(s) {unknown}; known: {sorted(registry)}")
    if updates is not None and not any(u in registry[n]["updates"] for n in names for u in updates):
        raise ValueError(f"dearcomm: no schedule among {names} has an update in {list(updates)}")
    with_credit = [n for n in registry if registry[n]["default_credit_bytes"] > 0]
    if credit_given and any(c is not None for c in credit_mb) and not any(n in with_credit for n in names):
        raise ValueError(f"dearcomm: plan()'s credit_mb {list(credit_mb)} applies to {with_credit}, none of which is "
                         f"searched ({names}); leave credit_mb out or add one of them to schedules")
    grid = []
    for name in names:
        entry = registry[name]
        ordered = [entry["default_update"]] + [u for u in entry["updates"] if u != entry["default_update"]]
        credits = credit_mb if entry["default_credit_bytes"] > 0 else (None,)
        for update in (u for u in ordered if updates is None or u in updates):
            for bucket in bucket_mb:
                for partition in (partition_mb if name not in PLANNED_SCHEDULES else (None,)):  # a plan sets the pieces
                    for credit in credits:
                        grid.append(dict(schedule=name, update=update, bucket_mb=bucket, partition_mb=partition,
                                         credit_mb=credit))
    return grid


def plan(profile, *, world_size: int, network: Network, schedules: Optional[Sequence[str]] = None,
         updates: Optional[Sequence[str]] = None, bucket_mb: Sequence[float] = BUCKET_MB, partition_mb: Sequence[Optional[float]] = PARTITION_MB,
         credit_mb: Optional[Sequence[Optional[float]]] = None, step_ms: Optional[float] = None,
         iterations: int = 3) -> Plan:
    """Simulates every candidate (see the module's docstring), one per
    distinct bucket layout of a schedule, update and credit, and returns the
    fastest with its prediction and the default's. ``profile``,
    ``network``, ``step_ms`` and ``iterations`` as in dearcomm.simulate;
    ``schedules`` and ``updates`` restrict the search (default: every
    registered schedule with each of its updates); ``credit_mb``: the
    credits tried where a schedule has one (default CREDIT_MB)."""
    credit_given, credit_mb = credit_mb is not None, CREDIT_MB if credit_mb is None else credit_mb
    for name, values in (("bucket_mb", bucket_mb), ("partition_mb", partition_mb), ("credit_mb", credit_mb)):
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"dearcomm: plan()'s {name} must be a non-empty list of sizes, got {values!r}")
    check_network(network)
    run = dict(world_size=world_size, network=network, step_ms=step_ms, iterations=iterations)
    seen: Dict[Tuple, Candidate] = {}
    layouts = set()
    modules = profile.for_simulation() if isinstance(profile, TrainingProfile) else profile  # once, for the layouts
    for options in _grid(schedules, updates, bucket_mb, partition_mb, credit_mb, credit_given):
        key = tuple(options[k] for k in _OPTION_ORDER)
        # Sizes that lay out the same buckets train alike: the first in grid
        # order stands for them (GPT: 24 bucket x partition sizes, 7 layouts),
        # so no trial of auto measures one layout twice.
        layout = (options["schedule"], options["update"], options["credit_mb"],
                  bucket_layout(modules, world_size=world_size, **options).describe())
        if layout not in layouts:
            layouts.add(layout)
            seen[key] = _candidate(options, simulate(profile, **options, **run))
    defaults = dict(DEFAULT_OPTIONS)
    default = seen.get(tuple(defaults[k] for k in _OPTION_ORDER))  # the grid's first entry when dear is searched
    if default is None:
        default = _candidate(defaults, simulate(profile, **defaults, **run))
    # stable: ties keep grid order
    ordered = sorted(seen.values(), key=lambda c: (c.predicted_ms, c.timeline_ms or c.predicted_ms))
    return Plan(best=ordered[0], default=default, candidates=ordered)
