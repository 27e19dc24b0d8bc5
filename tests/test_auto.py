"""wrap()'s "auto" options: every rank trains with rank 0's plan although
their timings differ, training equals one process on the global batch
(profiling restores what it touched; a re-plan moves the optimizer state to
the new layout and update strategy), and bad combinations are refused."""
import dataclasses
import math
import time
import types

import pytest
import torch

import dearcomm
from dearcomm import _auto, autotune
from dearcomm._auto import surrogate_loss
from tests.models import MixedNet, batches, global_batch, step_on_global_batch, step_on_slice
from tests.multiprocess import run_workers

# And 3 reconfiguration steps. Each plan's trials take at most 20 steps (10 trials of 2: the first round's
# 2 families, the reference and wrap()'s default; the first again; 1 refinement; 2 contenders, the default
# and the reference confirmed, as many as the timings make), then 1 warm-up and 2 window steps: two plans 46.
STEPS = 48

# Options a re-plan may move between, each with AdamW state to carry over:
# the update strategy changes (sharded -> replicated -> full), and the layout.
RECONFIGURATIONS = [
    dict(schedule="wfbp", update="replicated", bucket_mb=0.0, partition_mb=None, credit_mb=None),
    dict(schedule="bytescheduler", update="replicated", bucket_mb=25.0, partition_mb=400 / 2**20, credit_mb=None),
    dict(schedule="dear", update="sharded", bucket_mb=2048 / 2**20, partition_mb=None, credit_mb=None),
]


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)


def _auto_worker(rank, world_size):
    # Two candidates and the reference measured for one step each (after one that rebuilds the buckets),
    # then the first of them again, then the fastest family's runner-up, then (unless the reference measured fastest) the fastest and
    # the reference once more; every window "drifts": one re-plan, whose trials go the same way.
    _auto.WARMUP, _auto.WINDOW, _auto.DRIFT = 1, 2, -1.0
    _auto.MAX_REPLANS, _auto.MAX_TRIALS, _auto.REFINE_TRIALS, _auto.REFINE_FAMILIES, _auto.TRIAL_STEPS = 1, 2, 1, 1, 1
    _auto.CONFIRM_ROUNDS = _auto.CONFIRM_MAX_ROUNDS = 1  # one confirmation round, however close
    _auto.REFINE_MAX_FAMILIES = 1  # one family refined, however close the others measured
    # MixedNet's 2 KiB fit one bucket at every size of the default grid, and
    # sizes that lay out the same buckets are one candidate: 0.5 KiB buckets
    # give every family a second layout.
    autotune.BUCKET_MB = (25.0, 0.0005)
    torch.manual_seed(0)
    model = MixedNet()
    slow = 0.002 * rank  # ranks measure different compute times: only rank 0's may decide
    model.conv.register_forward_hook(lambda *args: time.sleep(slow))
    draws = []  # what training forwards draw (as dropout would): profiling must not shift them

    def draw(*args):
        if not model._dear.planning:
            draws.append(torch.rand(1).item())
    model.fc.register_forward_hook(draw)
    model, optimizer = dearcomm.wrap(model, make_optimizer(model), schedule="auto", bucket_mb="auto",
                                     partition_mb="auto", credit_mb="auto")
    assert model.auto_plan() is None
    torch.manual_seed(1)
    for step, (x, y) in enumerate(batches(STEPS, global_batch(world_size))):
        step_on_slice(model, optimizer, x, y, rank, world_size)
        if step == 4:  # moves the optimizer state through every update strategy and two layouts
            for options in RECONFIGURATIONS:
                # What a planner set for the plan auto kept (usbyte's blocks and
                # priorities, deft's delays) belongs to that plan's schedule.
                options = dict(options, blocks=None, priorities=None, delays=None)
                model._dear.reconfigure(dataclasses.replace(model._dear.options, **options))
                x2, y2 = next(batches(1, global_batch(world_size), seed=100 + step))
                step_on_slice(model, optimizer, x2, y2, rank, world_size)
    model.sync()
    torch.manual_seed(1)
    assert draws == [torch.rand(1).item() for _ in draws], "profiling drew from the training's random stream"
    plans = model._dear.auto.plans  # overlap_report() under "auto": tests/test_overlap_report.py
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()},
                plans=[(p.options, p.step, p.predicted_ms, p.profile.forward_ms, p.network, p.shortlist, p.measured_ms,
                        p.reference, p.confirmations, p.decided, p.first_trial_ms, p.runners_up, p.default)
                       for p in plans],
                options=dataclasses.asdict(model._dear.options) | dict(choice=None, process_group=None))


def _reference():
    torch.manual_seed(0)
    model = MixedNet()
    optimizer = make_optimizer(model)
    return model, optimizer


