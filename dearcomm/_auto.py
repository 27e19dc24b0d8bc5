"""wrap()'s "auto" options: schedule, bucket_mb, partition_mb and credit_mb
chosen for this job by simulation, at the start of training and again when
the measured iterations drift from the prediction.

At the first training forward, before any gradient is communicated:
  1. every rank times the collectives on the training group (network_probe:
     about a second on 1 Gbit/s) and the ranks profile their compute on the
     batches they were given, in step as they train (profiler.profile_calls
     with the training group: a few forward+backward+step iterations of the
     plain model, its state restored, each iteration the slowest rank's; the
     loss is the model's ``.loss`` or the sum of its outputs: backward costs
     the same whatever the loss);
     on a CPU it also measures how much compute and collectives slow each
     other on its shared cores (contention.measure_contention: forward and
     backward beside all-reduces of up to 64 MiB, a few seconds at 1 Gbit/s);
  2. rank 0 simulates every candidate the "auto" options leave open
     (autotune.plan) on that profile and the probed network, and
     broadcasts a shortlist: the best predicted candidate of each schedule
     and update (MAX_TRIALS at most), the reference and wrap()'s default
     (below), and each family's runners-up;
  3. training goes on with each shortlisted candidate in turn for one step
     that rebuilds the buckets (WARMUP steps for the first: the job's first
     steps run slow; the first delays nothing, so a loop of several
     backwards a step is seen before deft's delays would refuse it) and TRIAL_STEPS measured ones (the optimizer
     state moving along, DearRuntime.reconfigure); then the first once
     more, 1 + TRIAL_STEPS steps as the others, and that trial counts; then with the
     REFINE_TRIALS runners-up of the REFINE_FAMILIES families that measured
     fastest, of any other within REFINE_WITHIN of the fastest and of any
     whose trial measured REFINE_MISPRICED slower than predicted than the
     others' did (a family's runners-up differ from its best in partition size
     first: the simulator errs more on how finely to cut than on bucket
     sizes). The shortlist always holds the reference, DDP's layout (wfbp,
     25 MiB buckets, no partitions; for options the user fixed, those),
     and wrap()'s default for the "auto" options (what the job would train
     with without them: on loopback the simulator priced dear-sharded with
     partitions ahead of it, and in 6 of 6 runs of the MLP the default, never
     measured, beat what auto kept by 4-10%):
     the CONFIRM_CONTENDERS fastest measured candidates, and wrap()'s
     default where the simulation prices it within CONFIRM_DEFAULT_WITHIN
     of the fastest, and the reference
     are measured once more, in turn, in rounds; a contender
     beats the reference if its median ratio to it is below
     1 - CONFIRM_MARGIN, or below 1 where its prediction is below the
     reference's by CONFIRM_MARGIN (its threshold). After CONFIRM_ROUNDS
     rounds, a contender whose median ratio lies within CONFIRM_CERTAINTY
     standard errors of its threshold is measured in further rounds (up to
     CONFIRM_MAX_ROUNDS); of those that beat the reference, the one
     predicted fastest among those within CONFIRM_MARGIN of the lowest ratio
     replaces it.
     Rank 0's medians decide, so every rank trains with the same plan,
     whatever its own timings. A prediction is off by 2-6% here
     (median per row, most often short), up to 13%; a few measured steps separate
     candidates the simulator ranks too close, and the confirmation keeps a
     candidate that was merely lucky in its trial (on a compute-bound job
     every candidate is within noise of the others) from replacing a plan
     as fast as DDP;
  4. the plan and the choice are logged (logger "dearcomm", INFO, rank 0)
     and kept in ``model.auto_plan()``.
Then, after WARMUP more steps, every WINDOW steps rank 0 compares the
median measured iteration with what the chosen candidate measured; off by
more than DRIFT, all ranks measure and plan again at the next forward (at
most MAX_REPLANS times).
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import autotune, deft
from ._options import SCHEDULES, WrapOptions
from .contention import NotFitted, measure_contention, with_contention
from ._lockstep import PeerFailed
from .prediction import KINDS, Network, bucket_layout
from .network_probe import NetworkNotFitted, probe_network
from .profiler import TrainingProfile, profile_calls
from .usbyte import plan_job
from ._rank0 import rank0s
from ._runtime import _weak_hook

logger = logging.getLogger("dearcomm")

AUTO = "auto"
AUTO_OPTIONS = ("schedule", "bucket_mb", "partition_mb", "credit_mb")
"""wrap()'s options that take "auto"."""

