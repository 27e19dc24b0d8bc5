"""model.overlap_report(): how much communication ran beside compute,
measured from the engine's traced collectives over a window of iterations
(dearcomm/overlap.py)."""
import dataclasses
import logging
import os
import types

import pytest
import torch
import torch.nn.functional as F

import dearcomm
from dearcomm.overlap import WARMUP, WINDOW, overlap_of
from tests.models import MixedNet, batches, local_slice
from tests.multiprocess import run_workers

MS = 1_000_000


def event(launched, completed, wait_begin=-1, wait_end=-1):
    return dict(kind="all_reduce", bucket=0, launched_ns=launched * MS, completed_ns=completed * MS,
                wait_begin_ns=wait_begin * MS if wait_begin >= 0 else -1,
                wait_end_ns=wait_end * MS if wait_end >= 0 else -1)


def test_hand_computed_report():
    # Iteration [0, 10]: collectives [2, 6] and [5, 8] (busy 2..8: 6 ms), waited [7, 8].
    # Iteration [10, 30]: [12, 14] and [20, 31] (busy 2 + 10 ms inside it), waited [28, 30].
    events = [event(2, 6, 3, 3), event(5, 8, 7, 8), event(12, 14), event(20, 31, 28, 30)]
    report = overlap_of(events, [0, 10 * MS, 30 * MS], "dear/sharded")
    assert report.iterations == 2
    assert report.iteration_ms == pytest.approx((10 + 20) / 2)
    assert report.communication_ms == pytest.approx((6 + 12) / 2)
    assert report.exposed_ms == pytest.approx((1 + 2) / 2)
    assert report.compute_ms == pytest.approx(15 - 1.5)  # the medians: iteration - exposed
    assert [p for it in report.per_iteration for p in it] == pytest.approx([10, 6, 1, 20, 12, 2])
    assert report.hidden == pytest.approx(1 - 1.5 / 9)
    assert report.bound_ms == pytest.approx(13.5)
    assert "dear/sharded" in str(report) and "83% hidden" in str(report) and "more than in flight" not in str(report)
    finished_long = dataclasses.replace(report, exposed_ms=12.0)  # waits that average and unpack after the collective
    assert "0% hidden" in str(finished_long) and "the waits include averaging and unpacking" in str(finished_long)


def test_needs_a_whole_iteration():
    with pytest.raises(ValueError, match="at least one whole iteration"):
        overlap_of([], [0])


def train(model, optimizer, rank, world_size, steps, early_at=None):
    early = None
    for i, (x, y) in enumerate(batches(steps, 8)):
        F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == early_at:
            try:
                model.overlap_report()
            except RuntimeError as e:
                early = str(e)
    return early


def wrapped(schedule="dear", update=None):
    torch.manual_seed(0)
    model = MixedNet()
    return dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01), bucket_mb=0.001, schedule=schedule,
                         update=update)


def overlap_worker(rank, world_size):
    """Per schedule: the error before the window is complete, the report and
    what was logged; then a run with a Timeline attached."""
    os.environ["DEARCOMM_OVERLAP_REPORT"] = "1"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dearcomm").addHandler(handler)
    logging.getLogger("dearcomm").setLevel(logging.INFO)
    out = {}
    for schedule, update in SCHEDULES:
        records.clear()
        model, optimizer = wrapped(schedule, update)
        early = train(model, optimizer, rank, world_size, WARMUP + WINDOW + 2, early_at=WARMUP)
        out[schedule] = (early, model.overlap_report(),
                         [r.getMessage() for r in records if "dearcomm overlap" in r.getMessage()])
        model.close()

    from dearcomm.timeline import Timeline
    model, optimizer = wrapped()
    Timeline().attach(model)
    train(model, optimizer, rank, world_size, WARMUP + WINDOW + 1)
    try:
        model.overlap_report()
        out["timeline"] = "no error"
    except RuntimeError as e:
        out["timeline"] = str(e)
    return out


SCHEDULES = [("dear", "sharded"), ("wfbp", "replicated")]


def test_report_from_real_runs():
    for rank, out in enumerate(run_workers(overlap_worker, 2)):
        for schedule, update in SCHEDULES:
            early, report, logged = out[schedule]
            assert early and f"needs {WINDOW - 1} more optimizer.step()s" in early, early
            assert report.iterations == WINDOW and report.schedule == f"{schedule}/{update}"
            assert report.iteration_ms > 0 and report.communication_ms > 0
            assert report.compute_ms == pytest.approx(report.iteration_ms - report.exposed_ms)
            for iteration, communication, exposed in report.per_iteration:
                assert 0 <= exposed <= iteration and 0 < communication <= iteration, report.per_iteration
            assert 0 <= report.hidden <= 1
            assert len(logged) == (1 if rank == 0 else 0), logged  # once, on rank 0
        message = out["timeline"]
        assert "no overlap report: a dearcomm.timeline.Timeline took the engine's trace" in message, message