@pytest.mark.parametrize("world_size", [2, 3])
def test_auto_every_rank_takes_rank0s_plan_and_trains_like_one_process(world_size):
    results = run_workers(_auto_worker, world_size, deadline=240)
    plans = [r["plans"] for r in results]
    assert len(plans[0]) == 2, "one plan at the start and one re-plan after the drift check"
    assert plans[0][0][1] == 0 and plans[0][1][1] > 0
    family = lambda options: (options["schedule"], options["update"])  # noqa: E731
    for options, _, predicted, _, _, shortlist, measured, reference, confirmations, decided, first, runners_up, \
            default in plans[0]:
        assert decided and len(measured) == len(shortlist)
        assert first is not None and first > 0, "the first candidate measured again after the first round"
        assert {k: shortlist[reference][0][k] for k in ("schedule", "bucket_mb", "partition_mb", "credit_mb")} == \
            dict(schedule="wfbp", bucket_mb=25.0, partition_mb=None, credit_mb=None), "the reference: DDP's layout"
        assert shortlist[default][0] | dict(blocks=None, priorities=None) == \
            dict(schedule="dear", update="sharded", bucket_mb=25.0, partition_mb=None, credit_mb=None,
                 blocks=None, priorities=None), "wrap()'s default"
        # The two families' best, then the reference and wrap()'s default unless among them.
        first_round = 2 + len({i for i in (reference, default) if i >= 2})
        assert max(reference, default) < first_round and len({family(o) for o, _ in shortlist[:2]}) == 2
        # The fastest family with a runner-up left is refined: usbyte has one candidate, its planner's,
        # and a family whose runner-up is the reference has none left once the reference is measured.
        first_options = [o for o, _ in shortlist[:first_round]]
        open_families = {family(o) for o, _ in runners_up if o not in first_options}
        # Which families come first follows the ranks' timings: where the first round's families have
        # no runner-up left (their second layout is the reference or the default), nothing is refined.
        refinable = [i for i in range(first_round) if family(shortlist[i][0]) in open_families]
        if not refinable:
            assert len(shortlist) == first_round, "no runner-up left in the families measured: nothing refined"
        else:
            fastest_first = min(refinable, key=lambda i: measured[i])
            assert len(shortlist) == first_round + 1, "then the fastest family's runner-up"
            assert family(shortlist[-1][0]) == family(shortlist[fastest_first][0]), "the faster family's runner-up"
            assert shortlist[-1][0] not in [o for o, _ in shortlist[:-1]]
        best = min(range(len(measured)), key=lambda i: measured[i])
        contenders = [] if best == reference else sorted((i for i in range(len(measured)) if i != reference),
                                                         key=lambda i: (measured[i], i))[:_auto.CONFIRM_CONTENDERS]
        if default != reference and default not in contenders and \
                shortlist[default][1] <= min(p for _, p in shortlist) * (1 + _auto.CONFIRM_DEFAULT_WITHIN):
            contenders.append(default)
        if not contenders:
            assert confirmations == () and (options, predicted) == shortlist[reference]
            continue
        assert [i for i, _ in confirmations] == [*contenders, reference], \
            "the fastest candidates, wrap()'s default where priced near the fastest, and the reference measured again"
        again = dict(confirmations)  # one round: the ratio of its measurements decides
        ratio = {i: again[i] / again[reference] for i in contenders}
        margin = 1 - _auto.CONFIRM_MARGIN
        beating = [i for i in contenders
                   if ratio[i] < margin or (ratio[i] < 1 and shortlist[i][1] / shortlist[reference][1] < margin)]
        kept = reference
        if beating:  # of those measured alike, the one predicted faster
            lowest = min(ratio[i] for i in beating)
            kept = min((i for i in beating if ratio[i] <= lowest + _auto.CONFIRM_MARGIN),
                       key=lambda i: (shortlist[i][1], ratio[i]))
        assert (options, predicted) == shortlist[kept], "the reference stays unless a contender beats it again"
    for rank, theirs in enumerate(plans):
        assert theirs == plans[0], f"rank {rank} planned differently from rank 0"
    first = plans[0][0]
    # blocks and priorities: usbyte's plan is a candidate (None in every other one's options).
    assert set(first[0]) == {"schedule", "update", "bucket_mb", "partition_mb", "credit_mb", "blocks", "priorities"}
    assert first[2] > 0 and first[4].gbit_s > 0
    assert first[4].all_reduce_lanes == 2, "the probed network: gloo's two worker threads run two all-reduces at once"
    assert set(first[4].host_ms) == {"reduce_scatter", "all_gather", "all_reduce", "ordered_all_reduce"} and \
        all(math.isfinite(v) and v >= 0 for v in first[4].host_ms.values()), "the probe's host cost per collective"
    assert "ordered_all_reduce" in first[4].per_kind, "deft's ordered all-reduce, probed as a collective of its own"
    # The last reconfiguration's options are in force (a plan came before it).
    assert all(r["options"] == results[0]["options"] for r in results)

    model, optimizer = _reference()
    for step, (x, y) in enumerate(batches(STEPS, global_batch(world_size))):
        step_on_global_batch(model, optimizer, x, y)
        if step == 4:
            for _ in RECONFIGURATIONS:
                x2, y2 = next(batches(1, global_batch(world_size), seed=100 + step))
                step_on_global_batch(model, optimizer, x2, y2)
    expected = dict(model.named_parameters())
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def test_auto_refuses_what_it_cannot_plan():
    model = MixedNet()
    optimizer = make_optimizer(model)
    with pytest.raises(ValueError, match="dearcomm: credit_mb is bytescheduler's option"):
        dearcomm.wrap(model, optimizer, schedule="auto", credit_mb=4.0)
    for schedule in (None, "wfbp"):  # wrap()'s default (dear), or another schedule without a credit
        given = {} if schedule is None else dict(schedule=schedule)
        with pytest.raises(ValueError, match=f"schedule='{schedule or 'dear'}' has no credit; credit_mb='auto' "
                                             "applies to schedule='bytescheduler'"):
            dearcomm.wrap(model, optimizer, credit_mb="auto", **given)
    with pytest.raises(ValueError, match="dearcomm: bucket_mb='auto' cannot be combined with blocks"):
        dearcomm.wrap(model, optimizer, bucket_mb="auto", blocks={"head.weight": [39]})
    with pytest.raises(ValueError, match="dearcomm: priorities are usbyte's order for one job"):
        dearcomm.wrap(model, optimizer, schedule="auto", priorities={"head.weight": 0})
    with pytest.raises(TypeError, match="dearcomm: bucket_mb must be a number of MiB"):
        dearcomm.wrap(model, optimizer, bucket_mb="automatic")


