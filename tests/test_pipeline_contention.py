"""The pipeline simulator with the data-parallel simulator's contention
factors (Topology.compute_slowdown κ, comm_slowdown λ): a device computes κ
times slower while a transfer at it is on the link, which runs λ times slower
while a device at one of its ends computes. One process."""
import dataclasses
import math
import random

import pytest

from dearcomm.pipeline import (BACKWARD, FORWARD, LayerProfile, Plan, Task, TransferCpu, chain, exhaustive_plan,
                               gpipe_plan, list_schedule, one_f_one_b_plan, plan_pipeline, servers, simulate,
                               switched, uniform)
from dearcomm.pipeline.cores import Contention
from tests.pipeline_cases import asymmetric_topology, check_schedule, random_profile, topologies

# 10 ms per task; 1e7 bytes cross the cut at 1 GB/s: 10 ms on the link, no latency.
PROFILE = chain("two", [LayerProfile("a", 10.0, 10.0, 1e7, 0.0), LayerProfile("b", 10.0, 10.0, 0.0, 0.0)])
TOPOLOGY = uniform(2, gbytes_per_s=1.0, latency_us=0.0)
ORDERS = {0: (Task(FORWARD, 0, 0), Task(FORWARD, 0, 1), Task(BACKWARD, 0, 0), Task(BACKWARD, 0, 1)),
          1: (Task(FORWARD, 1, 0), Task(BACKWARD, 1, 0), Task(FORWARD, 1, 1), Task(BACKWARD, 1, 1))}
PLAN = Plan((0, 1, 2), ((0,), (1,)), ORDERS, 2)


def _contended(topology, compute_slowdown, comm_slowdown):
    return dataclasses.replace(topology, compute_slowdown=compute_slowdown, comm_slowdown=comm_slowdown)


def _span(result, kind, stage, m):
    lane = "compute" if kind in ("F", "B") else "comm"
    kind = {"F": FORWARD, "B": BACKWARD}.get(kind, kind)
    task_kind = kind if lane == "compute" else (FORWARD if kind == "act" else BACKWARD)
    return next((s.start_ms, s.end_ms) for s in result.spans
                if s.lane == lane and s.kind == kind and s.task == Task(task_kind, stage, m))


def test_a_hand_computed_timeline():
    # κ = 2, λ = 1.25. F(0,0) alone [0, 10].
    topo = _contended(TOPOLOGY, 2.0, 1.25)
    result = simulate(PLAN, PROFILE, topo)
    check_schedule(PLAN, result, topo)
    # [10, 22.5]: act 0 at 0.8 (device 0 computes), F(0,1) at 0.5 does 6.25 of 10;
    # then alone: F(0,1) ends at 26.25.
    assert _span(result, "act", 1, 0) == pytest.approx((10.0, 22.5))
    assert _span(result, "F", 0, 1) == pytest.approx((10.0, 26.25))
    # F(1,0) starts on arrival (22.5) and does 3.75 alone until act 1 starts at
    # 26.25; then both are contended: act 1 needs 12.5 ms, F(1,0)'s last 6.25
    # take 12.5 too: both end at 38.75.
    assert _span(result, "act", 1, 1) == pytest.approx((26.25, 38.75))
    assert _span(result, "F", 1, 0) == pytest.approx((22.5, 38.75))
    # B(1,0) alone [38.75, 48.75]; then grad 0 beside F(1,1): grad ends 61.25,
    # F(1,1) did 6.25, its last 3.75 alone: ends 65.
    assert _span(result, "B", 1, 0) == pytest.approx((38.75, 48.75))
    assert _span(result, "grad", 0, 0) == pytest.approx((48.75, 61.25))
    assert _span(result, "F", 1, 1) == pytest.approx((48.75, 65.0))
    # B(0,0) [61.25, 71.25] and B(1,1) [65, 75] with no transfer; grad 1 alone [75, 85]; B(0,1) [85, 95].
    assert _span(result, "B", 0, 0) == pytest.approx((61.25, 71.25))
    assert _span(result, "grad", 0, 1) == pytest.approx((75.0, 85.0))
    assert result.makespan_ms == pytest.approx(95.0)
    # Without contention: every task 10 ms, every transfer 10 ms.
    assert simulate(PLAN, PROFILE, TOPOLOGY).makespan_ms == pytest.approx(80.0)


