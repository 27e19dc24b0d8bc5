"""The US-Byte planner (dearcomm/usbyte.py): hand-computed plans, the
invariants of every plan on random profiles, the priority search, and the
per-parameter expansion of a module profile with the simulator's cost."""
import dataclasses
import math
import random

import pytest
import torch

from dearcomm import ModuleProfile, Network, simulate
from dearcomm.usbyte import Block, Layer, layers_from_profile, plan, plan_for_profile, ring_allreduce_ms


def affine(alpha_ms, ms_per_unit, unit=100):
    """cost(n elements) = α + n/unit · ms_per_unit; binary-exact numbers keep the times exact."""
    return lambda n: alpha_ms + n / unit * ms_per_unit


def ready_times(layers):
    ready, t = [0.0] * len(layers), 0.0
    for l in range(len(layers) - 1, -1, -1):
        t += layers[l].backward_ms
        ready[l] = t
    return ready


def check_plan(layers, unit, cost, p, step_ms=0.0):
    """Every invariant a plan must keep, whatever the profile."""
    L = len(layers)
    ready = ready_times(layers)
    t_bwd = ready[0]
    tol = 1e-9 * max(1.0, t_bwd)
    assert sorted(p.priorities) == list(range(L))
    per_layer = p.layer_blocks()
    for l, sizes in enumerate(per_layer):
        assert sum(sizes) == layers[l].numel, f"layer {l}: {sizes} do not add up to {layers[l].numel}"
        assert all(n > 0 for n in sizes)
        assert all(n % unit == 0 for n in sizes[:-1]), f"layer {l}: {sizes} not whole units of {unit}"
    channel_free = -math.inf
    phase2_layers = []
    sent = [0] * L
    for b in p.blocks:
        assert b.start_ms >= channel_free, f"{b} overlaps the block before it (free at {channel_free})"
        assert b.end_ms == pytest.approx(b.start_ms + cost(b.numel), rel=1e-12, abs=1e-12)
        assert b.start_ms >= ready[b.layer] - tol, f"{b} starts before its gradient is ready at {ready[b.layer]}"
        if b.phase == 1:
            assert not phase2_layers, "a phase-1 block after a phase-2 one"
            assert b.start_ms < t_bwd
            # The channel idles only until a gradient is ready, and sends the most urgent ready layer.
            assert b.start_ms == channel_free or b.start_ms == ready[b.layer]
            waiting = [l for l in range(L) if ready[l] <= b.start_ms and sent[l] < layers[l].numel]
            assert min(waiting, key=p.priorities.__getitem__) == b.layer
            # It runs up to the next gradient unless the layer has nothing more to send.
            if sent[b.layer] + b.numel < layers[b.layer].numel:
                assert b.end_ms >= min(r for r in ready if r > b.start_ms) - tol
        else:
            assert b.phase == 2 and b.start_ms == max(channel_free, t_bwd)
            phase2_layers.append(b.layer)
        sent[b.layer] += b.numel
        channel_free = b.end_ms
    assert phase2_layers == sorted(set(phase2_layers)), "phase 2 is not input-first, one block per layer"
    # The iteration time, from the blocks alone.
    f = t_bwd + step_ms
    for l in range(L):
        f = max(f, max(b.end_ms for b in p.blocks if b.layer == l)) + layers[l].forward_ms
    assert p.iteration_ms == pytest.approx(f, rel=1e-12, abs=1e-12)


def random_case(rng):
    L = rng.randint(1, 30)
    layers = [Layer(int(10 ** rng.uniform(0, 6)),
                    rng.choice([0.0, rng.uniform(0, 3)]), rng.choice([0.0, rng.uniform(0, 5)])) for _ in range(L)]
    unit = int(10 ** rng.uniform(0, 5))
    alpha, beta = rng.choice([0.0, rng.uniform(0, 0.5)]), rng.choice([0.0, rng.uniform(0, 1e-5)])
    return layers, unit, (lambda n: alpha + beta * n)