def test_surrogate_loss_sums_every_output_that_trains():
    w = torch.ones(3, requires_grad=True)
    out = {"logits": w * 2, "aux": (w * 3, torch.arange(3)), "frozen": torch.ones(3)}
    loss = surrogate_loss(out)
    loss.backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 5.0))

    class WithLoss(dict):
        loss = (w * 4).sum()
    assert surrogate_loss(WithLoss()) is WithLoss.loss
    with pytest.raises(ValueError, match="dearcomm: auto could not profile the model"):
        surrogate_loss((torch.ones(2), [torch.arange(2)]))



# ---- choosing among measured candidates (no processes) -------------------------------------------


def _candidate(predicted_ms, **options):
    full = dict(schedule="dear", update="sharded", bucket_mb=25.0, partition_mb=None, credit_mb=None)
    return dearcomm.autotune.Candidate(dict(full, **options), predicted_ms)


def _knobs(monkeypatch, **values):
    """Sets _auto's constants for one test."""
    for name, value in values.items():
        monkeypatch.setattr(_auto, name, value)


def _plan_measured(measured, reference, confirmations=(), predicted=None):
    predicted = predicted or [100.0 + i for i in range(len(measured))]
    shortlist = tuple(({"schedule": f"s{i}"}, predicted[i]) for i in range(len(measured)))
    return _auto.AutoPlan(options=shortlist[0][0], predicted_ms=100.0, default_ms=100.0, candidates=len(measured),
                          step=0, reason="test", network=None, profile=None, shortlist=shortlist,
                          runners_up=(), refined=True, measured_ms=tuple(measured), reference=reference,
                          confirmations=tuple(confirmations))


ALL_AUTO = ("schedule", "bucket_mb", "partition_mb", "credit_mb")


def _first_round_of(candidates, default):
    """_first_round over candidates (fastest predicted first), every option "auto"."""
    result = autotune.Plan(best=candidates[0], default=default, candidates=candidates)
    return _auto._first_round(result, ALL_AUTO, update_free=True)


def test_the_first_round_measures_ddp_s_layout_and_wrap_s_default_whatever_their_prediction(monkeypatch):
    _knobs(monkeypatch, MAX_TRIALS=2)
    # As on loopback: dear-sharded with partitions predicted fastest, the default far behind.
    candidates = [_candidate(90.0, partition_mb=4.0), _candidate(92.0, update="replicated", partition_mb=4.0),
                  _candidate(95.0, schedule="bytescheduler", update="replicated"),
                  _candidate(97.0, partition_mb=16.0), _candidate(99.0),
                  _candidate(101.0, schedule="wfbp", update="replicated")]
    auto = ALL_AUTO
    first, runners_up, reference, default = _first_round_of(candidates, candidates[4])
    assert first == [candidates[0], candidates[1], candidates[5], candidates[4]]
    assert (reference, default) == (2, 3)
    assert candidates[3] in runners_up
    # Where the planner picks the update, the default is dear's own (sharded), not a faster
    # replicated one; where the user fixed it (every candidate has theirs), it is that one.
    replicated = _candidate(98.0, update="replicated")
    both = sorted(candidates + [replicated], key=lambda c: c.predicted_ms)
    first, _, _, default = _first_round_of(both, candidates[4])
    assert first[default] == candidates[4]
    fixed = [c for c in both if c.options["update"] == "replicated"]
    first, _, reference, default = _auto._first_round(
        autotune.Plan(best=fixed[0], default=candidates[4], candidates=fixed), auto, update_free=False)
    assert first[default] == replicated and first[reference].options["schedule"] == "wfbp"
    # The default already in the first round (predicted fastest): not measured twice.
    ranked = [candidates[4], candidates[5], candidates[0]]
    first, _, reference, default = _first_round_of(ranked, ranked[0])
    assert first == ranked[:2] and (reference, default) == (1, 0)
    # Only bucket_mb "auto" (the rest the user's): DDP's layout and wrap()'s default are one candidate.
    sizes = [_candidate(90.0, bucket_mb=1.0), _candidate(99.0)]
    result = autotune.Plan(best=sizes[0], default=sizes[1], candidates=sizes)
    first, _, reference, default = _auto._first_round(result, ("bucket_mb",), update_free=False)
    assert first == sizes and reference == default == 1


def test_the_first_trial_delays_nothing_even_where_delays_are_predicted_fastest(monkeypatch):
    # deft's delays refuse a loop of several backwards a step; the first
    # candidate's steps show such a loop (forbid_delays) before any delay trains.
    _knobs(monkeypatch, MAX_TRIALS=3)
    candidates = [_candidate(80.0, schedule="deft", update="replicated", delays={"0.weight": 1}),
                  _candidate(90.0, partition_mb=4.0), _candidate(99.0),
                  _candidate(101.0, schedule="wfbp", update="replicated")]
    first, _, reference, default = _first_round_of(candidates, candidates[2])
    assert first == [candidates[1], candidates[0], candidates[3], candidates[2]]
    assert (reference, default) == (2, 3)