def test_each_factor_alone():
    # κ only: the transfers keep their 10 ms, the tasks beside them slow down.
    kappa = simulate(PLAN, PROFILE, _contended(TOPOLOGY, 2.0, 1.0))
    assert _span(kappa, "act", 1, 0) == pytest.approx((10.0, 20.0))
    assert _span(kappa, "F", 0, 1) == pytest.approx((10.0, 25.0))  # 5 of 10 beside the transfer, 5 alone
    # λ only: the tasks keep their 10 ms, the transfers run at 0.8 beside them.
    lam = simulate(PLAN, PROFILE, _contended(TOPOLOGY, 1.0, 1.25))
    assert _span(lam, "F", 0, 1) == pytest.approx((10.0, 20.0))
    assert _span(lam, "act", 1, 0) == pytest.approx((10.0, 22.0))  # 8 of 10 beside F(0,1), 2 alone at full speed


def test_the_planner_plans_with_the_factors():
    # Two stages beat one device with free transfers (210 against 240 ms); the
    # activations' 30 ms beside the compute make them lose with κ = 2, λ = 1.5.
    profile = chain("t", [LayerProfile("a", 10.0, 20.0, 3e7, 1e9), LayerProfile("b", 10.0, 20.0, 0.0, 1e9)])
    free = plan_pipeline(profile, TOPOLOGY, 4)
    assert free.devices == ((0,), (1,)) and free.predicted_ms == pytest.approx(210.0)
    topo = _contended(TOPOLOGY, 2.0, 1.5)
    aware = plan_pipeline(profile, topo, 4)
    assert aware.bounds == (0, 2) and aware.predicted_ms == pytest.approx(240.0)
    assert simulate(free, profile, topo).makespan_ms > 240.0


def test_nothing_side_by_side_nothing_slower():
    # One micro-batch: every transfer runs while both devices wait.
    plan = Plan((0, 1, 2), ((0,), (1,)), {0: (Task(FORWARD, 0, 0), Task(BACKWARD, 0, 0)),
                                          1: (Task(FORWARD, 1, 0), Task(BACKWARD, 1, 0))}, 1)
    free = simulate(plan, PROFILE, TOPOLOGY).makespan_ms
    assert free == pytest.approx(60.0)
    assert simulate(plan, PROFILE, _contended(TOPOLOGY, 3.0, 3.0)).makespan_ms == pytest.approx(free)


def _spans(result):
    return sorted((s.lane, s.kind, s.device, str(s.task), round(s.start_ms, 6), round(s.end_ms, 6))
                  for s in result.spans)


@pytest.mark.parametrize("devices", [3, 4])
def test_factors_of_one_give_the_fixed_times_timelines(devices):
    # κ a hair above 1 runs the contended event loop (transfers queued for their
    # resources in ready order and ended by their work); every span must be the
    # one the fixed times' reservations give, on shared links and NICs too.
    for seed in range(10):
        profile = random_profile(6, seed)
        for topo in topologies(devices) + [asymmetric_topology(devices, seed)]:
            hair = _contended(topo, 1.0 + 1e-13, 1.0)
            for plan in (one_f_one_b_plan(profile, topo, 4), gpipe_plan(profile, topo, 4)):
                assert _spans(simulate(plan, profile, hair)) == _spans(simulate(plan, profile, topo)), \
                    (seed, topo.name, plan.name)


