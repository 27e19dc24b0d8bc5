"""What one iteration does, per schedule: the engine's states and the
collectives it issues, in order. These tests say what each schedule does
(instead of reading the engine to find out), and they hold every rank to the
same collective sequence whatever order its gradients arrive in, which is what
keeps gloo and NCCL from pairing the wrong collectives.

The engine is driven directly (gloo, real processes): gradients arrive by
mark_grad_ready in a rank-dependent order, then step() and the next forward's
waits, as dearcomm's hooks would call them."""
import random

import pytest
import torch
import torch.distributed as dist

from dearcomm import _C
from tests.multiprocess import run_workers

SIZES = [300, 200, 100, 50, 25, 12, 7]  # forward order
CAP_BYTES = 1200                        # -> buckets [300], [200, 100], [50, 25, 12, 7] after bucket 0
# (schedule, update, credit bytes): bytescheduler with its default credit and
# with 400 bytes, less than a bucket. One iteration has no link model yet (the
# first is adopted by the fourth backward), so the link is taken to keep up and
# each all-reduce goes when ready either way; test_link_model_* below runs more.
SCHEDULES = [("dear", "sharded", 0), ("dear", "replicated", 0), ("wfbp", "replicated", 0),
             ("bytescheduler", "replicated", 0), ("bytescheduler", "replicated", 400),
             ("usbyte", "replicated", 0), ("deft", "replicated", 0)]
DEFT_DELAYS = [1, 0, 0]  # the input-side bucket, launched last, one step late


def choice_of(schedule, update, credit):
    choice = _C.resolve_schedule(schedule, update, credit or None)
    return choice.with_bucket_delays(DEFT_DELAYS) if schedule == "deft" else choice


def arrival_order(rank):
    """Rank 0: the usual backward order (last layer first). Others: shuffled,
    as when autograd runs independent branches in another order."""
    order = list(reversed(range(len(SIZES))))
    if rank:
        random.Random(rank).shuffle(order)
    return order


def traced_engine(sizes, cap_bytes, world_size, schedule, update, credit):
    """An engine over fp32 parameters of `sizes`, tracing its collectives."""
    layout = _C.plan_buckets(sizes, [torch.float32] * len(sizes), cap_bytes, world_size)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    engine = _C.Engine(layout, params, [f"p{i}" for i in range(len(sizes))], dist.group.WORLD,
                       choice_of(schedule, update, credit), 60.0)
    engine.set_tracing(True)
    return layout, engine


def issued(engine):
    """The traced collectives since the last call, in launch order."""
    return [(e["kind"], e["bucket"]) for e in sorted(engine.take_trace(), key=lambda e: e["launched_ns"])]


def one_iteration(rank, world_size, schedule, update, credit):
    layout, engine = traced_engine(SIZES, CAP_BYTES, world_size, schedule, update, credit)
    engine.set_recording(True)
    states = [str(engine.state).split(".")[-1]]

    def note():
        state = str(engine.state).split(".")[-1]
        if state != states[-1]:
            states.append(state)

    for p in arrival_order(rank):
        engine.mark_grad_ready(p, torch.full((SIZES[p],), float(rank + 1)))
        note()
    engine.check_backward_complete()
    engine.end_backward()
    note()
    if engine.reductions_waited != "in_next_forward":
        engine.finish_reductions()  # step(): wait for every reduction ...
        note()
    engine.end_step()      # ... and issue what the next forward needs
    note()
    for b in range(len(layout.buckets)):  # the next forward, bucket by bucket
        engine.require_bucket(b)
        note()
    engine.flush()  # deft: waits for the delayed all-reduce (the simulation ends with one too)
    note()
    return len(layout.buckets), states, issued(engine), engine.prefetch_misses, engine.take_records()


EXPECTED = {
    # name: (states, collectives given B buckets)
    ("dear", "sharded", 0): (["IDLE", "BACKWARD", "REDUCED", "GATHERING", "IDLE"],
                          lambda B: [("reduce_scatter", b) for b in reversed(range(B))] +
                                    [("all_gather", b) for b in range(B)]),
    ("dear", "replicated", 0): (["IDLE", "BACKWARD", "REDUCED", "GATHERING", "IDLE"],
                             lambda B: [("reduce_scatter", b) for b in reversed(range(B))] +
                                       [("all_gather", b) for b in range(B)]),
    ("wfbp", "replicated", 0): (["IDLE", "BACKWARD", "REDUCED", "IDLE"],
                                lambda B: [("all_reduce", b) for b in reversed(range(B))]),
    # step() leaves the all-reduces running; the forward waits for each bucket's.
    ("bytescheduler", "replicated", 0): (["IDLE", "BACKWARD", "GATHERING", "IDLE"],
                                         lambda B: [("all_reduce", b) for b in reversed(range(B))]),
    # Buckets of 1280, 1280 and 512 bytes (world size 2; 1344, 1344, 576 at
    # 3), 400 bytes of credit, no link model yet: each goes alone onto a link
    # taken to have sent the previous one.
    ("bytescheduler", "replicated", 400): (["IDLE", "BACKWARD", "GATHERING", "IDLE"],
                                           lambda B: [("all_reduce", b) for b in reversed(range(B))]),
    # No planner's priorities and no link model yet: each block goes when ready, updated as bytescheduler.
    ("usbyte", "replicated", 0): (["IDLE", "BACKWARD", "GATHERING", "IDLE"],
                                  lambda B: [("all_reduce", b) for b in reversed(range(B))]),
    # wfbp's order; bucket 0's all-reduce is left in flight by step() (the flush waits for it).
    ("deft", "replicated", 0): (["IDLE", "BACKWARD", "REDUCED", "IDLE"],
                                lambda B: [("all_reduce", b) for b in reversed(range(B))]),
}


