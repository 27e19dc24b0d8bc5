"""Bad numbers entering dearcomm.pipeline get a `dearcomm:` error naming the
field, where it came from and the value; and neither the planner nor the
simulator can hang (a NaN layer time once made the simulator's event loop
spin forever).

Every call runs in a spawned worker process under a deadline, so that a hang
fails its test instead of blocking the run: one worker serves the whole file
(importing dearcomm takes a second or two), looks each case up by name in the
table below (the module builds the same table in both processes), and is
killed and replaced when a case overruns. No torch.distributed."""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import random
import tempfile
import time
from typing import Callable, Dict, List, NamedTuple

import pytest

from dearcomm.pipeline import (LayerProfile, ModelProfile, Plan, Task, Topology, TransferCpu, all_plans, brute_force,
                               chain, coarsen, dapple_plan, gpipe_orders, gpipe_plan, list_orders, list_schedule,
                               load_shared_profile, one_f_one_b_orders, one_f_one_b_plan, pipedream_plan,
                               plan_pipeline, preset, profile_sequential, servers, simulate, switched, uniform)

NAN, INF = math.nan, math.inf
CASE_S = 10        # a bad-argument case answers in milliseconds; this only has to catch a hang
PLAN_S = 30        # a property case plans and simulates (well under a second when the machine is free)
STARTUP_S = 120    # a spawned worker imports torch and dearcomm

# Bad values per sort of field; "text" and "bool" are wrong types (TypeError).
HUGE = 10 ** 400   # an int past any float: an OverflowError in float arithmetic
HUGER = 10 ** 5000  # past the digits str() converts: a ValueError of Python's own
HUGE_SHOWN = {id(HUGE): "an int of about 401 digits", id(HUGER): "an int of about 5001 digits"}
REALS = {"nan": NAN, "inf": INF, "-inf": -INF, "negative": -1.0, "bool": True, "text": "2", "huge": HUGE,
         "huger": HUGER}
POSITIVE_REALS = {**REALS, "zero": 0.0}                     # a rate that must carry data
INDICES = {"nan": NAN, "inf": INF, "-inf": -INF, "negative": -1, "fraction": 2.5, "float": 2.0, "bool": True,
           "text": "2"}                                      # a count or index where 0 is fine
COUNTS = {**INDICES, "zero": 0}                              # a count that must be >= 1


# ---- the table of bad arguments ---------------------------------------------------

class Row(NamedTuple):
    entry: str                          # the public function or class called
    field: str                          # the name the error must give
    where: str                          # and this part of its context
    bad: Dict[str, object]              # label -> bad value
    call: Callable[[object], object]    # value -> the call with that value in that field


def _profile(layers: int = 3) -> ModelProfile:
    return chain("p", [LayerProfile(f"l{i}", 1.0, 2.0, 1e6, 1e6) for i in range(layers)])


def _layer(field: str, v) -> LayerProfile:
    return LayerProfile("l0", **{"forward_ms": 1.0, "backward_ms": 1.0, "activation_bytes": 0.0,
                                 "param_bytes": 0.0, field: v})


def _shared_profile(key: str, v) -> ModelProfile:
    # A shared-profiles file whose one model has a bad number in its first layer (json writes NaN, Infinity).
    layer = {"id": "n1", "fwd_ms": 1.0, "bwd_ms": 1.0, "act_bytes": 0.0, "param_bytes": 0.0, key: v}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profiles.json")
        with open(path, "w") as f:
            json.dump({"m": {"layers": [layer, dict(layer, id="n2", **{key: 1.0})]}}, f)
        return load_shared_profile("m", path)


def _topology(**fields) -> Topology:
    args = dict(bandwidth=((0.0, 1e9), (1e9, 0.0)), latency=((0.0, 1e-5), (1e-5, 0.0)))
    return Topology(**{**args, **fields})