def test_invariants_and_search_on_random_profiles():
    rng = random.Random(20240601)
    improved = 0
    for _ in range(300):
        layers, unit, cost = random_case(rng)
        base = plan(layers, unit, cost, search=False)
        assert base.priorities == tuple(range(len(layers)))
        best = plan(layers, unit, cost)
        check_plan(layers, unit, cost, base)
        check_plan(layers, unit, cost, best)
        assert best.iteration_ms <= base.iteration_ms
        improved += best.iteration_ms < base.iteration_ms
        assert plan(layers, unit, cost) == best  # deterministic
    assert improved > 0  # the search does something on random profiles


def test_hand_computed_plan():
    # S = 100 elements, all-reduce of n elements: 1 ms + 1 ms per 100 elements.
    # layer 0: 250 elements (units 100, 100, 50), forward 2, backward 3
    # layer 1: 100 elements (1 unit),             forward 1, backward 2
    # layer 2: 450 elements (units 4 x 100, 50),   forward 1, backward 1
    # Gradients ready: layer 2 at 1, layer 1 at 1+2 = 3, layer 0 at 3+3 = 6 = end of backward.
    # Phase 1:
    #   t=1: only layer 2; the gap to 3 fits 1 unit (1+1 = 2 ms; 2 units would take 3): [1, 3], 100 el.
    #   t=3: layer 1 outranks 2; all of it (2 ms) fits the gap to 6: [3, 5], 100 el.
    #   t=5: layer 2 again (a new block: layer 1's came between); the gap to 6 fits no unit,
    #        so one unit anyway: [5, 7], 100 el. t=7 >= 6: phase 1 is over.
    # Phase 2, from 7, input side first: layer 0's 250 el [7, 10.5], layer 2's last 250 el [10.5, 14].
    # Forward from 6: layer 0 waits to 10.5, ends 12.5; layer 1 (done at 5) 12.5 -> 13.5;
    #   layer 2 waits to 14, ends 15. iteration_ms = 15.
    # Search: only layer 0 starts late (7 > 6), and it has the top rank already: nothing to try.
    layers = [Layer(250, 2.0, 3.0), Layer(100, 1.0, 2.0), Layer(450, 1.0, 1.0)]
    for search in (False, True):
        p = plan(layers, 100, affine(1.0, 1.0), search=search)
        assert p.blocks == (Block(2, 100, 1, 1.0, 3.0), Block(1, 100, 1, 3.0, 5.0), Block(2, 100, 1, 5.0, 7.0),
                            Block(0, 250, 2, 7.0, 10.5), Block(2, 250, 2, 10.5, 14.0))
        assert p.iteration_ms == 15.0
        assert p.priorities == (0, 1, 2)
        assert p.layer_blocks() == [[250], [100], [100, 100, 250]]
    # An optimizer step of 4 ms: forward from 10; layer 0 waits to 10.5 and the rest follows as before.
    p = plan(layers, 100, affine(1.0, 1.0), step_ms=4.0)
    assert p.iteration_ms == 15.0
    p = plan(layers, 100, affine(1.0, 1.0), step_ms=5.0)  # forward from 11: 13, 14, then 14 -> 15
    assert p.iteration_ms == 15.0
    p = plan(layers, 100, affine(1.0, 1.0), step_ms=6.0)  # forward from 12: 14, 15, 16
    assert p.iteration_ms == 16.0