def sequences_worker(rank, world_size):
    return {f"{s}-{u}-{c}": one_iteration(rank, world_size, s, u, c) for s, u, c in SCHEDULES}


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_schedule_walks_its_states_and_issues_its_collectives_in_order(world_size):
    results = run_workers(sequences_worker, world_size)
    for schedule, update, credit in SCHEDULES:
        name = f"{schedule}-{update}-{credit}"
        expected_states, expected_collectives = EXPECTED[(schedule, update, credit)]
        for rank, per_schedule in enumerate(results):
            buckets, states, collectives, misses, _ = per_schedule[name]
            assert buckets == 3, f"the sizes were meant to give 3 buckets, got {buckets}"
            assert states == expected_states, f"{name}, rank {rank}: states {states}"
            assert collectives == expected_collectives(buckets), f"{name}, rank {rank}: {collectives}"
            assert misses == 0


def two_backwards(rank, world_size, schedule, update, credit):
    """Two backwards before step() (a GAN's discriminator), then the next
    forward: the iteration's events, the collectives issued and the state
    it ends in, or the error."""
    layout, engine = traced_engine(SIZES, CAP_BYTES, world_size, schedule, update, credit)
    engine.set_recording(True)
    try:
        for _ in range(2):
            for p in arrival_order(rank):
                engine.mark_grad_ready(p, torch.full((SIZES[p],), float(rank + 1)))
            engine.end_backward()
    except RuntimeError as e:
        return str(e)
    if engine.reductions_waited != "in_next_forward":
        engine.finish_reductions()
    engine.end_step()
    for b in range(len(layout.buckets)):
        engine.require_bucket(b)
    events = [r["event"] for r in engine.take_records() if r["bucket"] < 0]
    return events, issued(engine), str(engine.state).split(".")[-1]


def two_backwards_worker(rank, world_size):
    return {f"{s}-{u}-{c}": two_backwards(rank, world_size, s, u, c) for s, u, c in SCHEDULES}


def test_a_second_backward_before_step_reduces_every_bucket_again():
    """As DDP: each backward's reductions go out, in the same order on every
    rank, and step() follows as after one; deft, whose delayed buckets a
    second backward would overtake, refuses it, naming the parameter."""
    results = run_workers(two_backwards_worker, 2)
    for schedule, update, credit in SCHEDULES:
        name = f"{schedule}-{update}-{credit}"
        _, one_collectives = EXPECTED[(schedule, update, credit)]
        for rank, per_schedule in enumerate(results):
            got = per_schedule[name]
            if schedule == "deft":
                assert "got a second gradient before optimizer.step(), which a schedule that delays buckets" in got
                continue
            events, collectives, final_state = got
            reductions = [c for c in one_collectives(3) if c[0] != "all_gather"]
            assert collectives == reductions + one_collectives(3), f"{name}, rank {rank}: {collectives}"
            # The second begins once the first's reductions finished (waited for there, if still in flight).
            again = events.index("backward_again")
            assert events[:again + 1] == ["backward_begins", "reductions_waited", "backward_again"], events
            assert final_state == "IDLE", f"{name}: {final_state}"
        assert results[0][name] == results[1][name] or schedule == "deft"


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_gradient_orders_issue_identical_collectives(world_size):
    """Guards against launching reductions in arrival order: a rank whose
    gradients come in another order would pair its collectives with the wrong
    ones of its peers (garbage or a hang)."""
    assert arrival_order(1) != arrival_order(0)
    results = run_workers(sequences_worker, world_size)
    for schedule, update, credit in SCHEDULES:
        name = f"{schedule}-{update}-{credit}"
        sequences = [per_schedule[name][2] for per_schedule in results]
        assert all(s == sequences[0] for s in sequences), f"{name}: {sequences}"