def test_trials_go_first_round_then_the_first_again_then_runners_up_then_confirmations(monkeypatch):
    _knobs(monkeypatch, REFINE_FAMILIES=1, REFINE_TRIALS=1, REFINE_MAX_FAMILIES=1, CONFIRM_CONTENDERS=1,
           CONFIRM_ROUNDS=1)
    schedules = ["dear", "bytescheduler", "wfbp"]  # wfbp: the reference
    shortlist = tuple((_candidate(100.0 + i, schedule=s, update="replicated").options, 100.0 + i)
                      for i, s in enumerate(schedules))
    runners_up = tuple((_candidate(110.0, schedule=s, update="replicated", partition_mb=1.0).options, 110.0)
                       for s in schedules)
    plan = _auto.AutoPlan(options=shortlist[0][0], predicted_ms=100.0, default_ms=100.0, candidates=6, step=0,
                          reason="test", network=None, profile=None, shortlist=shortlist, runners_up=runners_up,
                          reference=2)
    order = []
    # dear's first trial reads slow (130 ms); measured again it is the fastest (90 ms), so its
    # family is the one refined, and it is the contender confirmed against the reference.
    for ms in [130.0, 105.0, 100.0, 90.0, 95.0, 91.0, 100.0]:
        assert not plan.decided
        order.append(plan.next_trial())
        plan = plan.with_trial(ms)
    assert plan.decided and plan.next_trial() is None
    assert order == [0, 1, 2, 0, 3, 0, 2]
    assert plan.first_trial_ms == 130.0 and plan.measured_ms == (90.0, 105.0, 100.0, 95.0)
    assert plan.shortlist[3][0] == runners_up[0][0], "dear's runner-up: its family measured fastest the second time"
    assert plan.choice() == (0, 91.0)
    logged = str(dataclasses.replace(plan, profile=types.SimpleNamespace(forward_ms=1.0, backward_ms=2.0, step_ms=1.0),
                                     network=dearcomm.prediction.Network(alpha_us=100.0, gbit_s=1.0), default=0))
    assert "the first candidate's first trial 130.00 ms" in logged
    assert "measured (default) schedule=dear" in logged and ", (reference) schedule=wfbp" in logged
    assert "the slowest rank's with the compute varying 0.0%" in logged
    shared = str(dataclasses.replace(plan, profile=types.SimpleNamespace(forward_ms=1.0, backward_ms=2.0, step_ms=1.0),
                                     network=dearcomm.prediction.Network(alpha_us=100.0, gbit_s=1.0, cores_share=2.0)))
    assert "2 ranks per core taking turns" in shared and "slowest rank" not in shared
    # One candidate and no runner-up: nothing to measure again.
    alone = _auto.AutoPlan(options=shortlist[0][0], predicted_ms=100.0, default_ms=100.0, candidates=1, step=0,
                           reason="test", network=None, profile=None, shortlist=shortlist[:1])
    assert alone.decided


def test_the_fastest_trial_must_beat_the_reference_again_to_replace_it(monkeypatch):
    _knobs(monkeypatch, CONFIRM_ROUNDS=3, CONFIRM_CONTENDERS=1)
    plan = _plan_measured([90.0, 110.0, 100.0], reference=2)
    assert plan.next_round() == (0, 2) and plan.next_trial() == 0 and not plan.decided
    # Lucky in its trial: measured again, it is as fast as the reference; the reference stays.
    lucky = _plan_measured([90.0, 110.0, 100.0], 2, [(0, 101.0), (2, 100.0), (0, 99.0), (2, 100.5), (0, 100.0),
                                                      (2, 99.0)])
    assert lucky.decided and lucky.next_trial() is None
    assert lucky.choice() == (2, 100.0)
    # Faster again in every round, but by less than the margin: within noise, the reference stays.
    slightly = _plan_measured([90.0, 110.0, 100.0], 2, [(0, 98.5), (2, 100.0), (0, 98.6), (2, 100.0), (0, 98.4),
                                                         (2, 100.0)])
    assert slightly.choice() == (2, 100.0)
    # One round's outlier (as measured on ResNet: 269 against 294 ms) does not make it faster.
    outlier = _plan_measured([90.0, 110.0, 100.0], 2, [(0, 322.3), (2, 320.6), (0, 269.1), (2, 294.0), (0, 301.0),
                                                        (2, 300.0)])
    assert outlier.choice()[0] == 2
    # Faster again, by more than the margin: it replaces the reference.
    faster = _plan_measured([90.0, 110.0, 100.0], 2, [(0, 91.0), (2, 100.0), (0, 99.0), (2, 100.0), (0, 93.0),
                                                       (2, 101.0)])
    assert faster.choice() == (0, 93.0)
    # Faster again by less than the margin, but predicted faster by more (as on widein at batch
    # 1024: predicted 0.91x, measured 0.987x): the trials confirm the simulation's direction.
    predicted = _plan_measured([90.0, 110.0, 100.0], 2, slightly.confirmations, predicted=[91.0, 110.0, 100.0])
    assert predicted.choice() == (0, 98.5)
    # Predicted faster by more than the margin, measured slower: the reference stays.
    slower = [(i, ms + 3.0 if i == 0 else ms) for i, ms in slightly.confirmations]
    assert _plan_measured([90.0, 110.0, 100.0], 2, slower, predicted=[91.0, 110.0, 100.0]).choice()[0] == 2
    # The reference measured fastest: nothing to confirm.
    plain = _plan_measured([105.0, 110.0, 100.0], 2)
    assert plain.next_round() == () and plain.decided and plain.choice() == (2, 100.0)
    # No reference (none among the candidates): the fastest measured.
    assert _plan_measured([105.0, 95.0], None).choice() == (1, 95.0)


