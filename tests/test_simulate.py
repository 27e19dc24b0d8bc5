"""The simulated device: the executor and policies that train, on a virtual
clock. Each schedule's timeline on a 3-bucket profile is computed by hand
below (every collective's exact start and end), and checked op by op.

Profile: three modules, each with one 1 MiB fp32 parameter (one bucket each
with bucket_mb=0), forward 1 ms and backward 2 ms each; 2 ranks; α = 0 and a
bandwidth at which a reduce-scatter or all-gather of 1 MiB takes 1 ms (an
all-reduce 2 ms); the optimizer takes 2 ms over the whole model (sharded: 1 ms
for the half a rank owns; replicated: 2/3 ms per parameter, in the forward).
"""
import dataclasses
import math

import pytest
import torch

import dearcomm
from dearcomm import ModuleProfile, Network, _C

MIB = 1 << 20
NUMEL = MIB // 4
# (p-1)/p * n * beta = 1 ms for n = 1 MiB at p = 2: beta = 2e-3 / MiB s/byte.
NETWORK = Network(alpha_us=0.0, gbit_s=8 * MIB / 2e-3 / 1e9)
PROFILE = [ModuleProfile(f"m{i}", forward_ms=1.0, backward_ms=2.0, param_numels=[NUMEL]) for i in range(3)]
U = 2.0 / 3.0  # one parameter's replicated update

# Every collective, in the order waited for: (kind, bucket, iteration, start ms, end ms).
# The comments follow the compute stream.
EXPECTED = {
    ("dear", "sharded"): (12.0, [
        # it 0: fwd [0,3]; bwd m2 [3,5] -> RS2, m1 [5,7] -> RS1, m0 [7,9] -> RS0; step() waits until 10,
        # updates the shard [10,11], issues AG0..AG2
        ("reduce_scatter", 2, 0, 5, 6), ("reduce_scatter", 1, 0, 7, 8), ("reduce_scatter", 0, 0, 9, 10),
        # it 1 starts at 11: waits AG0 (12), fwd m0 [12,13], m1 [13,14], m2 [14,15]; bwd [15,21]
        ("all_gather", 0, 0, 11, 12), ("all_gather", 1, 0, 12, 13), ("all_gather", 2, 0, 13, 14),
        ("reduce_scatter", 2, 1, 17, 18), ("reduce_scatter", 1, 1, 19, 20), ("reduce_scatter", 0, 1, 21, 22),
        # step [22,23]; the final forward starts at 23: iteration = 23 - 11
        ("all_gather", 0, 1, 23, 24), ("all_gather", 1, 1, 24, 25), ("all_gather", 2, 1, 25, 26),
    ]),
    ("dear", "replicated"): (13.0, [
        ("reduce_scatter", 2, 0, 5, 6), ("reduce_scatter", 1, 0, 7, 8), ("reduce_scatter", 0, 0, 9, 10),
        # step() updates nothing: AGs issued at 10; it 1 starts at 10, waits AG0 (11), updates p0, fwd m0, ...
        ("all_gather", 0, 0, 10, 11), ("all_gather", 1, 0, 11, 12), ("all_gather", 2, 0, 12, 13),
        # fwd ends at 11 + 3 updates + 3 fwd = 16; bwd m2 [16,18], m1 [18,20], m0 [20,22]
        ("reduce_scatter", 2, 1, 18, 19), ("reduce_scatter", 1, 1, 20, 21), ("reduce_scatter", 0, 1, 22, 23),
        ("all_gather", 0, 1, 23, 24), ("all_gather", 1, 1, 24, 25), ("all_gather", 2, 1, 25, 26),
    ]),
    ("wfbp", "replicated"): (13.0, [
        # it 0: AR2 [5,7], AR1 [7,9], AR0 [9,11]; backward returns at 11 with averages; step [11,13]
        ("all_reduce", 2, 0, 5, 7), ("all_reduce", 1, 0, 7, 9), ("all_reduce", 0, 0, 9, 11),
        # it 1 starts at 13: fwd [13,16], bwd m2 [16,18] ...
        ("all_reduce", 2, 1, 18, 20), ("all_reduce", 1, 1, 20, 22), ("all_reduce", 0, 1, 22, 24),
    ]),
    ("bytescheduler", "replicated"): (13.0, [
        # it 0: AR2 [5,7], AR1 [7,9], AR0 [9,11]; step() at 9 waits for nothing
        # it 1 starts at 9: waits AR0 (11), updates p0, fwd m0, ... (fwd ends at 16)
        ("all_reduce", 0, 0, 9, 11), ("all_reduce", 1, 0, 7, 9), ("all_reduce", 2, 0, 5, 7),
        # bwd m2 [16,18] -> AR2 [18,20], m1 -> AR1 [20,22], m0 -> AR0 [22,24]; step at 22: iteration 22 - 9
        ("all_reduce", 0, 1, 22, 24), ("all_reduce", 1, 1, 20, 22), ("all_reduce", 2, 1, 18, 20),
    ]),
}


