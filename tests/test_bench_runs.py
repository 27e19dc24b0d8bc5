"""train_bench.py's run names and prediction_summary.py's reading of them:
a run timed twice ('X/again') is X's configuration, and the summary lists it
apart from the candidates."""
import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import prediction_summary  # noqa: E402
import train_bench  # noqa: E402


@pytest.mark.parametrize("name", ["ddp", "ddp/b0.25", "dear-sharded/p4", "bytescheduler/p4/c1",
                                  "bytescheduler/p0.25/sync", "auto", "dear-bo"])
def test_a_run_timed_again_is_the_same_configuration(name):
    assert train_bench.parse_run(f"{name}/again") == train_bench.parse_run(name)
    assert train_bench.parse_run(f"{name}/again@DEARCOMM_GRAD_VIEWS=0") == train_bench.parse_run(name)
    assert train_bench.syncs_after_step(f"{name}/again") == name.endswith("/sync")
    assert train_bench.configuration(f"{name}/again@DEARCOMM_GRAD_VIEWS=0") == name


def test_again_is_a_mark_at_the_end_only():
    with pytest.raises(SystemExit, match="unknown modifier 'again'"):
        train_bench.parse_run("dear-sharded/again/p4")
    with pytest.raises(SystemExit, match="takes none"):
        train_bench.parse_run("auto/p4/again")


def test_the_summary_keeps_repeats_apart_from_the_candidates():
    runs = {"ddp": dict(median_ms=100.0), "ddp/again": dict(median_ms=104.0),
            "dear-sharded/p4": dict(median_ms=80.0), "dear-sharded/p4/again": dict(median_ms=76.0),
            "wfbp/again": dict(median_ms=90.0)}  # no first run: nothing to compare it with
    assert not prediction_summary.is_candidate("dear-sharded/p4/again")
    assert prediction_summary.is_candidate("dear-sharded/p4")
    assert prediction_summary.repeats(runs) == pytest.approx({"ddp": 0.04, "dear-sharded/p4": -0.05})


def test_the_replay_applies_the_current_rule_to_a_stored_auto_run():
    """auto_replay.py on the confirmations the widein run at 4 ranks stored
    (timed-twice/auto-rule-widein-1gbit-4.json): both contenders beat the
    reference within 0.4% of each other; the run kept the lower ratio
    (1 MiB partitions), the current rule the one predicted faster (4 MiB)."""
    import auto_replay

    p1 = {"schedule": "dear", "bucket_mb": 25.0, "partition_mb": 1.0, "credit_mb": None, "update": "sharded"}
    p4 = dict(p1, partition_mb=4.0)
    ddp = {"schedule": "wfbp", "bucket_mb": 25.0, "partition_mb": None, "credit_mb": None, "update": "replicated"}
    run = dict(auto_options=p1, auto_predicted_ms=456.4, auto_default_ms=483.5,
               auto_shortlist=[[p4, 430.1], [ddp, 479.9], [p1, 456.4]], auto_measured_ms=[414.4, 485.6, 426.9],
               auto_confirmations=[[0, 433.0], [2, 430.4], [1, 491.6], [0, 424.4], [2, 422.5], [1, 485.3],
                                   [0, 430.7], [2, 434.2], [1, 504.0]])
    assert auto_replay.replayed(run) == (2, 0, ((p4, 430.1), (ddp, 479.9), (p1, 456.4)))
    assert auto_replay.replayed(dict(run, auto_confirmations=[])) is None
    # Confirmations of another set of contenders (one, from older files): not replayed.
    assert auto_replay.replayed(dict(run, auto_confirmations=[[0, 433.0], [1, 491.6]] * 3)) is None


def test_every_kappa_estimator_recovers_a_slowdown_the_rounds_share():
    """kappa_estimators.py on synthetic rounds: compute of 0.1 s slowed 1.5x
    wherever a collective covers it, in rounds of different coverage."""
    import kappa_estimators

    def wall(covered, kappa=1.5, work=0.1):
        return work / ((1 - covered) + covered / kappa)
    rounds = [dict(compute_slowdown=1.5, alone_s=[0.1, 0.1, 0.1], beside=[[wall(c), c] for c in cover])
              for cover in ((1.0, 1.0, 0.6), (0.8, 1.0), (1.0, 0.3))]
    got = kappa_estimators.estimators(rounds)
    assert set(got) == {"median of rounds", "pooled median", "pooled ratio", "mean of rounds"}
    assert all(k == pytest.approx(1.5) for k in got.values()), got
    # An iteration that covered less than half its time counts in none.
    mixed = [dict(alone_s=[0.1], beside=[[wall(0.3, kappa=9.0), 0.3], [wall(1.0), 1.0]])]
    assert kappa_estimators.pooled_ratio(mixed) == pytest.approx(1.5)