def test_the_two_fastest_trials_are_confirmed_and_the_one_that_beats_the_reference_most_wins(monkeypatch):
    _knobs(monkeypatch, CONFIRM_ROUNDS=3, CONFIRM_CONTENDERS=2)
    # As on widein at 4 ranks: 1 lucky in its trial, 3 a little behind it, 2 the reference.
    trials = [480.0, 421.3, 539.6, 460.8]
    plan = _plan_measured(trials, reference=2)
    assert plan.contenders() == (1, 3)
    assert plan.next_round() == (1, 3, 2) and plan.next_trial() == 1
    again = [(1, 465.9), (3, 452.0), (2, 511.0), (1, 589.4), (3, 447.0), (2, 504.7), (1, 520.0), (3, 450.1), (2, 506.3)]
    assert _plan_measured(trials, 2, again[:4]).next_trial() == 3 and not _plan_measured(trials, 2, again[:4]).decided
    # After three rounds 3 is decided (0.885-0.889 the reference's time), 1 is not (0.91, 1.17,
    # 1.03: its median lies within two standard errors of 0.97): it and the reference go on.
    three = _plan_measured(trials, 2, again)
    assert three.next_round() == (1, 2) and three.next_trial() == 1 and not three.decided
    plan = three
    while (index := plan.next_trial()) is not None:
        plan = plan.with_trial(510.0 if index == 1 else 500.0)
    ratios = plan.confirmed_ratios()  # 1.02 the reference's time, its first rounds spread: never decided
    assert len(ratios[1]) == _auto.CONFIRM_MAX_ROUNDS and len(ratios[3]) == 3
    assert plan.decided and plan.choice() == (3, 450.1)
    # Rounds that agree decide it before the last: 0.84 of the reference's time from the fourth on.
    plan = three
    while (index := plan.next_trial()) is not None:
        plan = plan.with_trial(420.0 if index == 1 else 500.0)
    assert 3 < len(plan.confirmed_ratios()[1]) < _auto.CONFIRM_MAX_ROUNDS, plan.confirmed_ratios()
    assert plan.decided and plan.choice()[0] in (1, 3)
    # Neither beats the reference by the margin: the reference stays.
    close = [(i, ms if i == 2 else 500.0) for i, ms in again]
    assert _plan_measured(trials, 2, close).choice()[0] == 2
    # Both beat it, measured within the margin of each other: the one predicted faster, whichever measured
    # lower (as on widein at 4 ranks: 1 MiB partitions 0.871 the reference's time, 4 MiB 0.874; predicted
    # 456 and 430 ms, and the 1 MiB run took 1.036x the 4 MiB one's time fixed).
    alike = [(1, 440.0), (3, 445.0), (2, 500.0)] * 3
    assert _plan_measured(trials, 2, alike).choice()[0] == 1, "predicted 101 against 103"
    assert _plan_measured(trials, 2, alike, predicted=[100.0, 103.0, 104.0, 101.0]).choice() == (3, 445.0)
    # Apart by more than the margin: the lower ratio, whatever the prediction says.
    apart = [(1, 470.0), (3, 440.0), (2, 500.0)] * 3
    assert _plan_measured(trials, 2, apart).choice() == (3, 440.0)
    # Only one of them beats the reference: it, even where the other is predicted faster.
    one = [(1, 440.0), (3, 497.0), (2, 500.0)] * 3
    assert _plan_measured(trials, 2, one, predicted=[100.0, 103.0, 104.0, 101.0]).choice() == (1, 440.0)
    # Only one candidate but the reference: one contender.
    assert _plan_measured([90.0, 100.0], reference=1).next_round() == (0, 1)


def test_wraps_default_priced_near_the_fastest_is_confirmed_whatever_its_one_trial_read(monkeypatch):
    _knobs(monkeypatch, CONFIRM_ROUNDS=3, CONFIRM_CONTENDERS=1)
    # As the MLP on loopback: the default (0) priced fastest, its one trial slow (492 ms); a
    # runner-up (3) measured fastest in a quieter moment; the reference (2).
    trials, predicted = [492.0, 502.1, 477.9, 399.3], [438.4, 453.0, 463.6, 469.1]
    plan = dataclasses.replace(_plan_measured(trials, 2, predicted=predicted), default=0)
    assert plan.contenders() == (3, 0) and plan.next_round() == (3, 0, 2)
    # Measured again in turn, the default is the faster: predicted faster than the reference by
    # more than the margin, it needs only to measure faster.
    again = [(3, 428.3), (0, 381.0), (2, 398.1), (3, 422.2), (0, 384.5), (2, 412.9), (3, 413.0), (0, 379.9),
             (2, 396.0)]
    assert dataclasses.replace(plan, confirmations=tuple(again)).choice() == (0, 381.0)
    # The reference measured fastest: the default is still measured against it.
    assert dataclasses.replace(plan, measured_ms=(492.0, 502.1, 390.0, 399.3)).next_round() == (0, 2)
    # Priced more than CONFIRM_DEFAULT_WITHIN behind the fastest (as on a slow link): its trial decides.
    far = dataclasses.replace(_plan_measured(trials, 2, predicted=[480.0, 453.0, 463.6, 440.0]), default=0)
    assert far.contenders() == (3,)
    # Already a contender, or the reference itself: measured once as such.
    assert dataclasses.replace(_plan_measured([380.0, 502.1, 477.9, 399.3], 2, predicted=predicted),
                               default=0).contenders() == (0,)
    assert dataclasses.replace(_plan_measured(trials, 2, predicted=predicted), default=2).contenders() == (3,)