def assert_timeline(network, schedule, update, iteration_ms, expected):
    p = dearcomm.simulate(PROFILE, schedule=schedule, update=update, world_size=2, network=network, step_ms=2.0,
                          bucket_mb=0, iterations=2)
    assert len(p.layout.buckets) == 3
    got = [(op["kind"], op["bucket"], op["iteration"], op["start_ms"], op["end_ms"]) for op in p.ops]
    assert len(got) == len(expected), got
    for g, e in zip(got, expected):
        assert g[:3] == e[:3] and g[3] == pytest.approx(e[3], abs=1e-9) and g[4] == pytest.approx(e[4], abs=1e-9), \
            (g, e)
    assert p.iteration_ms == pytest.approx(iteration_ms, abs=1e-9)


@pytest.mark.parametrize("schedule,update", list(EXPECTED))
def test_hand_computed_timeline(schedule, update):
    assert_timeline(NETWORK, schedule, update, *EXPECTED[(schedule, update)])


# Compute runs twice as long while a collective is in flight (cores shared with
# the transport): each span below is its work stretched over the busy parts.
SLOW = dataclasses.replace(NETWORK, compute_slowdown=2.0)
EXPECTED_SLOWED = {
    ("wfbp", "replicated"): (15.0, [
        # it 0: fwd [0,3]; bwd m2 [3,5] -> AR2 [5,7]; m1 from 5: half speed to 7 (1 ms of work), done at 8
        # -> AR1 [8,10]; m0 from 8: done at 11 -> AR0 [11,13]; waited at 13; step [13,15]
        ("all_reduce", 2, 0, 5, 7), ("all_reduce", 1, 0, 8, 10), ("all_reduce", 0, 0, 11, 13),
        # it 1 starts at 15: fwd [15,18], bwd m2 [18,20], ... the same shifted by 15
        ("all_reduce", 2, 1, 20, 22), ("all_reduce", 1, 1, 23, 25), ("all_reduce", 0, 1, 26, 28),
    ]),
    ("dear", "sharded"): (14.0, [
        # it 0: bwd m2 [3,5] -> RS2 [5,6]; m1 from 5: 0.5 ms of work by 6, done at 7.5 -> RS1 [7.5,8.5];
        # m0 done at 10 -> RS0 [10,11]; step waits to 11, shard [11,12], AGs issued at 12
        ("reduce_scatter", 2, 0, 5, 6), ("reduce_scatter", 1, 0, 7.5, 8.5), ("reduce_scatter", 0, 0, 10, 11),
        # it 1 starts at 12: waits AG0 (13); fwd m0 beside AG1, AG2: half speed, done at 15; m1 [15,16], m2 [16,17]
        ("all_gather", 0, 0, 12, 13), ("all_gather", 1, 0, 13, 14), ("all_gather", 2, 0, 14, 15),
        # bwd m2 [17,19] -> RS2 [19,20]; m1 done at 21.5 -> RS1; m0 done at 24 -> RS0 [24,25]; step [25,26]
        ("reduce_scatter", 2, 1, 19, 20), ("reduce_scatter", 1, 1, 21.5, 22.5), ("reduce_scatter", 0, 1, 24, 25),
        ("all_gather", 0, 1, 26, 27), ("all_gather", 1, 1, 27, 28), ("all_gather", 2, 1, 28, 29),
    ]),
}


@pytest.mark.parametrize("schedule,update", list(EXPECTED_SLOWED))
def test_hand_computed_timeline_with_compute_slowed_beside_collectives(schedule, update):
    assert_timeline(SLOW, schedule, update, *EXPECTED_SLOWED[(schedule, update)])


# A collective runs twice as long while compute runs beside it (the other
# direction of the same sharing); compute itself is not slowed here.
COMM_SLOW = dataclasses.replace(NETWORK, comm_slowdown=2.0)
EXPECTED_COMM_SLOWED = {
    ("wfbp", "replicated"): (15.0, [
        # it 0: bwd m2 [3,5] -> AR2 from 5; beside m1 [5,7] it does 1 of its 2 ms, beside m0 [7,9] the other:
        # AR2 [5,9]; AR1 (issued 7) and AR0 (issued 9) run alone while backward's end waits: [9,11], [11,13];
        # step [13,15]
        ("all_reduce", 2, 0, 5, 9), ("all_reduce", 1, 0, 9, 11), ("all_reduce", 0, 0, 11, 13),
        ("all_reduce", 2, 1, 20, 24), ("all_reduce", 1, 1, 24, 26), ("all_reduce", 0, 1, 26, 28),
    ]),
    ("dear", "sharded"): (13.0, [
        # it 0: RS2 beside m1 [5,7], RS1 beside m0 [7,9]; RS0 alone while step() waits [9,10]; shard [10,11]
        ("reduce_scatter", 2, 0, 5, 7), ("reduce_scatter", 1, 0, 7, 9), ("reduce_scatter", 0, 0, 9, 10),
        # it 1 starts at 11: AG0 alone [11,12]; AG1 beside fwd m0 [12,13] gets half done, the rest alone while
        # m1 waits: 13.5; AG2 beside fwd m1 [13.5,14.5], the rest alone: 15; fwd m2 [15,16]; bwd [16,22]
        ("all_gather", 0, 0, 11, 12), ("all_gather", 1, 0, 12, 13.5), ("all_gather", 2, 0, 13.5, 15),
        # RS2 beside m1 [18,20], RS1 beside m0 [20,22], RS0 alone [22,23]; shard [23,24]: iteration 24 - 11
        ("reduce_scatter", 2, 1, 18, 20), ("reduce_scatter", 1, 1, 20, 22), ("reduce_scatter", 0, 1, 22, 23),
        ("all_gather", 0, 1, 24, 25), ("all_gather", 1, 1, 25, 26.5), ("all_gather", 2, 1, 26.5, 28),
    ]),
}