def test_the_noise_report_measures_what_it_is_given(tmp_path):
    """prediction_noise.py on synthetic rows: every iteration 1.05x its CPU;
    runs timed twice 2% apart either way; the profile's compute 3% over and
    under DDP's on-CPU compute around each model's own ratio."""
    import json
    import math

    import prediction_noise

    def row(model, profile_ratio, again, predicted):
        runs = {"ddp": dict(median_ms=105.0, cpu_ms=100.0, predicted_ms=100.0,
                            phases_ms={"forward": 30.0, "backward": 60.0, "backward off-CPU": 10.0, "step": 20.0}),
                "wfbp": dict(median_ms=105.0, cpu_ms=100.0, predicted_ms=predicted, predicted_cpu_ms=110.0),
                "wfbp/again": dict(median_ms=105.0 * again, cpu_ms=100.0 * again)}
        profile = dict(forward_ms=30.0 * profile_ratio, backward_ms=50.0 * profile_ratio, step_ms=20.0 * profile_ratio)
        path = tmp_path / f"{model}-{profile_ratio}-{again}.json"
        path.write_text(json.dumps(dict(model=model, runs=runs, profile=profile)))
        return path

    paths = [row("mlp", 1.03, 1.02, 100.0), row("mlp", 1.03 ** -1, 1.02 ** -1, 120.0),
             row("gpt", 1.2 * 1.03, 1.02, 100.0), row("gpt", 1.2 / 1.03, 1.02 ** -1, 100.0)]
    rows = prediction_noise.load(paths)
    per_row, ratio = prediction_noise.cpu_following(rows)
    assert ratio == pytest.approx(1.05)
    assert all(r == pytest.approx(1.05) for ratios in per_row.values() for r in ratios.values())

    again, ddp_wfbp = prediction_noise.pairs(rows)
    assert sorted(again) == pytest.approx(sorted([math.log(1.02), -math.log(1.02)] * 2))
    assert ddp_wfbp == pytest.approx([0.0] * 4)
    by_model = prediction_noise.profile_against_training(rows)
    assert sorted(by_model) == ["gpt", "mlp"]
    # Each model's own ratio (1.0 and 1.2) is taken out: what is left is the 3% either way.
    assert prediction_noise.within_model_sd(by_model) == pytest.approx(math.log(1.03) * math.sqrt(2))

    # ddp is a control, not a candidate: one run per row; the second row's wfbp is 14.3% off.
    assert prediction_noise.observed_scores(rows) == ([1, 1, 1, 1], 3, 3)
    # At DDP's level (105 measured over 100 predicted): 105 on the rows that predicted 100, 126 (+20%) on the other.
    assert prediction_noise.scores_with_ddp_level(rows) == ([1, 1, 1, 1], 3, 3)
    rows[1][1]["runs"]["wfbp"]["predicted_ms"] = 95.0  # -9.5% as it is, -5% at DDP's level
    assert prediction_noise.observed_scores(rows) == ([1, 1, 1, 1], 4, 4)
    rows[0][1]["runs"]["wfbp"]["predicted_ms"] = 111.0  # +5.7% as it is, +11% at DDP's level
    assert prediction_noise.scores_with_ddp_level(rows) == ([1, 1, 1, 1], 3, 3)
    rows[0][1]["runs"]["wfbp"]["predicted_ms"] = 100.0
    assert prediction_noise.exact_model_scores([10, 10], 0.0, 0.0) == (20.0, 2.0)
    runs, rows_met = prediction_noise.exact_model_scores([10, 10], 0.5, 0.0)
    assert runs < 10 and rows_met < 0.5
    assert prediction_noise.cpu_predicted(rows)[paths[0]] == {"wfbp": pytest.approx(0.10)}
    assert prediction_noise.machine_share(rows) == {}  # no machine CPU recorded


