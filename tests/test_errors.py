"""Bad input gets a clear error that names the problem, on every rank, and
nothing hangs (every multi-process run has a deadline)."""
import copy
import datetime
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dearcomm
from tests.models import MixedNet, batches, local_slice, step_on_global_batch
from tests.multiprocess import run_workers


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


# ---- without processes: options are checked before anything else ----------

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(bucket_mb=-1), ValueError, "bucket_mb must be >= 0"),
    (dict(bucket_mb=float("nan")), ValueError, "bucket_mb must be >= 0"),
    (dict(bucket_mb="25"), TypeError, "bucket_mb must be a number"),
    (dict(update="lazy"), ValueError, "unknown update 'lazy'"),
    (dict(schedule="ring"), ValueError, "unknown schedule 'ring'"),
    (dict(schedule="wfbp", update="sharded"), NotImplementedError, "wfbp' with update='sharded' is not supported"),
    (dict(timeout=5), ValueError, "timeout must be a positive datetime.timedelta"),
    (dict(bucket_mb=-float("inf")), ValueError, "bucket_mb must be >= 0"),
    # Every numeric option, with NaN, -inf, negative and zero where zero means nothing.
    *[(dict(partition_mb=v), ValueError, "partition_mb must be a positive number of MiB")
      for v in (float("nan"), -float("inf"), -1.0, 0, True)],
    *[(dict(schedule="bytescheduler", credit_mb=v), ValueError, "credit_mb must be a positive number of MiB")
      for v in (float("nan"), -float("inf"), -1.0, 0)],
    *[(dict(max_grad_norm=v), ValueError, "max_grad_norm must be a (positive )?number")
      for v in (float("nan"), -float("inf"), -1.0, 0, True, "1")],
    (dict(blocks={"fc.weight": [float("nan")]}), ValueError, r"blocks\['fc.weight'\] must be a non-empty list of positive"),
    (dict(blocks={"fc.weight": [64.0, 196.0]}), ValueError, r"blocks\['fc.weight'\] must be a non-empty list of positive"),
])
def test_bad_options(kwargs, error, message):
    model = MixedNet()
    with pytest.raises(error, match=message):
        dearcomm.wrap(model, sgd(model), **kwargs)


def test_wrap_before_init_process_group():
    model = MixedNet()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized.*init_process_group"):
        dearcomm.wrap(model, sgd(model))


# ---- in processes -------------------------------------------------------------

class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


class ComplexParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=torch.complex64))


def one_step(model, optimizer, rank, world_size, tokens=None):
    tokens, labels = next(batches(1, 8))
    F.cross_entropy(model(local_slice(tokens, rank, world_size)), local_slice(labels, rank, world_size)).backward()