def test_consecutive_blocks_of_a_layer_merge_and_keep_every_unit():
    # S = 100, all-reduce 1 ms + 1 ms per unit. Layer 2 (500 el) ready at 1, layer 1 (100 el) at
    # 4.5, layer 0 (100 el) at 6.5.
    # t=1: the gap to 4.5 fits 2 units (1+2 = 3 ms) -> ends at 4; nothing else is ready, and layer 2
    # is still the most urgent: the block grows instead of a second one (3 units, 4 ms: [1, 5]; two
    # blocks would have ended at 6). Its units add up: 300 elements, not the 100 just added.
    # t=5: layer 1 [5, 7]. Phase 2 from 7: layer 0 [7, 9], layer 2's last 200 el [9, 12].
    layers = [Layer(100, 0.0, 2.0), Layer(100, 0.0, 3.5), Layer(500, 0.0, 1.0)]
    p = plan(layers, 100, affine(1.0, 1.0), search=False)
    assert p.blocks == (Block(2, 300, 1, 1.0, 5.0), Block(1, 100, 1, 5.0, 7.0), Block(0, 100, 2, 7.0, 9.0),
                        Block(2, 200, 2, 9.0, 12.0))
    assert p.layer_blocks() == [[100], [100], [300, 200]]
    assert p.iteration_ms == 12.0


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_a_gap_of_k_units_gives_a_block_of_k_units(k):
    # All-reduce: 0.5 ms + 0.25 ms per unit of 64 elements. Layer 1 (big) is ready at 2; layer 0 becomes
    # ready a gap later that fits exactly k units: the first block has k units and ends with the gap.
    cost = affine(0.5, 0.25, unit=64)
    gap = 0.5 + 0.25 * k
    layers = [Layer(1000, 1.0, gap), Layer(64 * 20 + 7, 1.0, 2.0)]
    first = plan(layers, 64, cost).blocks[0]
    assert (first.layer, first.numel, first.start_ms, first.end_ms) == (1, 64 * k, 2.0, 2.0 + gap)
    # A hair shorter fits k-1 units, and the channel, free before layer 0 is ready, sends one more unit
    # of layer 1, which merges: still k units, now ending just after layer 0 is ready.
    layers[0] = Layer(1000, 1.0, gap - 1e-6)
    assert plan(layers, 64, cost).blocks[0].numel == 64 * k
    # A hair longer: k units end before layer 0 is ready, so one more unit joins them.
    layers[0] = Layer(1000, 1.0, gap + 1e-6)
    assert plan(layers, 64, cost).blocks[0].numel == 64 * (k + 1)
    # Long enough for the whole layer: one block, its short last unit included.
    layers[0] = Layer(1000, 1.0, 100.0)
    assert plan(layers, 64, cost).layer_blocks()[1] == [64 * 20 + 7]


def test_priority_search_strictly_improves():
    # S = 100, all-reduce 1 ms + 1 ms per unit.
    # layer 0: 300 el, forward 0, backward 6;  layer 1: 200 el, forward 0, backward 0;
    # layer 2: 500 el, forward 3, backward 1. Ready: layers 2 and 1 at 1, layer 0 at 7.
    # Input-first: t=1 layer 1 whole [1, 4]; t=4 layer 2, gap to 7 fits 2 units [4, 7]; phase 2:
    #   layer 0 [7, 11], layer 2's last 300 el [11, 15]. Forward from 7: 11, 11, 15 + 3 = 18.
    # Search: layer 2 starts at 4, 3 ms after it is ready; started on time its 2-unit block would end
    #   at 4, during layer 0's backward (1..7): layer 2 takes layer 0's rank (ranks 1, 2, 0).
    #   t=1 layer 2 whole (6 ms) fits the gap to 7: [1, 7]; phase 2: layer 0 [7, 11], layer 1 [11, 14].
    #   Forward: 11, 14, 14 + 3 = 17 < 18: kept.
    layers = [Layer(300, 0.0, 6.0), Layer(200, 0.0, 0.0), Layer(500, 3.0, 1.0)]
    base = plan(layers, 100, affine(1.0, 1.0), search=False)
    assert base.iteration_ms == 18.0
    assert base.blocks == (Block(1, 200, 1, 1.0, 4.0), Block(2, 200, 1, 4.0, 7.0), Block(0, 300, 2, 7.0, 11.0),
                           Block(2, 300, 2, 11.0, 15.0))
    best = plan(layers, 100, affine(1.0, 1.0))
    assert best.priorities == (1, 2, 0)
    assert best.blocks == (Block(2, 500, 1, 1.0, 7.0), Block(0, 300, 2, 7.0, 11.0), Block(1, 200, 2, 11.0, 14.0))
    assert best.iteration_ms == 17.0