@pytest.mark.parametrize("schedule,update", list(EXPECTED_COMM_SLOWED))
def test_hand_computed_timeline_with_collectives_slowed_beside_compute(schedule, update):
    assert_timeline(COMM_SLOW, schedule, update, *EXPECTED_COMM_SLOWED[(schedule, update)])


def test_hand_computed_all_reduces_sharing_the_link_two_at_a_time():
    """all_reduce_lanes=2 (gloo's two worker threads): backward 0.5 ms a
    module, so each 2 ms all-reduce is issued while the one before runs; two
    run at once, each at half the rate, the third waits for a lane. deft asks
    the backend for issue order, so it runs them one at a time whatever the
    network says."""
    quick = [dataclasses.replace(m, backward_ms=0.5) for m in PROFILE]

    def timeline(schedule, lanes):
        p = dearcomm.simulate(quick, schedule=schedule, world_size=2, step_ms=2.0, bucket_mb=0, iterations=1,
                              network=dataclasses.replace(NETWORK, all_reduce_lanes=lanes))
        return sorted((op["bucket"], pytest.approx(op["start_ms"], abs=1e-9), pytest.approx(op["end_ms"], abs=1e-9))
                      for op in p.ops), p.iteration_ms

    # fwd [0,3]; bwd m2 [3,3.5] -> AR2, m1 [3.5,4] -> AR1, m0 [4,4.5] -> AR0; one lane: back to back from 3.5
    one_at_a_time = ([(0, 7.5, 9.5), (1, 5.5, 7.5), (2, 3.5, 5.5)], pytest.approx(11.5))
    assert timeline("wfbp", 1) == one_at_a_time
    # Two lanes: AR2 alone [3.5,4] (1.5 ms of work left); from 4 AR1 beside it, both at half rate: AR2 ends
    # at 7, AR1 has 0.5 left; AR0 starts at 7 beside it: AR1 ends at 8, AR0 has 1.5 left alone: 9.5
    assert timeline("wfbp", 2) == ([(0, 7, 9.5), (1, 4, 8), (2, 3.5, 7)], pytest.approx(11.5))
    assert timeline("deft", 2) == one_at_a_time


def test_hand_computed_timeline_of_deft_whose_ordered_all_reduces_cost_their_own():
    """An all-reduce the backend keeps in issue order (deft's) costs what
    Network's "ordered_all_reduce" says: here half the bandwidth, 4 ms each;
    wfbp's all-reduces keep the "all_reduce" price."""
    slow = dataclasses.replace(NETWORK, per_kind={"ordered_all_reduce": (0.0, NETWORK.gbit_s / 2)})
    p = dearcomm.simulate(PROFILE, schedule="deft", world_size=2, network=slow, step_ms=2.0, bucket_mb=0,
                          iterations=2, delays=[1, 0, 0])
    got = [(op["bucket"], op["iteration"], pytest.approx(op["start_ms"], abs=1e-9),
            pytest.approx(op["end_ms"], abs=1e-9)) for op in p.ops]
    assert got == [
        # it 0: fwd [0,3]; bwd m2 [3,5] -> AR2 [5,9], m1 [5,7] -> AR1 [9,13], m0 [7,9] -> AR0 [13,17] (delayed);
        # backward returns with AR1 at 13, step [13,15]
        (2, 0, 5, 9), (1, 0, 9, 13),
        # it 1 starts at 15: fwd [15,18], bwd m2 [18,20] -> AR2 [20,24], m1 -> AR1 [24,28], m0 -> AR0 [28,32];
        # backward returns at 28 with it 0's AR0; step [28,30]: iteration 30 - 15
        (2, 1, 20, 24), (1, 1, 24, 28), (0, 0, 13, 17), (0, 1, 28, 32),
    ]
    assert p.iteration_ms == pytest.approx(15.0)
    assert dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, network=slow, step_ms=2.0, bucket_mb=0,
                             iterations=2).iteration_ms == pytest.approx(13.0)


def test_hand_computed_timeline_with_gradients_spread_over_a_module_s_backward():
    """One module, two 1 MiB parameters (a bucket each), backward 2 ms; the
    second's gradient ready 0.5 ms into it, the first's at its end."""
    module = ModuleProfile("m", forward_ms=1.0, backward_ms=2.0, param_numels=[NUMEL, NUMEL], grad_ready_ms=[2.0, 0.5])

    def timeline(profile):
        p = dearcomm.simulate(profile, schedule="wfbp", world_size=2, network=NETWORK, step_ms=2.0, bucket_mb=0,
                              iterations=1)
        return sorted((op["bucket"], op["start_ms"], op["end_ms"]) for op in p.ops), p.iteration_ms

    # fwd [0,1]; AR1 [1.5,3.5]; AR0 ready at 3, behind it [3.5,5.5]; backward waits to 5.5; step [5.5,7.5]
    assert timeline([module]) == ([(0, pytest.approx(3.5), pytest.approx(5.5)),
                                   (1, pytest.approx(1.5), pytest.approx(3.5))], pytest.approx(7.5))
    # Without the spacing both are ready at 3: AR1 [3,5], AR0 [5,7], step [7,9].
    whole = dataclasses.replace(module, grad_ready_ms=())
    assert timeline([whole]) == ([(0, pytest.approx(5), pytest.approx(7)), (1, pytest.approx(3), pytest.approx(5))],
                                 pytest.approx(9))