def misuse_worker(rank, world_size):
    results = {}

    def check(name, action):
        try:
            action()
            results[name] = None
        except Exception as e:  # the test asserts type and message
            results[name] = (type(e).__name__, str(e))

    def foreign_optimizer():
        dearcomm.wrap(MixedNet(), sgd(MixedNet()))

    def meta_device():
        model = nn.Linear(4, 4, device="meta")
        dearcomm.wrap(model, sgd(model))

    def sparse_embedding():
        model = nn.Sequential(nn.Embedding(10, 3, sparse=True))
        dearcomm.wrap(model, sgd(model))

    def complex_parameter():
        model = ComplexParam()
        dearcomm.wrap(model, sgd(model))

    def wrap_twice():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        dearcomm.wrap(model, optimizer.optimizer)

    def unused_parameter():
        model = Unused()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        model(torch.ones(2, 4)).sum().backward()

    def step_before_backward():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        optimizer.step()

    def step_twice():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        one_step(model, optimizer, rank, world_size)
        optimizer.step()
        optimizer.step()

    def backward_twice():
        # Two backwards before step() add up, as with DDP (test_training_features), except where deft delays buckets.
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model), schedule="deft", bucket_mb=0,
                                         delays={"fc.weight": 1, "fc.bias": 1})
        one_step(model, optimizer, rank, world_size)
        one_step(model, optimizer, rank, world_size)

    def clip_before_last_backward():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        one_step(model, optimizer, rank, world_size)
        optimizer.clip_grad_norm_(1.0)
        one_step(model, optimizer, rank, world_size)
        optimizer.step()

    def parameter_changes_shape():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        one_step(model, optimizer, rank, world_size)
        optimizer.step()
        model.embed.weight.data = torch.zeros(18, 7)  # a bigger vocabulary still runs
        optimizer.zero_grad()
        one_step(model, optimizer, rank, world_size)

    def parameter_added():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        model.extra = nn.Linear(2, 2)
        one_step(model, optimizer, rank, world_size)

    def optimizer_misses_parameters():
        model = MixedNet()  # a second, plain optimizer for the rest would apply un-averaged gradients
        dearcomm.wrap(model, torch.optim.SGD(model.head.parameters(), lr=0.1))

    def ddp_wrapped():
        model = nn.parallel.DistributedDataParallel(MixedNet())
        dearcomm.wrap(model, sgd(model))

    def steps_after_no_sync_backwards_only():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        with model.no_sync():
            one_step(model, optimizer, rank, world_size)
        optimizer.step()  # gradient accumulation whose last micro-batch also ran under no_sync()

    def unfrozen_after_training():
        model = MixedNet()
        model.head.requires_grad_(False)
        model, optimizer = dearcomm.wrap(model, sgd(model))
        one_step(model, optimizer, rank, world_size)
        model.head.requires_grad_(True)  # progressive unfreezing: its gradients would be neither averaged nor applied
        one_step(model, optimizer, rank, world_size)

    def options_differ_between_ranks():
        model = MixedNet()  # a planner run on each rank chose other pieces: other collectives, a hang
        dearcomm.wrap(model, sgd(model), blocks={"fc.weight": [64 * (rank + 1), 260 - 64 * (rank + 1)]})

    def unused_differ_between_ranks():  # each would wait in a collective the other never issues
        model = MixedNet()
        dearcomm.wrap(model, sgd(model), find_unused_parameters=rank == 1)

    def clip_differs_between_ranks():  # each rank would clip its own shard to its own limit
        model = MixedNet()
        dearcomm.wrap(model, sgd(model), max_grad_norm=1.0 if rank == 0 else 0.01)

    def lr_differs_between_ranks():  # each rank would update its shard at its own rate
        model = MixedNet()
        dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9))

    def auto_on_one_rank():  # "auto" starts from 25.0: compared as given, not as it starts
        model = MixedNet()
        dearcomm.wrap(model, sgd(model), bucket_mb="auto" if rank == 1 else 25.0)

    def blocks_unknown_name():
        model = MixedNet()
        dearcomm.wrap(model, sgd(model), blocks={"embed.weights": [119]})

    def blocks_wrong_sum():
        model = MixedNet()
        dearcomm.wrap(model, sgd(model), blocks={"embed.weight": [64, 64]})

    def blocks_misaligned():
        model = MixedNet()  # 2 ranks: pieces of 32 fp32 elements (2 x 64 bytes)
        dearcomm.wrap(model, sgd(model), blocks={"embed.weight": [60, 59]})

    def clip_with_nan_max_norm():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        one_step(model, optimizer, rank, world_size)
        optimizer.clip_grad_norm_(float("nan"))

    def clip_with_negative_norm_type():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        one_step(model, optimizer, rank, world_size)
        optimizer.clip_grad_norm_(1.0, norm_type=-2.0)

    def two_models_backward_twice():
        # torch's DCGAN loop: the discriminator's two backwards before its step, which its delayed buckets do not
        # take; both models have a '0.bias'.
        generator, discriminator = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 1))
        generator, _ = dearcomm.wrap(generator, sgd(generator))
        discriminator, _ = dearcomm.wrap(discriminator, sgd(discriminator), schedule="deft", bucket_mb=0,
                                         delays={"0.weight": 1, "0.bias": 1})
        x = torch.ones(2, 4)
        discriminator(x).sum().backward()
        discriminator(generator(x).detach()).sum().backward()

    def two_models_step_twice():
        generator, discriminator = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 1))
        generator, generator_optimizer = dearcomm.wrap(generator, sgd(generator))
        discriminator, _ = dearcomm.wrap(discriminator, sgd(discriminator))
        generator(torch.ones(2, 4)).sum().backward()
        generator_optimizer.step()
        generator_optimizer.step()

    def step_with_closure():
        model = MixedNet()
        model, optimizer = dearcomm.wrap(model, sgd(model))
        optimizer.step(lambda: 0.0)

    for name, action in list(locals().items()):
        if callable(action) and name not in ("check",):
            check(name, action)
    return results


