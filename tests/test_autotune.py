"""dearcomm.plan(): wrap()'s options chosen by simulating every schedule over
a grid of sizes (dearcomm/autotune.py)."""
import math

import pytest

import dearcomm
from dearcomm import ModuleProfile, Network
from dearcomm.prediction import bucket_layout

MIB = 1 << 20
# Backward about as long as the all-reduce at 1 Gbit/s, a 16 MiB first layer.
PROFILE = [ModuleProfile("first", 20.0, 40.0, [4 * MIB]),
           *[ModuleProfile(f"layer{i}", 10.0, 20.0, [MIB // 2]) for i in range(6)]]
SLOW = Network(alpha_us=50, gbit_s=2)


def test_the_choice_is_the_fastest_candidate_and_its_prediction_holds():
    p = dearcomm.plan(PROFILE, world_size=4, network=SLOW, step_ms=5.0)
    assert p.best is p.candidates[0]
    assert all(p.best.predicted_ms <= c.predicted_ms for c in p.candidates)
    again = dearcomm.simulate(PROFILE, world_size=4, network=SLOW, step_ms=5.0, **p.options)
    assert again.iteration_ms == pytest.approx(p.predicted_ms, rel=1e-12)
    default = dearcomm.simulate(PROFILE, world_size=4, network=SLOW, step_ms=5.0)
    assert p.default.predicted_ms == pytest.approx(default.iteration_ms, rel=1e-12)
    assert p.gain_over_default >= 1.0
    assert str(p).startswith(f"dearcomm plan: schedule={p.options['schedule']}")


def test_where_the_host_cpu_bounds_every_candidate_alike_the_shorter_timeline_ranks_first():
    # 8 ms of host CPU per MiB of every all-reduce: 224 ms over the model's 28 MiB, past every timeline.
    cpu_bound = Network(alpha_us=50, gbit_s=2, host_ms_per_mib={"all_reduce": 8.0})
    # Grid order puts 25 MiB first; its timeline is the longer.
    p = dearcomm.plan(PROFILE, world_size=4, network=cpu_bound, step_ms=5.0, schedules=["wfbp"],
                      bucket_mb=[25.0, 1.0], partition_mb=[None], credit_mb=[None])
    assert len(p.candidates) == 2 and p.candidates[0].predicted_ms == pytest.approx(p.candidates[1].predicted_ms)
    assert p.candidates[0].timeline_ms < p.candidates[1].timeline_ms < p.candidates[0].predicted_ms
    # Without the bound the same order, by the timelines alone.
    plain = dearcomm.plan(PROFILE, world_size=4, network=SLOW, step_ms=5.0, schedules=["wfbp"],
                          bucket_mb=[25.0, 1.0], partition_mb=[None], credit_mb=[None])
    assert [c.options for c in plain.candidates] == [c.options for c in p.candidates]
    assert p.best.options["bucket_mb"] == 1.0


def test_every_registered_schedule_and_update_is_searched():
    p = dearcomm.plan(PROFILE, world_size=4, network=SLOW)
    searched = {(c.options["schedule"], c.options["update"]) for c in p.candidates}
    registry = {(e["name"], u) for e in dearcomm._C.schedules() for u in e["updates"]}
    # usbyte and deft only when asked for: the grid has no planner's blocks or delays for them.
    assert searched == registry - {("usbyte", "replicated"), ("deft", "replicated")}
    for schedule in ("usbyte", "deft"):  # asked for: without partitions, which their plans replace
        asked = dearcomm.plan(PROFILE, world_size=4, network=SLOW, schedules=[schedule], bucket_mb=[0.0])
        assert {c.options["schedule"] for c in asked.candidates} == {schedule}
        assert {c.options["partition_mb"] for c in asked.candidates} == {None}
    credits = {c.options["credit_mb"] for c in p.candidates if c.options["schedule"] == "bytescheduler"}
    assert credits == {None, 1.0, 4.0, 16.0}
    assert all(c.options["credit_mb"] is None for c in p.candidates if c.options["schedule"] != "bytescheduler")


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedules=[]), r"schedules must be a non-empty list of names \(or None: all\), got \[\]"),
    (dict(schedules="dear"), "schedules must be a non-empty list of names .*got 'dear'"),
    (dict(updates="sharded"), "updates must be a non-empty list of names .*got 'sharded'"),
    (dict(schedules=["dear", "wfbp"], credit_mb=[4.0]),
     r"credit_mb \[4.0\] applies to \['bytescheduler'\], none of which is searched \(\['dear', 'wfbp'\]\)"),
])
def test_a_grid_that_cannot_be_searched_as_asked_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=r"dearcomm: plan\(\)'s " + match):
        dearcomm.plan(PROFILE, world_size=4, network=SLOW, **kwargs)


