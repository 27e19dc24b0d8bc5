"""fit_compute_slowdown(): the simulator's compute slowdown beside collectives,
recovered from timings (dearcomm/contention.py, benchmarks/contention.py)."""
import json
import os
import random
import statistics

import pytest

import dearcomm
from dearcomm.contention import (collectives_cpu, fit_comm_cpu_slowdown, fit_compute_cpu_slowdown, fit_compute_slowdown,
                                 fit_iteration_cv, with_contention)
from tests.multiprocess import run_workers

WORK_S = 0.010


def wall(work_s, covered, slowdown):
    """An iteration of `work_s` whose wall time a collective covers for the
    fraction `covered`: w = wall·(1-c) + wall·c/κ."""
    return work_s / ((1 - covered) + covered / slowdown)


@pytest.mark.parametrize("slowdown", [1.0, 1.25, 1.6, 3.0])
def test_recovers_a_known_slowdown(slowdown):
    rng = random.Random(0)
    alone = [WORK_S * rng.uniform(0.98, 1.02) for _ in range(12)]
    beside = []
    for _ in range(40):
        c = rng.uniform(0.3, 1.0)  # some iterations only partly covered, as at the ends of the stream
        beside.append((wall(WORK_S, c, slowdown) * rng.uniform(0.98, 1.02), c))
    fit = fit_compute_slowdown(alone_s=alone, beside=beside)
    assert fit.slowdown == pytest.approx(slowdown, rel=0.04)
    assert fit.used == sum(c >= 0.5 for _, c in beside)
    assert fit.alone_ms == pytest.approx(WORK_S * 1e3, rel=0.02)


def test_exact_when_fully_covered():
    fit = fit_compute_slowdown(alone_s=[WORK_S] * 3, beside=[(WORK_S * 1.3, 1.0)] * 5)
    assert fit.slowdown == pytest.approx(1.3, rel=1e-12)


def test_reads_the_benchmark_json(tmp_path):
    path = tmp_path / "contention.json"
    path.write_text(json.dumps(dict(alone_s=[WORK_S] * 4, beside=[[wall(WORK_S, 0.8, 1.5), 0.8]] * 4)))
    assert dearcomm.fit_compute_slowdown(path).slowdown == pytest.approx(1.5, rel=1e-9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(alone_s=[], beside=[(0.01, 1.0)]), "needs compute iterations alone and beside"),
    (dict(alone_s=[-0.01], beside=[(0.01, 1.0)]), "compute time alone must be a positive finite number, got -0.01"),
    (dict(alone_s=[float("nan")], beside=[(0.01, 1.0)]), "compute time alone must be"),
    (dict(alone_s=[0.01], beside=[(float("inf"), 1.0)]), "compute time beside collectives must be"),
    (dict(alone_s=[0.01], beside=[(0.01, 1.5)]), r"busy fraction .* must be in \[0, 1\], got 1.5"),
    (dict(alone_s=[0.01], beside=[(0.012, 0.2)]), "no iteration beside collectives was covered"),
])
def test_bad_timings_get_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match="dearcomm: .*" + match):
        fit_compute_slowdown(**kwargs)


def test_a_file_without_timings_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="has no 'alone_s' and 'beside'"):
        fit_compute_slowdown(path)


def test_comm_slowdown_is_the_ratio_of_median_times_and_never_below_one():
    from dearcomm.contention import fit_comm_slowdown
    assert fit_comm_slowdown([1.0, 1.1, 0.9], [2.2, 1.8, 2.0, 9.0]) == pytest.approx(2.1 / 1.0)
    assert fit_comm_slowdown([1.0], [0.8]) == 1.0  # faster beside compute: noise, not a speed-up
    with pytest.raises(ValueError, match="dearcomm: fit_comm_slowdown needs"):
        fit_comm_slowdown([], [1.0])
    with pytest.raises(ValueError, match="a collective's time beside compute must be a positive"):
        fit_comm_slowdown([1.0], [float("nan")])


SLOW_CALLS = 4  # two warm-ups and the first two timed iterations


def _slow_start(rank, world_size):
    """measure_contention on a compute whose first calls take 10x longer (a
    model's first iterations, before its memory settles): the 'alone' time
    the fit uses must be the settled one."""
    import time

    from dearcomm.contention import measure_contention

    calls = [0]

    def compute():
        calls[0] += 1
        time.sleep(0.2 if calls[0] <= SLOW_CALLS else 0.02)

    measured = measure_contention(compute, nbytes=1 << 16, iters=3)
    return statistics.median(measured["alone_s"]), len(measured["alone_s"])