MISUSE = {
    "foreign_optimizer": ("ValueError", r"param_groups\[0\]\['params'\]\[0\] \(shape \(1,\)\) is not a parameter of the module"),
    "meta_device": ("ValueError", "parameters are on the meta device \\(shapes without data\\); materialize"),
    "sparse_embedding": ("ValueError", "module '0' \\(Embedding\\) makes sparse gradients"),
    "complex_parameter": ("TypeError", "parameter 'w' has dtype torch.complex64"),
    "wrap_twice": ("ValueError", "already wrapped"),
    "unused_parameter": ("ValueError", r"2 parameter\(s\) got no gradient in this backward: 'unused.weight', 'unused.bias'"),
    "step_before_backward": ("RuntimeError", "step\\(\\) called before the first backward"),
    "step_twice": ("RuntimeError", "step\\(\\) called without a backward since the last step"),
    "backward_twice": ("RuntimeError", "^dearcomm: parameter '.*' got a second gradient before optimizer.step\\(\\), "
                                       "which a schedule that delays buckets \\(deft\\) does not take"),
    "clip_before_last_backward": ("RuntimeError", r"clip_grad_norm_\(\) ran before the last backward of this step"),
    "two_models_backward_twice": ("RuntimeError", r"^dearcomm: \[model 2 of the 2 wrapped \(Sequential\)\] parameter "
                                  r"'0\.(weight|bias)' got a second gradient before optimizer.step\(\), which a "
                                  r"schedule that delays"),
    "two_models_step_twice": ("RuntimeError", r"^dearcomm: \[model 1 of the 2 wrapped \(Sequential\)\] "
                              r"optimizer.step\(\) called without a backward since the last step"),
    "step_with_closure": ("NotImplementedError", "step\\(closure\\) is not supported"),
    "clip_with_nan_max_norm": ("ValueError", "max_norm must be a number >= 0 .*got nan"),
    "clip_with_negative_norm_type": ("ValueError", "norm_type must be a positive number or inf, got -2.0"),
    "options_differ_between_ranks": ("ValueError", r"rank 1 passed other wrap\(\) options than rank 0 \(ranks that "
                                                   r"differ: \[1\]\): blocks=\{'fc.weight': \[64, 196\]\} on rank 0 "
                                                   r"but \{'fc.weight': \[128, 132\]\} on rank 1"),
    "unused_differ_between_ranks": ("ValueError", r"rank 1 passed other wrap\(\) options than rank 0 .*"
                                                  r"find_unused_parameters=False on rank 0 but True on rank 1"),
    "clip_differs_between_ranks": ("ValueError", r"max_grad_norm=1.0 on rank 0 but 0.01 on rank 1"),
    "lr_differs_between_ranks": ("ValueError", r"rank 1's optimizer differs from rank 0's \(ranks that differ: "
                                               r"\[1\]\): param_groups\[0\]\['lr'\] is 0.1 on rank 0 but 0.2 on rank 1"),
    "auto_on_one_rank": ("ValueError", r"bucket_mb=25.0 on rank 0 but 'auto' on rank 1"),
    "blocks_unknown_name": ("ValueError", r"blocks names \['embed.weights'\], which are not trainable parameters"),
    "blocks_wrong_sum": ("ValueError", r"blocks\['embed.weight'\] add up to 128 elements, but the parameter has 119"),
    "blocks_misaligned": ("ValueError", r"blocks\['embed.weight'\] has pieces of \[60\] elements; every piece but "
                                        r"the last must be a multiple of 32 \(world_size 2 x 64 bytes of torch.float32\)"),
    "parameter_changes_shape": ("ValueError", "parameter 'embed.weight' has 126 elements but had 119"),
    "optimizer_misses_parameters": ("ValueError", r"trainable parameter\(s\) \['scale', 'embed.weight', "
                                                  r"'conv.weight', .*are in no param group of the optimizer given to "
                                                  r"wrap\(\)"),
    "ddp_wrapped": ("ValueError", r"wrap\(\) takes the plain model, not torch's DistributedDataParallel, which "
                                  r"dearcomm replaces .*: pass ddp.module"),
    "steps_after_no_sync_backwards_only": ("RuntimeError", r"step\(\) called before the first backward \(a backward "
                                                         r"inside model.no_sync\(\) does not count"),
    "unfrozen_after_training": ("ValueError", r"parameter\(s\) \['head.weight', 'head.bias'\] became trainable after "
                                              r"wrap\(\); their gradients would be neither averaged nor applied"),
    "parameter_added": ("ValueError", r"trainable parameters changed after wrap\(\) \(added \['extra.weight', 'extra.bias'\]"),
}

