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
