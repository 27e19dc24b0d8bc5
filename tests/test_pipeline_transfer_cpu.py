"""The simulator's transfer CPU model (Topology.transfer_cpu): a transfer's
sending and receiving CPU work runs on its endpoints, delays their tasks by
exactly what it costs, and zero cost changes nothing. One process."""
import dataclasses

import pytest

from dearcomm.pipeline import (LayerProfile, Plan, Task, TransferCpu, chain, gpipe_orders, list_schedule,
                               one_f_one_b_orders, simulate, uniform)
from tests.pipeline_cases import check_schedule, random_profile, topologies

MIB = 1 << 20


def _two_stages(microbatches: int, cpu: TransferCpu):
    # 1 ms forward, 2 ms backward per stage; 1 MiB crosses the cut at 1 GB/s (1.048576 ms), no latency.
    profile = chain("two", [LayerProfile("a", 1.0, 2.0, MIB, 0.0), LayerProfile("b", 1.0, 2.0, 0.0, 0.0)])
    topo = dataclasses.replace(uniform(2, gbytes_per_s=1.0, latency_us=0.0), transfer_cpu=cpu)
    devices = ((0,), (1,))
    plan = Plan((0, 1, 2), devices, gpipe_orders(devices, microbatches), microbatches)
    return plan, simulate(plan, profile, topo), topo


def _start(result, kind, stage, m):
    return next(s.start_ms for s in result.spans if s.lane == "compute" and s.task == Task(kind, stage, m))


def test_a_send_delays_the_senders_next_task_by_its_cpu_cost():
    cpu = TransferCpu(send_ms_per_message=0.1, send_ms_per_mib=0.5)
    plan, result, topo = _two_stages(2, cpu)
    # F0 of micro-batch 0 ends at 1 ms; its send costs 0.6 ms of device 0 before F0 of micro-batch 1.
    assert cpu.send_ms(MIB) == pytest.approx(0.6)
    assert _start(result, "F", 0, 1) == pytest.approx(1.0 + 0.6)
    _, free, _ = _two_stages(2, TransferCpu())
    assert _start(free, "F", 0, 1) == pytest.approx(1.0)
    check_schedule(plan, result, topo)


def test_a_receive_costlier_than_the_transfer_delays_the_consumer():
    # The receiver is idle when the transfer starts (t = 1), so its 3 ms of receiving
    # CPU run at once and end after the data arrive (t = 2.048576): F1 starts at 4.
    cpu = TransferCpu(recv_ms_per_message=1.0, recv_ms_per_mib=2.0)
    plan, result, topo = _two_stages(1, cpu)
    assert _start(result, "F", 1, 0) == pytest.approx(1.0 + 3.0)
    # A receive cheaper than the transfer hides in the wait: F1 starts on arrival.
    _, cheap, _ = _two_stages(1, TransferCpu(recv_ms_per_mib=0.5))
    assert _start(cheap, "F", 1, 0) == pytest.approx(1.0 + MIB / 1e9 * 1e3)
    check_schedule(plan, result, topo)


def test_one_micro_batch_closed_form():
    # F0, [send cpu on 0 | recv cpu on 1 while the activation flies], F1, B1, [gradient], B0.
    # Every charge here hides in a wait except the receiver's, which exceeds the transfer.
    occupancy = MIB / 1e9 * 1e3
    cpu = TransferCpu(send_ms_per_mib=0.5, recv_ms_per_mib=1.5)
    _, result, _ = _two_stages(1, cpu)
    assert result.makespan_ms == pytest.approx(1 + 1.5 + 1 + 2 + 1.5 + 2)
    _, free, _ = _two_stages(1, TransferCpu())
    assert free.makespan_ms == pytest.approx(1 + occupancy + 1 + 2 + occupancy + 2)


def test_zero_cost_is_the_free_transfer_model_exactly():
    shapes = [((0, 2, 4, 6), ((0,), (1,), (2,))), ((0, 3, 5, 6), ((3,), (0, 2), (1,)))]
    for seed, (bounds, devices) in enumerate(shapes):
        profile = random_profile(6, seed)
        for topo in topologies(4):
            explicit = dataclasses.replace(topo, transfer_cpu=TransferCpu(0.0, 0.0, 0.0, 0.0))
            for orders in (gpipe_orders(devices, 5), one_f_one_b_orders(devices, 5, profile, topo, bounds)):
                plan = Plan(bounds, devices, orders, 5)
                a, b = simulate(plan, profile, topo), simulate(plan, profile, explicit)
                assert a.makespan_ms == b.makespan_ms and a.spans == b.spans
            listed = list_schedule(profile, explicit, bounds, devices, 5)
            assert listed.makespan_ms == list_schedule(profile, topo, bounds, devices, 5).makespan_ms
            assert not [s for s in listed.spans if s.lane == "cpu"]