def test_runners_up_try_other_partition_sizes_first():
    family = [_candidate(100.0 + i, partition_mb=p) for i, p in enumerate([None, None, 4.0, None, 1.0, 4.0])]
    assert [c.options["partition_mb"] for c in _auto._other_cuts_first(family)] == [4.0, 1.0, None, None, 4.0]


def test_families_measured_within_the_noise_of_the_fastest_are_refined_too(monkeypatch):
    _knobs(monkeypatch, REFINE_FAMILIES=2, REFINE_TRIALS=1, REFINE_WITHIN=0.05, REFINE_MAX_FAMILIES=3)
    schedules = ["wfbp", "wfbp", "bytescheduler", "dear", "usbyte"]  # wfbp twice: its best and the reference
    shortlist = tuple((_candidate(100.0, schedule=s, update="replicated").options, 100.0) for s in schedules)
    runners_up = tuple((_candidate(100.0, schedule=s, update="replicated", partition_mb=1.0).options, 101.0)
                       for s in ["wfbp", "bytescheduler", "dear", "usbyte"])
    plan = _auto.AutoPlan(options=shortlist[0][0], predicted_ms=100.0, default_ms=100.0, candidates=5, step=0,
                          reason="test", network=None, profile=None, shortlist=shortlist, runners_up=runners_up,
                          measured_ms=(427.0, 428.0, 429.0, 437.0, 462.0), reference=1)
    added = [options["schedule"] for options, _ in _auto._refined(plan).shortlist[len(shortlist):]]
    # wfbp and bytescheduler (the two fastest families; wfbp once), dear at 2.3% behind; usbyte 8% behind is not.
    assert added == ["wfbp", "bytescheduler", "dear"]
    # usbyte 3% behind is within the margin, but beyond REFINE_MAX_FAMILIES ...
    close = dataclasses.replace(plan, measured_ms=(427.0, 428.0, 429.0, 437.0, 440.0))
    assert [o["schedule"] for o, _ in _auto._refined(close).shortlist[len(shortlist):]] == added
    # ... which, raised, lets it in.
    _knobs(monkeypatch, REFINE_MAX_FAMILIES=4)
    assert [o["schedule"] for o, _ in _auto._refined(close).shortlist[len(shortlist):]] == added + ["usbyte"]


def test_nothing_is_refined_where_the_measured_families_have_no_runner_up_left(monkeypatch):
    _knobs(monkeypatch, REFINE_FAMILIES=1, REFINE_TRIALS=1, REFINE_MAX_FAMILIES=1)
    # Measured: wfbp's and dear's best (0.5 KiB buckets), then the reference and the default (25 MiB), which
    # are those families' only runners-up. bytescheduler, not measured, has one left: it is not a refinement.
    first = [("wfbp", 0.0005), ("dear", 0.0005), ("wfbp", 25.0), ("dear", 25.0)]
    shortlist = tuple((_candidate(100.0, schedule=s, update="replicated", bucket_mb=b).options, 100.0)
                      for s, b in first)
    runners_up = shortlist[2:] + ((_candidate(101.0, schedule="bytescheduler", update="replicated").options, 101.0),)
    plan = _auto.AutoPlan(options=shortlist[0][0], predicted_ms=100.0, default_ms=100.0, candidates=5, step=0,
                          reason="test", network=None, profile=None, shortlist=shortlist, runners_up=runners_up,
                          reference=2, default=3)
    for ms in (410.0, 420.0, 430.0, 440.0, 412.0):  # the first round, then the first candidate again
        plan = plan.with_trial(ms)
    assert plan.refined and plan.shortlist == shortlist, "no runner-up of a measured family: nothing added"
    # The confirmation follows as with a refinement: the fastest (wfbp's best) against the reference.
    assert plan.next_trial() == 0 and not plan.decided


def test_a_family_whose_trial_was_mispriced_is_refined_too(monkeypatch):
    _knobs(monkeypatch, REFINE_FAMILIES=2, REFINE_TRIALS=1, REFINE_WITHIN=0.05, REFINE_MAX_FAMILIES=3,
           REFINE_MISPRICED=0.10)
    # GPT at 4 ranks, 1 Gbit/s: (schedule, update, predicted, measured) of the first round's trials.
    trials = [("dear", "sharded", 899.7, 979.4), ("usbyte", "replicated", 919.8, 833.6),
              ("dear", "replicated", 920.0, 879.5), ("bytescheduler", "replicated", 921.1, 806.0),
              ("wfbp", "replicated", 921.1, 845.2)]
    shortlist = tuple((_candidate(p, schedule=s, update=u).options, p) for s, u, p, _ in trials)
    runners_up = tuple((_candidate(930.0, schedule=s, update=u, partition_mb=4.0).options, 930.0)
                       for s, u, _, _ in trials if s != "usbyte")  # usbyte's planner gives one candidate
    plan = _auto.AutoPlan(options=shortlist[0][0], predicted_ms=899.7, default_ms=950.0, candidates=5, step=0,
                          reason="test", network=None, profile=None, shortlist=shortlist, runners_up=runners_up,
                          measured_ms=tuple(m for *_, m in trials), reference=4)
    # dear sharded took 1.089x its prediction, the others 0.875-0.956x (median 0.918)
    assert _auto._mispriced(plan) == [("dear", "sharded")]
    added = [(o["schedule"], o["update"]) for o, _ in _auto._refined(plan).shortlist[len(shortlist):]]
    # bytescheduler and wfbp (the fastest), then dear sharded; usbyte, within 5%, has no runner-up
    assert added == [("bytescheduler", "replicated"), ("wfbp", "replicated"), ("dear", "sharded")]
    # The third place goes to the mispriced family before one within 5% of the fastest (wfbp, 845 ms).
    close = dataclasses.replace(plan, measured_ms=(979.4, 833.6, 830.0, 806.0, 845.2))
    assert [(o["schedule"], o["update"]) for o, _ in _auto._refined(close).shortlist[len(shortlist):]] == \
        [("bytescheduler", "replicated"), ("dear", "replicated"), ("dear", "sharded")]
    # Priced like the others: not refined.
    fair = dataclasses.replace(plan, measured_ms=(880.0, *plan.measured_ms[1:]))  # 1.065x the median ratio
    assert _auto._mispriced(fair) == []
    assert ("dear", "sharded") not in [(o["schedule"], o["update"]) for o, _ in
                                       _auto._refined(fair).shortlist[len(shortlist):]]