def test_single_layer_and_zero_times():
    # One layer: nothing to overlap with, everything goes after backward.
    p = plan([Layer(250, 1.0, 2.0)], 100, affine(1.0, 1.0))
    assert p.blocks == (Block(0, 250, 2, 2.0, 5.5),) and p.iteration_ms == 6.5
    # No backward time at all: no phase 1.
    layers = [Layer(100, 1.0, 0.0), Layer(100, 1.0, 0.0)]
    p = plan(layers, 100, affine(1.0, 1.0))
    assert [b.phase for b in p.blocks] == [2, 2] and p.iteration_ms == 2.0 + 2.0 + 1.0
    # A free channel: every block takes 0 ms and the forward never waits.
    p = plan([Layer(10, 1.0, 1.0), Layer(10 ** 6, 1.0, 1.0)], 1, lambda n: 0.0)
    assert p.iteration_ms == 4.0 and p.layer_blocks() == [[10], [10 ** 6]]


# --- a module profile ------------------------------------------------------

PROFILE = [
    ModuleProfile("pre", 0.125, 0.5, []),          # no parameters, before any: folds into layer 0
    ModuleProfile("embed", 1.0, 2.0, [1000]),
    ModuleProfile("relu", 0.5, 0.25, []),          # folds into embed's parameter, the layer before it
    ModuleProfile("block", 2.0, 4.0, [3000, 10]),  # both times on its last parameter
]


def test_layers_from_profile():
    assert layers_from_profile(PROFILE) == [Layer(1000, 0.125 + 1.0 + 0.5, 0.5 + 2.0 + 0.25),
                                            Layer(3000, 0.0, 0.0), Layer(10, 2.0, 4.0)]


def test_allreduce_cost_matches_the_simulator():
    # β = 8 bit / 8 Gbit/s = 1 ns/byte; p = 4, fp32:
    # 2 * (3 * 10 µs + 3/4 * 4n bytes * 1 ns) = 0.06 ms + 6e-6 ms * n.
    net = Network(alpha_us=10.0, gbit_s=8.0)
    cost = ring_allreduce_ms(net, 4, 4)
    assert cost(1000) == pytest.approx(0.066, rel=1e-12)
    assert ring_allreduce_ms(net, 4, 2)(1000) == pytest.approx(0.063, rel=1e-12)
    assert ring_allreduce_ms(Network(10.0, 8.0, comm_slowdown=2.0), 4, 4)(1000) == pytest.approx(0.132, rel=1e-12)
    per_kind = Network(10.0, 8.0, per_kind={"all_reduce": (0.0, 16.0), "reduce_scatter": (99.0, 1.0)})
    assert ring_allreduce_ms(per_kind, 4, 4)(1000) == pytest.approx(0.003, rel=1e-12)
    # The simulator's own all-reduce of one 1024-element fp32 bucket (no padding at that size).
    sim = simulate([ModuleProfile("m", 1.0, 2.0, [1024])], schedule="wfbp", world_size=4, network=net,
                   bucket_mb=0)
    op = next(op for op in sim.ops if op["kind"] == "all_reduce")
    assert op["end_ms"] - op["start_ms"] == pytest.approx(cost(1024), rel=1e-9)


def test_plan_for_profile():
    net = Network(alpha_us=10.0, gbit_s=8.0)
    p = plan_for_profile(PROFILE, net, world_size=4, unit=64)
    layers = layers_from_profile(PROFILE)
    assert p == plan(layers, 64, lambda n: 0.06 + 6e-6 * n)
    check_plan(layers, 64, lambda n: 0.06 + 6e-6 * n, p)
    # By hand: ready: layer 2 at 4, layer 1 at 4, layer 0 at 6.75. The channel is free from 4:
    # layer 1 (3000 el, 0.078 ms) whole by 4.078, then layer 2 (10 el) to 4.07806; layer 0 after
    # backward: 6.75 + 0.066 = 6.816; forward 1.625 + 0 + 2 -> iteration 10.441.
    assert [(b.layer, b.numel, b.phase) for b in p.blocks] == [(1, 3000, 1), (2, 10, 1), (0, 1000, 2)]
    assert p.iteration_ms == pytest.approx(6.75 + 0.066 + 1.625 + 2.0, rel=1e-12)
    # fp16 parameters: 2 bytes an element; an explicit size overrides the dtype's.
    half = [dataclasses.replace(m, dtype=torch.float16) for m in PROFILE]
    assert plan_for_profile(half, net, 4, 64) == plan_for_profile(PROFILE, net, 4, 64, bytes_per_element=2)
    # A 1 ms step: the forward starts at 7.75, after layer 0's block (6.816): 7.75 + 1.625 + 2.
    assert plan_for_profile(PROFILE, net, 4, 64, step_ms=1.0).iteration_ms == pytest.approx(11.375, rel=1e-12)