_misuse_results = []


@pytest.mark.parametrize("name", sorted(MISUSE))
def test_misuse_raises_on_every_rank(name):
    if not _misuse_results:
        _misuse_results.extend(run_workers(misuse_worker, 2, deadline=120))
    expected_type, pattern = MISUSE[name]
    for rank, results in enumerate(_misuse_results):
        got = results[name]
        assert got is not None, f"rank {rank}: {name} raised nothing"
        assert got[0] == expected_type, f"rank {rank}: {name} raised {got}"
        assert "dearcomm:" in got[1], got[1]
        assert re.search(pattern, got[1]), f"rank {rank}: {got[1]!r} does not match {pattern!r}"


def diverging_worker(rank, world_size):
    """Rank 1 skips a layer: it raises at once, naming the parameters; the
    others wait for a reduction that never comes and raise at the timeout."""
    model = Unused()
    model.forward = (lambda x: model.used(x) + model.unused(x)) if rank != 1 else (lambda x: model.used(x))
    model, optimizer = dearcomm.wrap(model, sgd(model), bucket_mb=0, timeout=datetime.timedelta(seconds=3))
    try:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_parameter_without_gradient_on_one_rank_errors_instead_of_hanging():
    results = run_workers(diverging_worker, 3, deadline=90)
    assert results[1][0] == "ValueError" and "'unused.weight', 'unused.bias'" in results[1][1], results[1]
    for rank in (0, 2):
        assert results[rank] is not None, f"rank {rank} finished a step its peer never joined"
        assert f"dearcomm: [rank {rank}] reduce-scatter of bucket" in results[rank][1], results[rank]


# ---- a peer dies ---------------------------------------------------------------

PEER_TIMEOUT = datetime.timedelta(seconds=10)


def dying_peer_worker(rank, world_size, schedule, update, when):
    """Rank 1 dies, between two steps or in the middle of a backward; the
    others must raise an error naming the collective, not hang."""
    import os
    import time

    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, sgd(model), bucket_mb=0, schedule=schedule, update=update,
                                     timeout=PEER_TIMEOUT)
    if rank == 1 and when == "in-backward":
        model.fc.weight.register_post_accumulate_grad_hook(lambda p: os._exit(3))
    start = time.monotonic()
    try:
        for step, (x, y) in enumerate(batches(3, 12)):
            if rank == 1 and when == "between-steps" and step == 1:
                os._exit(3)
            optimizer.zero_grad()
            F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            optimizer.step()
        model.sync()
    except Exception as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def close_after_dead_peer_worker(rank, world_size):
    """Rank 1 dies after a step; rank 0's error quotes gloo's without the C++
    backtraces of the errors inside it, and close() detaches the model even
    though the all-gathers it would finish cannot: the module is plain again
    and runs a local forward."""
    import os
    import time
    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, sgd(model), bucket_mb=0, timeout=PEER_TIMEOUT)
    x, y = next(iter(batches(1, 12)))
    F.cross_entropy(model(x), y).backward()
    if rank == 0:
        # Rank 1 is gone before this step's all-gathers are posted, so they
        # cannot finish (had they finished before it left, close() would
        # have nothing to finish and nothing to raise).
        time.sleep(1)
    optimizer.step()
    if rank == 1:
        os._exit(3)
    try:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        return "trained on without its peer"
    except RuntimeError as e:
        caught = str(e)
    try:
        model.close()
        closed = None
    except RuntimeError as e:
        closed = str(e)
    with torch.no_grad():
        model(x)
    return caught, closed, type(model) is MixedNet


