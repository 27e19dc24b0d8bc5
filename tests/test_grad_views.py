""".grad as a view into its gradient bucket (as DDP's gradient_as_bucket_view):
after zero_grad(set_to_none=False) autograd accumulates straight into the
bucket and backward packs nothing; after zero_grad() .grad is None and backward
packs each new gradient into its slot; training stays exactly that of one
process on the global batch whatever the user does with .grad (zero_grad
either way, no_sync(), replacing .grad)."""
import contextlib
import copy
import traceback

import pytest
import torch
import torch.nn.functional as F

import dearcomm
from tests.models import MixedNet, batches, global_batch, local_slice, step_on_global_batch
from tests.multiprocess import run_workers
from tests.test_parity import SCHEDULES, SMALL_BUCKET_MB, make_optimizer
from tests.test_training_features import averaged_in_grad

TOL = dict(rtol=1e-5, atol=1e-6)
# bytescheduler and usbyte all-reduce in place and the next forward reads the
# result, after zero_grad() and the user's code have written .grad: .grad
# cannot live in its buckets there.
NO_VIEWS = {("bytescheduler", "replicated"), ("usbyte", "replicated")}
STEPS = 4


def assert_no_failures(results):
    report = [f"rank {rank}:\n" + "\n".join(f"--- {k}:\n{v}" for k, v in failures.items())
              for rank, failures in enumerate(results) if failures]
    assert not report, "\n".join(report)


def each_case(cases, fn):
    failures = {}
    for case in cases:
        try:
            fn(*case)
        except Exception:
            failures["-".join(map(str, case))] = traceback.format_exc()
    return failures


def wrapped_pair(schedule, update, **options):
    torch.manual_seed(0)
    model = MixedNet()
    reference = copy.deepcopy(model)
    optimizer, ref_opt = make_optimizer("sgd", model), make_optimizer("sgd", reference)
    model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=SMALL_BUCKET_MB, schedule=schedule, update=update,
                                     **options)
    return model, optimizer, reference, ref_opt


def train_step(model, x, y):
    F.cross_entropy(model(x), y).backward()


# ---- .grad lives in the bucket ---------------------------------------------------

def views_worker(rank, world_size):
    n = global_batch(world_size)

    def run(schedule, update, comm_dtype):
        model, optimizer, _, _ = wrapped_pair(schedule, update, comm_dtype=comm_dtype)
        runtime = model._dear
        no_views = comm_dtype is not None or (schedule, update) in NO_VIEWS
        packed = []
        for x, y in batches(STEPS, n):
            train_step(model, local_slice(x, rank, world_size), local_slice(y, rank, world_size))
            engine = runtime.engine
            packed.append(engine.packed_params)
            layout = engine.layout
            for i, param in enumerate(runtime.params):
                view, slot = engine.grad_view(i), layout.params[i]
                if no_views:
                    assert view is None, f"{runtime.names[param]}: a view into a {comm_dtype} bucket ({schedule})"
                    continue
                # The slot of the flat buffer itself: the storage every parameter
                # of the buffer shares, at the parameter's offset in it.
                assert param.grad is view, f"{runtime.names[param]}: .grad is not its bucket view"
                first = runtime.params[layout.buckets[slot.bucket].first_param]
                assert param.grad.untyped_storage().data_ptr() == first.grad.untyped_storage().data_ptr()
                assert param.grad.data_ptr() == param.grad.untyped_storage().data_ptr() + layout.buffer_offset(i) * 4
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        count = len(runtime.params)
        if not no_views:
            # The first backward packs (.grad was None) and points .grad at the
            # views; zero-filled views are accumulated into, never packed.
            assert packed == [count] + [0] * (STEPS - 1), f"parameters packed per backward: {packed}"
        else:
            assert packed == [count] * STEPS, f"parameters packed per backward: {packed}"
        # A copy owns its memory: it must not share (or keep alive) the bucket.
        twin = copy.deepcopy(model)
        assert all(p.grad is None for p in twin.parameters())

    cases = [(s, u, None) for s, u in SCHEDULES] + [("dear", "sharded", torch.bfloat16),
                                                   ("wfbp", "replicated", torch.float16)]
    return each_case(cases, run)


@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_is_its_bucket_view_and_backward_packs_nothing(world_size):
    """Guards against the views not being installed, or the engine still copying
    a gradient that autograd already accumulated into its bucket (the saving
    lost without any wrong number); and against views into buckets that cannot
    hold .grad as it is (another comm dtype, fp16's pre-division)."""
    assert_no_failures(run_workers(views_worker, world_size, deadline=240))


# ---- parity whatever the loop does with .grad ---------------------------------------

VARIANTS = ["set_to_none", "zero_fill", "module_zero_grad", "no_sync", "no_sync_zero_fill", "replaced_grad"]
ZERO_FILL = ("zero_fill", "no_sync_zero_fill")  # zero_grad(set_to_none=False): the views are kept


