"""DeAR's buffer-size tuner (benchmarks/bo_tuner.py), the baseline of
wrap()'s "auto": it finds the minimum of a known cost curve, and on a live
job every rank tries the same sizes and ends with the same layout."""
import argparse
import math
import os
import sys

import torch

from tests.multiprocess import run_workers

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
import bo_tuner  # noqa: E402


def test_finds_the_minimum_of_a_known_curve():
    # Iteration time with its minimum at 8 MiB, growing with the factor away from it.
    tuned = bo_tuner.tune_bucket_mb(lambda mb: 1.0 + (math.log2(mb) - 3.0) ** 2)
    assert len(tuned.trials) == bo_tuner.TRIALS
    assert all(bo_tuner.LOW_MB <= mb <= bo_tuner.HIGH_MB for mb, _ in tuned.trials)
    assert 8 / 1.5 <= tuned.bucket_mb <= 8 * 1.5, tuned.trials
    assert tuned.bucket_mb == min(tuned.trials, key=lambda t: t[1])[0]


def _tune_live(rank, world_size):
    sys.path.insert(0, BENCHMARKS)
    import train_bench

    torch.manual_seed(0)
    args = argparse.Namespace(model="mlp", model_args=["width=64", "depth=3"], bucket_mb=25.0)
    model, optimizer = train_bench.build("dear-bo", args)
    x, y = train_bench.make(args).batch(8, torch.Generator().manual_seed(rank))
    train_bench.iteration(model, optimizer, x, y)
    tuned = train_bench.bo_tune(model, optimizer, x, y, iters=1, trials=3)
    return dict(trials=[mb for mb, _ in tuned.trials], best=tuned.bucket_mb,
                in_force=model._dear.options.bucket_mb, built=model._dear.engine is not None)


def test_every_rank_tries_the_same_sizes_and_keeps_the_best():
    results = run_workers(_tune_live, 2, deadline=180)
    assert results[0]["trials"] == results[1]["trials"] and len(results[0]["trials"]) == 3
    for r in results:
        assert r["in_force"] == r["best"] == results[0]["best"] and r["built"]