DRIFT = 0.25
"""Re-plan when the median measured iteration is this fraction off the
chosen candidate's measured time (its trials', or with a single candidate
its first window's)."""
WINDOW = 20
"""Steps per drift check (their median is compared)."""
WARMUP = 5
"""Steps after a plan before its iterations are measured (allocators, caches)."""
MAX_REPLANS = 2
MAX_TRIALS = 6
"""Candidates measured first: the best predicted of each schedule and update
(six families: dear sharded and replicated, wfbp, bytescheduler, usbyte,
deft; with four, GPT's best family, wfbp with partitions, was never measured),
and the reference and wrap()'s default where they are not among them."""
REFINE_TRIALS = 2
"""Then the next best predicted candidates of each of the REFINE_FAMILIES
families that measured fastest."""
REFINE_FAMILIES = 2
REFINE_WITHIN = 0.05
"""...and of every other family whose best measured within this fraction of
the fastest: trials of TRIAL_STEPS steps differ by a few percent from noise
alone (widein at 4 ranks: dear sharded 437 ms against wfbp's 427 in their
trials, 411 against 455 timed over more steps), so such a family is not
known to be slower."""
REFINE_MISPRICED = 0.10
"""...and of every family whose trial measured this fraction slower, against
its prediction, than the median family's did: the simulator priced that
family's best wrongly, so it may have ranked the family's other layouts
wrongly too (GPT at 4 ranks: dear sharded's trial, 1 MiB buckets, measured
1.09x its prediction against 0.84-0.96x for the other families; its 4 MiB
partitions, never measured, were the fastest fixed run, 1.17x DDP against
auto's 1.09x)."""
REFINE_MAX_FAMILIES = 3
"""At most this many families refined (the fastest first, then the
mispriced): on a compute-bound job every family measures within noise of
the others."""
TRIAL_STEPS = 3
"""Steps measured per candidate, after one that rebuilds its buckets."""
CONFIRM_CONTENDERS = 2
"""How many of the fastest measured candidates (the reference apart) are
measured again against it: with one, a candidate lucky in its trial took the
only place, failed its confirmation, and a better one 9% behind it in the
trials was never confirmed (widein at 4 ranks: usbyte's 421 ms trial, then
DDP's layout kept; dear-sharded/p4's trial 461 ms, 1.14x DDP over 8 rounds)."""
CONFIRM_DEFAULT_WITHIN = 0.05
"""wrap()'s default is confirmed against the reference whatever its trial
measured when the simulation prices it within this fraction of the fastest
shortlisted candidate: it cannot tell the two apart, and one trial of a few
steps is too noisy to drop it (the MLP on loopback: the default's one
trial 492 ms, 1.30x its median over 8 rounds fixed; in 8 of 56 stored auto
runs the default, measured once and not confirmed, took 3-9% less time
fixed than what auto kept, 7 of them with the default priced within 5%)."""
CONFIRM_ROUNDS = 3
"""Times the contenders and the reference are measured again, in turn, at
least (three: the median of the rounds is not moved by one outlier)."""
CONFIRM_MAX_ROUNDS = 9
CONFIRM_CERTAINTY = 2.0
"""A contender is measured in further rounds, CONFIRM_MAX_ROUNDS in all at
most, while its median ratio to the reference lies within this many
standard errors of its threshold: one round's ratio varies by 7.5-8%
here on loopback (robust spread over 535 stored rounds, against the fixed
runs' ratio; 5% at 1 Gbit/s), so three rounds tell a contender 7% faster
than the reference from one as fast as it in about 4 of 5 runs. Drawn
from those rounds' errors, measuring on while undecided raises that to
more than 9 of 10, and takes a contender as fast as the reference for
faster in 17% of runs instead of 28%, at 7 rounds on average where it is close
(benchmarks/confirmation_rounds.py; the errors drawn include the fixed
runs' own, so the real rounds vary less)."""
CONFIRM_MARGIN = 0.03
"""How much faster than the reference a contender must be, by the median
over the confirmation rounds of its time ÷ the reference's, to replace it:
less is within this machine's noise between trials. A contender predicted
faster by the margin needs only to measure faster: widein at batch 1024
kept DDP's layout twice in one row with dear-sharded/p4 predicted 0.91x its
time and measured 0.987x and 0.976x of it in the confirmations (three rounds
of three steps); over 8 rounds dear-sharded/p4 took 0.92x DDP's time. Of
47 stored auto runs this changed 3 choices, each to a faster fixed run."""
REFERENCE = dict(schedule="wfbp", bucket_mb=25.0, partition_mb=None, credit_mb=None)
"""The reference candidate's values of the "auto" options: DDP's layout
(where the user's fixed options rule wfbp out, wrap()'s default is the
reference)."""
PROFILE_ITERATIONS, PROFILE_WARMUP = 6, 2
"""Iterations profiled at the first forward (after the warm-up ones), and
iterations timed beside collectives for the contention factors. With 3 (and
1 warm-up), widein at 4 ranks read backward 51.8 ms and κ 1.98 where 8 rounds
read 63.6 ms and 1.35, priced dear with small partitions 20% fast, and the
best family (dear-sharded/p4, 1.14x DDP) was left out of the trials; with 6
it was chosen (1.11x DDP, 1.036x the best's time; one run)."""
CONTENTION_BYTES = 64 * 2**20
"""All-reduce size for the contention measurement (or the model's size, if smaller)."""


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """What "auto" chose, and from what (rank 0's measurements)."""
    options: Dict[str, Any]
    """The choice: the wrap() options trained with once the trials are over
    (``decided``); while they run, the predicted best (each trial trains
    with its own candidate of ``shortlist``)."""
    predicted_ms: float
    default_ms: float
    """wrap()'s default for the "auto" options (dear, 25 MiB buckets, no
    partitions; the options the user fixed as given) on the same prediction."""
    candidates: int
    step: int
    """Optimizer steps taken before this plan (0: planned at the start)."""
    reason: str
    network: Network
    """α–β of the probed collectives, fitted, and on a CPU the contention
    factors (rank 0's measurements)."""
    profile: TrainingProfile
    planning_s: float = 0.0
    """Rank 0's wall time for probing, profiling and simulating."""
    shortlist: Tuple[Tuple[Dict[str, Any], float], ...] = ()
    """The candidates measured on the running job, with their predictions (ms)."""
    runners_up: Tuple[Tuple[Dict[str, Any], float], ...] = ()
    """Per family (schedule, update), its next best predicted candidates: the
    refinement measures REFINE_TRIALS of each of the fastest families'
    (REFINE_FAMILIES, then the mispriced, then others within REFINE_WITHIN,
    REFINE_MAX_FAMILIES at most)."""
    refined: bool = False
    measured_ms: Tuple[float, ...] = ()
    """Rank 0's median iteration of each shortlisted candidate, as far as
    measured (the first candidate's from its second trial, once taken)."""
    first_trial_ms: Optional[float] = None
    """The first candidate's first trial, once it was measured again after
    the others (see ``first_again_due``); kept for the log only."""
    reference: Optional[int] = None
    """The shortlist's index of the reference candidate (see the module's docstring)."""
    default: Optional[int] = None
    """The shortlist's index of wrap()'s default for the "auto" options."""
    confirmations: Tuple[Tuple[int, float], ...] = ()
    """(shortlist index, rank 0's median iteration) of the confirmation round, as far as measured."""

    @property
    def decided(self) -> bool:
        """Every shortlisted candidate measured, refinement and confirmation
        included (or only one to train with)."""
        if len(self.shortlist) + len(self.runners_up) <= 1:
            return True
        return self.refined and self.next_trial() is None

    @property
    def first_again_due(self) -> bool:
        """Whether the first candidate is measured again now: every candidate
        of the first round measured, it once. Its first trial follows the
        job's first steps and WARMUP untimed ones, every other trial one step
        after a switch; measured once more as the others are, that trial
        counts."""
        return (not self.refined and self.first_trial_ms is None and len(self.shortlist) > 1
                and len(self.measured_ms) == len(self.shortlist))

    def fastest_measured(self) -> int:
        """The shortlist's index of the fastest measured candidate (ties: the earlier)."""
        return min(range(len(self.measured_ms)), key=lambda i: self.measured_ms[i])

    def contenders(self) -> Tuple[int, ...]:
        """The shortlist's indices of the candidates measured again against the
        reference: the CONFIRM_CONTENDERS fastest measured but it, fastest
        first (none where it measured fastest), then wrap()'s default where
        it is not among them and predicted within CONFIRM_DEFAULT_WITHIN of
        the fastest; none if there is no reference."""
        if self.reference is None:
            return ()
        fastest: Tuple[int, ...] = ()
        if self.fastest_measured() != self.reference:
            order = sorted(range(len(self.measured_ms)), key=lambda i: (self.measured_ms[i], i))
            fastest = tuple(i for i in order if i != self.reference)[:CONFIRM_CONTENDERS]
        default = self.default
        if default is None or default == self.reference or default in fastest:
            return fastest
        best_predicted = min(predicted for _, predicted in self.shortlist)
        if self.shortlist[default][1] <= best_predicted * (1 + CONFIRM_DEFAULT_WITHIN):
            return fastest + (default,)
        return fastest

    def _rounds(self) -> Tuple[List[Dict[int, float]], Dict[int, float]]:
        """The confirmations as rounds, {shortlist index: ms}: the complete
        ones (each ends with the reference's) and the one under way."""
        complete: List[Dict[int, float]] = []
        current: Dict[int, float] = {}
        for index, ms in self.confirmations:
            current[index] = ms
            if index == self.reference:
                complete.append(current)
                current = {}
        return complete, current

    def confirmed_ratios(self) -> Dict[int, List[float]]:
        """Per contender, its time over the reference's in each complete
        round that measured it (the two measured back to back)."""
        ratios: Dict[int, List[float]] = {c: [] for c in self.contenders()}
        for measured in self._rounds()[0]:
            for c, ms in measured.items():
                if c != self.reference:
                    ratios[c].append(ms / measured[self.reference])
        return ratios

    def threshold(self, contender: int) -> float:
        """The median ratio to the reference below which ``contender`` beats
        it: 1 - CONFIRM_MARGIN, or 1 where predicted faster by the margin.
        The simulation, which no noise moves, sizes the gain where the few
        measured steps only confirm its direction."""
        predicted = self.shortlist[contender][1] / self.shortlist[self.reference][1]
        return 1.0 if predicted < 1 - CONFIRM_MARGIN else 1 - CONFIRM_MARGIN

    def _undecided(self, contender: int, ratios: List[float]) -> bool:
        """Whether ``contender`` is measured in another round (see CONFIRM_CERTAINTY)."""
        n = len(ratios)
        if n >= CONFIRM_MAX_ROUNDS:
            return False
        if n < CONFIRM_ROUNDS:
            return True
        if n < 2:
            return False  # one round (CONFIRM_ROUNDS 1): no spread to weigh it by
        # The median's standard error, about 1.25 times the mean's.
        error = 1.2533 * statistics.stdev(ratios) / n ** 0.5
        return abs(statistics.median(ratios) - self.threshold(contender)) <= CONFIRM_CERTAINTY * error

    def next_round(self) -> Tuple[int, ...]:
        """What the confirmation round under way (or the next) measures, in
        order: the contenders still undecided, then the reference; () when
        none is (once the shortlist is measured)."""
        ratios = self.confirmed_ratios()
        undecided = tuple(c for c in self.contenders() if self._undecided(c, ratios[c]))
        return (*undecided, self.reference) if undecided else ()

    def next_trial(self) -> Optional[int]:
        """The shortlist's index of the candidate to measure next; None when the choice is made."""
        if len(self.measured_ms) < len(self.shortlist):
            return len(self.measured_ms)
        if self.first_again_due:
            return 0
        queue, under_way = self.next_round(), self._rounds()[1]
        return queue[len(under_way)] if queue else None

    def with_trial(self, measured: float) -> "AutoPlan":
        """This plan with what the trial of ``next_trial()`` measured (rank
        0's median); once the first round is measured, refined."""
        if len(self.measured_ms) < len(self.shortlist):
            plan = dataclasses.replace(self, measured_ms=self.measured_ms + (measured,))
        elif self.first_again_due:
            plan = dataclasses.replace(self, first_trial_ms=self.measured_ms[0],
                                       measured_ms=(measured,) + self.measured_ms[1:])
        else:
            plan = dataclasses.replace(self, confirmations=self.confirmations + ((self.next_trial(), measured),))
        if len(plan.measured_ms) == len(plan.shortlist) and not plan.refined and not plan.first_again_due:
            plan = _refined(plan)
        return plan

    def choice(self) -> Tuple[int, float]:
        """(shortlist index, what it measured) of the candidate to train with:
        the fastest measured, or after a confirmation a contender that beat
        the reference (by CONFIRM_MARGIN, as measured or as predicted): of
        those within CONFIRM_MARGIN of the one that beat it by most, the one
        predicted fastest; else the reference."""
        contenders = self.contenders()
        if not contenders:
            best = self.fastest_measured()
            return best, self.measured_ms[best]
        again = {i: [ms for j, ms in self.confirmations if j == i] for i in (*contenders, self.reference)}
        # Paired: each round's measurements ran back to back; the median of
        # the rounds' ratios is not moved by one round's outlier.
        ratio = {c: statistics.median(r) for c, r in self.confirmed_ratios().items()}
        beating = [c for c in contenders if ratio[c] < self.threshold(c)]
        if not beating:
            return self.reference, statistics.median(again[self.reference])
        # Of those that beat it, any within the margin of the lowest ratio
        # measured alike: the one predicted faster (widein at 4 ranks: 4 MiB
        # partitions predicted 430 ms, 1 MiB 456, confirmed at 0.874 and 0.871
        # the reference's time; fixed, the 1 MiB run took 1.036x the 4 MiB one's).
        lowest = min(ratio[c] for c in beating)
        kept = min((c for c in beating if ratio[c] <= lowest + CONFIRM_MARGIN),
                   key=lambda c: (self.shortlist[c][1], ratio[c]))
        return kept, statistics.median(again[kept])

    @property
    def gain_over_default(self) -> float:
        return self.default_ms / self.predicted_ms

    def describe(self) -> str:
        """The chosen options, as wrap()'s keyword arguments."""
        return _describe(self.options)

    def _label(self, i: int) -> str:
        """"(reference) " / "(default) " before shortlist entry i, where it is one."""
        labels = [name for name, index in (("reference", self.reference), ("default", self.default)) if index == i]
        return f"({', '.join(labels)}) " if labels else ""

    def __str__(self) -> str:
        trials = ""
        if self.measured_ms:
            trials = "; measured " + ", ".join(f"{self._label(i)}{_describe(o)} {m:.2f} ms (predicted {p:.2f})"
                                               for i, ((o, p), m) in enumerate(zip(self.shortlist, self.measured_ms)))
        if self.first_trial_ms is not None:
            trials += f"; the first candidate's first trial {self.first_trial_ms:.2f} ms (measured again after the others)"
        if self.confirmations:
            trials += "; measured again against the reference: " + ", ".join(
                f"{'reference' if i == self.reference else _describe(self.shortlist[i][0])} {m:.2f} ms"
                for i, m in self.confirmations)
        # Before its trials the line names the predicted best and what is measured next; after, the choice.
        verb = "chose" if self.decided else "measures its shortlist on the job, predicted best"
        return (f"dearcomm auto ({self.reason}): {verb} {self.describe()} -> {self.predicted_ms:.2f} ms per iteration "
                f"predicted, {self.gain_over_default:.3f}x wrap()'s default ({self.default_ms:.2f} ms); "
                f"{self.candidates} candidates simulated in {self.planning_s:.1f} s on the ranks' profile (forward "
                f"{self.profile.forward_ms:.1f} ms, backward {self.profile.backward_ms:.1f} ms, step "
                f"{self.profile.step_ms:.1f} ms) and probed network "
                f"(all-reduce: {self.network.alpha_us:.0f} us, {self.network.gbit_s:.2f} Gbit/s; compute "
                f"{self.network.compute_slowdown:.2f}x slower beside collectives, collectives "
                f"{self.network.comm_slowdown:.2f}x slower beside compute; each collective costs compute "
                + "/".join(f"{self.network.host_ms.get(k, 0.0):.2f}" for k in KINDS)
                + " ms (reduce-scatter/all-gather/all-reduce), and the host CPU "
                + "/".join(f"{self.network.host_ms_per_mib.get(k, 0.0):.3f}" for k in KINDS)
                + " ms per MiB more, a bound on the iteration: their CPU "
                + f"{self.network.bound_comm_cpu_slowdown:.2f}x, the compute's "
                + f"{self.network.compute_cpu_slowdown:.2f}x beside each other, "
                + (f"{self.network.cores_share:g} ranks per core taking turns" if self.network.cores_share > 1 else
                   f"the slowest rank's with the compute varying {self.network.iteration_cv:.1%}") + ")" + trials)