def test_hand_computed_timeline_with_packing_and_averaging_on_the_host():
    """The host copies a bucket's gradients in before its reduction (1 ms per
    MiB here) and divides what this rank reduced after the wait (0.5 ms per
    MiB), both on the compute stream."""
    p = dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, network=NETWORK, step_ms=2.0, bucket_mb=0,
                          iterations=1, pack_ms_per_mib=1.0, average_ms_per_mib=0.5)
    # fwd [0,3]; bwd m2 [3,5], pack [5,6] -> AR2 [6,8]; m1 [6,8], pack [8,9] -> AR1 [9,11]; m0 [9,11],
    # pack [11,12] -> AR0 [12,14]; averages after each wait: [12,12.5], [12.5,13], [14,14.5]; step to 16.5
    got = [(op["bucket"], op["start_ms"], op["end_ms"]) for op in p.ops]
    assert got == [(2, pytest.approx(6), pytest.approx(8)), (1, pytest.approx(9), pytest.approx(11)),
                   (0, pytest.approx(12), pytest.approx(14))], got
    averages = [(s["start_ms"], s["end_ms"]) for s in p.spans if s["name"] == "average"]
    assert averages == [pytest.approx((12, 12.5)), pytest.approx((12.5, 13)), pytest.approx((14, 14.5))]
    assert p.iteration_ms == pytest.approx(16.5)
    # A reduce-scatter leaves this rank 1/p of the bucket to divide: 0.25 ms each.
    dear = dearcomm.simulate(PROFILE, schedule="dear", world_size=2, network=NETWORK, step_ms=2.0, bucket_mb=0,
                             iterations=1, average_ms_per_mib=0.5)
    assert [s["end_ms"] - s["start_ms"] for s in dear.spans if s["name"] == "average"] == [pytest.approx(0.25)] * 3


def test_hand_computed_timeline_with_each_collective_s_host_cost():
    """Each all-reduce costs the compute stream 0.5 ms (Network.host_ms): owed
    from its issue, paid before the next compute, absorbed by a wait at least
    that long."""
    network = dataclasses.replace(NETWORK, host_ms={"all_reduce": 0.5})
    p = dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, network=network, step_ms=2.0, bucket_mb=0,
                          iterations=1)
    # fwd [0,3]; bwd m2 [3,5] -> AR2 [5,7]; host [5,5.5], m1 [5.5,7.5] -> AR1 [7.5,9.5]; host [7.5,8], m0 [8,10]
    # -> AR0 [10,12]; the wait from 10 to 12 absorbs AR0's; step [12,14]
    got = [(op["bucket"], op["start_ms"], op["end_ms"]) for op in p.ops]
    assert got == [(2, pytest.approx(5), pytest.approx(7)), (1, pytest.approx(7.5), pytest.approx(9.5)),
                   (0, pytest.approx(10), pytest.approx(12))], got
    host = [(s["start_ms"], s["end_ms"]) for s in p.spans if s["name"] == "host"]
    assert host == [pytest.approx((5, 5.5)), pytest.approx((7.5, 8))]
    assert p.iteration_ms == pytest.approx(14.0)
    # Other kinds' costs leave an all-reduce schedule alone; without them: 13 ms (EXPECTED).
    other = dataclasses.replace(NETWORK, host_ms={"reduce_scatter": 3.0, "all_gather": 3.0})
    assert dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, network=other, step_ms=2.0, bucket_mb=0,
                             iterations=1).iteration_ms == pytest.approx(13.0)