def _rows() -> List[Row]:
    p, t2, t4 = _profile(), uniform(2), uniform(4)
    two = ((0,), (1,))
    rows = [Row("LayerProfile", f, "layer 'l0'", REALS, lambda v, f=f: _layer(f, v))
            for f in ("forward_ms", "backward_ms", "activation_bytes", "param_bytes")]
    rows.append(Row("ModelProfile", "cut_bytes[0]", "profile 'p'", REALS,
                    lambda v: ModelProfile("p", p.layers[:2], (v,))))
    readable = {name: v for name, v in REALS.items() if name != "huger"}  # json cannot read it: a test below
    rows += [Row("load_shared_profile", f, "profile 'm' in", readable, lambda v, k=k: _shared_profile(k, v))
             for k, f in (("fwd_ms", "forward_ms"), ("bwd_ms", "backward_ms"), ("act_bytes", "activation_bytes"),
                          ("param_bytes", "param_bytes"))]
    rows.append(Row("coarsen", "max_layers", "coarsen()", COUNTS, lambda v: coarsen(p, v)))
    rows.append(Row("profile_sequential", "repeats", "profile_sequential()", COUNTS,
                    lambda v: profile_sequential(None, None, repeats=v)))
    rows.append(Row("profile_sequential", "warmup", "profile_sequential()", INDICES,
                    lambda v: profile_sequential(None, None, warmup=v)))
    rows += [Row("TransferCpu", f.name, "TransferCpu", REALS, lambda v, f=f: TransferCpu(**{f.name: v}))
             for f in dataclasses.fields(TransferCpu)]
    rows += [
        Row("Topology", "bandwidth[0][1]", "topology 'custom'", REALS,
            lambda v: _topology(bandwidth=((0.0, v), (1e9, 0.0)))),
        Row("Topology", "latency[1][0]", "topology 'custom'", REALS,
            lambda v: _topology(latency=((0.0, 0.0), (v, 0.0)))),
        Row("Topology", "host_cores", "topology 'custom'", REALS, lambda v: _topology(host_cores=v)),
        Row("uniform", "n", "uniform()", COUNTS, lambda v: uniform(v)),
        Row("uniform", "gbytes_per_s", "uniform()", POSITIVE_REALS, lambda v: uniform(2, v)),
        Row("uniform", "latency_us", "uniform()", REALS, lambda v: uniform(2, 1.0, v)),
        Row("switched", "rates[1]", "switched()", POSITIVE_REALS, lambda v: switched([1e9, v])),
        Row("switched", "latency_us", "switched()", REALS, lambda v: switched([1e9, 1e9], v)),
        Row("servers", "n", "servers()", COUNTS, lambda v: servers(v, 2, True, 10, 50, 1)),
        Row("servers", "per_server", "servers()", COUNTS, lambda v: servers(4, v, True, 10, 50, 1)),
        Row("preset", "n", "preset('nvlink-pairs')", COUNTS, lambda v: preset("nvlink-pairs", v)),
    ]
    for i, f in enumerate(("intra_gbps", "nvlink_gbps", "nic_gbps", "intra_latency_us", "nic_latency_us")):
        rows.append(Row("servers", f, "servers()", REALS, lambda v, i=i: servers(4, 2, True, *(
            [10.0, 50.0, 1.0, 2.0, 30.0][:i] + [v] + [10.0, 50.0, 1.0, 2.0, 30.0][i + 1:]))))
    planner_args = (("max_stages", COUNTS), ("finalists", INDICES), ("num_caps", COUNTS),
                    ("exhaustive_limit", INDICES), ("refine_budget", INDICES), ("starts", COUNTS))
    rows.append(Row("plan_pipeline", "num_microbatches", "plan_pipeline()", COUNTS, lambda v: plan_pipeline(p, t2, v)))
    rows += [Row("plan_pipeline", f, "plan_pipeline()", bad, lambda v, f=f: plan_pipeline(p, t2, 2, **{f: v}))
             for f, bad in planner_args]
    rows.append(Row("all_plans", "num_microbatches", "plan_pipeline()", COUNTS, lambda v: all_plans(p, t2, v)))
    rows.append(Row("all_plans", "starts", "plan_pipeline()", COUNTS, lambda v: all_plans(p, t2, 2, starts=v)))
    for fn, where in ((gpipe_plan, "gpipe_plan()"), (one_f_one_b_plan, "one_f_one_b_plan()"),
                      (pipedream_plan, "pipedream_plan()"), (dapple_plan, "dapple_plan()"),
                      (brute_force, "brute_force()")):
        rows.append(Row(fn.__name__, "num_microbatches", where, COUNTS, lambda v, fn=fn: fn(p, t2, v)))
    rows += [
        Row("Plan", "num_microbatches", "plan 'plan'", COUNTS, lambda v: Plan((0, 1, 3), two, {}, v)),
        Row("Plan", "bounds[1]", "plan 'plan'", INDICES, lambda v: Plan((0, v, 3), two, {}, 2)),
        Row("Plan", "devices[1][0]", "plan 'plan'", INDICES, lambda v: Plan((0, 1, 3), ((0,), (v,)), {}, 2)),
        Row("Plan", "predicted_ms", "plan 'plan'", REALS, lambda v: Plan((0, 1, 3), two, {}, 2, "plan", v)),
        Row("list_schedule", "num_microbatches", "list_schedule()", COUNTS,
            lambda v: list_schedule(p, t2, (0, 1, 3), two, v)),
        Row("list_schedule", "bounds[1]", "list_schedule()", INDICES,
            lambda v: list_schedule(p, t2, (0, v, 3), two, 2)),
        Row("list_schedule", "devices[1][0]", "list_schedule()", INDICES,
            lambda v: list_schedule(p, t2, (0, 1, 3), ((0,), (v,)), 2)),
        Row("list_schedule", "max_in_flight[0]", "list_schedule()", COUNTS,
            lambda v: list_schedule(p, t2, (0, 1, 3), two, 2, max_in_flight={0: v})),
        Row("list_orders", "num_microbatches", "list_schedule()", COUNTS,
            lambda v: list_orders(p, t4, (0, 1, 3), ((0, 1), (2,)), v)),
        Row("gpipe_orders", "num_microbatches", "gpipe_orders()", COUNTS, lambda v: gpipe_orders(two, v)),
        Row("gpipe_orders", "devices[0][0]", "gpipe_orders()", INDICES, lambda v: gpipe_orders(((v,), (1,)), 2)),
        Row("one_f_one_b_orders", "num_microbatches", "one_f_one_b_orders()", COUNTS,
            lambda v: one_f_one_b_orders(two, v)),
        Row("one_f_one_b_orders", "devices[0][0]", "one_f_one_b_orders()", INDICES,
            lambda v: one_f_one_b_orders(((v,), (1,)), 2)),
    ]
    return rows