def _describe(options: Dict[str, Any]) -> str:
    planned = {"blocks": "parameters in blocks", "priorities": "parameters ranked",
               "delays": "parameters delayed"}  # a planner's: counted
    return " ".join(f"{k}=<{len(v)} {planned[k]}>" if k in planned else f"{k}={v}"
                    for k, v in options.items() if v is not None)


def split_auto(values: Dict[str, Any], blocks) -> Tuple[Dict[str, Any], Tuple[str, ...]]:
    """wrap()'s values of (some of) AUTO_OPTIONS -> (the values to start
    with, the names that are "auto"). An "auto" starts at wrap()'s default."""
    defaults = {f.name: f.default for f in dataclasses.fields(WrapOptions) if f.name in AUTO_OPTIONS}
    start, auto = {}, []
    for name, value in values.items():
        if isinstance(value, str) and value == AUTO:
            auto.append(name)
            start[name] = defaults[name]
        else:
            start[name] = value
    if auto and blocks:
        raise ValueError(f"dearcomm: {'/'.join(auto)}='auto' cannot be combined with blocks: blocks fix the layout, "
                         "which the planner's simulation does not know")
    if auto and start.get("schedule") == "usbyte":
        raise ValueError(f"dearcomm: schedule='usbyte' plans its own blocks and order at the first training "
                         f"forward; {'/'.join(auto)}='auto' does not apply to it")
    if auto and start.get("schedule") == "deft":
        raise ValueError(f"dearcomm: schedule='deft' plans its own delays at the first training forward; "
                         f"{'/'.join(auto)}='auto' does not apply to it (schedule='auto' with max_delay= "
                         f"considers deft beside the others)")
    schedule = start.get("schedule", defaults["schedule"])
    if "credit_mb" in auto and "schedule" not in auto and schedule in SCHEDULES and schedule != "bytescheduler":
        raise ValueError(f"dearcomm: schedule={schedule!r} has no credit; credit_mb='auto' applies to "
                         "schedule='bytescheduler' (or schedule='auto', which may pick it)")
    if "schedule" in auto and start.get("credit_mb") is not None:
        raise ValueError("dearcomm: credit_mb is bytescheduler's option; with schedule='auto' leave it None or "
                         "'auto' (the planner sets it where it picks bytescheduler)")
    return start, tuple(auto)