def _integer_profile(layers: int, seed: int):
    # Whole-ms costs and 1e6-byte cuts on 1 GB/s links: many events at the same instant.
    rng = random.Random(seed)
    return chain(f"int{seed}", [LayerProfile(f"l{i}", rng.randint(1, 4), rng.randint(1, 6),
                                             rng.choice([1e6, 2e6, 3e6]), rng.choice([0.0, 2e6]))
                                for i in range(layers)])


@pytest.mark.parametrize("devices", [3, 4])
def test_factors_of_one_give_the_fixed_times_timelines_with_ties(devices):
    for seed in range(6):
        profile = _integer_profile(6, seed)
        for topo in (uniform(devices, gbytes_per_s=1.0, latency_us=0.0),
                     switched([1e9] * devices, latency_us=0.0), servers(devices, 2, True, intra_gbps=1, nvlink_gbps=2, nic_gbps=1,
                                                                  intra_latency_us=0, nic_latency_us=0)):
            hair = _contended(topo, 1.0 + 1e-13, 1.0)
            for plan in (one_f_one_b_plan(profile, topo, 5), gpipe_plan(profile, topo, 5),
                         plan_pipeline(profile, topo, 5)):
                assert _spans(simulate(plan, profile, hair)) == _spans(simulate(plan, profile, topo)), \
                    (seed, topo.name, plan.name)


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_factors_of_one_give_the_fixed_times_results(devices):
    # The same for the planner's plans (replicated stages, their all-reduces).
    for seed in range(5):
        profile = random_profile(6, seed)
        for topo in topologies(devices):
            plan = plan_pipeline(profile, topo, 4)
            hair = _contended(topo, 1.0 + 1e-13, 1.0)
            result = simulate(plan, profile, hair)
            check_schedule(plan, result, hair)
            assert result.makespan_ms == pytest.approx(simulate(plan, profile, topo).makespan_ms, rel=1e-9)


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_contended_schedules_are_valid_and_replay(devices):
    for seed in range(4):
        profile = random_profile(6, seed)
        for topo in topologies(devices):
            topo = _contended(topo, 1.7, 1.3)
            plan = plan_pipeline(profile, topo, 4)
            result = simulate(plan, profile, topo)
            check_schedule(plan, result, topo)
            listed = list_schedule(profile, topo, plan.bounds, plan.devices, 4)
            replay = simulate(plan.with_orders(listed.orders), profile, topo)
            assert replay.makespan_ms == pytest.approx(listed.makespan_ms)


def test_only_the_devices_at_a_transfers_ends_slow_down():
    speeds = Contention(2.0, 4.0)
    speeds.start_task(0.0, "task on 2", 10.0, device=2)
    speeds.start_transfer(0.0, "0 -> 1", 10.0, devices=(0, 1))
    assert speeds.speeds() == {"task on 2": 1.0, "0 -> 1": 1.0}
    speeds.start_transfer(1.0, "1 -> 2", 10.0, devices=(1, 2))
    assert speeds.speeds() == {"task on 2": 0.5, "0 -> 1": 1.0, "1 -> 2": 0.25}
    assert speeds.next_end() == pytest.approx(10.0)  # 0 -> 1: 1 ms done, 9 left at full speed
    assert speeds.finished(10.0, due=True) == ["0 -> 1"]
    assert speeds.left == pytest.approx({"task on 2": 10.0 - 1.0 - 4.5, "1 -> 2": 10.0 - 2.25})


def test_an_item_is_done_when_its_time_left_is_negligible_not_its_work():
    # A transfer slowed a billion times with 1e-8 ms of work left still has
    # 10 ms to run: it must not end with the bystander task that ends first.
    speeds = Contention(1.0, 1e9)
    speeds.start_transfer(0.0, "x", 10.0, devices=(0, 1))
    speeds.start_task(10.0 - 1e-8, "beside x", 100.0, device=0)
    speeds.start_task(10.0 - 1e-8, "bystander", 2.0, device=2)
    end = speeds.next_end()
    assert end == pytest.approx(12.0)
    assert speeds.finished(end, due=True) == ["bystander"]
    assert speeds.next_end() == pytest.approx(20.0)