def test_cpu_work_is_conserved_and_schedules_stay_valid():
    # Every transfer charges its two ends, every all-reduce every member: the CPU
    # spans add up to exactly that, and never overlap a task on their device.
    cpu = TransferCpu(0.05, 0.3, 0.02, 0.4)
    profile = random_profile(6, seed=7)
    bounds, devices = (0, 1, 4, 6), ((0, 1), (2,), (3,))
    M = 4
    for topo in topologies(4):
        topo = dataclasses.replace(topo, transfer_cpu=cpu)
        for orders in (gpipe_orders(devices, M), list_schedule(profile, topo, bounds, devices, M).orders):
            plan = Plan(bounds, devices, orders, M)
            result = simulate(plan, profile, topo)
            check_schedule(plan, result, topo)
            want = {d: 0.0 for d in range(4)}
            for s in range(len(devices) - 1):
                nbytes = profile.boundary_bytes(bounds[s + 1])
                for m in range(M):
                    a, b = plan.device_of(s, m), plan.device_of(s + 1, m)
                    for src, dst in ((a, b), (b, a)):  # activation, then gradient
                        want[src] += cpu.send_ms(nbytes)
                        want[dst] += cpu.recv_ms(nbytes)
            chunk = profile.param_bytes(0, 1) / 2
            for d in devices[0]:
                want[d] += 2 * (cpu.send_ms(chunk) + cpu.recv_ms(chunk))
            for d in range(4):
                got = sum(s.end_ms - s.start_ms for s in result.spans if s.device == d and s.lane == "cpu")
                assert got == pytest.approx(want[d])
            free = simulate(plan, profile, dataclasses.replace(topo, transfer_cpu=TransferCpu()))
            assert result.makespan_ms >= free.makespan_ms - 1e-9


def test_negative_cpu_costs_are_rejected():
    with pytest.raises(ValueError, match="must be >= 0"):
        TransferCpu(send_ms_per_mib=-1.0)


# ---- devices sharing a host's cores -------------------------------------------------

def _on_cores(topo, cores):
    return dataclasses.replace(topo, host_cores=cores)


def test_enough_cores_change_nothing():
    profile = random_profile(6, seed=2)
    bounds, devices = (0, 3, 5, 6), ((3,), (0, 2), (1,))
    for topo in topologies(4):
        plan = Plan(bounds, devices, one_f_one_b_orders(devices, 5, profile, topo, bounds), 5)
        alone, shared = simulate(plan, profile, topo), simulate(plan, profile, _on_cores(topo, 4))
        assert shared.makespan_ms == pytest.approx(alone.makespan_ms)
        check_schedule(plan, shared, _on_cores(topo, 4))


def test_two_replicas_on_one_core_take_twice_as_long():
    # Pure data parallelism over 2 devices, free links: each replica's F and B run
    # at the same time as the other's, at half speed on one core.
    profile = chain("flat", [LayerProfile("a", 1.0, 2.0, 0.0, 0.0)])
    devices = ((0, 1),)
    plan = Plan((0, 1), devices, gpipe_orders(devices, 2), 2)
    topo = uniform(2)
    assert simulate(plan, profile, topo).makespan_ms == pytest.approx(3.0)
    assert simulate(plan, profile, _on_cores(topo, 1)).makespan_ms == pytest.approx(6.0)
    assert simulate(plan, profile, _on_cores(topo, 2)).makespan_ms == pytest.approx(3.0)


def test_a_send_shares_the_core_with_the_next_task():
    # One core; F0 of micro-batch 0 ends at 1 ms and its 1 ms of sending work runs
    # beside F0 of micro-batch 1: both at half speed, both end at 3 ms (the
    # activation, 4.19 ms on the link, reaches device 1 only after that).
    profile = chain("two", [LayerProfile("a", 1.0, 2.0, MIB, 0.0), LayerProfile("b", 1.0, 2.0, 0.0, 0.0)])
    topo = dataclasses.replace(uniform(2, gbytes_per_s=0.25, latency_us=0.0),
                               transfer_cpu=TransferCpu(send_ms_per_mib=1.0), host_cores=1)
    devices = ((0,), (1,))
    plan = Plan((0, 1, 2), devices, gpipe_orders(devices, 2), 2)
    result = simulate(plan, profile, topo)
    f01 = next(s for s in result.spans if s.task == Task("F", 0, 1) and s.lane == "compute")
    assert (f01.start_ms, f01.end_ms) == pytest.approx((1.0, 3.0))
    sends = sorted((s.start_ms, s.end_ms) for s in result.spans if s.lane == "cpu" and s.device == 0)
    assert sends[0] == pytest.approx((1.0, 3.0))
    check_schedule(plan, result, topo)


def test_on_shared_cores_the_data_wait_for_the_receiving_work():
    # Plenty of cores: the 3 ms of receiving work runs beside the 1.05 ms transfer,
    # and F1 starts when both are done (t = 1 + 3).
    plan, result, topo = _two_stages(1, TransferCpu(recv_ms_per_message=1.0, recv_ms_per_mib=2.0))
    shared = simulate(plan, chain("two", [LayerProfile("a", 1.0, 2.0, MIB, 0.0),
                                          LayerProfile("b", 1.0, 2.0, 0.0, 0.0)]), _on_cores(topo, 8))
    assert _start(shared, "F", 1, 0) == pytest.approx(4.0)
    assert shared.makespan_ms == pytest.approx(result.makespan_ms)


def test_cores_must_be_positive():
    with pytest.raises(ValueError, match="host_cores must be >= 0"):
        _on_cores(uniform(2), -1)


def test_profiles_can_time_with_another_clock():
    # The shared-cores model wants tasks' CPU time: profile_sequential reads the
    # clock it is given (here a fake one that ticks 1 s per reading).
    import itertools

    import torch
    from torch import nn

    from dearcomm.pipeline import profile_sequential
    ticks = itertools.count()
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    profile = profile_sequential(model, torch.randn(5, 4), torch.randint(0, 2, (5,)), nn.functional.cross_entropy,
                                 clock=lambda: float(next(ticks)))
    assert all(l.forward_ms == 1000.0 and l.backward_ms == 1000.0 for l in profile.layers)
    assert [l.activation_bytes for l in profile.layers] == [5 * 3 * 4, 5 * 3 * 4, 5 * 2 * 4]