class AutoPlanner:
    """The runtime's "auto" part (see the module's docstring)."""

    def __init__(self, runtime, module: nn.Module, optimizer: torch.optim.Optimizer, auto: Tuple[str, ...],
                 update_given: bool, max_delay: Optional[int] = None) -> None:
        self.runtime = runtime
        # wrap(schedule="auto", max_delay=d): deft with delays up to d is a candidate (0 once its guard fired).
        self.max_delay = max_delay or 0
        # Whether deft's delays are ever planned, fixed at wrap() (max_delay
        # drops to 0 once deft's guard fires): a re-plan from a deft plan must
        # still clear its delays.
        self._delays_planned = self.max_delay > 0
        self.optimizer = optimizer  # the user's: profiling times its full step
        self.auto = auto
        self.update_free = "schedule" in auto and not update_given  # the planner picks the update too
        self.plans: List[AutoPlan] = []
        self._plan_due = True
        self._expected_ms: Optional[float] = None  # what measured iterations are compared with
        self._baseline_due = False  # the next window's median becomes _expected_ms
        self._replan_reason = ""
        self._steps = 0
        self._measure_from = WARMUP
        self._last_step_end: Optional[float] = None
        self._iteration_ms: List[float] = []
        self._switch_to: Optional[Dict[str, Any]] = None  # options to train with from the next forward
        self._trying = False  # measuring the last plan's shortlist
        self.handle = module.register_forward_pre_hook(_weak_hook(self._before_forward), with_kwargs=True, prepend=True)

    @property
    def settled(self) -> bool:
        """Training with its choice: no plan due, no candidate on trial, no switch pending."""
        return not (self._plan_due or self._trying or self._switch_to is not None)

    # ---- hooks ------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args, kwargs) -> None:
        if self.runtime.planning or not (module.training and torch.is_grad_enabled()):
            return
        if self._switch_to is not None:
            self._train_with(self._switch_to)
            self._switch_to = None
        if self._plan_due:
            self._plan_due = False
            self._plan(module, args, kwargs)

    def _plan(self, module: nn.Module, args, kwargs) -> None:
        reason = "first training forward" if not self.plans else self._replan_reason
        runtime = self.runtime
        current = _describe({name: getattr(runtime.options, name) for name in self.auto})
        if runtime.world_size == 1:  # nothing to communicate: every layout trains alike
            if runtime.rank == 0:
                logger.info("dearcomm: auto: one rank, nothing to communicate; training with %s", current)
            return
        started = time.perf_counter()
        try:
            profile, network = measure_job(runtime, module, self.optimizer, args, kwargs)
        except NetworkNotFitted as e:  # on every rank alike; the model's own failures raise (ProfilingFailed)
            if runtime.rank == 0:
                logger.warning("dearcomm: auto could not measure the network at its %s (%s); training on with %s, "
                               "without planning again", reason, e, current)
            self._expected_ms, self._baseline_due = None, False  # no drift check: nothing to plan with
            return
        plan = self._plan_on_rank0(profile, network, reason, started)
        self.plans.append(plan)
        if self.runtime.rank == 0:
            logger.info("%s", plan)
        self._train_with(plan.shortlist[0][0])
        self._trying = not plan.decided
        # One candidate, nothing measured: its first window is what later ones
        # are compared with. Compared with the prediction instead, a model the
        # simulator prices 2x off re-planned (probe, profile) to the same
        # choice at every window up to MAX_REPLANS.
        self._expected_ms = None
        self._baseline_due = plan.decided
        # WARMUP steps before the first trial too: a job's first steps run
        # slow (the optimizer's state allocated, memory settling). With one,
        # the first candidate (then the predicted best) measured slowest against its
        # prediction of all candidates in 15 of 25 rows (GPT at 4 ranks: dear
        # with 1 MiB buckets 900 ms in its trial, 787 ms fixed in the same row).
        # With them it read faster than its second trial on 7 of 9 rows, so
        # the trial that counts is a second one, taken as every other
        # candidate's is (AutoPlan.first_again_due).
        self._start_measuring(skip=WARMUP)

    def forbid_delays(self) -> None:
        """deft's guard fired: no candidate trains with delays from now on."""
        self.max_delay = 0

    def keep(self) -> None:
        """A checkpoint's deft plan was loaded: train with it, plan no more."""
        self._plan_due = self._trying = self._baseline_due = False
        self._switch_to = None
        self._expected_ms = None  # nothing measured to compare with: no drift check

    def _as_trained(self, options: Dict[str, Any]) -> Dict[str, Any]:
        """``options`` as training takes them: once delays are forbidden, deft on time (as wfbp)."""
        if not self.max_delay and options.get("delays"):
            return dict(options, delays={}, max_delay=0)
        return options

    def _train_with(self, options: Dict[str, Any]) -> None:
        options = self._as_trained(options)
        current = {name: getattr(self.runtime.options, name) for name in options}
        if options != current:
            self.runtime.reconfigure(dataclasses.replace(self.runtime.options, **options))

    def _start_measuring(self, skip: int) -> None:
        """Iterations are measured from the (skip+1)-th step on: the first
        after a change of options rebuilds the buckets and moves the state."""
        self._measure_from = self._steps + skip
        self._iteration_ms.clear()

    def step_ended(self) -> None:
        """After every optimizer.step(): the iteration's time; at the end of a
        trial the next candidate, at the end of a window the drift check
        (a broadcast from rank 0, on every rank, at the same step)."""
        now = time.perf_counter()
        self._steps += 1
        if self._last_step_end is not None and self._steps > self._measure_from:
            self._iteration_ms.append((now - self._last_step_end) * 1e3)
        self._last_step_end = now
        if self._trying:
            if len(self._iteration_ms) >= TRIAL_STEPS:
                self._trial_ended(self._agreed_median())
            return
        if len(self._iteration_ms) < WINDOW or (self._expected_ms is None and not self._baseline_due):
            return
        measured = self._agreed_median()
        self._iteration_ms.clear()
        if self._baseline_due:
            self._expected_ms, self._baseline_due = measured, False
            return
        if abs(measured / self._expected_ms - 1) > DRIFT and len(self.plans) <= MAX_REPLANS:
            self._replan_reason = (f"measured {measured:.2f} ms per iteration vs {self._expected_ms:.2f} ms "
                                   f"expected at step {self._steps}")
            self._plan_due = True

    def _agreed_median(self) -> float:
        """Rank 0's median of the iterations measured: every rank decides alike."""
        return rank0s(statistics.median(self._iteration_ms), self.runtime.group, what="auto's measured iteration")

    def _trial_ended(self, measured: float) -> None:
        plan = self.plans[-1] = self.plans[-1].with_trial(measured)
        following = plan.next_trial()
        if following is not None:
            self._switch_to = plan.shortlist[following][0]
            self._start_measuring(skip=1)
            return
        chosen, chosen_ms = plan.choice()
        options, predicted = plan.shortlist[chosen]
        options = self._as_trained(options)  # what its trials trained with, and the log and auto_plan() say
        plan = self.plans[-1] = dataclasses.replace(plan, options=options, predicted_ms=predicted)
        if self.runtime.rank == 0:
            logger.info("%s", plan)
        self._switch_to = options
        self._trying = False
        self._expected_ms = chosen_ms  # the drift check compares with what was measured
        self._start_measuring(skip=WARMUP)

    # ---- measuring and planning ------------------------------------------------------

    def _planned_schedule_open(self) -> bool:
        """Whether a schedule that plans its own pieces (usbyte, deft: update
        "replicated" only, no partitions) may be chosen at all."""
        options = self.runtime.options
        return ("schedule" in self.auto and (self.update_free or options.update == "replicated")
                and ("partition_mb" in self.auto or options.partition_mb is None))

    def _usbyte_open(self) -> bool:
        """Whether usbyte is a candidate: it sets its own buckets, blocks and
        order, so only where the bucket size is "auto" too and no other
        option rules it out. (Not the current options' blocks and priorities:
        wrap() refuses them beside "auto", so they are a usbyte plan's, which
        a re-plan may leave.)"""
        return self._planned_schedule_open() and "bucket_mb" in self.auto

    def _deft_open(self) -> bool:
        """Whether deft is a candidate: only where the user allowed delays
        (they change what training computes)."""
        return self._planned_schedule_open() and self.max_delay > 0

    def _plan_on_rank0(self, profile: TrainingProfile, network: Network, reason: str, started: float) -> AutoPlan:
        runtime = self.runtime
        chosen = None
        if runtime.rank == 0:
            options = runtime.options
            fixed = lambda name, grid: grid if name in self.auto else (getattr(options, name),)  # noqa: E731
            result = autotune.plan(
                profile, world_size=runtime.world_size, network=network,
                schedules=None if "schedule" in self.auto else [options.schedule],
                updates=None if self.update_free else [options.update],
                bucket_mb=fixed("bucket_mb", autotune.BUCKET_MB),
                partition_mb=fixed("partition_mb", autotune.PARTITION_MB),
                credit_mb=fixed("credit_mb", autotune.CREDIT_MB))
            keys = self.auto + (("update",) if self.update_free else ())
            if self._usbyte_open():
                result = _with_usbyte(result, profile, network, runtime)
                keys += ("blocks", "priorities")  # None for every other candidate: switching clears them
            if self._deft_open():
                result = _with_deft(result, profile, network, runtime, fixed("bucket_mb", autotune.BUCKET_MB),
                                    self.max_delay)
            if self._planned_schedule_open() and self._delays_planned:  # after deft's guard too: it clears them
                keys += ("delays", "max_delay")
            first, runners_up, reference, default = _first_round(result, self.auto, self.update_free)
            # The default for these options (the user's fixed ones as given), else the planner's dear default.
            default_ms = result.default.predicted_ms if default is None else first[default].predicted_ms
            shortlist = tuple(({k: c.options.get(k) for k in keys}, c.predicted_ms) for c in first)
            runners_up = tuple(({k: c.options.get(k) for k in keys}, c.predicted_ms) for c in runners_up)
            best = min(shortlist, key=lambda entry: entry[1])  # not always the first trial's (_first_round)
            chosen = AutoPlan(options=best[0], shortlist=shortlist, runners_up=runners_up,
                              reference=reference, default=default,
                              predicted_ms=result.predicted_ms, default_ms=default_ms,
                              candidates=len(result.candidates), step=self._steps, reason=reason,
                              network=network, profile=profile, planning_s=time.perf_counter() - started)
        return rank0s(chosen, runtime.group, what="auto's plan")


