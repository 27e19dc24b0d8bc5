"""The planner against the best plan under the three order rules (brute
force) on small cases (≤ 8 layers, ≤ 4 devices), its determinism, and its
errors. One process. tests/test_pipeline_exhaustive.py compares it with the
exhaustive optimum."""
import dataclasses
import pathlib

import pytest

from dearcomm.pipeline import LayerProfile, chain, uniform
from dearcomm.pipeline.brute_force import brute_force
from dearcomm.pipeline.planner import plan_pipeline
from tests.pipeline_cases import check_schedule, random_profile, topologies

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = [(4, 2, 4, 1), (6, 3, 4, 1), (5, 4, 3, 1)]  # (layers, devices, micro-batches, seeds)


def test_planner_is_never_slower_than_the_best_rule_plan():
    from dearcomm.pipeline import simulate
    ratios = []
    for L, D, M, seeds in CASES:
        for seed in range(seeds):
            profile = random_profile(L, seed + 10 * L)
            for topo in topologies(D):
                rules = brute_force(profile, topo, M)
                plan = plan_pipeline(profile, topo, M)
                check_schedule(plan, simulate(plan, profile, topo), topo)
                ratios.append((plan.predicted_ms / rules.predicted_ms, f"L={L} D={D} M={M} seed={seed} {topo.name}"))
    assert max(ratios)[0] <= 1 + 1e-9, max(ratios)


def test_planner_is_deterministic_and_predicts_its_simulation():
    from dearcomm.pipeline import simulate
    profile, topo = random_profile(8, seed=7), topologies(4)[2]
    a, b = plan_pipeline(profile, topo, 6), plan_pipeline(profile, topo, 6)
    assert a == b and a.predicted_ms == b.predicted_ms
    assert simulate(a, profile, topo).makespan_ms == pytest.approx(a.predicted_ms)


def test_one_device_is_plain_training():
    profile = random_profile(3, seed=1)
    plan = plan_pipeline(profile, uniform(1), 4)
    assert plan.bounds == (0, 3) and plan.devices == ((0,),)
    assert plan.predicted_ms == pytest.approx(4 * profile.total_ms())


def test_planner_errors_name_the_problem():
    profile = random_profile(3, seed=1)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer, got 0"):
        plan_pipeline(profile, uniform(2), 0)
    # max_stages is a cap: above the layers or devices it caps nothing (it was refused).
    assert plan_pipeline(profile, uniform(8), 4, max_stages=5) == plan_pipeline(profile, uniform(8), 4)
    assert plan_pipeline(profile, uniform(2), 4, max_stages=3) == plan_pipeline(profile, uniform(2), 4)
    with pytest.raises(ValueError, match="brute_force\\(\\) is for at most 8 layers"):
        brute_force(random_profile(9, seed=0), uniform(2), 2)
    with pytest.raises(ValueError, match="has a negative cost"):
        chain("bad", [LayerProfile("x", -1.0, 1.0, 0.0, 0.0)])


def test_max_stages_that_no_split_fits_names_the_cap():
    """The error described the best split of any stage count (one that fitted
    when more stages were allowed) instead of what max_stages allows."""
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 1e6, 1e9) for i in range(4)]
    topology = uniform(4).with_memory(6e9)
    assert plan_pipeline(chain("big", layers), topology, 4).num_stages >= 2  # fits on two or more stages
    with pytest.raises(ValueError, match=r"no plan fits in memory within max_stages=1; the split that fits best "
                                         r"\(1 stage at layers \(0, 4\)\) still overflows.*raise max_stages"):
        plan_pipeline(chain("big", layers), topology, 4, max_stages=1)


def test_counting_the_candidates_of_many_devices_is_immediate():
    """The planner asks whether a problem is small before planning; the count
    for 32 devices took hours (a recursion without memory)."""
    from dearcomm.pipeline.candidates import count_candidates
    from dearcomm.pipeline.candidates import all_bounds, all_groups
    assert count_candidates(24, 32, 24) > 10 ** 30
    for layers, devices in ((3, 2), (4, 3), (5, 4)):
        made = sum(1 for b in all_bounds(layers) if len(b) - 1 <= devices
                   for _ in all_groups(tuple(range(devices)), len(b) - 1))
        assert count_candidates(layers, devices, devices) == made


def test_a_tie_goes_to_fewer_devices():
    """One micro-batch cannot pipeline: where a split costs nothing more (a
    cut of 0 bytes), the planner kept it on two devices all the same."""
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 0.0, 1e3) for i in range(4)]
    plan = plan_pipeline(chain("free-cuts", layers), uniform(2), 1)
    assert plan.devices == ((0,),) and plan.predicted_ms == pytest.approx(12.0)


def test_exhaustive_search_checks_its_start_plan():
    """A start plan from another problem was taken as is: its time became
    the bound to beat, and its layers and devices were never checked."""
    from dearcomm.pipeline.exhaustive import exhaustive_plan
    profile, other = random_profile(4, seed=1), random_profile(5, seed=2)
    with pytest.raises(ValueError, match=r"exhaustive_plan\(\): start plan 'planner' does not fit this problem: "
                                         r".*stage bounds \(0, .*, 5\) must rise strictly from 0 to 4"):
        exhaustive_plan(profile, uniform(2), 3, start=plan_pipeline(other, uniform(2), 3))
    with pytest.raises(ValueError, match=r"start plan 'planner' has 3 micro-batches, the problem 4"):
        exhaustive_plan(profile, uniform(2), 4, start=plan_pipeline(profile, uniform(2), 3))
    with pytest.raises(ValueError, match=r"does not fit this problem: .*stage 0 uses device 2; the topology has "
                                         r"devices 0..1"):
        exhaustive_plan(profile, uniform(2), 3, start=plan_pipeline(profile, uniform(3), 3))
    # A start plan whose time is another's: the search still finds this problem's optimum.
    start = plan_pipeline(profile, uniform(2), 3)
    lucky = dataclasses.replace(start, predicted_ms=start.predicted_ms / 10)
    assert exhaustive_plan(profile, uniform(2), 3, start=lucky).predicted_ms == \
        exhaustive_plan(profile, uniform(2), 3, start=start).predicted_ms


def test_benchmark_and_example_refuse_counts_that_plan_nothing(tmp_path):
    """0 micro-batches or cases raised ZeroDivisionError, UnboundLocalError or
    ValueError deep inside; a memory limit that nothing fits divided by no rows."""
    import subprocess
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import pipeline_bench
    for argv in (["plans", "--microbatches", "0"], ["optimality", "--cases", "0"], ["plans", "--memory-gb", "-1"]):
        with pytest.raises(SystemExit) as stop:
            pipeline_bench.main(argv + ["--out", str(tmp_path)])
        assert stop.value.code == 2, argv
    lines = []
    assert pipeline_bench._summary([], lines.append) is None and lines == ["", "no plan fits in any case"]
    for args, message in ((["--steps", "0"], "--steps must be at least 1, got 0"),
                          (["--steps", "-5"], "--steps must be at least 1, got -5"),
                          (["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
                          (["--batch", "10", "--microbatches", "4"],
                           "--batch 10 does not split into --microbatches 4 equal micro-batches")):
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "pipeline_train.py"), *args],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