def test_the_host_cpu_bounds_the_iteration_where_it_is_longer_than_the_timeline():
    """Network.host_ms_per_mib: each all-reduce of a 1 MiB bucket takes 4 ms
    of host CPU, and 2x that beside compute (comm_cpu_slowdown); with 0.5 ms
    per call, three per iteration: cpu = compute (3 + 6 + 2) + 3·2·(0.5 + 4)."""
    mib_profile = [ModuleProfile(f"m{i}", 1.0, 2.0, [MIB // 4]) for i in range(3)]
    fast = Network(alpha_us=0.0, gbit_s=math.inf, host_ms={"all_reduce": 0.5}, host_ms_per_mib={"all_reduce": 4.0},
                   comm_cpu_slowdown=2.0)
    p = dearcomm.simulate(mib_profile, schedule="wfbp", world_size=2, network=fast, step_ms=2.0, bucket_mb=0)
    # The timeline: 11 ms of compute and three host costs paid before the next compute (none waits).
    assert p.timeline_ms == pytest.approx(11.0 + 3 * 0.5)
    assert p.cpu_ms == pytest.approx(11.0 + 3 * 2 * (0.5 + 4.0))
    assert p.iteration_ms == pytest.approx(p.cpu_ms)
    # Unset, the factor is comm_slowdown's (the collectives' wall beside compute).
    walled = dearcomm.simulate(mib_profile, schedule="wfbp", world_size=2, bucket_mb=0, step_ms=2.0,
                               network=dataclasses.replace(fast, comm_cpu_slowdown=None, comm_slowdown=1.5))
    assert walled.cpu_ms == pytest.approx(11.0 + 3 * 1.5 * (0.5 + 4.0))
    # Given, it replaces comm_slowdown in the bound (which then charges their CPU, not their wall).
    stretched = dearcomm.simulate(mib_profile, schedule="wfbp", world_size=2, bucket_mb=0, step_ms=2.0,
                                  network=dataclasses.replace(fast, comm_slowdown=3.0, comm_cpu_slowdown=1.0))
    assert stretched.cpu_ms == pytest.approx(11.0 + 3 * (0.5 + 4.0))
    # Where the link exposes its all-reduces the timeline is the longer: the bound leaves it alone.
    slow = dataclasses.replace(fast, gbit_s=NETWORK.gbit_s / 16)
    plain = dearcomm.simulate(mib_profile, schedule="wfbp", world_size=2, network=slow, step_ms=2.0, bucket_mb=0)
    assert plain.cpu_ms == pytest.approx(p.cpu_ms)
    assert plain.iteration_ms == pytest.approx(plain.timeline_ms) and plain.timeline_ms > plain.cpu_ms
    # A sharded update counts its shard of the step, and the all-gathers' CPU: 0.5 ms per MiB each.
    dear = dearcomm.simulate(mib_profile, schedule="dear", world_size=2, network=dataclasses.replace(
        fast, host_ms={}, host_ms_per_mib={"reduce_scatter": 1.0, "all_gather": 0.5}), step_ms=2.0, bucket_mb=0)
    assert dear.cpu_ms == pytest.approx(3 + 6 + 1.0 + 3 * 2 * (1.0 + 0.5))
    # A replicated update runs before each forward from the second iteration on: the steady
    # iteration's bound counts it (2 ms over the three), the first iteration's would not.
    replicated = dearcomm.simulate(mib_profile, schedule="dear", update="replicated", world_size=2,
                                   network=dataclasses.replace(fast, host_ms={}, host_ms_per_mib={
                                       "reduce_scatter": 1.0, "all_gather": 0.5}), step_ms=2.0, bucket_mb=0)
    assert replicated.cpu_ms == pytest.approx(3 + 2.0 + 6 + 3 * 2 * (1.0 + 0.5))


def test_compute_beside_a_collective_counts_compute_cpu_slowdown_times_its_work_in_the_bound():
    """Network.compute_cpu_slowdown = 1.5 on the hand-computed timelines
    (EXPECTED): wfbp's steady iteration runs backward m1 and m0 (4 ms of
    work) beside AR2 and AR1, fwd, m2's backward and the step alone; dear's
    forward of m0 and m1 runs beside AG1 and AG2, backward m1 and m0 each 1 ms
    beside RS2 and RS1 (4 ms). Each collective's CPU: 4 ms per MiB."""
    mu = dataclasses.replace(NETWORK, compute_cpu_slowdown=1.5, host_ms_per_mib={"all_reduce": 4.0})
    wfbp = dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, network=mu, step_ms=2.0, bucket_mb=0)
    assert wfbp.timeline_ms == pytest.approx(13.0)
    assert wfbp.cpu_ms == pytest.approx(3 + 6 + 2 + 0.5 * 4 + 3 * 4.0)
    # ν scales only the collectives' part.
    both = dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, step_ms=2.0, bucket_mb=0,
                             network=dataclasses.replace(mu, comm_cpu_slowdown=1.25))
    assert both.cpu_ms == pytest.approx(3 + 6 + 2 + 0.5 * 4 + 1.25 * 3 * 4.0)
    dear = dearcomm.simulate(PROFILE, schedule="dear", world_size=2, step_ms=2.0, bucket_mb=0, network=dataclasses.replace(
        mu, host_ms_per_mib={"reduce_scatter": 1.0, "all_gather": 0.5}))
    assert dear.timeline_ms == pytest.approx(12.0)
    assert dear.cpu_ms == pytest.approx(3 + 6 + 1 + 0.5 * 4 + 3 * (1.0 + 0.5))
    # Without a collective beside it compute counts as alone: an infinitely fast link.
    alone = dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, step_ms=2.0, bucket_mb=0,
                              network=dataclasses.replace(mu, gbit_s=math.inf))
    assert alone.cpu_ms == pytest.approx(11 + 3 * 4.0)