class ProfilingFailed(ValueError):
    """Some rank could not profile the job (raised on every rank alike)."""


def measure_job(runtime, module: nn.Module, optimizer: torch.optim.Optimizer, args,
                kwargs) -> Tuple[TrainingProfile, Network]:
    """What a planner at the first training forward plans from: the network
    probed on the training group (α–β fitted to rank 0's times), the ranks'
    profile on the plain model (in step, each iteration the slowest rank's),
    and on a CPU how much compute and collectives slow each other (they
    share its cores). The hooks stand aside; gradients
    and buffers are put back as they were. Collectives: every rank calls it."""
    runtime.sync()  # parameters current before they are profiled
    network = probe_network(runtime.group, next(module.parameters()).device).network  # may raise NetworkNotFitted
    grads = {p: p.grad for p in module.parameters()}  # profiling must not touch accumulated gradients
    # Nor buffers: BatchNorm's running statistics and counts move in every training forward.
    buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def forward_backward() -> None:
        surrogate_loss(module(*args, **kwargs)).backward()
        module.zero_grad(set_to_none=True)

    device = next(module.parameters()).device
    runtime.planning = True
    # fork_rng: dropout and the like draw during profiling; training then
    # draws what it would have drawn without "auto".
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            try:  # every rank raises alike if one could not profile (profile_calls with a group)
                profile = profile_calls(module, lambda: surrogate_loss(module(*args, **kwargs)), optimizer,
                                        iterations=PROFILE_ITERATIONS, warmup=PROFILE_WARMUP,
                                        group=runtime.group,
                                        find_unused_parameters=runtime.options.find_unused_parameters)
            except PeerFailed as e:  # another rank failed: raise as it does
                if not e.value_errors:
                    raise
                raise ProfilingFailed(str(e)) from None
            except ValueError as e:  # e.g. a parameter without a gradient on some rank's batch
                if not str(e).startswith("dearcomm:"):
                    raise  # the model's own error: training would meet it too
                raise ProfilingFailed(str(e)) from None
            if device.type == "cpu":
                nbytes = min(CONTENTION_BYTES, sum(p.numel() * p.element_size() for p in grads))
                try:
                    measured = measure_contention(forward_backward, runtime.group, nbytes=nbytes,
                                                  iters=PROFILE_ITERATIONS)
                except NotFitted as e:  # after its collectives, so every rank is still in step
                    # A model whose collectives are too short beside its compute to time the
                    # sharing (a small model on a fast link): it hardly matters there.
                    logger.info("dearcomm: contention not measured (%s); taken as none", e)
                else:
                    network = with_contention(network, measured)
        return profile, network
    finally:
        runtime.planning = False
        for p, grad in grads.items():
            p.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _with_usbyte(result: autotune.Plan, profile: TrainingProfile, network: Network, runtime) -> autotune.Plan:
    """The simulated candidates and US-Byte's own plan for the job (its
    planner's blocks and order; dearcomm.usbyte.plan_job), fastest first."""
    job = plan_job(profile, network, runtime.world_size, comm_dtype=runtime.options.comm_dtype)
    return _with_candidates(result, [autotune.Candidate(
        dict(job.wrap_options(), schedule="usbyte", update="replicated", partition_mb=None, credit_mb=None),
        job.predicted_ms)])


