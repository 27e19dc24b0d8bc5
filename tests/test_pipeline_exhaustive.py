"""The exhaustive optimum against plain enumeration (every partition, every
mapping, every valid permutation of every device's tasks, each simulated)
on tiny problems, and the planner against the exhaustive optimum. One process."""
import dataclasses
import itertools
import math

import pytest

from dearcomm.pipeline import (BACKWARD, FORWARD, Plan, SimulationStuck, Task, TransferCpu, gpipe_plan, plan_pipeline,
                               simulate)
from dearcomm.pipeline.candidates import all_candidates
from dearcomm.pipeline.exhaustive import exhaustive_plan
from tests.pipeline_cases import asymmetric_topology, check_schedule, optimality_cases, random_profile, switched


def _valid_orders(tasks):
    """Every permutation in which each micro-batch's F comes before its B."""
    for perm in itertools.permutations(tasks):
        seen = set()
        if all(t.kind == FORWARD and not seen.add(t.microbatch) or t.microbatch in seen for t in perm):
            yield perm


def _plain_optimum(profile, topology, M) -> float:
    best = math.inf
    for _, (bounds, groups), _ in all_candidates(profile, topology, M, topology.size):
        per_device = []
        for s, g in enumerate(groups):
            for j, d in enumerate(g):
                mine = [Task(k, s, m) for m in range(j, M, len(g)) for k in (FORWARD, BACKWARD)]
                per_device.append([(d, o) for o in _valid_orders(mine)])
        for combo in itertools.product(*per_device):
            try:
                best = min(best, simulate(Plan(bounds, groups, dict(combo), M), profile, topology).makespan_ms)
            except SimulationStuck:
                pass
    return best


@pytest.mark.parametrize("layers,microbatches,topology", [
    (3, 2, switched([0.4e9, 1.5e9])), (2, 3, switched([0.4e9, 1.5e9])), (3, 2, asymmetric_topology(2, 0))])
def test_exhaustive_equals_plain_enumeration(layers, microbatches, topology):
    profile = random_profile(layers, seed=layers + microbatches)
    start = gpipe_plan(profile, topology, microbatches)  # a plan to beat, not the answer
    best = exhaustive_plan(profile, topology, microbatches, start=start)
    assert best.predicted_ms == pytest.approx(_plain_optimum(profile, topology, microbatches), rel=1e-12)
    assert simulate(best, profile, topology).makespan_ms == best.predicted_ms


def test_planner_is_near_the_exhaustive_optimum():
    ratios = []
    for profile, topology, M in itertools.islice(optimality_cases(48), 0, 12):
        if topology.size > 3:  # the exact search takes seconds there; the benchmark runs them
            continue
        plan = plan_pipeline(profile, topology, M)
        check_schedule(plan, simulate(plan, profile, topology), topology)
        best = exhaustive_plan(profile, topology, M, start=plan)
        check_schedule(best, simulate(best, profile, topology), topology)
        ratios.append(plan.predicted_ms / best.predicted_ms)
    assert len(ratios) >= 4 and min(ratios) >= 1 - 1e-12
    assert max(ratios) <= 1.03, ratios


def test_exhaustive_refuses_what_it_cannot_search():
    with pytest.raises(ValueError, match=r"exhaustive_plan\(\) is for at most 8 layers, 4 devices and 8 micro-batches"):
        exhaustive_plan(random_profile(3, seed=0), switched([1e9] * 2), 9)
    cpu = switched([1e9] * 2)
    with pytest.raises(ValueError, match="models free transfers"):
        exhaustive_plan(random_profile(3, seed=0), dataclasses.replace(cpu, transfer_cpu=TransferCpu(1.0)), 2)


def test_brute_force_within_a_memory_limit():
    """Candidates that do not fit are skipped (one crashed on None), and a
    problem that nothing fits is the planner's error (it returned None)."""
    from dearcomm.pipeline import LayerProfile, brute_force, chain, check_memory, uniform
    heavy = chain("m", [LayerProfile(f"l{i}", 1.0, 2.0, 1e3, 1e8) for i in range(3)])
    topology = uniform(3, gbytes_per_s=0.01).with_memory(5e8)
    plan = brute_force(heavy, topology, 4)
    check_memory(plan, heavy, topology)
    assert plan.bounds == (0, 1, 2, 3)
    four = chain("m", [LayerProfile(f"l{i}", 1.0, 2.0, 1e6, 1e6) for i in range(4)])
    with pytest.raises(ValueError, match=r"dearcomm: brute_force\(\): no plan fits in memory; .* stage 1 "
                                         r"\(layers \[2, 4\)\) needs 1.1e\+07 bytes"):
        brute_force(four, uniform(2).with_memory(7e6), 4)
