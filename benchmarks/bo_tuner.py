"""DeAR's own tuner, the baseline wrap()'s "auto" is compared with: Bayesian
optimisation of the fusion buffer size on the running job, as DeAR's
reference implementation does it (the bayes_opt library, a Gaussian process
with its default acquisition), about 10 trials of a few iterations each.

Each trial lays the buckets out again at the suggested size
(DearRuntime.reconfigure: the next backward rebuilds them), runs one untimed
iteration and `iters` timed ones, and scores the median; rank 0's median
decides for every rank (one broadcast per trial), so all ranks try the same
sizes in the same order. The search runs over log2 of the size, 1 to 64 MiB:
the sizes that matter differ by factors, not by megabytes.

train_bench.py's "dear-bo" run tunes this way before it is timed:
    torchrun --nproc_per_node=2 benchmarks/train_bench.py --model mlp --runs ddp auto dear-bo
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, List, Tuple

from bayes_opt import BayesianOptimization

from dearcomm._rank0 import rank0s

TRIALS = 10
LOW_MB, HIGH_MB = 1.0, 64.0


@dataclasses.dataclass
class Tuned:
    bucket_mb: float
    trials: List[Tuple[float, float]]
    """(bucket_mb, median seconds per iteration) in the order tried."""
    seconds: float
    """Wall time of the whole search (every trial's iterations and rebuilds)."""


def tune_bucket_mb(measure: Callable[[float], float], trials: int = TRIALS, low_mb: float = LOW_MB,
                   high_mb: float = HIGH_MB, seed: int = 0) -> Tuned:
    """Minimises ``measure(bucket_mb)`` (seconds per iteration) over
    [low_mb, high_mb] in ``trials`` calls; returns the best size tried."""
    started = time.perf_counter()
    search = BayesianOptimization(f=None, pbounds={"log2_mb": (math.log2(low_mb), math.log2(high_mb))},
                                  random_state=seed, verbose=0, allow_duplicate_points=True)
    tried = []
    for _ in range(trials):
        point = search.suggest()
        bucket_mb = 2.0 ** float(point["log2_mb"])
        seconds = measure(bucket_mb)
        tried.append((bucket_mb, seconds))
        search.register(params=point, target=-seconds)
    best = min(tried, key=lambda t: t[1])[0]
    return Tuned(bucket_mb=best, trials=tried, seconds=time.perf_counter() - started)


def live_measure(model, run_iteration: Callable[[], None], iters: int) -> Callable[[float], float]:
    """A ``measure`` for tune_bucket_mb on a wrapped model: lays its buckets
    out at the size, then times ``run_iteration`` (one training iteration);
    rank 0's median, the same on every rank."""
    runtime = model._dear

    def measure(bucket_mb: float) -> float:
        runtime.reconfigure(dataclasses.replace(runtime.options, bucket_mb=bucket_mb))
        run_iteration()  # rebuilds the buckets
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run_iteration()
            times.append(time.perf_counter() - start)
        model.sync()
        return rank0s(statistics.median(times), None)

    return measure
