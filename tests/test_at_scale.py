"""The at-scale simulation's profiles (benchmarks/scale_profiles.py) and one
row of benchmarks/at_scale.py: sizes against the published parameter counts,
times that are usable, the byte-wise fallback against a hand-computed
spread, and properties the simulated schedules must have. Single process."""
import math

import pytest

import dearcomm
from benchmarks import at_scale
from benchmarks.scale_profiles import MODELS, build, distribute_by_bytes, load_layers, match_in_order
from dearcomm.pipeline import param_tensors

# Published parameter counts (torchvision, Hugging Face): an independent check
# that no parameter tensor the package ships is lost or doubled on the way.
PUBLISHED = {"resnet50": 25_557_032, "vgg16": 138_357_544, "bert-base": 109_482_240, "bert-large": 335_141_888,
             "gpt2-small": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080}


@pytest.fixture(scope="module")
def profiles():
    return {m: build(m) for m in MODELS}


def test_every_model_has_its_published_parameter_count(profiles):
    assert set(profiles) == set(PUBLISHED)
    for m, p in profiles.items():
        assert p.num_tensors == len(param_tensors(m)), m
        assert p.numel == PUBLISHED[m], (m, p.numel)


def test_times_are_finite_and_non_negative_and_the_compute_is_not_empty(profiles):
    for m, p in profiles.items():
        for mod in p.modules:
            assert math.isfinite(mod.forward_ms) and mod.forward_ms >= 0, (m, mod)
            assert math.isfinite(mod.backward_ms) and mod.backward_ms >= 0, (m, mod)
            assert all(isinstance(n, int) and n >= 1 for n in mod.param_numels), (m, mod)
        assert p.forward_ms > 10 and p.backward_ms > p.forward_ms, (m, p.forward_ms, p.backward_ms)
        assert math.isfinite(p.step_ms) and p.step_ms > 0, m


def test_profiled_models_keep_every_profiled_layer_and_its_time(profiles):
    # ResNet-50, VGG-16 and BERT-large match their layers exactly: one module
    # per layer (PipeDream's Input node left out), the profile's totals kept.
    for m in ("resnet50", "vgg16", "bert-large"):
        layers = [l for l in load_layers(MODELS[m].layer_key) if l["op"] != "Input"]
        p = profiles[m]
        assert "matched exactly" in p.how, p.how
        assert len(p.modules) == len(layers)
        assert p.forward_ms == pytest.approx(sum(l["fwd_ms"] for l in layers))
        assert p.backward_ms == pytest.approx(sum(l["bwd_ms"] for l in layers))
        for mod, layer in zip(p.modules, layers):
            assert 4 * sum(mod.param_numels) == layer["param_bytes"], (m, layer["id"])


def test_derived_transformers_scale_with_their_parameters(profiles):
    # Same time per block parameter as BERT-large's encoder layers: a GPT-2
    # medium block (12.6 M, as a BERT-large layer) takes a BERT-large layer's time.
    large = next(mod for mod in profiles["bert-large"].modules if mod.name == "layer_0")
    block = next(mod for mod in profiles["gpt2-medium"].modules if mod.name == "h.0")
    assert sum(block.param_numels) == sum(large.param_numels)
    assert block.forward_ms == pytest.approx(large.forward_ms)
    assert block.backward_ms == pytest.approx(large.backward_ms)
    head = profiles["gpt2-small"].modules[-1]
    assert head.name.startswith("lm_head") and not head.param_numels and head.forward_ms > 0


def test_unmatched_layers_spread_their_time_by_bytes():
    # Tensors of 4, 8 and 4 bytes; layers of 8, 0 and 8 bytes. A's time splits
    # 4:4 over tensors 0 and 1, B (no parameters, at byte 8) goes to tensor 1,
    # C's splits 4:4 over tensors 1 and 2.
    layers = [dict(id="A", fwd_ms=1.0, bwd_ms=2.0, param_bytes=8.0), dict(id="B", fwd_ms=0.5, bwd_ms=0.25,
              param_bytes=0.0), dict(id="C", fwd_ms=3.0, bwd_ms=6.0, param_bytes=8.0)]
    numels = [1, 2, 1]
    assert match_in_order(layers, numels) is None
    mods = distribute_by_bytes(layers, numels)
    assert [m.param_numels for m in mods] == [[1], [2], [1]]
    assert [m.forward_ms for m in mods] == pytest.approx([0.5, 0.5 + 0.5 + 1.5, 1.5])
    assert [m.backward_ms for m in mods] == pytest.approx([1.0, 1.0 + 0.25 + 3.0, 3.0])


def test_one_small_simulation_per_model_and_no_iteration_shorter_than_its_compute(profiles):
    for m, p in profiles.items():
        pred = dearcomm.simulate(list(p.modules), world_size=8, network=dearcomm.network_preset("100gb-ib"),
                                 schedule="dear", step_ms=p.step_ms)
        assert math.isfinite(pred.iteration_ms), m
        assert pred.iteration_ms >= p.forward_ms + p.backward_ms - 1e-6, (m, pred.iteration_ms)


def test_a_compute_bound_row_hides_its_communication_in_every_schedule(profiles):
    # ResNet-50 (batch ≈ 128) on 100gb-ib at 8 ranks: its all-reduces take a
    # few % of the compute, so every schedule lands between forward + backward
    # and 2% above forward + backward + the full step.
    p = profiles["resnet50"]
    row = at_scale.simulate_row(p, "100gb-ib", 8, tune=False)
    assert set(row["runs"]) == set(at_scale.runs()) >= {"wfbp", "dear-sharded", "dear-replicated", "bytescheduler"}
    assert row["all_reduce_ms"] < 0.1 * (p.forward_ms + p.backward_ms)
    for name, r in row["runs"].items():
        assert p.forward_ms + p.backward_ms <= r["iteration_ms"] <= 1.02 * (p.forward_ms + p.backward_ms + p.step_ms), \
            (name, r["iteration_ms"])


def test_wfbp_grows_with_the_world_size_and_overlap_stays_under_its_ceiling(profiles):
    # On 10gbe a ring all-reduce costs 2(p-1)α + 2(p-1)/p·n·β: WFBP, which
    # hides it behind backward only, must slow down as p grows; no schedule
    # may beat WFBP by more than 1 + T_fwd/(T_fwd + T_bwd) (+ the sharded step).
    p = profiles["bert-base"]
    times = [at_scale.simulate_one(p, "10gbe", w, dict(schedule="wfbp"), {}).iteration_ms for w in (8, 16, 64)]
    assert times[0] < times[1] < times[2], times
    row = at_scale.simulate_row(p, "25gbe", 8, tune=False)
    ceiling = at_scale.overlap_ceiling(p) + p.step_ms / row["runs"]["wfbp"]["iteration_ms"]
    speedups = at_scale.speedups(row["runs"])
    assert speedups["dear-replicated"] > 1.05  # communication about equal to compute: overlap pays
    assert all(s <= ceiling for s in speedups.values()), (speedups, ceiling)