def test_the_machine_share_is_the_cores_neither_idle_nor_in_softirq(tmp_path):
    import json

    import prediction_noise

    # 2 cores over 1 s: 0.1 s idle and 0.1 s of softirq leave the ranks 90%; two rounds alike.
    machine = dict(busy=1.9, softirq=0.1, idle=0.1, wall=1.0)
    data = dict(runs={"ddp": dict(median_ms=111.0, cpu_ms=100.0), "wfbp": dict(median_ms=113.0, cpu_ms=100.0),
                      "auto": dict(median_ms=115.0, cpu_ms=100.0)},
                contention=dict(rounds=[dict(beside_machine_s=machine), dict(beside_machine_s=machine)]))
    path = tmp_path / "row.json"
    path.write_text(json.dumps(data))
    (ratio, share), = prediction_noise.machine_share(prediction_noise.load([path])).values()
    assert ratio == pytest.approx(1.13) and share == pytest.approx(1 / 0.9)


def test_the_wall_parts_split_the_cores_and_find_the_slowest_rank(tmp_path):
    import json

    import prediction_noise

    # 2 ranks on 2 cores, two iterations of 100 ms: 200 ms of cores, of it 170 the ranks' CPU
    # (rank 0 90 then 80, rank 1 80 then 90), 10 softirq, 16 idle, 4 another process's.
    run = dict(iterations_ms=[100.0, 100.0], cpu_iterations_ms=[[90.0, 80.0], [80.0, 90.0]],
               machine_ms=dict(busy=184.0, softirq=10.0, idle=16.0), median_ms=100.0, cpu_ms=85.0)
    path = tmp_path / "row.json"
    path.write_text(json.dumps(dict(runs={"wfbp": run, "ddp": dict(median_ms=100.0, cpu_ms=85.0)})))
    (n, p), = prediction_noise.wall_parts(prediction_noise.load([path])).values()
    assert n == 1  # ddp records neither
    assert p == pytest.approx(dict(cpu=0.85, softirq=0.05, idle=0.08, rest=0.02, over_mean=100 / 85,
                                   slowest=90 / 85, over_slowest=100 / 90))


def test_the_idle_phases_split_each_phase_by_thread():
    import idle_phases

    # One rank: the training thread "1" and gloo's "2" (born during the backward). Forward 10 ms,
    # all of it the training thread's; backward 30 ms: it runs 12 and waits 2 to run, gloo runs 10,
    # so it was blocked 16 ms and the rank's core idle 8; step 5 ms of it alone.
    ms = 1_000_000
    stamps = [(0.000, {"1": (0, 0)}),
              (0.010, {"1": (10 * ms, 0)}),
              (0.040, {"1": (22 * ms, 2 * ms), "2": (10 * ms, 0)}),
              (0.045, {"1": (27 * ms, 2 * ms), "2": (10 * ms, 0)})]
    fwd, bwd, step = idle_phases.phase_parts(stamps, "1")
    assert fwd == pytest.approx(dict(wall_ms=10.0, cpu_ms=10.0, beyond_cpu_ms=0.0, blocked_ms=0.0, start=0.0, end=0.010))
    assert bwd == pytest.approx(dict(wall_ms=30.0, cpu_ms=22.0, beyond_cpu_ms=8.0, blocked_ms=16.0, start=0.010,
                                     end=0.040))
    assert step["cpu_ms"] == pytest.approx(5.0) and step["blocked_ms"] == pytest.approx(0.0)
    # Two ranks, the second 2 ms late: the iteration runs 47 ms on one clock; each rank left 45 - 37 ms
    # of its core unused.
    late = [(t + 0.002, threads) for t, threads in stamps]
    out = idle_phases.summary([[[fwd, bwd, step]], [idle_phases.phase_parts(late, "1")]])
    assert out["iteration_ms"] == pytest.approx(47.0) and out["unused_core_ms"] == pytest.approx(2 * 8.0)
    assert out["phases"]["backward"] == pytest.approx(dict(wall_ms=30.0, cpu_ms=22.0, beyond_cpu_ms=8.0,
                                                           blocked_ms=16.0))