def _with_deft(result: autotune.Plan, profile: TrainingProfile, network: Network, runtime,
               bucket_sizes, max_delay: int) -> autotune.Plan:
    """The simulated candidates and DeFT's plan for each bucket size
    (dearcomm.deft.plan_job: the delays that hide the most, least stale),
    fastest first."""
    added, layouts = [], set()
    for bucket_mb in bucket_sizes:
        layout = bucket_layout(profile, world_size=runtime.world_size, schedule="deft", bucket_mb=bucket_mb).describe()
        if layout in layouts:
            continue  # the same buckets, the same delays: one candidate (as autotune.plan)
        layouts.add(layout)
        job = deft.plan_job(profile, network, runtime.world_size, bucket_mb=bucket_mb,
                            comm_dtype=runtime.options.comm_dtype, max_delay=max_delay)
        added.append(autotune.Candidate(dict(job.wrap_options(), schedule="deft", update="replicated",
                                             partition_mb=None, credit_mb=None, max_delay=max_delay),
                                        job.predicted_ms))
    return _with_candidates(result, added)


def _with_candidates(result: autotune.Plan, added: List[autotune.Candidate]) -> autotune.Plan:
    """`result` with a planner's candidates among the simulated ones, fastest first."""
    candidates = sorted(list(result.candidates) + added, key=lambda c: c.predicted_ms)  # stable: ties keep order
    return dataclasses.replace(result, best=candidates[0], candidates=candidates)