def test_the_ranks_meeting_every_iteration_take_the_slowest_ranks_bound():
    """Network.iteration_cv = 0.1: where the host CPU bounds the iteration
    (the test above's 20 ms of CPU), it takes 1 + 0.1 x the expected largest
    of world_size standard normals times that; the CPU itself and a timeline
    that is the longer stay as they are."""
    mib_profile = [ModuleProfile(f"m{i}", 1.0, 2.0, [MIB // 4]) for i in range(3)]
    fast = Network(alpha_us=0.0, gbit_s=math.inf, host_ms={"all_reduce": 0.5}, host_ms_per_mib={"all_reduce": 4.0},
                   comm_cpu_slowdown=1.0)
    spread = dataclasses.replace(fast, iteration_cv=0.1)
    for world, slowest in ((2, 1 / math.sqrt(math.pi)), (3, 1.5 / math.sqrt(math.pi)), (4, 1.0294)):
        p = dearcomm.simulate(mib_profile, schedule="wfbp", world_size=world, network=spread, step_ms=2.0,
                              bucket_mb=0)
        assert p.cpu_ms == pytest.approx(11.0 + 3 * 4.5, rel=1e-3)  # 3 ranks pad the buckets a little
        assert p.iteration_ms == pytest.approx(p.cpu_ms * (1 + 0.1 * slowest), rel=1e-4)
        assert dearcomm.prediction.expected_slowest_of(world) == pytest.approx(slowest, rel=1e-4)
    assert dearcomm.prediction.expected_slowest_of(1) == pytest.approx(0.0, abs=1e-9)
    # Ranks that fill their own cores (share <= 1) meet the slowest; ranks taking turns on shared cores
    # (share > 1) hand the waiting one's core to the slower: the bound as it is.
    for share, factor in ((0.0, 1.0294), (0.5, 1.0294), (1.0, 1.0294), (1.5, 0.0), (2.0, 0.0)):
        p = dearcomm.simulate(mib_profile, schedule="wfbp", world_size=4, step_ms=2.0, bucket_mb=0,
                              network=dataclasses.replace(spread, cores_share=share))
        assert p.iteration_ms == pytest.approx(p.cpu_ms * (1 + 0.1 * factor), rel=1e-4), share
    for bad in (-1.0, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError, match="cores_share must be a non-negative finite number"):
            dearcomm.simulate(mib_profile, schedule="wfbp", world_size=4, step_ms=2.0, bucket_mb=0,
                              network=dataclasses.replace(spread, cores_share=bad))
    assert dearcomm.prediction.expected_slowest_of(64) == pytest.approx(2.3437, rel=1e-3)
    # A link that exposes its all-reduces: the timeline is the longer, the spread leaves it.
    slow = dataclasses.replace(spread, gbit_s=NETWORK.gbit_s / 16)
    plain = dearcomm.simulate(mib_profile, schedule="wfbp", world_size=2, network=slow, step_ms=2.0, bucket_mb=0)
    assert plain.iteration_ms == pytest.approx(plain.timeline_ms) and plain.timeline_ms > plain.cpu_ms * 1.06
    for bad in (-0.1, float("nan"), float("inf"), "0.1"):
        with pytest.raises(ValueError, match="iteration_cv must be a non-negative finite number"):
            dearcomm.simulate(mib_profile, schedule="wfbp", world_size=2, step_ms=2.0, bucket_mb=0,
                              network=dataclasses.replace(fast, iteration_cv=bad))
    with pytest.raises(ValueError, match="expected_slowest_of needs a count >= 1"):
        dearcomm.prediction.expected_slowest_of(0)


def test_the_simulators_own_iteration_is_the_prediction_and_checks_its_spread():
    """The C++ simulator applies the slowest rank itself: its iteration_s is
    what dearcomm.simulate returns, and it refuses a bad spread on its own."""
    layout = _C.plan_buckets([MIB // 4], [torch.float32], 0, 4)
    costs = {kind: (0.0, 0.0) for kind in ("reduce_scatter", "all_gather", "all_reduce")}
    args = (layout, None, [("m", 1e-3, 2e-3, [0])], 0.0, [MIB // 4], dearcomm.WrapOptions(schedule="wfbp").choice,
            costs, 2)
    host = dict(host_s={"all_reduce": 1e-3})
    plain = _C.simulate(*args, **host)
    spread = _C.simulate(*args, **host, iteration_cv=0.1)
    assert plain["cpu_s"] == pytest.approx(4e-3) and plain["iteration_s"] == pytest.approx(4e-3)
    assert spread["iteration_s"] == pytest.approx(4e-3 * (1 + 0.1 * _C.expected_slowest_of(4)))
    assert _C.simulate(*args, **host, iteration_cv=0.1, cores_share=2.0)["iteration_s"] == pytest.approx(4e-3)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="iteration_cv must be a finite number >= 0"):
            _C.simulate(*args, iteration_cv=bad)
        with pytest.raises(ValueError, match="cores_share must be a finite number >= 0"):
            _C.simulate(*args, cores_share=bad)
    with pytest.raises(ValueError, match="expected_slowest_of needs a count >= 1"):
        _C.expected_slowest_of(0)


def test_a_wait_runs_from_when_compute_asked_to_when_the_collective_ended():
    # wfbp, collectives slowed beside compute (above): backward ends at 9 and waits for AR1 (to 11), AR0 (to 13).
    p = dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, network=COMM_SLOW, step_ms=2.0, bucket_mb=0,
                          iterations=1)
    waits = [(op["bucket"], op["wait_begin_ms"], op["wait_end_ms"]) for op in p.ops]
    assert waits == [(2, pytest.approx(9), pytest.approx(9)), (1, pytest.approx(9), pytest.approx(11)),
                     (0, pytest.approx(11), pytest.approx(13))], waits


def test_replicated_updates_each_parameter_before_its_forward():
    p = dearcomm.simulate(PROFILE, schedule="dear", update="replicated", world_size=2, network=NETWORK, step_ms=2.0,
                          bucket_mb=0, iterations=2)
    it1 = [(s["name"], s["start_ms"], s["end_ms"]) for s in p.spans if s["iteration"] == 1][:6]
    expected = [("update", 11, 11 + U), ("fwd m0", 11 + U, 12 + U), ("update", 12 + U, 12 + 2 * U),
                ("fwd m1", 12 + 2 * U, 13 + 2 * U), ("update", 13 + 2 * U, 15), ("fwd m2", 15, 16)]
    for g, e in zip(it1, expected):
        assert g[0] == e[0] and g[1] == pytest.approx(e[1]) and g[2] == pytest.approx(e[2]), (g, e)


def test_a_prediction_draws_as_a_timeline(tmp_path):
    from dearcomm.timeline import plot_gantt, write_chrome_trace
    p = dearcomm.simulate(PROFILE, world_size=2, network=NETWORK, step_ms=2.0, bucket_mb=0)
    events = p.timeline_events()
    assert {e["lane"] for e in events} == {"compute", "reduce", "gather"}
    write_chrome_trace(str(tmp_path / "trace.json"), {"dear (predicted)": [events]})
    plot_gantt(str(tmp_path / "trace.png"), {"dear (predicted)": events})
    assert (tmp_path / "trace.json").stat().st_size > 0 and (tmp_path / "trace.png").stat().st_size > 0
    rows = p.buckets()
    assert [r["bucket"] for r in rows] == [0, 1, 2] and all("gather_end_ms" in r for r in rows)


def test_more_ranks_cost_more_and_a_faster_network_less():
    base = dict(schedule="dear", step_ms=2.0, bucket_mb=0)
    t2 = dearcomm.simulate(PROFILE, world_size=2, network=NETWORK, **base).iteration_ms
    t8 = dearcomm.simulate(PROFILE, world_size=8, network=Network(alpha_us=50, gbit_s=NETWORK.gbit_s), **base)
    fast = dearcomm.simulate(PROFILE, world_size=2, network=Network(alpha_us=0, gbit_s=1e6), **base).iteration_ms
    assert t8.iteration_ms > t2 > fast
    # Perfect overlap bounds it below: compute alone is 3 + 6 + 1 ms.
    assert fast == pytest.approx(10.0, abs=1e-3)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(world_size=1), ValueError, "world_size must be an int >= 2"),
    (dict(schedule="nope"), ValueError, "unknown schedule"),
    (dict(step_ms=float("nan")), ValueError, "step_ms must be"),
    (dict(pack_ms_per_mib=-1.0), ValueError, "pack_ms_per_mib must be"),
    (dict(average_ms_per_mib=math.inf), ValueError, "average_ms_per_mib must be"),
    (dict(network="25gbe"), TypeError, r"got str; for a preset, network=dearcomm.network_preset\('25gbe'\)"),
    (dict(profile="profile.json"), TypeError,
     r"got a path \('profile.json'\); read a saved one with dearcomm.TrainingProfile.load\(path\)"),
    (dict(iterations=0), ValueError, "iterations must be"),
    (dict(profile=[ModuleProfile("m", float("nan"), 1.0, [10])]), ValueError, "'m' forward_ms must be"),
    (dict(profile=[ModuleProfile("m", 1.0, 1.0, [0])]), ValueError, "parameter of 0 elements"),
    (dict(profile=[ModuleProfile("m", 1.0, 1.0, [])]), ValueError, "no parameter"),
    (dict(profile=[ModuleProfile("m", 1.0, 1.0, [10], grad_ready_ms=[0.5, 1.0])]), ValueError,
     "1 parameters but 2 grad_ready_ms"),
    (dict(profile=[ModuleProfile("m", 1.0, 1.0, [10], grad_ready_ms=[1.5])]), ValueError,
     "gradient ready 1.5 ms into its backward, after its backward_ms"),
    (dict(profile=[ModuleProfile("m", 1.0, 1.0, [10], grad_ready_ms=[-0.5])]), ValueError, "grad_ready_ms must be"),
    (dict(profile=[ModuleProfile("m", 1.0, 1.0, [10], grad_ready_ms=[math.nan])]), ValueError,
     "grad_ready_ms must be"),
    (dict(profile=None), TypeError, "the profile is a dearcomm.TrainingProfile .* got NoneType"),
])
def test_bad_inputs_get_clear_errors(kwargs, error, match):
    args = dict(profile=PROFILE, world_size=2, network=NETWORK)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        dearcomm.simulate(args.pop("profile"), **args)


@pytest.mark.parametrize("figures,match", [
    (dict(alpha_us=-1, gbit_s=1), "Network alpha_us must be"),
    (dict(alpha_us=1, gbit_s=0), "gbit_s must be"),
    (dict(alpha_us=1, gbit_s=1, per_kind={"broadcast": (1, 1)}), "per_kind names"),
    (dict(alpha_us=1, gbit_s=1, per_kind={"ordered_all_reduce": (1, -1)}), "ordered_all_reduce gbit_s must be"),
    (dict(alpha_us=1, gbit_s=1, per_kind={"all_reduce": (1,)}),
     r"per_kind\['all_reduce'\] must be \(alpha_us, gbit_s\), got \(1,\)"),
    (dict(alpha_us=1, gbit_s=1, per_kind={"all_gather": "x"}), r"per_kind\['all_gather'\] must be \(alpha_us, gbit_s\)"),
    (dict(alpha_us=1, gbit_s=1, host_ms={"ordered_all_reduce": math.inf}), "ordered_all_reduce host_ms must be"),
    (dict(alpha_us=1, gbit_s=1, host_ms_per_mib={"broadcast": 1.0}), "host_ms_per_mib names"),
    (dict(alpha_us=1, gbit_s=1, host_ms_per_mib={"reduce_scatter": -0.5}), "reduce_scatter host_ms_per_mib must be"),
    (dict(alpha_us=1, gbit_s=1, host_ms_per_mib={"all_reduce": math.inf}), "all_reduce host_ms_per_mib must be"),
    (dict(alpha_us=1, gbit_s=1, host_ms={"broadcast": 1.0}), "host_ms names"),
    (dict(alpha_us=1, gbit_s=1, host_ms={"all_reduce": -1.0}), "all_reduce host_ms must be"),
    (dict(alpha_us=1, gbit_s=1, host_ms={"all_gather": math.nan}), "all_gather host_ms must be"),
    (dict(alpha_us=1, gbit_s=1, compute_slowdown=0.5), "compute_slowdown must be"),
    (dict(alpha_us=1, gbit_s=1, compute_slowdown=math.inf), "compute_slowdown must"),
    (dict(alpha_us=1, gbit_s=1, comm_slowdown=0.9), "comm_slowdown must be"),
    (dict(alpha_us=1, gbit_s=1, comm_slowdown=math.nan), "comm_slowdown must be"),
    (dict(alpha_us=1, gbit_s=1, comm_cpu_slowdown=0.5), "comm_cpu_slowdown must be"),
    (dict(alpha_us=1, gbit_s=1, compute_cpu_slowdown=0.9), "compute_cpu_slowdown must be"),
    (dict(alpha_us=1, gbit_s=1, comm_cpu_slowdown=math.inf), "comm_cpu_slowdown must be"),
    (dict(alpha_us=1, gbit_s=1, all_reduce_lanes=0), "all_reduce_lanes must be"),
    (dict(alpha_us=1, gbit_s=1, all_reduce_lanes=1.5), "all_reduce_lanes must be"),
])
def test_bad_network_figures_are_refused_where_the_network_is_made(figures, match):
    with pytest.raises(ValueError, match=match):
        Network(**figures)


def test_numpy_numbers_are_taken_as_numbers():
    import numpy as np

    plain = dearcomm.simulate(PROFILE, world_size=8, network=NETWORK, step_ms=1.0).iteration_ms
    numpy = dearcomm.simulate(PROFILE, world_size=np.int64(8), network=NETWORK, step_ms=np.float32(1.0)).iteration_ms
    assert numpy == pytest.approx(plain)
    pair = Network(alpha_us=NETWORK.alpha_us, gbit_s=NETWORK.gbit_s, per_kind={"all_reduce": np.array([5.0, 10.0])})
    assert dearcomm.simulate(PROFILE, world_size=8, network=pair).iteration_ms > 0
    for figures in (np.array(3.0), torch.tensor(2.0), {5.0, 10.0}):
        with pytest.raises(ValueError, match=r"per_kind\['all_reduce'\] must be \(alpha_us, gbit_s\)"):
            Network(alpha_us=1, gbit_s=1, per_kind={"all_reduce": figures})


def test_every_schedule_and_update_runs_on_the_simulated_device():
    for name, entry in {e["name"]: e for e in dearcomm._C.schedules()}.items():
        for update in entry["updates"]:
            p = dearcomm.simulate(PROFILE, schedule=name, update=update, world_size=4, network=NETWORK,
                                  step_ms=1.0, bucket_mb=0.5)
            assert math.isfinite(p.iteration_ms) and p.iteration_ms >= 9.0  # compute alone: 3 + 6 ms


def test_hand_computed_timeline_of_deft_with_the_input_side_bucket_one_step_late():
    """deft, bucket 0 delayed: its all-reduce (launched last, ending 2 ms
    after backward) is no longer waited when backward returns but by the
    next backward's end, so each iteration is 11 ms instead of wfbp's 13."""
    p = dearcomm.simulate(PROFILE, schedule="deft", world_size=2, network=NETWORK, step_ms=2.0, bucket_mb=0,
                          iterations=2, delays=[1, 0, 0])
    got = [(op["kind"], op["bucket"], op["iteration"], pytest.approx(op["start_ms"], abs=1e-9),
            pytest.approx(op["end_ms"], abs=1e-9)) for op in p.ops]
    assert got == [
        # it 0: fwd [0,3]; bwd m2 [3,5] -> AR2 [5,7], m1 -> AR1 [7,9], m0 [7,9] -> AR0 [9,11], left in flight;
        # backward returns at 9 (AR1), step [9,11]
        ("all_reduce", 2, 0, 5, 7), ("all_reduce", 1, 0, 7, 9),
        # it 1 starts at 11: fwd [11,14], bwd m2 [14,16] -> AR2 [16,18], m1 -> AR1 [18,20], m0 -> AR0 [20,22] in
        # slot 1; backward returns at 20 with it 0's AR0 (ended at 11) for bucket 0; step [20,22]
        ("all_reduce", 2, 1, 16, 18), ("all_reduce", 1, 1, 18, 20), ("all_reduce", 0, 0, 9, 11),
        # the final forward starts at 22: iteration = 22 - 11; its flush waits for it 1's AR0
        ("all_reduce", 0, 1, 20, 22),
    ]
    assert p.iteration_ms == pytest.approx(11.0)
    assert dearcomm.simulate(PROFILE, schedule="wfbp", world_size=2, network=NETWORK, step_ms=2.0, bucket_mb=0,
                             iterations=2).iteration_ms == pytest.approx(13.0)