def test_the_reference_is_ddps_layout_or_the_users_own_options():
    candidates = [_candidate(90.0, bucket_mb=4.0, partition_mb=1.0),
                  _candidate(95.0, schedule="wfbp", update="replicated", bucket_mb=4.0),
                  _candidate(97.0, bucket_mb=25.0),
                  _candidate(99.0, schedule="wfbp", update="replicated", bucket_mb=25.0)]
    result = dearcomm.autotune.Plan(best=candidates[0], default=candidates[2], candidates=candidates)

    def reference(plan, auto):
        first, _, index, _ = _auto._first_round(plan, auto, update_free=False)
        return None if index is None else first[index]
    assert reference(result, ("schedule", "bucket_mb", "partition_mb", "credit_mb")) is candidates[3]
    # The schedule fixed by the user (every candidate has it): its 25 MiB buckets without partitions.
    dear_only = dataclasses.replace(result, candidates=[c for c in candidates if c.options["schedule"] == "dear"])
    assert reference(dear_only, ("bucket_mb", "partition_mb")) is candidates[2]
    # wfbp ruled out (the user's update): wrap()'s default.
    assert reference(dear_only, ("schedule", "bucket_mb", "partition_mb")) is candidates[2]
    none_fits = dataclasses.replace(result, candidates=candidates[:2])
    assert reference(none_fits, ("schedule", "bucket_mb", "partition_mb")) is None


class _WithUnusedHead(MixedNet):
    def __init__(self):
        super().__init__()
        self.unused_head = torch.nn.Linear(4, 4)  # never called: no gradient, as DDP's find_unused_parameters allows


def _unused_worker(rank, world_size):
    torch.manual_seed(0)
    model = _WithUnusedHead()
    model, optimizer = dearcomm.wrap(model, make_optimizer(model), schedule="auto", find_unused_parameters=True)
    torch.manual_seed(1)
    for x, y in batches(12, global_batch(world_size)):
        step_on_slice(model, optimizer, x, y, rank, world_size)
    model.sync()
    return dict(plan=model.auto_plan() is not None, params={n: p.detach().clone() for n, p in model.named_parameters()})