def test_a_replicated_stage_and_a_bystander():
    # Stage 0 on devices 0 and 1 (a micro-batch each, 30 ms backward), stage 1
    # on device 2. Device 0's backward runs while the gradient 2 -> 1 is on the
    # link, which is not at device 0: full speed. The all-reduce (2 steps of
    # 1e7 bytes at 1 GB/s: 20 ms) starts when both backwards of stage 0 end,
    # with nothing left to compute at its ends: full speed too.
    profile = chain("rep", [LayerProfile("a", 10.0, 30.0, 1e7, 2e7), LayerProfile("b", 10.0, 10.0, 0.0, 0.0)])
    topo = _contended(uniform(3, gbytes_per_s=1.0, latency_us=0.0), 2.0, 1.0)
    orders = {0: (Task(FORWARD, 0, 0), Task(BACKWARD, 0, 0)), 1: (Task(FORWARD, 0, 1), Task(BACKWARD, 0, 1)),
              2: (Task(FORWARD, 1, 0), Task(BACKWARD, 1, 0), Task(FORWARD, 1, 1), Task(BACKWARD, 1, 1))}
    plan = Plan((0, 1, 2), ((0, 1), (2,)), orders, 2)
    result = simulate(plan, profile, topo)
    check_schedule(plan, result, topo)
    # F(0,*) [0, 10]; both activations on their own links [10, 20]; F(1,0) [20, 30],
    # B(1,0) [30, 40]; grad 0 [40, 50] beside F(1,1) on device 2, which does 5 of 10
    # by 50 and ends at 55; B(0,0) [50, 80]; B(1,1) [55, 65]; grad 1 (2 -> 1) [65, 75]
    # beside B(0,0); B(0,1) [75, 105]; the all-reduce [105, 125].
    assert _span(result, "F", 1, 1) == pytest.approx((40.0, 55.0))
    assert _span(result, "grad", 0, 1) == pytest.approx((65.0, 75.0))
    assert _span(result, "B", 0, 0) == pytest.approx((50.0, 80.0))
    reduces = sorted((s.device, s.start_ms, s.end_ms) for s in result.spans if s.kind == "allreduce")
    assert reduces == [(0, pytest.approx(105.0), pytest.approx(125.0)), (1, pytest.approx(105.0), pytest.approx(125.0))]
    assert result.makespan_ms == pytest.approx(125.0)


@pytest.mark.parametrize("field,value,error", [
    ("compute_slowdown", 0.5, ValueError), ("comm_slowdown", 0.0, ValueError), ("comm_slowdown", -1, ValueError),
    ("compute_slowdown", math.nan, ValueError), ("comm_slowdown", math.inf, ValueError),
    ("comm_slowdown", "2", TypeError), ("compute_slowdown", True, TypeError),
])
def test_bad_factors_are_refused(field, value, error):
    with pytest.raises(error, match=rf"{field} must be a finite factor >= 1 \(1: not slowed\), got {value!r}"):
        dataclasses.replace(TOPOLOGY, **{field: value})


def test_the_two_cpu_models_are_not_combined():
    with pytest.raises(ValueError, match="two models of the transfers' CPU work"):
        dataclasses.replace(TOPOLOGY, compute_slowdown=1.5, host_cores=2)
    with pytest.raises(ValueError, match="two models of the transfers' CPU work"):
        dataclasses.replace(TOPOLOGY, comm_slowdown=1.5, transfer_cpu=TransferCpu(send_ms_per_mib=1.0))


def test_the_exhaustive_search_refuses_contention():
    with pytest.raises(ValueError, match="compute/comm slowdown"):
        exhaustive_plan(PROFILE, _contended(TOPOLOGY, 1.5, 1.0), 2)