def test_close_after_a_dead_peer_detaches_and_errors_carry_no_backtrace():
    results = run_workers(close_after_dead_peer_worker, 2, deadline=120, allow_death=True)
    caught, closed, plain = results[0]
    for message in (caught, closed):
        assert message is not None and message.startswith("dearcomm: [rank 0]"), message
        assert "frame #" not in message and "Exception raised from" not in message, message
    assert plain, "close() left the model wrapped"


@pytest.mark.parametrize("when", ["between-steps", "in-backward"])
@pytest.mark.parametrize("schedule, update", [("dear", "sharded"), ("wfbp", "replicated")])
def test_dead_peer_raises_within_timeout(schedule, update, when):
    results = run_workers(dying_peer_worker, 3, schedule, update, when, deadline=120, allow_death=True)
    assert type(results[1]).__name__ == "Died", results[1]
    for rank in (0, 2):
        message, seconds = results[rank]
        assert message is not None, f"rank {rank} finished training without its dead peer"
        assert f"dearcomm: [rank {rank}]" in message and "of bucket" in message, message
        assert seconds < PEER_TIMEOUT.total_seconds() + 30, f"rank {rank} took {seconds:.0f} s to notice"


# ---- uneven inputs ---------------------------------------------------------------

def uneven_inputs_worker(rank, world_size):
    """Rank 1 has one batch fewer and goes on to other work (a long
    evaluation, no collective): rank 0's extra step raises at the timeout,
    naming the collective, instead of hanging. DDP's join(), for such a
    loop, raises by name: dearcomm does not take it."""
    import time

    from torch.distributed.algorithms.join import Join

    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, sgd(model), bucket_mb=0, timeout=PEER_TIMEOUT)
    joins = []
    for attempt in (lambda: model.join(), lambda: Join([model])):
        try:
            attempt()
        except AttributeError as e:
            joins.append(str(e))
    start = time.monotonic()
    try:
        for x, y in batches(3 - rank, 12):
            optimizer.zero_grad()
            F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            optimizer.step()
        model.sync()
        if rank == 1:
            time.sleep(PEER_TIMEOUT.total_seconds() + 5)
        return None, time.monotonic() - start, joins
    except RuntimeError as e:
        return str(e), time.monotonic() - start, joins


def test_uneven_inputs_raise_at_the_timeout_and_join_is_refused_by_name():
    results = run_workers(uneven_inputs_worker, 2, deadline=120)
    for joins in (r[2] for r in results):
        assert len(joins) == 2 and all(m.startswith("dearcomm: a wrapped model has no join") and
                                       "uneven inputs" in m and "DistributedSampler" in m for m in joins), joins
        assert joins[0].startswith("dearcomm: a wrapped model has no join:"), joins  # model.join()
        assert joins[1].startswith("dearcomm: a wrapped model has no join_"), joins  # Join([model]) asks for more
    message, seconds, _ = results[0]
    assert message is not None and message.startswith("dearcomm: [rank 0]") and "of bucket" in message, message
    assert "ran out of batches" in message and "same number of optimizer steps" in message, message
    assert seconds < PEER_TIMEOUT.total_seconds() + 10, f"rank 0 took {seconds:.0f} s to notice"
    assert results[1][0] is None, results[1]