def _family(options: Dict[str, Any]) -> Tuple[Any, Any]:
    """(schedule, update); None for one the planner was not free to choose."""
    return options.get("schedule"), options.get("update")


def _shortlist(result: autotune.Plan) -> Tuple[List[autotune.Candidate], List[autotune.Candidate]]:
    """What to measure first: the best predicted candidate of each schedule
    and update (the simulator's errors differ most between schedules),
    MAX_TRIALS at most, best predicted first; and each family's next
    REFINE_TRIALS best predicted (other partition sizes first), for the
    refinement, and one spare: the reference or wrap()'s default may be one of them."""
    by_family: Dict[Tuple[str, str], List[autotune.Candidate]] = {}
    for candidate in result.candidates:  # fastest predicted first
        by_family.setdefault(_family(candidate.options), []).append(candidate)
    first = [group[0] for group in by_family.values()][:MAX_TRIALS]
    runners_up = [c for group in by_family.values() for c in _other_cuts_first(group)[:REFINE_TRIALS + 1]]
    return first, runners_up


def _first_round(result: autotune.Plan, auto: Tuple[str, ...], update_free: bool
                 ) -> Tuple[List[autotune.Candidate], List[autotune.Candidate], Optional[int], Optional[int]]:
    """_shortlist's first round, with the reference and wrap()'s default
    after it where they are not in it, and the best predicted candidate
    that delays nothing first; its runners-up; the reference's and the
    default's index in the first round (None where not simulated)."""
    first, runners_up = _shortlist(result)
    default = _default(result, auto, update_free)
    # The others are the user's in every candidate: only the "auto" options tell DDP's layout.
    reference = _candidate_with(result, {k: v for k, v in REFERENCE.items() if k in auto}) or default
    anchors = (reference, default)
    for anchor in anchors:
        if anchor is not None and anchor not in first:
            first.append(anchor)
    # The first trial never delays: the job's first steps under it show
    # whether its loop takes several backwards a step, which delays refuse
    # (AutoPlanner.forbid_delays), before a candidate that delays trains.
    on_time = next((i for i, c in enumerate(first) if not c.options.get("delays")), 0)
    first.insert(0, first.pop(on_time))
    reference, default = (None if anchor is None else first.index(anchor) for anchor in anchors)
    return first, runners_up, reference, default