def parity_worker(rank, world_size):
    def run(schedule, update, variant):
        model, optimizer, reference, ref_opt = wrapped_pair(schedule, update)
        micro = 2 if variant.startswith("no_sync") else 1
        params, ref_params = list(model.parameters()), list(reference.parameters())
        packed = []
        for step, (x, y) in enumerate(batches(STEPS, global_batch(world_size) * micro)):
            if variant == "replaced_grad":
                for p in params:
                    p.grad = torch.zeros_like(p)  # the user's own tensors: they must be packed
            xs, ys = local_slice(x, rank, world_size).chunk(micro), local_slice(y, rank, world_size).chunk(micro)
            for i in range(micro):
                with model.no_sync() if i < micro - 1 else contextlib.nullcontext():
                    (F.cross_entropy(model(xs[i]), ys[i]) / micro).backward()
            packed.append(model._dear.engine.packed_params)
            if micro == 1:
                # What .grad holds after backward: wfbp, the average (as with
                # DDP); dear and bytescheduler, this rank's local gradient.
                loss = F.cross_entropy(reference(x), y) if averaged_in_grad(schedule, update) else F.cross_entropy(
                    reference(xs[0]), ys[0])
                for p, expected, q in zip(params, torch.autograd.grad(loss, ref_params), ref_params):
                    torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"step {step} .grad: {m}")
            optimizer.step()
            if variant in ZERO_FILL:
                optimizer.zero_grad(set_to_none=False)
            elif variant == "module_zero_grad":
                model.zero_grad()
            else:
                optimizer.zero_grad()
            step_on_global_batch(reference, ref_opt, x, y)
            model.sync()
            torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()), **TOL,
                                       msg=lambda m: f"step {step}: {m}")
        count = len(params)
        # Only zero_grad(set_to_none=False) keeps the views for the next backward.
        every_step = variant not in ZERO_FILL or (schedule, update) in NO_VIEWS
        expected = [count] * STEPS if every_step else [count] + [0] * (STEPS - 1)
        assert packed == expected, f"parameters packed per backward: {packed}, expected {expected}"

    return each_case([(s, u, v) for s, u in SCHEDULES for v in VARIANTS], run)


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_whatever_the_loop_does_with_grad(world_size):
    """Guards against skipping the pack for a .grad that is not its bucket view
    (a user's own tensor: zeros would be sent), against zero_grad(set_to_none=
    False) leaving the buckets unzeroed (gradients would add up across steps)
    or dropping the views (packing every step), against zero_grad() leaving
    .grad a view (autograd would add to the last step's gradient), against no_sync() micro-batches not accumulating in
    the views, and against replicated all-gathers landing in the memory .grad
    points into (.grad would show averages and the next backward add to them)."""
    assert_no_failures(run_workers(parity_worker, world_size, deadline=300))


# ---- .grad changed after backward is still refused (dear) ------------------------------

def refusal_worker(rank, world_size):
    n = global_batch(world_size)
    x, y = next(batches(1, n))
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)

    def run(update, change):
        model, optimizer, _, _ = wrapped_pair("dear", update)
        train_step(model, x, y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # .grad stays the views, zero-filled
        train_step(model, x, y)
        assert model.head.weight.grad is model._dear.engine.grad_view(model._dear.index[model.head.weight])
        if change == "one_grad":
            model.head.weight.grad.mul_(2.0)
            message = r"\.grad of 'head\.weight' was changed after backward"  # that one only, not its bucket
        elif change == "some_zeroed":
            for param in list(model.parameters())[:2]:
                param.grad.zero_()
            message = r"\.grad of '[\w.]+' and 1 more was changed after backward"
        else:  # every .grad: the step is skipped, and step() has nothing to apply
            optimizer.zero_grad(set_to_none=change == "set_to_none")
            message = r"without a backward since the last step.*zero_grad\(\) between a backward and step\(\) skips"
        with pytest.raises(RuntimeError, match=message):
            optimizer.step()

    changes = ("one_grad", "some_zeroed", "zero_fill", "set_to_none")
    return each_case([(u, c) for u in ("sharded", "replicated") for c in changes], run)


def test_grad_changed_after_backward_is_refused_per_parameter():
    """Guards against a change of .grad going unnoticed (some .grad zeroed,
    or zero_grad() between backward and step() taken for neither a change nor
    a skipped step), and against
    views sharing one version counter: a write to one .grad must name that
    parameter, and the engine's writes to the bucket must not count as the
    user's (that would make every normal step raise)."""
    assert_no_failures(run_workers(refusal_worker, 2))


# ---- what zero_grad() leaves in .grad ---------------------------------------------------

def zero_grad_worker(rank, world_size):
    n = global_batch(world_size)
    x, y = next(batches(1, n))
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)

    def run(schedule, update, how):
        model, optimizer, _, _ = wrapped_pair(schedule, update)
        engine_of = lambda: model._dear.engine  # noqa: E731 (built at the first backward)
        for _ in range(2):  # the second backward starts from the views
            train_step(model, x, y)
            optimizer.step()
            if how == "module":
                model.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=how == "set_to_none")
        runtime = model._dear
        for i, param in enumerate(runtime.params):
            name = runtime.names[param]
            if how == "zero_fill":
                assert param.grad is not None and not param.grad.any(), f"{name}: .grad is not zeros"
                if (schedule, update) not in NO_VIEWS:
                    assert param.grad is engine_of().grad_view(i), f"{name}: the view was not kept"
            else:  # as torch's zero_grad(): the default set_to_none=True
                assert param.grad is None, f"{name}: .grad is {type(param.grad).__name__}, not None"

    return each_case([(s, u, h) for s, u in SCHEDULES for h in ("set_to_none", "zero_fill", "module")], run)


def test_zero_grad_sets_grad_to_none_or_zero_fills_the_views():
    """Guards against zero_grad() keeping the views whatever set_to_none says
    (the next backward would pay a fill and an add instead of one copy, and
    code that tests `p.grad is None` after zero_grad() would see zeros), and
    against zero_grad(set_to_none=False) dropping the views."""
    assert_no_failures(run_workers(zero_grad_worker, 2, deadline=180))