ROWS = {f"{r.entry}-{r.field}-{label}": (r, value) for r in _rows() for label, value in r.bad.items()}

# Arguments of the wrong kind altogether (TypeError naming the argument).
WRONG_TYPES = {
    "simulate-plan": ("plan", lambda: simulate(None, _profile(), uniform(2))),
    "simulate-profile": ("profile", lambda: simulate(Plan((0, 3), ((0,),), gpipe_orders(((0,),), 1), 1),
                                                     "p", uniform(2))),
    "plan_pipeline-topology": ("topology", lambda: plan_pipeline(_profile(), "uniform", 2)),
    "list_schedule-priority": ("priority", lambda: list_schedule(_profile(), uniform(2), (0, 3), ((0,),), 2,
                                                                 priority=3)),
    "ModelProfile-layers": ("layers[1]", lambda: ModelProfile("p", (LayerProfile("l0", 1.0, 1.0, 0.0, 0.0),
                                                                    (1.0, 1.0, 0.0, 0.0)), (0.0,))),
    "Topology-transfer_cpu": ("transfer_cpu", lambda: _topology(transfer_cpu=0.5)),
}


# ---- the simulator itself, past the argument checks --------------------------------

class DirectLinksOnly(Topology):
    """A topology that will not route around a missing link (the stock one
    does): a transfer 0 -> 2 must use the zero-bandwidth link itself."""

    def route(self, src: int, dst: int) -> List[int]:
        return [src] if src == dst else [src, dst]