def _other_cuts_first(family: List[autotune.Candidate]) -> List[autotune.Candidate]:
    """A family's candidates after its best, fastest predicted first, but
    each partition size the family has not shown yet before the rest."""
    shown = {family[0].options.get("partition_mb")}
    other_cuts, rest = [], []
    for candidate in family[1:]:
        cut = candidate.options.get("partition_mb")
        (rest if cut in shown else other_cuts).append(candidate)
        shown.add(cut)
    return other_cuts + rest


def _default(result: autotune.Plan, auto: Tuple[str, ...], update_free: bool) -> Optional[autotune.Candidate]:
    """The simulated candidate with wrap()'s defaults for the options that are
    "auto" (and for the update, where the planner picks it), None if none."""
    chosen = set(auto) | ({"update"} if update_free else set())
    return _candidate_with(result, {k: v for k, v in autotune.DEFAULT_OPTIONS if k in chosen})


def _candidate_with(result: autotune.Plan, values: Dict[str, Any]) -> Optional[autotune.Candidate]:
    """The fastest predicted candidate with these values, None if none."""
    for candidate in result.candidates:  # fastest predicted first
        if all(candidate.options.get(k) == v for k, v in values.items()):
            return candidate
    return None


def _refined(plan: AutoPlan) -> AutoPlan:
    """After the first round: the runners-up of the REFINE_FAMILIES fastest
    measured families, then of those whose trial was mispriced, then of any
    other within REFINE_WITHIN of the fastest, join the shortlist
    (REFINE_MAX_FAMILIES families at most; a family with no runner-up left
    to measure, such as a planner's, is passed over)."""
    measured = [options for options, _ in plan.shortlist]  # the reference may be a runner-up too
    left: Dict[Tuple[Any, Any], List] = {}  # per family, its runners-up not measured yet
    for candidate in plan.runners_up:
        if candidate[0] not in measured:
            left.setdefault(_family(candidate[0]), []).append(candidate)
    families = []  # by their fastest measured candidate, fastest first
    for i in sorted(range(len(plan.measured_ms)), key=lambda i: plan.measured_ms[i]):
        family = _family(plan.shortlist[i][0])
        if family not in (f for f, _ in families):
            families.append((family, plan.measured_ms[i]))
    best = families[0][1] if families else 0.0
    open_ = [(f, ms) for f, ms in families if f in left]
    order = [f for f, _ in open_[:REFINE_FAMILIES]] + [f for f in _mispriced(plan) if f in left] + \
        [f for f, ms in open_[REFINE_FAMILIES:] if ms <= best * (1 + REFINE_WITHIN)]
    refined = list(dict.fromkeys(order))[:max(REFINE_FAMILIES, REFINE_MAX_FAMILIES)]
    extra = tuple(c for family in refined for c in left[family][:REFINE_TRIALS])
    return dataclasses.replace(plan, shortlist=plan.shortlist + extra, refined=True)


def _mispriced(plan: AutoPlan) -> List[Tuple[Any, Any]]:
    """The families whose trial (their first measured candidate) took more
    than 1 + REFINE_MISPRICED times the median family's measured ÷ predicted."""
    ratio: Dict[Tuple[Any, Any], float] = {}
    for (options, predicted), measured in zip(plan.shortlist, plan.measured_ms):
        if predicted > 0:
            ratio.setdefault(_family(options), measured / predicted)
    if len(ratio) < 3:
        return []  # no median to speak of
    typical = statistics.median(ratio.values())
    return [f for f, r in sorted(ratio.items(), key=lambda item: -item[1]) if r > typical * (1 + REFINE_MISPRICED)]


def surrogate_loss(output: Any) -> torch.Tensor:
    """A scalar to run backward from: the output's ``.loss`` (Hugging Face
    models), else the sum of every floating-point tensor in it. Backward's
    cost does not depend on which loss it starts from."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    tensors = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise ValueError("dearcomm: auto could not profile the model: its output holds no floating-point tensor "
                         "that requires grad (nothing to run backward from)")
    return sum(t.float().sum() for t in tensors)


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
