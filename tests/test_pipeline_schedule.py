"""The simulator and the GPipe / 1F1B / list-scheduled orders: every schedule
valid, known closed forms reproduced, bad inputs rejected with clear errors.
One process, no torch.distributed."""
import pytest

from dearcomm.pipeline import (LayerProfile, Plan, Task, Topology, chain, gpipe_orders, list_schedule,
                               load_shared_profile, one_f_one_b_orders, preset, simulate, uniform)
from dearcomm.pipeline.draw import draw_timeline, write_chrome_trace
from tests.pipeline_cases import check_schedule, random_profile, topologies

SHAPES = [  # (bounds, devices per stage)
    ((0, 6), ((0,),)),
    ((0, 2, 4, 6), ((0,), (1,), (2,))),
    ((0, 1, 6), ((0, 1), (2,))),
    ((0, 3, 5, 6), ((3,), (0, 2), (1,))),
    ((0, 4, 6), ((0, 1, 2), (3,))),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rule", ["gpipe", "1f1b", "list"])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_schedules_are_valid(shape, rule, M):
    bounds, devices = shape
    profile = random_profile(6, seed=M)
    for topo in topologies(4):
        if rule == "list":
            orders = list_schedule(profile, topo, bounds, devices, M).orders
        elif rule == "gpipe":
            orders = gpipe_orders(devices, M)
        else:
            orders = one_f_one_b_orders(devices, M, profile, topo, bounds)
        plan = Plan(bounds, devices, orders, M, rule)
        result = simulate(plan, profile, topo)
        check_schedule(plan, result, topo)


def test_one_f_one_b_keeps_its_memory_bound():
    # Classic 1F1B: stage s never holds more than S - s forwards without their backward.
    devices = tuple((s,) for s in range(4))
    orders = one_f_one_b_orders(devices, 8)
    for s, d in enumerate(range(4)):
        live = peak = 0
        for t in orders[d]:
            live += 1 if t.kind == "F" else -1
            peak = max(peak, live)
        assert peak == 4 - s
    # Replicated stages: list-scheduled under the same bound, and never deadlocking.
    profile = random_profile(6, seed=5)
    for topo in topologies(8):
        for devices in (((0, 1), (2,), (3, 4, 5), (6, 7)), ((0,), (1, 2, 3), (4, 5), (6,))):
            bounds = (0, 1, 3, 5, 6)
            plan = Plan(bounds, devices, one_f_one_b_orders(devices, 9, profile, topo, bounds), 9)
            check_schedule(plan, simulate(plan, profile, topo), topo)


def test_list_schedule_replays_to_the_same_time():
    profile = random_profile(6, seed=3)
    topo = topologies(4)[2]
    bounds, devices = SHAPES[3]
    listed = list_schedule(profile, topo, bounds, devices, 6)
    assert simulate(Plan(bounds, devices, listed.orders, 6), profile, topo).makespan_ms == pytest.approx(
        listed.makespan_ms)


def test_gpipe_on_balanced_stages_matches_the_closed_form():
    # S equal stages, free links: (M + S - 1) * (f + b), bubble (S-1)/(M+S-1).
    S, M, f, b = 4, 8, 2.0, 3.0
    profile = chain("flat", [LayerProfile(f"l{i}", f, b, 0.0, 0.0) for i in range(S)])
    topo = uniform(S)
    devices = tuple((s,) for s in range(S))
    for orders in (gpipe_orders(devices, M), one_f_one_b_orders(devices, M)):
        result = simulate(Plan(tuple(range(S + 1)), devices, orders, M), profile, topo)
        assert result.makespan_ms == pytest.approx((M + S - 1) * (f + b))


def test_transfers_and_allreduce_are_counted():
    # Two stages, one micro-batch: f0, transfer, f1, b1, transfer, b0; then the
    # replicated stage 0's ring all-reduce.
    profile = chain("two", [LayerProfile("a", 1.0, 2.0, 1e6, 8e6), LayerProfile("b", 1.0, 2.0, 0.0, 0.0)])
    topo = uniform(3, gbytes_per_s=1.0, latency_us=0.0)  # 1e6 B = 1 ms
    plan = Plan((0, 1, 2), ((0,), (1,)), gpipe_orders(((0,), (1,)), 1), 1)
    assert simulate(plan, profile, topo).makespan_ms == pytest.approx(1 + 1 + 1 + 2 + 1 + 2)
    devices = ((0, 2), (1,))
    plan = Plan((0, 1, 2), devices, gpipe_orders(devices, 2), 2)
    result = simulate(plan, profile, topo)
    # Ring all-reduce of 8e6 bytes over 2 devices at 1 GB/s: 2 * (1/2) * 8 ms.
    allreduce = [s for s in result.spans if s.kind == "allreduce"]
    assert allreduce and allreduce[0].end_ms - allreduce[0].start_ms == pytest.approx(8.0)
    check_schedule(plan, result, topo)


def test_shared_profiles_load_with_skip_connections():
    resnet = load_shared_profile("pipedream/resnet50")
    assert len(resnet) == 177
    # A cut inside a residual block carries the block's input too.
    assert max(b - resnet.layers[i].activation_bytes for i, b in enumerate(resnet.cut_bytes)) > 0


def test_timeline_pictures(tmp_path):
    profile = random_profile(4, seed=1)
    topo = preset("nvlink-pairs", 4)
    devices = ((0, 1), (2,), (3,))
    runs = {}
    for name, orders in (("gpipe", gpipe_orders(devices, 4)), ("1f1b", one_f_one_b_orders(devices, 4, profile, topo, (0, 1, 3, 4)))):
        runs[name] = simulate(Plan((0, 1, 3, 4), devices, orders, 4, name), profile, topo)
    draw_timeline(str(tmp_path / "t.png"), runs, "test")
    write_chrome_trace(str(tmp_path / "t.json"), runs)
    assert (tmp_path / "t.png").stat().st_size > 1000 and (tmp_path / "t.json").stat().st_size > 100


# ---- bad inputs ------------------------------------------------------------------

def test_disconnected_device_is_an_error():
    bw = ((0, 1e9, 0), (1e9, 0, 0), (0, 0, 0))
    with pytest.raises(ValueError, match=r"device\(s\) \[2\] have no link"):
        Topology(bw, ((0,) * 3,) * 3)
    islands = ((0, 1e9, 0, 0), (1e9, 0, 0, 0), (0, 0, 0, 1e9), (0, 0, 1e9, 0))
    with pytest.raises(ValueError, match="disconnected"):
        Topology(islands, ((0,) * 4,) * 4)


def test_routed_pairs_use_the_widest_path():
    # 0 - 1 - 2 in a line: 0 -> 2 goes through 1, at the narrower hop's speed.
    bw = ((0, 2e9, 0), (2e9, 0, 1e9), (0, 1e9, 0))
    topo = Topology(bw, ((0, 1e-5, 0), (1e-5, 0, 1e-5), (0, 1e-5, 0)))
    assert topo.route(0, 2) == [0, 1, 2]
    assert topo.transfer_ms(0, 2, 1e6) == pytest.approx((1.0, 0.02))


def test_bad_plans_are_rejected():
    profile = random_profile(3, seed=0)
    topo = uniform(4)
    devices = ((0,), (1,), (2,), (3,))
    with pytest.raises(ValueError, match="4 stages but only 3 layers"):
        simulate(Plan((0, 1, 2, 3, 3), devices, gpipe_orders(devices, 2), 2), profile, topo)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer, got 0"):
        simulate(Plan((0, 1, 3), devices[:2], {}, 0), profile, topo)
    with pytest.raises(ValueError, match="device 0 is in stages 0 and 1"):
        simulate(Plan((0, 1, 3), ((0,), (0,)), {}, 2), profile, topo)
    orders = gpipe_orders(devices[:2], 2)
    orders[0] = orders[0][::-1]
    with pytest.raises(ValueError, match="device 0 runs B0 before F0"):
        simulate(Plan((0, 1, 3), devices[:2], orders, 2), profile, topo)


def test_a_deadlocking_order_is_reported():
    # Device 0 waits for B1 before running F1, which device 1 can only get from F1.
    profile = random_profile(2, seed=0)
    orders = {0: (Task("F", 0, 0), Task("B", 0, 0), Task("F", 0, 1), Task("B", 0, 1)),
              1: (Task("F", 1, 1), Task("B", 1, 1), Task("F", 1, 0), Task("B", 1, 0))}
    with pytest.raises(ValueError, match="deadlocks: device 0 waits to run B0s0"):
        simulate(Plan((0, 1, 2), ((0,), (1,)), orders, 2), profile, uniform(2))


def test_orders_that_deadlock_are_found_without_times():
    """The runtime checks orders before it runs them (it cannot simulate
    without a profile): the check agrees with the simulator."""
    from dearcomm.pipeline import SimulationStuck, one_f_one_b_orders, simulate, uniform
    from dearcomm.pipeline.plan import check_runs_through
    profile = random_profile(3, seed=2)
    devices = ((0,), (1,), (2,))
    for orders in (gpipe_orders(devices, 4), one_f_one_b_orders(devices, 4)):
        check_runs_through(Plan((0, 1, 2, 3), devices, orders, 4))
    task = lambda text: Task(text[0], int(text[3]), int(text[1]))  # noqa: E731
    waits = {0: tuple(map(task, ["F0s0", "F1s0", "B1s0", "B0s0"])),  # backwards out of order: waits, finishes
             1: tuple(map(task, ["F1s1", "F0s1", "B0s1", "B1s1"]))}
    check_runs_through(Plan((0, 1, 3), devices[:2], waits, 2))
    stuck = {**waits, 0: tuple(map(task, ["F0s0", "B0s0", "F1s0", "B1s0"]))}
    plan = Plan((0, 1, 3), devices[:2], stuck, 2, "stuck")
    with pytest.raises(ValueError, match=r"plan 'stuck' deadlocks: device 0 waits to run B0s0 for B0s1; "
                                         r"device 1 waits to run F1s1 for F1s0"):
        check_runs_through(plan)
    with pytest.raises(SimulationStuck):
        simulate(plan, profile, uniform(2))