def auto_overlap_worker(rank, world_size):
    """schedule="auto": the steps until it trains with its choice (the report
    refused at each), then the rest of WARMUP + WINDOW; the report and the options."""
    torch.manual_seed(0)
    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01), schedule="auto")
    refused, steps = [], 0
    for x, y in batches(200, 8):
        F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if model.auto_plan() is not None and model._dear.auto.settled:
            break
        try:
            model.overlap_report()
            refused.append(False)
        except RuntimeError as e:
            refused.append("\"auto\" options are measuring candidates" in str(e))
    settled_at = steps
    for x, y in batches(WARMUP + WINDOW - 1, 8, seed=1):  # the settled step above was the first
        F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    options = model._dear.options
    return dict(refused=refused, settled_at=settled_at, report=model.overlap_report(),
                trained=f"{options.schedule}/{options.update}", plan=model.auto_plan().describe(),
                predicted=model.auto_plan().predicted_ms)


def test_under_auto_the_report_measures_the_choice_not_the_trials():
    for out in run_workers(auto_overlap_worker, 2, deadline=240):
        assert out["settled_at"] > WARMUP + WINDOW, "auto tried candidates for longer than one window"
        assert all(out["refused"]), "no report while auto tried candidates"
        report = out["report"]
        assert report.schedule == out["trained"] and report.best_plan == out["plan"], (report, out)
        assert out["predicted"] == report.best_plan_ms and f"the predicted best plan ({out['plan']})" in str(report)
        assert report.iterations == WINDOW


class _Engine:
    def __init__(self):
        self.tracing = False

    def set_tracing(self, on):
        self.tracing = on

    def take_trace(self):
        return [dict(kind="all_reduce", bucket=0, launched_ns=0, completed_ns=1, wait_begin_ns=-1, wait_end_ns=-1)]


class _Runtime:
    """What OverlapMonitor reads of a runtime: its options, engine, rank and "auto" part."""

    def __init__(self):
        self.options = dearcomm.WrapOptions(schedule="dear")
        self.engine = _Engine()
        self.rank = 1
        self.auto = types.SimpleNamespace(settled=True, plans=[])


def test_each_configuration_is_measured_once_it_trains_and_again_after_a_change():
    """The window's state machine, step by step: a report of the options that
    trained throughout the window, under "auto" never of its trials, and
    again after any change, even back to options its trials ended on."""
    from dearcomm.overlap import OverlapMonitor

    runtime = _Runtime()
    monitor = OverlapMonitor(runtime)

    def steps(n):
        for _ in range(n):
            monitor.step_ended()

    steps(WARMUP + WINDOW - 1)
    with pytest.raises(RuntimeError, match="needs 1 more optimizer.step"):
        monitor.get()
    steps(1)
    assert monitor.get().schedule == "dear/sharded" and not runtime.engine.tracing
    steps(30)  # reported: no window runs again while nothing changes
    assert not runtime.engine.tracing
    # A re-plan: trials of wfbp, then the choice is the last candidate tried (no rebuild when it settles).
    runtime.auto.settled = False
    runtime.options = dearcomm.WrapOptions(schedule="wfbp")
    steps(20)
    assert monitor.get().schedule == "dear/sharded", "the last report stays while candidates are tried"
    runtime.auto.settled = True
    steps(WARMUP + WINDOW)
    assert monitor.get().schedule == "wfbp/replicated"
    # A change without "auto" (deft's guard, a checkpoint's delays): measured again.
    runtime.auto = None
    runtime.options = dearcomm.WrapOptions(schedule="bytescheduler")
    steps(WARMUP + WINDOW - 1)
    assert monitor.get().schedule == "wfbp/replicated"
    steps(1)
    assert monitor.get().schedule == "bytescheduler/replicated"


def test_under_auto_the_report_says_it_waits_for_the_choice():
    from dearcomm.overlap import OverlapMonitor

    runtime = _Runtime()
    runtime.auto.settled = False
    monitor = OverlapMonitor(runtime)
    for _ in range(40):
        monitor.step_ended()
    with pytest.raises(RuntimeError, match=f'"auto" options are measuring candidates; the report measures its '
                                           f'choice over {WARMUP + WINDOW} optimizer.step'):
        monitor.get()
    assert not runtime.engine.tracing