def test_the_drift_summary_tells_launches_apart_from_rounds():
    """machine_drift.spread on synthetic launches: the machine 10% faster in
    the second launch, DDP's iteration 1.5x the compute in both, and each
    launch's rounds 1.05 above and below their median."""
    import math

    import machine_drift

    def launch(compute):
        rounds = [dict(compute_ms=compute * f, compute_cpu_ms=compute * f / 2, profile_ms=compute * f,
                       ddp_ms=1.5 * compute * f, ddp_cpu_ms=compute * f) for f in (1 / 1.05, 1.0, 1.05)]
        return dict(rounds=rounds, launch=rounds[1])

    out = machine_drift.spread([launch(100.0), launch(110.0)])
    median, low, high, across, within, leaves = out["DDP's iteration"]
    assert (low, high) == pytest.approx((150.0, 165.0))
    assert across == pytest.approx(math.log(1.1) / math.sqrt(2))
    assert within == pytest.approx(math.log(1.05))  # 4 deviations of log 1.05 over 6 rounds - 2 launches
    assert leaves == pytest.approx(1.25 * within / math.sqrt(3))
    median, low, high, across, within, _ = out["DDP / compute alone"]
    assert (median, low, high, across, within) == pytest.approx((1.5, 1.5, 1.5, 0.0, 0.0))


def test_the_collectives_of_a_row_are_the_medians_of_its_rounds():
    rounds = [dict(ar=a, cpu_ar=c, rs=1.0, cpu_rs=0.5, buckets=3, bytes=1024, m0_buckets=1, m0_bytes=256)
              for a, c in ((0.10, 0.05), (0.30, 0.04), (0.20, 0.09))]
    out = train_bench.median_of_rounds(rounds)
    assert out == dict(ar=0.20, cpu_ar=0.05, rs=1.0, cpu_rs=0.5, buckets=3, bytes=1024, m0_buckets=1, m0_bytes=256)


def test_the_kernel_cpu_check_compares_the_machine_with_the_ranks_clocks():
    """benchmarks/kernel_cpu.py as its docstring launches it, on 4 MiB calls:
    one row per size and kind, its busy time the ranks' CPU to within the
    counters' ticks and whatever else ran (this machine runs the tests too)."""
    from tests.launch import torchrun

    out = torchrun(2, "benchmarks/kernel_cpu.py", "--sizes-mib", "4", timeout=120)
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("4 MiB")]
    assert [r[2] for r in rows] == ["all_reduce", "reduce_scatter"], out
    for r in rows:
        wall, busy, softirq, idle, ranks, difference = map(float, r[3:])
        assert wall > 0 and ranks > 0 and 0 <= softirq <= busy, out
        assert difference == pytest.approx(busy - ranks, abs=0.002), out  # each printed to the ms


def test_a_run_time_is_the_median_of_its_rounds_means():
    # Rounds of 3 iterations whose long waits sit in some iterations only: the rounds' means
    # (0.5, 0.5, 0.7) give the throughput, where the median single iteration reads 0.3.
    times = [1.0, 0.2, 0.3, 1.0, 0.2, 0.3, 1.0, 1.0, 0.1]
    assert train_bench.round_means(times, 3) == pytest.approx([0.5, 0.5, 0.7])
    assert statistics.median(train_bench.round_means(times, 3)) == pytest.approx(0.5)
    assert statistics.median(times) == pytest.approx(0.3)


def test_a_run_time_averages_the_ranks_whose_clocks_stop_at_different_points():
    # Two ranks in lockstep at 0.5 s per iteration; each round, one of them is parked for
    # 0.1 s at the end of its last step, which the other's next round does not include.
    rank0 = [0.5, 0.5, 0.6, 0.4, 0.5, 0.5, 0.5, 0.5, 0.6]
    rank1 = [0.4, 0.5, 0.5, 0.5, 0.5, 0.6, 0.4, 0.5, 0.5]
    assert train_bench.pace([rank0, rank1], 3) == pytest.approx(0.5)
    slowest = max(statistics.median(train_bench.round_means(r, 3)) for r in (rank0, rank1))
    assert slowest == pytest.approx(1.6 / 3), "the slowest rank's reading is long by the jitter alone"
