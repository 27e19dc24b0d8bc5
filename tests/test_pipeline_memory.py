"""The pipeline memory model on a hand-computed case, and the planner under
a memory limit: over capacity is rejected, 1F1B-like orders fit, nothing
fitting is an error naming the stage and the bytes. One process."""
import pytest

from dearcomm.pipeline import LayerProfile, Plan, chain, gpipe_orders, one_f_one_b_orders, plan_pipeline, simulate
from dearcomm.pipeline.memory import check_memory, device_memory, in_flight_caps, peak_in_flight
from tests.pipeline_cases import check_schedule, switched

MB = 1e6
# Two layers of 1 MB parameters and 1 MB output each. With Adam (2 slots) a
# stage holds 4 MB per layer of weights, gradients and state. Stashed per
# micro-batch: stage 0 its output (1 MB); stage 1 its input and output (2 MB).
PROFILE = chain("two", [LayerProfile("a", 1.0, 2.0, MB, MB), LayerProfile("b", 1.0, 2.0, MB, MB)])
DEVICES = ((0,), (1,))


def _topology(capacity: float):
    return switched([1e9, 1e9]).with_memory(capacity)


def test_memory_of_gpipe_and_1f1b_by_hand():
    gpipe = Plan((0, 1, 2), DEVICES, gpipe_orders(DEVICES, 4), 4, "gpipe")
    f1b = Plan((0, 1, 2), DEVICES, one_f_one_b_orders(DEVICES, 4), 4, "1f1b")
    assert [peak_in_flight(gpipe.orders[d]) for d in (0, 1)] == [4, 4]
    assert [peak_in_flight(f1b.orders[d]) for d in (0, 1)] == [2, 1]
    assert device_memory(gpipe, PROFILE) == {0: 4 * MB + 4 * MB, 1: 4 * MB + 4 * 2 * MB}
    assert device_memory(f1b, PROFILE) == {0: 4 * MB + 2 * MB, 1: 4 * MB + 2 * MB}
    assert device_memory(f1b, PROFILE, optimizer_slots=0) == {0: 2 * MB + 2 * MB, 1: 2 * MB + 2 * MB}
    tight = _topology(7 * MB)
    with pytest.raises(ValueError, match=r"plan 'gpipe' does not fit: device 0 \(stage 0, layers \[0, 1\)\) "
                                         r"needs 8e\+06 bytes .* 4 micro-batch\(es\) of activations at 1e\+06"):
        check_memory(gpipe, PROFILE, tight)
    check_memory(f1b, PROFILE, tight)
    # Room left after the static 4 MB: 3 MB, i.e. 3 micro-batches on stage 0 and 1 on stage 1.
    assert in_flight_caps(PROFILE, tight, (0, 1, 2), DEVICES, 4) == {0: 3, 1: 1}
    assert in_flight_caps(PROFILE, tight, (0, 2), ((0,),), 4) is None  # 8 MB of parameters alone


def test_planner_trades_order_for_memory():
    free = plan_pipeline(PROFILE, _topology(1e12), 4)
    tight_topology = _topology(7 * MB)
    tight = plan_pipeline(PROFILE, tight_topology, 4)
    check_memory(tight, PROFILE, tight_topology)
    check_schedule(tight, simulate(tight, PROFILE, tight_topology), tight_topology)
    assert tight.devices == DEVICES and peak_in_flight(tight.orders[1]) == 1
    assert tight.predicted_ms >= free.predicted_ms - 1e-9
    # Without a limit the model charges nothing: the same plan as an unlimited topology.
    assert plan_pipeline(PROFILE, switched([1e9, 1e9]), 4) == free


def test_a_problem_that_fits_nowhere_names_the_stage_and_the_bytes():
    with pytest.raises(ValueError, match=r"plan_pipeline\(\): no plan fits in memory; .* stage 1 \(layers \[1, 2\)\) "
                                         r"needs 6e\+06 bytes .* more than the 5e\+06 bytes of device"):
        plan_pipeline(PROFILE, _topology(5 * MB), 4)
    with pytest.raises(ValueError, match="memory_bytes must give one capacity per device"):
        switched([1e9, 1e9]).with_memory([MB])
    with pytest.raises(ValueError, match="has a negative memory"):
        switched([1e9, 1e9]).with_memory(-1.0)