def late_first_backward_worker(rank, world_size):
    """Rank 1 stalls before its first forward (a slow data loader, a
    debugger): rank 0's first backward meets it in the check that every rank
    trains the same parameters, which waited for the group's timeout (30
    minutes on gloo) and then raised gloo's text alone; it raises at
    wrap(timeout=), naming the check."""
    import time

    model = MixedNet()
    model, optimizer = dearcomm.wrap(model, sgd(model), timeout=PEER_TIMEOUT)
    start = time.monotonic()
    if rank == 1:
        time.sleep(PEER_TIMEOUT.total_seconds() + 5)
        return None, time.monotonic() - start
    x, y = next(batches(1, 12))
    try:
        F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_peer_late_for_the_first_backward_raises_at_wraps_timeout():
    message, seconds = run_workers(late_first_backward_worker, 2, deadline=120)[0]
    assert message is not None and message.startswith("dearcomm: the first backward's check that every rank "
                                                      "trains the same parameters"), message
    assert "a peer stalled, died or did not call it" in message, message
    assert seconds < PEER_TIMEOUT.total_seconds() + 5, f"rank 0 took {seconds:.0f} s to notice"


def absent_peer_worker(rank, world_size, where):
    """Rank ``absent`` never comes to a meeting that waits for the group's
    timeout (3 s here): wrap()'s comparison of the models, or a decision
    rank 0 shares (auto's plan); the waiting rank raises a dearcomm: error
    naming it (gloo's text alone named nothing)."""
    import time

    from dearcomm._rank0 import rank0s
    group = torch.distributed.new_group(timeout=datetime.timedelta(seconds=3))
    absent = 1 if where == "wrap" else 0  # rank 0's broadcast may leave before anyone receives it
    if rank == absent:
        time.sleep(8)
        return None
    try:
        if where == "wrap":
            model = MixedNet()
            dearcomm.wrap(model, sgd(model), process_group=group)
        else:
            rank0s("plan", group, what="auto's plan")
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("where, message", [
    ("wrap", "dearcomm: wrap()'s check that every rank built the same model failed or did not complete within 3 s"),
    ("rank0s", "dearcomm: auto's plan did not reach every rank (the group's timeout): a peer stalled, died"),
])
def test_a_peer_absent_from_a_meeting_on_the_groups_timeout_is_named(where, message):
    got = [r for r in run_workers(absent_peer_worker, 2, where, deadline=120) if r is not None]
    assert len(got) == 1 and got[0].startswith(message), got


# ---- an exception inside backward ---------------------------------------------------

class RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (an out-of-memory, say)."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if RaiseInBackward.armed:
            raise RuntimeError("out of memory (simulated)")
        return grad


def backward_raises_worker(rank, world_size, where):
    """Every rank's backward raises in step 1 and the loop skips the batch, as
    an out-of-memory handler would. Raised before any gradient reached
    dearcomm (in the loss), training goes on as if the batch had not been
    there; raised after the head's gradients were reduced (between head and
    fc), the next training forward names what happened instead of a later
    step failing on a "second gradient" or the ranks hanging."""
    torch.manual_seed(0)
    model = MixedNet()
    reference = copy.deepcopy(model)
    if where == "after-some-gradients":
        model.fc.register_forward_hook(lambda module, args, out: RaiseInBackward.apply(out))
    model, optimizer = dearcomm.wrap(model, sgd(model), bucket_mb=0)
    ref_opt = sgd(reference)
    for step, (x, y) in enumerate(batches(4, 12)):
        RaiseInBackward.armed = step == 1
        try:
            loss = F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            if where == "in-the-loss":
                loss = RaiseInBackward.apply(loss)
            loss.backward()
        except RuntimeError as e:
            if "simulated" not in str(e):
                return "raised", str(e)
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()
        step_on_global_batch(reference, ref_opt, x, y)
    model.sync()
    torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()),
                               rtol=1e-5, atol=1e-6)
    return "trained", None


def test_backward_that_raised_before_any_gradient_leaves_training_intact():
    assert run_workers(backward_raises_worker, 2, "in-the-loss", deadline=120) == [("trained", None)] * 2


def test_backward_that_raised_midway_is_named_at_the_next_forward():
    for rank, (outcome, message) in enumerate(run_workers(backward_raises_worker, 2, "after-some-gradients",
                                                          deadline=120)):
        assert outcome == "raised", f"rank {rank} trained on after a backward that raised midway"
        assert "dearcomm: the previous backward did not finish" in message, message