# --- bad inputs ---------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: Layer(0, 1.0, 1.0), "numel"),
    (lambda: Layer(-5, 1.0, 1.0), "numel"),
    (lambda: Layer(2.5, 1.0, 1.0), "numel"),
    (lambda: Layer(10, -1.0, 1.0), "forward_ms"),
    (lambda: Layer(10, 1.0, -0.5), "backward_ms"),
    (lambda: Layer(10, math.nan, 1.0), "forward_ms"),
    (lambda: Layer(10, 1.0, math.inf), "backward_ms"),
    (lambda: plan([], 100, affine(1.0, 1.0)), "empty"),
    (lambda: plan([Layer(10, 1.0, 1.0)], 0, affine(1.0, 1.0)), "unit"),
    (lambda: plan([Layer(10, 1.0, 1.0)], -64, affine(1.0, 1.0)), "unit"),
    (lambda: plan([Layer(10, 1.0, 1.0)], 1.5, affine(1.0, 1.0)), "unit"),
    (lambda: plan([Layer(10, 1.0, 1.0)], 100, affine(1.0, 1.0), step_ms=-1.0), "step_ms"),
    (lambda: plan([Layer(10, 1.0, 1.0)], 100, lambda n: math.nan), "allreduce_ms"),
    (lambda: plan([Layer(10, 1.0, 1.0)], 100, lambda n: -1.0), "allreduce_ms"),
    (lambda: plan([Layer(10, 1.0, 1.0)], 100, "fast"), "allreduce_ms"),
    (lambda: plan_for_profile(PROFILE, Network(10.0, 8.0), 1, 64), "world_size"),
    (lambda: plan_for_profile(PROFILE, Network(10.0, 8.0), 4, 0), "unit"),
    (lambda: plan_for_profile(PROFILE, Network(10.0, 8.0, comm_slowdown=0.5), 4, 64), "comm_slowdown"),
    (lambda: plan_for_profile(PROFILE, Network(10.0, 8.0), 4, 64, bytes_per_element=0), "bytes_per_element"),
    (lambda: plan_for_profile([ModuleProfile("a", 1.0, 1.0, [])], Network(10.0, 8.0), 4, 64), "no parameter"),
    (lambda: plan_for_profile([ModuleProfile("a", 1.0, -1.0, [8])], Network(10.0, 8.0), 4, 64), "'a' backward_ms"),
    (lambda: plan_for_profile([ModuleProfile("a", math.inf, 1.0, [8])], Network(10.0, 8.0), 4, 64),
     "'a' forward_ms"),
    (lambda: plan_for_profile([ModuleProfile("a", 1.0, 1.0, [0])], Network(10.0, 8.0), 4, 64), "module 'a'"),
    (lambda: plan_for_profile([ModuleProfile("a", 1.0, 1.0, [8]), ModuleProfile("b", 1.0, 1.0, [8], torch.float16)],
                              Network(10.0, 8.0), 4, 64), "bytes_per_element"),
])
def test_bad_inputs_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_wrong_types_raise_type_error():
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        plan([Layer(10, 1.0, 1.0), (10, 1.0, 1.0)], 100, affine(1.0, 1.0))
    with pytest.raises(TypeError, match="network"):
        plan_for_profile(PROFILE, object(), 4, 64)