def test_memory_limits_from_numpy():
    """An array gives one limit per device (it was taken for one number and
    refused as non-numeric); a numpy scalar, one for all."""
    import numpy as np
    from dearcomm.pipeline import uniform
    assert uniform(3).with_memory(np.array([1e9, 2e9, 3e9])).memory_bytes == (1e9, 2e9, 3e9)
    assert uniform(2).with_memory(np.float64(5e9)).memory_bytes == (5e9, 5e9)


def test_a_coarsened_profile_stashes_what_its_layers_stash():
    """A merged block stashes every one of its layers' outputs: with only
    the last one counted, a plan that fit the coarsened profile overflowed
    on the layers it stands for. The cuts between blocks keep their sizes."""
    from dearcomm.pipeline import coarsen
    from dearcomm.pipeline.memory import stash_bytes
    layers = [LayerProfile(f"l{i}", 1.0, 2.0, (i + 1) * MB, MB) for i in range(6)]
    fine = chain("six", layers)
    coarse = coarsen(fine, 3)
    ends = [0] + [[l.name for l in layers].index(b.name.split("..")[-1]) + 1 for b in coarse.layers]
    assert len(coarse) == 3 and ends[-1] == 6
    for k in range(len(coarse)):
        assert stash_bytes(coarse, k, k + 1) == stash_bytes(fine, ends[k], ends[k + 1])
    assert coarse.cut_bytes == tuple(fine.boundary_bytes(b) for b in ends[1:-1])
    # The same plan needs the same bytes on the blocks as on their layers.
    plan = plan_pipeline(coarse, switched([1e9] * 3), 4)
    same = Plan(tuple(ends[b] for b in plan.bounds), plan.devices, plan.orders, 4, "fine")
    assert device_memory(plan, coarse) == pytest.approx(device_memory(same, fine))


def test_device_orders_differ_by_memory():
    """The DP gives stage 0 the first device of an order, so orders that
    differ only in which device is small are not the same to the planner:
    taken as one, the small device got the heavy stage (no plan fit at all,
    or a slower one depending on how the devices were numbered)."""
    from dearcomm.pipeline import uniform
    from dearcomm.pipeline.memory import least_memory_split
    heavy = chain("x", [LayerProfile("a", 1, 2, 1, 1.25 * MB), LayerProfile("b", 1, 2, 1, 1.25 * MB),
                        LayerProfile("c", 1, 2, 1, 0.125 * MB)])
    for memory in ([MB, 10.1 * MB], [10.1 * MB, MB]):
        topology = uniform(2).with_memory(memory)
        plan = plan_pipeline(heavy, topology, 4)
        check_memory(plan, heavy, topology)
        big = memory.index(max(memory))
        assert plan.bounds == (0, 2, 3) and plan.devices == ((big,), (1 - big,))
        # The last resort pairs needs with capacities: the heavy stage on the big device.
        bounds, devices, (ratio, _, _, _) = least_memory_split(heavy, topology)
        assert (bounds, devices) == ((0, 2, 3), ((big,), (1 - big,))) and ratio <= 1
    # An embedding-heavy first layer: the same devices numbered otherwise plan the same iteration.
    layers = [LayerProfile("emb", 2, 4, MB, 200 * MB)] + [LayerProfile(f"l{i}", 5, 10, MB, MB) for i in range(1, 12)]
    embedding = chain("emb", layers)
    times = []
    for small in (0, 1):
        memory = [1e9] * 6
        memory[small] = 200 * MB
        topology = uniform(6).with_memory(memory)
        plan = plan_pipeline(embedding, topology, 8)
        check_memory(plan, embedding, topology)
        times.append(plan.predicted_ms)
    assert times[0] == pytest.approx(times[1])
