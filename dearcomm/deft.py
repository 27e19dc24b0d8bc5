"""DeFT's planner: which buckets schedule="deft" applies late, and by how much.

DeFT (ICDE 2025) turns scheduling into knapsack problems: the items are the
buckets in launch order, weighing their communication time; the knapsacks
are compute windows (this backward, the step and next forward, the next
backward, ...) whose capacity is the compute that can hide communication;
a bucket may go to a later window only if its update is delayed, and the
delays must stay within a staleness budget (ALGORITHMS.md).

On dearcomm's link (one communicator per job, which runs collectives in the
order they were launched) the knapsacks have few fillings: a bucket put in a
later window holds back every bucket launched after it, which then waits
for it whether delayed or not; delaying it without them hides nothing. So the
undelayed buckets are a prefix of the launch order (last layers first) and
the delayed ones its suffix (the buckets nearest the input, ready last, whose
all-reduces are the exposed tail of backward). A second iteration of delay
adds nothing on such a link either, except where every bucket is delayed:
then the link may run up to ``max_delay`` iterations behind. This planner
therefore tries every suffix, with every delay up to ``max_delay``, on the
simulated device (the engine's own deft policy and the cost model: the
capacities and weights are the simulator's), and keeps the least stale of
those within ``tolerance`` of the fastest: delayed elements x delay is the
staleness budget it spends as little of as it can.

    plan = dearcomm.deft.plan_job(profile, network, world_size=4)
    print(plan.describe())
    model, opt = dearcomm.wrap(model, opt, schedule="deft", **plan.wrap_options())
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from .prediction import ModuleProfile, Network, simulate

TOLERANCE = 0.02  # a plan within 2% of the fastest counts as fast: fewer stale elements win


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One filling of the knapsacks: the first ``delayed_buckets`` buckets
    (input side, launched last) applied ``delay`` iterations late."""
    delayed_buckets: int
    delay: int
    delayed_elements: int
    predicted_ms: float

    @property
    def staleness(self) -> int:
        return self.delayed_elements * self.delay


@dataclasses.dataclass(frozen=True)
class DeftPlan:
    names: Tuple[str, ...]
    """The profile's parameters, in order."""
    delays: Tuple[int, ...]
    """Per parameter: iterations late (0: on time)."""
    bucket_mb: float
    """The bucket size the plan was made for (its buckets share a delay)."""
    max_delay: int
    chosen: Candidate
    candidates: Tuple[Candidate, ...]
    """Every filling tried, in the order tried."""

    @property
    def predicted_ms(self) -> float:
        return self.chosen.predicted_ms

    @property
    def undelayed_ms(self) -> float:
        """The same job with no delay (deft as wfbp)."""
        return self.candidates[0].predicted_ms

    def wrap_options(self) -> Dict:
        """wrap()'s options for this plan: delays by parameter name (and the
        bucket size the delays were planned for)."""
        return {"delays": {n: d for n, d in zip(self.names, self.delays) if d}, "bucket_mb": self.bucket_mb}

    def simulate_options(self) -> Dict:
        """dearcomm.simulate()'s options for this plan (delays by position;
        simulate max_delay + 3 iterations or more to see the steady state)."""
        return {"delays": list(self.delays), "bucket_mb": self.bucket_mb, "max_delay": self.max_delay}

    def describe(self) -> str:
        if not self.chosen.delayed_buckets:
            return (f"deft plan: no delay (predicted {self.predicted_ms:.2f} ms per iteration; the best delayed "
                    f"plan was not {TOLERANCE:.0%} faster)")
        delayed = sum(1 for d in self.delays if d)
        return (f"deft plan: {delayed} of {len(self.names)} parameters ({self.chosen.delayed_buckets} buckets, "
                f"{self.chosen.delayed_elements} elements) applied {self.chosen.delay} iteration(s) late; predicted "
                f"{self.predicted_ms:.2f} ms per iteration, {self.undelayed_ms:.2f} ms without delays")


def plan_job(profile, network: Network, world_size: int, *, bucket_mb: float = 25.0, comm_dtype=None,
             max_delay: int = 1, tolerance: float = TOLERANCE) -> DeftPlan:
    """The DeFT plan for a measured job (a dearcomm.TrainingProfile)."""
    names = tuple(p.name for m in profile.modules for p in m.params)
    return plan_modules(profile.for_simulation(), network, world_size, step_ms=profile.step_ms, names=names,
                        bucket_mb=bucket_mb, comm_dtype=comm_dtype, max_delay=max_delay, tolerance=tolerance)


def plan_modules(modules: Sequence[ModuleProfile], network: Network, world_size: int, *, step_ms: float = 0.0,
                 names: Optional[Sequence[str]] = None, bucket_mb: float = 25.0, comm_dtype=None,
                 max_delay: int = 1, tolerance: float = TOLERANCE) -> DeftPlan:
    """plan_job over a list of ModuleProfile (``names``: the parameters', in
    order; default p0, p1, ...)."""
    if not tolerance >= 0:
        raise ValueError(f"dearcomm: tolerance must be >= 0, got {tolerance!r}")
    modules = list(modules)
    numels = [n for m in modules for n in m.param_numels]
    names = tuple(names) if names is not None else tuple(f"p{i}" for i in range(len(numels)))
    if len(names) != len(numels):
        raise ValueError(f"dearcomm: {len(names)} names for {len(numels)} parameters")

    def predict(delays: List[int]):  # also checks the options (max_delay included)
        return simulate(modules, world_size=world_size, network=network, schedule="deft", step_ms=step_ms,
                        bucket_mb=bucket_mb, comm_dtype=comm_dtype, max_delay=max_delay, delays=delays,
                        iterations=max_delay + 3)

    undelayed = predict([0] * len(numels))
    layout = undelayed.layout
    bucket_of = [spec.bucket for spec in layout.params]

    def suffix(k: int, delay: int) -> List[int]:
        """Per parameter: `delay` for the first k buckets (launched last), else 0."""
        return [delay if b < k else 0 for b in bucket_of]

    candidates = [Candidate(0, 0, 0, undelayed.iteration_ms)]
    for delay in range(1, max_delay + 1):
        for k in range(1, len(layout.buckets) + 1):
            delays = suffix(k, delay)
            elements = sum(n for n, d in zip(numels, delays) if d)
            candidates.append(Candidate(k, delay, elements, predict(delays).iteration_ms))
    fastest = min(c.predicted_ms for c in candidates)
    chosen = min((c for c in candidates if c.predicted_ms <= fastest * (1 + tolerance)),
                 key=lambda c: (c.staleness, c.predicted_ms))
    return DeftPlan(names, tuple(suffix(chosen.delayed_buckets, chosen.delay)), bucket_mb, max_delay, chosen,
                    tuple(candidates))