LINE = ((0.0, 1e9, 0.0), (1e9, 0.0, 1e9), (0.0, 1e9, 0.0))   # 0 - 1 - 2: no link between 0 and 2
NO_LATENCY = ((0.0,) * 3,) * 3
ENDS = Plan((0, 1, 3), ((0,), (2,)), gpipe_orders(((0,), (2,)), 2), 2)  # stages on devices 0 and 2


def _nan_snippet():
    # The reported hang.
    prof = chain("p", [LayerProfile(f"l{i}", float("nan") if i == 0 else 2.0, 4.0, 1e6, 1e6) for i in range(4)])
    return plan_pipeline(prof, uniform(2), 4)


def _cycle():
    # Device 0 runs B0 before F1, so it waits for B0's gradient; device 1 sends
    # that only after F1 and B1, and F1 waits for device 0's F1: a cycle.
    orders = {0: (Task("F", 0, 0), Task("B", 0, 0), Task("F", 0, 1), Task("B", 0, 1)),
              1: (Task("F", 1, 1), Task("B", 1, 1), Task("F", 1, 0), Task("B", 1, 0))}
    return simulate(Plan((0, 1, 3), ((0,), (1,)), orders, 2), _profile(), uniform(2))


def _needed_zero_link():
    return simulate(ENDS, _profile(), DirectLinksOnly(LINE, NO_LATENCY, "direct"))


def _routed_around_zero_link():
    topo = Topology(LINE, NO_LATENCY, "line")
    result = simulate(ENDS, _profile(), topo)
    return sorted({tuple(topo.route(s.device, s.peer)) for s in result.spans if s.peer is not None})


def _overflowing_time():
    # One layer of 1e308 ms is a valid number; two micro-batches of it on one device end past the floats.
    prof = chain("huge", [LayerProfile("l0", 1e308, 0.0, 0.0, 0.0)])
    return simulate(Plan((0, 1), ((0,),), gpipe_orders(((0,),), 2), 2), prof, uniform(1))


def _nan_past_the_checks():
    # Forged past LayerProfile's check (object.__setattr__ on the frozen
    # dataclass), the NaN must still stop the event loop, not spin it.
    prof = _profile()
    object.__setattr__(prof.layers[1], "forward_ms", NAN)
    return simulate(Plan((0, 1, 3), ((0,), (1,)), gpipe_orders(((0,), (1,)), 2), 2), prof, uniform(2))


def _cores_that_never_finish():
    # A shared-cores model that never reports an item done (as float rounding
    # could): the event loop must give up within its bound, not re-arm forever.
    from dearcomm.pipeline.cores import SharedCores
    original = SharedCores.finished
    SharedCores.finished = lambda self, t, due=False: []
    try:
        topo = dataclasses.replace(uniform(2), host_cores=1.0)
        return simulate(Plan((0, 1, 3), ((0,), (1,)), gpipe_orders(((0,), (1,)), 2), 2), _profile(), topo)
    finally:
        SharedCores.finished = original


def _no_compute():
    # Zero times are valid: the planner's ladder of bottleneck caps once divided by the zero total.
    prof = chain("idle", [LayerProfile(f"l{i}", 0.0, 0.0, 1e6, 1e6) for i in range(4)])
    return plan_pipeline(prof, uniform(2), 4, num_caps=1).predicted_ms


def _replica_without_microbatches():
    # Three replicas, one micro-batch: replicas 1 and 2 run no task but still
    # all-reduce, and with transfer CPU costs that work lands on them.
    topo = dataclasses.replace(uniform(4), transfer_cpu=TransferCpu(0.1, 0.1, 0.1, 0.1))
    result = list_schedule(_profile(), topo, (0, 1, 3), ((0, 1, 2), (3,)), 1)
    return sorted({s.device for s in result.spans if s.lane == "cpu"})


DIRECT = {"nan-snippet": _nan_snippet, "cycle": _cycle, "needed-zero-link": _needed_zero_link,
          "routed-around-zero-link": _routed_around_zero_link, "overflowing-time": _overflowing_time,
          "nan-past-the-checks": _nan_past_the_checks, "cores-never-finish": _cores_that_never_finish,
          "no-compute": _no_compute, "replica-without-microbatches": _replica_without_microbatches}