def simulated_records(world_size, schedule, update, credit):
    """The executor's state changes for one iteration on the simulated device
    (no processes), over the layout traced_engine plans."""
    layout = _C.plan_buckets(SIZES, [torch.float32] * len(SIZES), CAP_BYTES, world_size)
    modules = [(f"m{i}", 0.0, 0.0, [i]) for i in range(len(SIZES))]  # one parameter each; backward: last first
    costs = {kind: (1e-5, 1e-9) for kind in ("reduce_scatter", "all_gather", "all_reduce")}
    result = _C.simulate(layout, None, modules, 0.0, SIZES, choice_of(schedule, update, credit), costs, 1)
    return result["records"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_simulated_device_walks_the_states_recorded_from_gloo(world_size):
    """The simulator runs the executor and policies that train: every state
    change of an iteration (bucket by bucket, with its sequence number) on the
    simulated device equals the one recorded on every rank of a real gloo run."""
    results = run_workers(sequences_worker, world_size)
    for schedule, update, credit in SCHEDULES:
        name = f"{schedule}-{update}-{credit}"
        simulated = simulated_records(world_size, schedule, update, credit)
        assert simulated, name
        for rank, per_schedule in enumerate(results):
            real = per_schedule[name][4]
            assert real == simulated, f"{name}, rank {rank}:\nreal {real}\nsimulated {simulated}"


BIG_SIZES = [2**20, 2**20, 2**20, 2**20]  # 4 MiB each: one bucket per tensor under a 4 MiB cap
ITERATIONS = 6


def link_model_worker(rank, world_size, rank0_syncs=False):
    """bytescheduler over several iterations, one bucket of credit, the ranks'
    backwards paced differently (rank 1 sleeps between gradients): what each
    rank issues, and the link model each backward ran on. `rank0_syncs`:
    rank 0 alone also syncs after every step, as a rank-0-only checkpoint does."""
    import time
    layout, engine = traced_engine(BIG_SIZES, 4 * 2**20, world_size, "bytescheduler", "replicated", 4 * 2**20)
    models, sequences = [], []
    for _ in range(ITERATIONS):
        for i, p in enumerate(reversed(range(len(BIG_SIZES)))):
            if rank == 1 and i:
                time.sleep(0.003)
            engine.mark_grad_ready(p, torch.ones(BIG_SIZES[p]))
            if i == 0:
                models.append(list(engine.link_model))  # what this backward's policy got
        engine.end_step()
        for b in range(len(layout.buckets)):
            engine.require_bucket(b)
        sequences.append(issued(engine))
        if rank0_syncs and rank == 0:
            engine.flush()
    engine.flush()
    return len(layout.buckets), models, sequences


@pytest.mark.parametrize("world_size, rank0_syncs", [(2, False), (3, False), (2, True)],
                         ids=["2", "3", "2-rank0-syncs"])
def test_link_model_is_agreed_by_every_rank_and_keeps_their_collectives_identical(world_size, rank0_syncs):
    """Guards the credit's link model: each rank measures its own rate and
    tick spacing, but the policy must get the same figures everywhere, or
    ranks with differently paced backwards would queue differently and pair
    the wrong all-reduces. No model for the first three backwards: iteration
    0's rate is known only in iteration 1's forward, summed at the end of
    backward 1, and adopted when backward 3 begins (kLinkAgreementLag = 2,
    engine.h: on a GPU the sum queues behind backward 1's reductions)."""
    results = run_workers(link_model_worker, world_size, rank0_syncs)
    buckets, models, sequences = results[0]
    assert buckets == len(BIG_SIZES)
    for rank, (_, other_models, other_sequences) in enumerate(results):
        assert other_models == models, f"rank {rank} ran on another link model: {other_models} vs {models}"
        assert other_sequences == sequences, f"rank {rank} issued {other_sequences} vs {sequences}"
    assert models[:3] == [[], [], []]
    assert len(models[3:]) == ITERATIONS - 3
    for model in models[3:]:
        assert len(model) == buckets and model[0] == 0, model
        # Rank 1 slept 3 ms before every later tick: the mean gap is >= 3 ms / world_size.
        assert all(drained > 0 for drained in model[1:]), model
    for sequence in sequences:
        assert sorted(sequence) == [("all_reduce", b) for b in range(buckets)]


def pinned_link_worker(rank, world_size):
    layout, engine = traced_engine(SIZES, CAP_BYTES, world_size, "bytescheduler", "replicated", 1)
    engine.pin_link_model([0] * len(layout.buckets))
    for p in arrival_order(rank):
        engine.mark_grad_ready(p, torch.ones(SIZES[p]))
    engine.end_step()
    for b in range(len(layout.buckets)):
        engine.require_bucket(b)
    return issued(engine)


def test_a_link_that_drains_nothing_queues_every_later_all_reduce_until_backward_ends():
    """The queued path that test_parity's stalled-link configs train on: the
    first all-reduce goes onto the idle link, the others wait and then go
    input side first, the reverse of WFBP's order."""
    for sequence in run_workers(pinned_link_worker, 2):
        assert sequence == [("all_reduce", 2), ("all_reduce", 0), ("all_reduce", 1)], sequence