def test_alone_is_timed_on_both_sides_of_the_collectives():
    for alone, samples in run_workers(_slow_start, 2, deadline=120):
        assert samples == 6, "3 compute iterations alone before the collectives and 3 after"
        assert alone < 0.1, f"alone {alone * 1e3:.0f} ms: the slow first iterations made the median"


def _uneven(rank, world_size):
    """measure_contention where rank 1's compute takes 5x rank 0's: each
    timed iteration alone must still start on every rank together."""
    import time

    from dearcomm.contention import measure_contention

    starts = []

    def compute():
        starts.append(time.time())
        time.sleep(0.1 if rank == 1 else 0.02)

    measure_contention(compute, nbytes=1 << 16, iters=3)
    return starts[2:5] + starts[-3:]  # after the 2 warm-ups: alone before, alone after


def test_ranks_time_each_iteration_alone_together():
    rank0, rank1 = run_workers(_uneven, 2, deadline=120)
    gaps = [abs(a - b) for a, b in zip(rank0, rank1)]
    assert max(gaps) < 0.1, f"iterations alone started {max(gaps) * 1e3:.0f} ms apart on the two ranks"


def _compute_fails(rank, world_size, call):
    """measure_contention where rank 1's compute raises at its `call`-th call
    (1: a warm-up; 5: the last iteration timed alone before the collectives;
    6: the first beside them, with this rank's all-reduce thread running)."""
    import time

    from dearcomm.contention import measure_contention

    calls = [0]

    def compute():
        calls[0] += 1
        if rank == 1 and calls[0] == call:
            raise RuntimeError(f"rank 1's compute broke at call {call}")
        time.sleep(0.02)

    try:
        measure_contention(compute, nbytes=1 << 16, iters=3)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("call", [1, 5, 6])
def test_a_rank_whose_compute_fails_fails_every_rank_without_a_hang(call):
    # Before, the other rank waited in a barrier for the group's timeout (30 min).
    rank0, rank1 = run_workers(_compute_fails, 2, call, deadline=90)
    assert rank1 == f"RuntimeError: rank 1's compute broke at call {call}"
    assert rank0 == (f"PeerFailed: dearcomm: measure_contention() failed on rank 1: RuntimeError: rank 1's "
                     f"compute broke at call {call}")


def _cpu_of_each_part(rank, world_size):
    """measure_contention on a compute that keeps its thread busy ~20 ms."""
    import time

    import torch

    from dearcomm.contention import measure_contention

    torch.set_num_threads(1)  # the compute's CPU is then its thread's

    def compute():
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    return measure_contention(compute, nbytes=1 << 20, iters=3)


def test_the_cpu_of_compute_and_of_the_collectives_is_recorded_apart():
    for m in run_workers(_cpu_of_each_part, 2, deadline=120):
        assert len(m["alone_cpu_s"]) == 6 and len(m["comm_alone_cpu_s"]) == 3
        assert all(0.018 < c < 0.05 for c in m["alone_cpu_s"]), m["alone_cpu_s"]
        # The compute's thread ran its loop the whole time beside the collectives, at most one core of it.
        assert 0 < m["beside_compute_cpu_s"] <= m["beside_compute_wall_s"] + 0.005
        assert m["beside_compute_cpu_s"] >= 0.018 * len(m["beside"])
        assert m["beside_comm_count"] >= 2
        # The all-reduces' CPU is the backend's threads', not the compute's.
        assert m["beside_comm_cpu_s"] > 0 and all(c > 0 for c in m["comm_alone_cpu_s"])
        # One intra-op thread: the process's CPU alone is the compute thread's (a little more, not twice).
        assert len(m["alone_process_cpu_s"]) == 6
        assert all(t - 0.002 <= p < 1.5 * t for p, t in zip(m["alone_process_cpu_s"], m["alone_cpu_s"]))
        # The machine's CPU over each phase: busy and idle cover its cores over the phase's wall.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        for phase in ("alone_machine_s", "beside_machine_s"):
            seen = m[phase]
            assert seen["wall"] > 0 and 0 <= seen["softirq"] <= seen["busy"], seen
            if os.path.exists("/proc/stat") and cores == os.cpu_count():
                assert (seen["busy"] + seen["idle"]) == pytest.approx(cores * seen["wall"], rel=0.3, abs=0.05), seen
        assert m["beside_process_cpu_s"] >= m["beside_compute_cpu_s"]
        # ν is their CPU per all-reduce beside over alone, as fitted from what was recorded.
        assert m["comm_cpu_slowdown"] == pytest.approx(fit_comm_cpu_slowdown(
            m["comm_alone_cpu_s"], m["beside_comm_cpu_s"], m["beside_comm_count"])) and m["comm_cpu_slowdown"] >= 1
        assert m["compute_cpu_slowdown"] == pytest.approx(fit_compute_cpu_slowdown(
            m["alone_cpu_s"], m["beside_compute_cpu_s"], len(m["beside"]))) and m["compute_cpu_slowdown"] >= 1
        assert m["iteration_cv"] == pytest.approx(fit_iteration_cv(m["alone_s"])) and m["iteration_cv"] > 0