# ---- random problems: a plan or a clear error, never a hang ------------------------

SEEDS = range(80)


def _random_problem(seed: int):
    rng = random.Random(seed)
    layers = [LayerProfile(f"l{i}", rng.choice([0.0, rng.uniform(0.1, 10)]), rng.uniform(0, 20),
                           rng.choice([0.0, 1e5, 1e6, 2e7]), rng.choice([0.0, rng.uniform(0, 4e7)]))
              for i in range(rng.randint(2, 8))]
    D = rng.randint(2, 4)
    bw = [[0.0] * D for _ in range(D)]
    for i in range(D):
        for j in range(D):
            if i != j and rng.random() > 0.3:  # ~30 % of the directed links are missing (zero bandwidth)
                bw[i][j] = rng.uniform(1e8, 2e10)
    lat = [[0.0 if i == j else rng.uniform(0, 5e-5) for j in range(D)] for i in range(D)]
    topology = dict(bandwidth=bw, latency=lat, name=f"rand{seed}")
    if rng.random() < 0.25:
        topology.update(transfer_cpu=TransferCpu(0.05, 0.2, 0.05, 0.2), host_cores=rng.choice([0, 1.5]))
    return chain(f"rand{seed}", layers), topology, rng.randint(1, 6)


def _plan_and_simulate(seed: int):
    profile, topology, M = _random_problem(seed)
    topo = Topology(**topology)  # may refuse unreachable devices: a clear error is a fine answer
    plan = plan_pipeline(profile, topo, M)
    result = simulate(plan, profile, topo)
    assert math.isfinite(result.makespan_ms) and result.makespan_ms == pytest.approx(plan.predicted_ms)
    for s in result.spans:  # every transfer goes over links that exist
        if s.peer is not None:
            hops = topo.route(s.device, s.peer)
            assert all(topo.bandwidth[a][b] > 0 for a, b in zip(hops, hops[1:])), (s, hops)
    return plan.describe()


# ---- the worker ------------------------------------------------------------------

def _case(name: str) -> Callable[[], object]:
    if name in ROWS:
        row, value = ROWS[name]
        return lambda: row.call(value)
    if name in WRONG_TYPES:
        return WRONG_TYPES[name][1]
    if name in DIRECT:
        return DIRECT[name]
    return lambda: _plan_and_simulate(int(name.removeprefix("random-")))


def _serve(conn) -> None:
    conn.send("ready")
    while True:
        name = conn.recv()
        start = time.perf_counter()
        try:
            result = _case(name)()
            outcome = ("returned", repr(result)[:300])
        except Exception as e:  # what it raised is the answer
            outcome = ("raised", [c.__name__ for c in type(e).__mro__], str(e))
        conn.send((*outcome, time.perf_counter() - start))