def end_of_backward_raised_worker(rank, world_size):
    """The end of a backward raises (a parameter got no gradient) after its
    reductions were issued for the other buckets; the loop catches it and
    zeroes the gradients. zero_grad() must not take that for a backward to
    skip (it raised the same error again), and the next training forward
    names what happened (it went on to a misleading "second gradient")."""
    seen = {}
    for schedule in ("dear", "wfbp"):
        torch.manual_seed(0)
        model = Unused()
        model.forward = lambda x, model=model: model.used(x) + (model.unused(x) if use_both[0] else 0)
        use_both = [True]
        model, optimizer = dearcomm.wrap(model, sgd(model), schedule=schedule, bucket_mb=0)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        use_both[0] = False
        try:
            model(torch.randn(2, 4)).sum().backward()
        except ValueError as e:
            seen[f"{schedule} backward"] = "got no gradient" in str(e)
        optimizer.zero_grad()  # the loop's handler
        use_both[0] = True
        try:
            model(torch.randn(2, 4))
        except RuntimeError as e:
            seen[f"{schedule} next forward"] = "the previous backward did not finish" in str(e)
        model.close()
    return seen


def test_a_backward_whose_end_raised_is_named_at_the_next_forward():
    for rank, seen in enumerate(run_workers(end_of_backward_raised_worker, 2, deadline=120)):
        assert seen == {f"{s} {w}": True for s in ("dear", "wfbp") for w in ("backward", "next forward")}, \
            f"rank {rank}: {seen}"


def stale_graph_worker(rank, world_size):
    """A backward through a graph kept (retain_graph) from before step():
    torch raises because step() wrote the parameters in place, and with
    dearcomm too, though the all-gathers write them behind autograd's back
    (it ran silently on the new weights)."""
    seen = {}
    for schedule in ("dear", "wfbp", "bytescheduler"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), schedule=schedule)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        loss = model(torch.randn(3, 4)).sum()
        loss.backward(retain_graph=True)
        optimizer.step()
        optimizer.zero_grad()
        try:
            loss.backward()
        except RuntimeError as e:
            seen[schedule] = str(e)
        model.close()
    return seen


def test_a_backward_through_a_graph_from_before_step_raises():
    for rank, seen in enumerate(run_workers(stale_graph_worker, 2, deadline=120)):
        for schedule in ("dear", "wfbp", "bytescheduler"):
            assert "modified by an inplace operation" in seen.get(schedule, ""), (rank, schedule, seen)


def late_peer_worker(rank, world_size, case):
    """Rank 1 arrives late (or never) at one of dearcomm's own collectives on
    the training group; rank 0 raises within wrap()'s timeout, naming it."""
    import time
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     timeout=datetime.timedelta(seconds=3))
    model(torch.randn(6, 4)).sum().backward()
    optimizer.step()
    if case == "buffers" and rank == 1:
        time.sleep(6)  # late for the forward's buffer broadcast
    loss = model(torch.randn(6, 4)).sum()
    if case == "buffers":
        return None
    loss.backward()
    try:
        if rank == 0:  # a rank-0-only norm, as torch's clip_grad_norm_ is local under DDP
            optimizer.clip_grad_norm_(1.0)
        else:
            time.sleep(6)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case, named", [
    ("buffers", "the broadcast of rank 0's buffers after a training forward failed or did not complete within 3 s"),
    ("clip", r"the all-reduce of the gradient norm for clipping \(optimizer.clip_grad_norm_ or "
             r"wrap\(max_grad_norm=\); every rank must clip\) failed or did not complete within 3 s"),
])
def test_dearcomms_own_collectives_keep_wraps_timeout(case, named):
    """The deadline is under the group's timeout (45 s here; 30 minutes by
    default): waiting for the group's timeout fails the test."""
    results = run_workers(_call_late_peer, 2, case, deadline=30)
    assert re.search("dearcomm: " + named, results[0] or ""), results


def _call_late_peer(rank, world_size, case):
    try:
        return late_peer_worker(rank, world_size, case)
    except RuntimeError as e:
        return str(e)