def test_comm_cpu_slowdown_is_the_cpu_per_collective_beside_over_alone_and_never_below_one():
    assert fit_comm_cpu_slowdown([0.010, 0.012, 0.011], 0.33, 25) == pytest.approx(0.0132 / 0.011)
    assert fit_comm_cpu_slowdown([0.010], 0.05, 10) == 1.0  # less beside compute: noise, not a saving
    for alone, beside, count in (([], 0.1, 3), ([0.01], 0.1, 0), ([0.01], 0.1, 2.5), ([0.01], 0.1, True)):
        with pytest.raises(ValueError, match="fit_comm_cpu_slowdown needs"):
            fit_comm_cpu_slowdown(alone, beside, count)
    with pytest.raises(ValueError, match="a collective's CPU alone must be a positive"):
        fit_comm_cpu_slowdown([0.0], 0.1, 2)
    with pytest.raises(ValueError, match="the collectives' CPU beside compute"):
        fit_comm_cpu_slowdown([0.01], float("nan"), 2)


def test_compute_cpu_slowdown_is_the_cpu_per_iteration_beside_over_alone_and_never_below_one():
    assert fit_compute_cpu_slowdown([0.020, 0.022, 0.021], 0.105, 4) == pytest.approx(0.02625 / 0.021)
    assert fit_compute_cpu_slowdown([0.020], 0.03, 2) == 1.0
    for alone, beside, count in (([], 0.1, 3), ([0.02], 0.1, 0), ([0.02], 0.1, None)):
        with pytest.raises(ValueError, match="fit_compute_cpu_slowdown needs"):
            fit_compute_cpu_slowdown(alone, beside, count)
    with pytest.raises(ValueError, match="a compute iteration's CPU alone must be a positive"):
        fit_compute_cpu_slowdown([-0.01], 0.1, 2)


def test_iteration_cv_is_a_robust_spread_of_the_iterations_alone_over_their_median():
    # Deviations from the median 0.10: 0.01, 0.01, 0, 0, 0.02, 0.01 -> their median 0.01.
    times = [0.09, 0.11, 0.10, 0.10, 0.12, 0.09]
    assert fit_iteration_cv(times) == pytest.approx(1.4826 * 0.01 / 0.10)
    # One slow first iteration (a model's first ones can take twice the rest) hardly moves it.
    assert fit_iteration_cv([0.20] + times[1:]) == pytest.approx(fit_iteration_cv(times), rel=0.05)
    assert fit_iteration_cv([0.1, 0.1]) == 0.0 and fit_iteration_cv([0.1]) == 0.0
    with pytest.raises(ValueError, match="a compute time alone must be a positive"):
        fit_iteration_cv([0.1, 0.0])


def test_with_contention_puts_every_measured_factor_into_the_network():
    measured = dict(compute_slowdown=1.5, comm_slowdown=1.8, comm_cpu_slowdown=1.1, compute_cpu_slowdown=1.02,
                    iteration_cv=0.04, alone_s=[0.1])
    network = with_contention(dearcomm.Network(alpha_us=5.0, gbit_s=1.0), measured)
    assert (network.compute_slowdown, network.comm_slowdown, network.comm_cpu_slowdown,
            network.compute_cpu_slowdown, network.iteration_cv) == (1.5, 1.8, 1.1, 1.02, 0.04)
    assert (network.alpha_us, network.gbit_s) == (5.0, 1.0)


def test_the_collectives_cpu_beside_takes_out_the_compute_pools_share():
    # One thread: the process's CPU less the compute thread's.
    assert collectives_cpu(1.0, 0.8, [0.1, 0.1], [0.1, 0.1]) == pytest.approx(0.2)
    # torch's pool did as much again as the compute thread alone: its share beside is taken out too.
    assert collectives_cpu(2.0, 0.8, [0.2, 0.21, 0.19], [0.1, 0.1, 0.1]) == pytest.approx(0.4)
    # Never below 0, nor a pool under 1 (the process's CPU alone read less than the thread's).
    assert collectives_cpu(1.0, 1.2, [0.1], [0.1]) == 0.0
    assert collectives_cpu(1.0, 0.8, [0.09], [0.1]) == pytest.approx(0.2)