class Worker:
    """Runs named cases in a spawned process; a case past its deadline kills it."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.proc = None

    def run(self, name: str, seconds: float):
        if self.proc is None:
            self._start()
        self.conn.send(name)
        if not self.conn.poll(seconds):
            self.stop()
            pytest.fail(f"{name}: no answer within {seconds} s; it hangs")
        try:
            return self.conn.recv()
        except EOFError:
            self.stop()
            pytest.fail(f"{name}: the worker died")

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(STARTUP_S):
            self.stop()
            pytest.fail(f"the worker did not start within {STARTUP_S} s")
        assert self.conn.recv() == "ready"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
            self.proc = None


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.stop()


def _raised(outcome, name: str):
    """(exception class names, message) of a case that had to raise."""
    assert outcome[0] == "raised", f"{name} returned {outcome[1]} instead of raising a dearcomm error"
    classes, message = outcome[1], outcome[2]
    assert message.startswith("dearcomm: "), f"{name}: {classes[0]}: {message}"
    return classes, message


# ---- the tests -------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ROWS))
def test_bad_numbers_are_refused_by_name(worker, name):
    row, value = ROWS[name]
    classes, message = _raised(worker.run(name, CASE_S), name)
    wrong_type = isinstance(value, (bool, str))
    assert ("TypeError" if wrong_type else "ValueError") in classes, (classes, message)
    shown = HUGE_SHOWN.get(id(value)) or repr(value)
    for part in (row.field, row.where, shown):
        assert part in message, f"{name}: {part!r} missing from {message!r}"


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_wrong_types_are_refused_by_name(worker, name):
    classes, message = _raised(worker.run(name, CASE_S), name)
    assert "TypeError" in classes and WRONG_TYPES[name][0] in message, (classes, message)


def test_the_reported_nan_profile_raises_within_a_second(worker):
    classes, message = _raised(worker.run("nan-snippet", 1.0), "nan-snippet")
    assert "ValueError" in classes
    assert "layer 'l0'" in message and "forward_ms" in message and "nan" in message


def test_a_cycle_in_the_orders_raises_naming_the_waiting_tasks(worker):
    classes, message = _raised(worker.run("cycle", CASE_S), "cycle")
    assert "RuntimeError" in classes and "ValueError" in classes  # ValueError: what simulate() raised before
    assert "device 0 waits to run B0s0" in message and "device 1 waits to run F1s1" in message


def test_a_needed_zero_bandwidth_link_raises_naming_the_link(worker):
    classes, message = _raised(worker.run("needed-zero-link", CASE_S), "needed-zero-link")
    assert "RuntimeError" in classes and "0 -> 2" in message and "bandwidth 0 bytes/s" in message
    # The stock topology routes the same plan around the missing link.
    outcome = worker.run("routed-around-zero-link", CASE_S)
    assert outcome[0] == "returned" and outcome[1] == repr([(0, 1, 2), (2, 1, 0)]), outcome


def test_times_that_overflow_raise_instead_of_running_forever(worker):
    classes, message = _raised(worker.run("overflowing-time", CASE_S), "overflowing-time")
    assert "RuntimeError" in classes and "t = inf ms" in message and "F1s0" in message


def test_a_nan_past_the_checks_cannot_spin_the_simulator(worker):
    classes, message = _raised(worker.run("nan-past-the-checks", CASE_S), "nan-past-the-checks")
    assert "RuntimeError" in classes and "t = nan ms" in message


def test_shared_cores_that_never_finish_stop_the_simulator(worker):
    classes, message = _raised(worker.run("cores-never-finish", CASE_S), "cores-never-finish")
    assert "RuntimeError" in classes and "no progress" in message and "device 1 waits to run" in message


def test_edge_cases_that_are_valid_still_plan(worker):
    assert worker.run("no-compute", CASE_S)[:2] == ("returned", "0.0")
    assert worker.run("replica-without-microbatches", CASE_S)[:2] == ("returned", "[0, 1, 2, 3]")


def test_a_predicted_end_on_shared_cores_ends_an_item_despite_rounding():
    from dearcomm.pipeline.cores import SharedCores
    cores = SharedCores(1.0)
    cores.start(0.0, "a", 1.0)
    cores.start(0.0, "b", 3.0)
    assert cores.finished(2.0 - 1e-6) == []             # a sliver of "a" is left: not done yet...
    assert cores.finished(2.0 - 1e-6, due=True) == ["a"]  # ...unless this was its predicted end


@pytest.mark.parametrize("seed", SEEDS)
def test_random_problems_give_a_plan_or_a_clear_error(worker, seed):
    name = f"random-{seed}"
    outcome = worker.run(name, PLAN_S)
    if outcome[0] == "raised":  # only the topology may refuse: devices that no route reaches
        classes, message = _raised(outcome, name)
        assert "ValueError" in classes and f"topology 'rand{seed}'" in message, (classes, message)
        assert "have no link" in message or "is disconnected" in message, message


def test_a_profile_file_with_an_int_python_cannot_read_is_named(tmp_path):
    path = tmp_path / "huge.json"
    path.write_text('{"m": {"layers": [{"id": "l0", "fwd_ms": 1' + "0" * 5000 + ', "bwd_ms": 1, "act_bytes": 1, '
                    '"param_bytes": 1}]}}')
    with pytest.raises(ValueError, match=r"dearcomm: profile file .*huge.json.* is not valid JSON \(or holds a "
                                         r"number Python does not read\)"):
        load_shared_profile("m", str(path))