def test_options_go_to_wrap_as_they_are():
    p = dearcomm.plan(PROFILE, world_size=4, network=SLOW, schedules=["bytescheduler"])
    assert p.options["schedule"] == "bytescheduler"
    dearcomm.WrapOptions(**p.options)  # validated as wrap() validates them


def test_deterministic_and_restricted():
    a = dearcomm.plan(PROFILE, world_size=8, network=SLOW, schedules=["wfbp"], bucket_mb=[25.0, 4.0])
    b = dearcomm.plan(PROFILE, world_size=8, network=SLOW, schedules=["wfbp"], bucket_mb=[25.0, 4.0])
    assert a.options == b.options and [c.options for c in a.candidates] == [c.options for c in b.candidates]
    assert {c.options["schedule"] for c in a.candidates} == {"wfbp"}
    layouts = {bucket_layout(PROFILE, world_size=8, schedule="wfbp", bucket_mb=b, partition_mb=p).describe()
               for b in (25.0, 4.0) for p in dearcomm.autotune.PARTITION_MB}
    assert len(a.candidates) == len(layouts) > 1


def test_sizes_that_lay_out_the_same_buckets_are_one_candidate():
    # 28 MiB in all: 64 MiB buckets and unbounded ones both hold everything in one.
    p = dearcomm.plan(PROFILE, world_size=4, network=SLOW, schedules=["wfbp"], bucket_mb=[64.0, math.inf],
                      partition_mb=[None])
    assert [c.options["bucket_mb"] for c in p.candidates] == [64.0], "the first in grid order stands for both"
    full = dearcomm.plan(PROFILE, world_size=4, network=SLOW)

    def layout(options):
        return (options["schedule"], options["update"], options["credit_mb"],
                bucket_layout(PROFILE, world_size=4, **options).describe())
    kept = [layout(c.options) for c in full.candidates]
    assert len(kept) == len(set(kept)), "one layout simulated twice"
    grid = {layout(o) for o in dearcomm.autotune._grid(None, None, dearcomm.autotune.BUCKET_MB,
                                                       dearcomm.autotune.PARTITION_MB, dearcomm.autotune.CREDIT_MB)}
    assert set(kept) == grid and len(grid) < len(dearcomm.autotune._grid(
        None, None, dearcomm.autotune.BUCKET_MB, dearcomm.autotune.PARTITION_MB, dearcomm.autotune.CREDIT_MB))


def test_a_faster_network_leaves_less_to_gain():
    slow = dearcomm.plan(PROFILE, world_size=4, network=SLOW, step_ms=5.0)
    fast = dearcomm.plan(PROFILE, world_size=4, network=Network(alpha_us=1, gbit_s=math.inf), step_ms=5.0)
    # Infinitely fast links: every schedule is compute alone; nothing to choose between.
    assert fast.gain_over_default == pytest.approx(1.0, abs=0.02)
    assert slow.predicted_ms > fast.predicted_ms


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedules=["nope"]), r"unknown schedule\(s\) \['nope'\]"),
    (dict(bucket_mb=[]), "bucket_mb must be a non-empty list"),
    (dict(partition_mb=4.0), "partition_mb must be a non-empty list"),
    (dict(bucket_mb=[-1.0]), "bucket_mb must be >= 0"),
    (dict(world_size=1), "world_size must be an int >= 2"),
])
def test_bad_inputs_get_clear_errors(kwargs, match):
    args = dict(world_size=4, network=SLOW) | kwargs
    with pytest.raises(ValueError, match=match):
        dearcomm.plan(PROFILE, **args)


def test_a_module_of_mixed_dtypes_lays_out_as_training_does():
    # A profiled module whose bias is bfloat16 beside a float32 weight: a
    # bucket holds one dtype, so training splits them; a layout from the
    # module's dominant dtype alone would hold both in one bucket.
    import torch
    from torch import nn

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 64))
            self.bias = nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))

        def forward(self, x):
            return x @ self.weight + self.bias.float()

    torch.manual_seed(0)
    model = nn.Sequential(Mixed(), nn.ReLU(), nn.Linear(64, 4))
    profile = dearcomm.profile(model, torch.randn(8, 64), iterations=1, warmup=0)
    params = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    trained = dearcomm._C.plan_buckets([p.numel() for p in params], [p.dtype for p in params],
                                       dearcomm.WrapOptions().bucket_cap_bytes, 2,
                                       dearcomm.WrapOptions().partition_bytes, [])
    assert bucket_layout(profile, world_size=2).describe() == trained.describe()
    assert len(trained.buckets) == 3
    with pytest.raises(ValueError, match="module 'm' has 2 parameters but 1 param_dtypes"):
        bucket_layout([ModuleProfile("m", 1.0, 1.0, [4, 4], param_dtypes=[torch.float32])], world_size=2)
    with pytest.raises(ValueError, match="module 'm' has a parameter of dtype torch.int64"):
        bucket_layout([ModuleProfile("m", 1.0, 1.0, [4], torch.int64)], world_size=2)