def test_auto_profiles_a_model_with_unused_parameters_where_wrap_allows_them():
    """find_unused_parameters=True: "auto" profiles such a model (the unused
    parameters taken as ready when backward ends) and trains it like one
    process, as schedule="dear" does."""
    results = run_workers(_unused_worker, 2, deadline=180)
    assert all(r["plan"] for r in results)
    torch.manual_seed(0)
    model = _WithUnusedHead()
    optimizer = make_optimizer(model)
    torch.manual_seed(1)
    for x, y in batches(12, global_batch(2)):
        step_on_global_batch(model, optimizer, x, y)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            torch.testing.assert_close(value, dict(model.named_parameters())[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def _trained_like_one_process(results, world_size, steps):
    torch.manual_seed(0)
    model = MixedNet()
    optimizer = make_optimizer(model)
    for x, y in batches(steps, global_batch(world_size)):
        step_on_global_batch(model, optimizer, x, y)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            torch.testing.assert_close(value, dict(model.named_parameters())[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


class _Records(list):
    def __init__(self):
        super().__init__()
        import logging
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.append(record.getMessage())
        logging.getLogger("dearcomm").addHandler(self.handler)
        logging.getLogger("dearcomm").setLevel(logging.INFO)


def _unfittable_probe_worker(rank, world_size):
    """Every probe of the network reads a small collective slower than a
    large one (a stall on a busy machine): no α-β line fits."""
    from dearcomm import network_probe

    calls = []

    def stalled(kind, full, shard, group, backend, repeats, *statistic):
        calls.append(full.numel())
        return 1e6 / full.numel(), 1.0  # µs: falls with size
    network_probe._timed = stalled
    logs = _Records()
    torch.manual_seed(0)
    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, make_optimizer(model), schedule="auto", bucket_mb="auto")
    for x, y in batches(4, global_batch(world_size)):
        step_on_slice(model, optimizer, x, y, rank, world_size)
    model.sync()
    return dict(plan=model.auto_plan(), schedule=model._dear.options.schedule, probes=len(calls), logs=list(logs),
                params={n: p.detach().clone() for n, p in model.named_parameters()})


def test_auto_trains_on_with_its_defaults_where_the_network_cannot_be_fitted():
    """The probe times again, and where no try fits, "auto" logs why and
    trains with the options it started with (wrap()'s defaults), as usbyte
    and deft do where they cannot profile: it raised at the first forward."""
    from dearcomm.network_probe import PROBE_BYTES, PROBE_TRIES

    results = run_workers(_unfittable_probe_worker, 2, deadline=120)
    for rank, r in enumerate(results):
        assert r["plan"] is None and r["schedule"] == "dear", r
        kinds = r["probes"] // PROBE_TRIES // (len(PROBE_BYTES) + 1)
        assert r["probes"] == PROBE_TRIES * (len(PROBE_BYTES) + 1) * kinds, f"rank {rank}: {r['probes']} timings"
    assert any("auto could not measure the network" in m and "could not be fitted in 3 tries" in m
               for m in results[0]["logs"]), results[0]["logs"]
    _trained_like_one_process(results, 2, 4)


def _one_rank_worker(rank, world_size):
    torch.manual_seed(0)
    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, make_optimizer(model), schedule="auto", bucket_mb="auto",
                                     partition_mb="auto")
    for x, y in batches(4, global_batch(world_size)):
        step_on_slice(model, optimizer, x, y, rank, world_size)
    model.sync()
    return dict(plan=model.auto_plan(), params={n: p.detach().clone() for n, p in model.named_parameters()})


def test_auto_on_one_rank_keeps_the_defaults():
    """One rank communicates nothing: "auto" does not probe a network (which
    needs two ranks, and raised at the first forward) and trains as wrap()'s
    defaults do."""
    results = run_workers(_one_rank_worker, 1, deadline=120)
    assert results[0]["plan"] is None
    _trained_like_one_process(results, 1, 4)


def _single_candidate_worker(rank, world_size):
    _auto.WARMUP, _auto.WINDOW, _auto.DRIFT = 1, 2, -1.0  # every window after the first "drifts"
    torch.manual_seed(0)
    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, make_optimizer(model), schedule="auto", update="sharded")
    plans = []
    for x, y in batches(7, global_batch(world_size)):
        step_on_slice(model, optimizer, x, y, rank, world_size)
        plans.append(len(model._dear.auto.plans))
    return dict(shortlist=len(model._dear.auto.plans[0].shortlist), plans=plans)


def test_a_single_candidate_is_compared_with_its_first_measured_window():
    """With one candidate nothing is measured before training with it: its
    first window (the iterations ending at steps 2 and 3 here) is what later
    windows are compared with, not the prediction (a model the simulator
    prices far off re-planned to the same choice at every window); the next
    window that drifts from it (steps 4-5) re-plans at the forward after it."""
    for rank, r in enumerate(run_workers(_single_candidate_worker, 2, deadline=180)):
        assert r["shortlist"] == 1, r
        assert r["plans"] == [1, 1, 1, 1, 1, 2, 2], f"rank {rank}: plans after each step {r['plans']}"


def _one_size_probe_worker(rank, world_size):
    from dearcomm import network_probe

    timed = []
    real = network_probe._timed
    network_probe._timed = lambda *args, **kwargs: timed.append(1) or real(*args, **kwargs)
    try:
        network_probe.probe_network(torch.distributed.group.WORLD, torch.device("cpu"), sizes=(1 << 20,))
    except ValueError as e:
        return type(e).__name__, str(e), len(timed)
    return None


def test_the_probe_times_again_only_when_its_times_do_not_grow():
    """A fit that fails for any other reason (here one size only) is no
    matter of noisy timing: raised at once, as it is, not after three tries
    as "could not be fitted"."""
    for rank, result in enumerate(run_workers(_one_size_probe_worker, 2, deadline=120)):
        assert result is not None, f"rank {rank}: one size was fitted"
        kind, message, timed = result
        assert kind == "ValueError" and "2 distinct sizes" in message, (rank, kind, message)
        assert timed == 2 * 4, f"rank {rank}: {timed} timings: timed again"  # one size and the host call, 4 kinds


def _layout_log_worker(rank, world_size, last_tried):
    import logging
    _auto.WARMUP, _auto.TRIAL_STEPS = 1, 1
    _auto.CONFIRM_ROUNDS = _auto.CONFIRM_MAX_ROUNDS = 1
    records = _Records()
    torch.manual_seed(0)
    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, make_optimizer(model), schedule="auto", bucket_mb="auto")
    if last_tried:  # the choice is what the last trial trained with: nothing to rebuild
        def choice(plan):
            current = model._dear.options
            return next(i for i, (o, _) in enumerate(plan.shortlist)
                        if all(o[k] == getattr(current, k) for k in ("schedule", "update", "bucket_mb"))), 1.0
        _auto.AutoPlan.choice = choice
    steps = 0
    for x, y in batches(60, global_batch(world_size)):
        step_on_slice(model, optimizer, x, y, rank, world_size)
        steps += 1
        if model._dear.auto.settled:
            break
    for x, y in batches(2, global_batch(world_size), seed=5):  # with the choice, rebuilt or not
        step_on_slice(model, optimizer, x, y, rank, world_size)
    logging.getLogger("dearcomm").removeHandler(records.handler)
    plan = model.auto_plan()
    return dict(settled=model._dear.auto.settled, trials=len(plan.measured_ms) + len(plan.confirmations),
                layouts=sum("buckets on" in m for m in records), plans=sum(m.startswith("dearcomm auto") for m in records))


@pytest.mark.parametrize("last_tried", [False, True])
def test_the_bucket_layout_is_logged_for_the_choice_not_for_every_trial(last_tried):
    """Each trial rebuilds the buckets; the layout's INFO lines were logged
    for every candidate (a screenful per trial). auto's own lines name the
    candidates; the layout is logged once, for what training goes on with,
    whether choosing it rebuilt the buckets or not (the candidate tried
    last)."""
    r = run_workers(_layout_log_worker, 2, last_tried, deadline=180)[0]
    assert r["settled"] and r["trials"] >= 3, r
    assert r["plans"] >= 1 and r["layouts"] == 1, r
