"""What real scripts do around the training loop: ranks that build different
models (an error at wrap(), not a hang), copies of the wrapped model (EMA,
copy.deepcopy, torch.save(model)), DDP-style `model.module`, bucket_mb=inf,
and transformers' save_pretrained."""
import copy
import io
import json
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dearcomm
from dearcomm import _C
from dearcomm._module import DearModule
from dearcomm._options import INT64_MAX, WrapOptions
from tests.models import MixedNet, batches, local_slice, step_on_global_batch, step_on_slice
from tests.multiprocess import run_workers
from tests.test_parity import make_optimizer
from tests.test_training_features import assert_same_parameters
from tests.test_training_features import each_schedule as each_schedule_on_rank
from tests.test_user_loops import assert_no_failures, wrapped_pair

GLOBAL_BATCH = 12


def each_schedule(fn):
    """Runs fn(schedule, update) for every schedule; collects failures by name."""
    return each_schedule_on_rank(None, None, fn)


# ---- item 7: a rank with another model raises at wrap(), on every rank ---------------

class Small(nn.Module):
    def __init__(self, out=4, dtype=torch.float32, extra=False, buffer=4, freeze_bias=False):
        super().__init__()
        self.used = nn.Linear(4, out, dtype=dtype)
        if extra:
            self.extra = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(buffer))
        self.used.bias.requires_grad_(not freeze_bias)


class Pair(nn.Module):
    def __init__(self, swapped):
        super().__init__()
        for name in ("b", "a") if swapped else ("a", "b"):
            setattr(self, name, nn.Linear(4, 4))


def mismatch_cases(world_size):
    """name -> (how rank r builds its model, the message every rank must raise)."""
    last = world_size - 1
    return {
        "extra layer on the last rank": (
            lambda r: Small(extra=r == last),
            f"rank {last}'s model differs from rank 0's (ranks that differ: [{last}]): parameter 'extra.weight' "
            f"(shape (4, 4), torch.float32) is extra on rank {last}"),
        "extra layer on rank 0": (
            lambda r: Small(extra=r == 0),
            f"rank 1's model differs from rank 0's (ranks that differ: {list(range(1, world_size))}): parameter "
            "'extra.weight' (shape (4, 4), torch.float32) is missing on rank 1"),
        "another shape": (
            lambda r: Small(out=5 if r == 1 else 4),
            "rank 1's model differs from rank 0's (ranks that differ: [1]): parameter 'used.weight' is "
            "(shape (4, 4), torch.float32) on rank 0 but (shape (5, 4), torch.float32) on rank 1"),
        "another dtype": (
            lambda r: Small(dtype=torch.float64 if r == 1 else torch.float32),
            "parameter 'used.weight' is (shape (4, 4), torch.float32) on rank 0 but "
            "(shape (4, 4), torch.float64) on rank 1"),
        "another buffer": (
            lambda r: Small(buffer=3 if r == last else 4),
            f"buffer 'steps' is (shape (4,), torch.float32) on rank 0 but (shape (3,), torch.float32) on rank {last}"),
        "another registration order": (
            lambda r: Pair(swapped=r == 1),
            "the same tensors, registered in another order: parameter 'a.weight' comes where rank 1 has "
            "parameter 'b.weight'"),
        "a frozen parameter": (
            lambda r: Small(freeze_bias=r == 1),
            "parameter 'used.bias' is (shape (4,), torch.float32) on rank 0 but (shape (4,), torch.float32, frozen) "
            "on rank 1"),
    }


def mismatch_worker(rank, world_size):
    """Every case in one set of processes: each raises on every rank right
    after the all-gather of signatures, so the group stays usable."""
    results = {}
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # the first one imports for seconds: not timed
    torch.distributed.barrier()  # ranks start at different times
    for name, (build, _) in mismatch_cases(world_size).items():
        model = build(rank)
        start = time.monotonic()
        try:
            dearcomm.wrap(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
            results[name] = None
        except Exception as e:
            results[name] = (type(e).__name__, str(e), time.monotonic() - start)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_another_model_on_one_rank_raises_on_every_rank(world_size):
    results = run_workers(mismatch_worker, world_size, deadline=60)
    for name, (_, expected) in mismatch_cases(world_size).items():
        for rank, got in enumerate(results):
            assert got[name] is not None, f"{name}: rank {rank} wrapped without an error"
            kind, message, seconds = got[name]
            assert kind == "ValueError", (name, rank, kind, message)
            assert message.startswith(f"dearcomm: [rank {rank}] "), message
            assert expected in message, f"{name}, rank {rank}:\n{message}\ndoes not contain\n{expected}"
            assert "Every rank must build the same model" in message, message
            assert seconds < 10, f"{name}: rank {rank} took {seconds:.1f} s (a collective timeout is 45 s)"


# ---- item 10: deepcopy / torch.save(model) give plain, synced modules ------------------

def _count_calls(module, args):
    module.calls = getattr(module, "calls", 0) + 1


def dearcomm_hooks(model):
    """Hooks left on a copy that are not the user's (the test's one is _count_calls)."""
    found = []
    for name, sub in model.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks", "_state_dict_hooks",
                     "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"):
            found += [f"{name}.{kind}: {h}" for h in getattr(sub, kind).values() if h is not _count_calls]
    for name, param in model.named_parameters():
        found += [f"{name}: {h}" for h in (param._post_accumulate_grad_hooks or {}).values()]
    return found


def assert_plain_copy(copied, model, what):
    assert type(copied) is MixedNet and not isinstance(copied, DearModule), f"{what}: {type(copied).__mro__}"
    assert "_dear" not in copied.__dict__ and "_dear_hooks" not in copied.__dict__, what
    assert not dearcomm_hooks(copied), f"{what}: {dearcomm_hooks(copied)}"
    assert list(copied.fc._forward_pre_hooks.values()) == [_count_calls], f"{what}: the user's hook is gone"
    originals = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for name, param in copied.named_parameters():
        storage = param.untyped_storage()
        assert storage.data_ptr() not in originals, f"{what}: '{name}' shares memory with the wrapped model"
        assert storage.nbytes() == param.numel() * param.element_size(), f"{what}: '{name}' is not compact"


def copy_worker(rank, world_size):
    def run(schedule, update):
        torch.manual_seed(0)
        model = MixedNet()
        model.fc.register_forward_pre_hook(_count_calls)  # the user's: copies keep it
        reference = copy.deepcopy(model)
        optimizer, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0.001, schedule=schedule, update=update)
        ema, ref_ema = copy.deepcopy(model), copy.deepcopy(reference)
        # usbyte's planner removes its own hook at the first training forward: not counted.
        planner = {model._dear.planner.handle.id} if model._dear.planner else set()

        def pre_hooks():
            return {name: [(k, h) for k, h in sub._forward_pre_hooks.items() if k not in planner]
                    for name, sub in model.named_modules()}
        hooks_before = pre_hooks()
        data = iter(batches(8, GLOBAL_BATCH))

        def step():
            x, y = next(data)
            step_on_slice(model, optimizer, x, y, rank, world_size)
            step_on_global_batch(reference, ref_opt, x, y)

        for _ in range(3):
            step()
            model.sync()  # an EMA reads the parameters: they must hold the step's result
            with torch.no_grad():
                for e, p in zip(list(ema.parameters()) + list(ref_ema.parameters()),
                                list(model.parameters()) + list(reference.parameters())):
                    e.lerp_(p, 0.1)
        assert_plain_copy(ema, model, "EMA")
        assert_same_parameters(ema, ref_ema, "EMA")

        step()  # no sync before the copies: they sync themselves
        copied = copy.deepcopy(model)
        assert_plain_copy(copied, model, "deepcopy")
        assert_same_parameters(copied, reference, "deepcopy")
        step()
        buffer = io.BytesIO()
        torch.save(model, buffer)
        loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        assert_plain_copy(loaded, model, "torch.save")
        assert_same_parameters(loaded, reference, "torch.save")
        # A deep copy of a submodule keeps dearcomm's hook, which must leave it
        # alone, also while all-gathers are pending.
        step()
        fc = copy.deepcopy(model.fc)
        fc(torch.randn(2, fc.in_features)).sum().backward()

        # The wrapped model is unchanged: its class, runtime and hooks, in order.
        assert isinstance(model, DearModule) and type(model).__name__ == "MixedNet"
        assert pre_hooks() == hooks_before
        # A copy trains on its own, without touching the wrapped model.
        before = {k: v.clone() for k, v in model.state_dict().items()}
        plain_opt = torch.optim.SGD(copied.parameters(), lr=0.5)
        x, y = next(batches(1, GLOBAL_BATCH, seed=5))
        F.cross_entropy(copied(x), y).backward()
        plain_opt.step()
        torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
        assert not torch.equal(copied.fc.weight, model.fc.weight)
        # ... and the wrapped model keeps training like the reference.
        step()
        step()
        model.sync()
        assert_same_parameters(model, reference, "after the copies")
    return each_schedule(run)


def test_deepcopy_and_torch_save_give_plain_synced_modules():
    assert_no_failures(run_workers(copy_worker, 2, deadline=120))


# ---- item 11a: `model.module` -----------------------------------------------------------

class HasModuleChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = MixedNet()

    def forward(self, x):
        return self.module(x)


class HasModuleAttribute(MixedNet):
    def __init__(self):
        super().__init__()
        self.module = "the user's"


class HasModuleProperty(MixedNet):
    module = property(lambda self: "the class's")


def module_attribute_worker(rank, world_size):
    def run(schedule, update):
        for cls in (MixedNet, HasModuleChild, HasModuleAttribute, HasModuleProperty):
            torch.manual_seed(0)
            model = cls()
            child = model.module if cls is HasModuleChild else None
            model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                             schedule=schedule, update=update)
            for x, y in batches(2, GLOBAL_BATCH):
                step_on_slice(model, optimizer, x, y, rank, world_size)
            expected = {HasModuleChild: child, HasModuleAttribute: "the user's", HasModuleProperty: "the class's"}
            if cls is MixedNet:
                with pytest.raises(AttributeError, match="^dearcomm: a wrapped model has no attribute 'module'"):
                    model.module
                unwrapped = model
                while hasattr(unwrapped, "module"):  # the common unwrap loop ends
                    unwrapped = unwrapped.module
                assert unwrapped is model
            else:
                assert model.module is expected[cls], (cls, model.module)
            with pytest.raises(AttributeError, match=f"'{cls.__name__}' object has no attribute 'no_such_attribute'"):
                model.no_such_attribute
    return each_schedule(run)


def test_module_attribute():
    assert_no_failures(run_workers(module_attribute_worker, 2, deadline=120))


# ---- item 11b: bucket_mb=inf -------------------------------------------------------------

def test_infinite_bucket_means_no_cap():
    assert WrapOptions(bucket_mb=float("inf")).bucket_cap_bytes == INT64_MAX
    assert WrapOptions(bucket_mb=1e30).bucket_cap_bytes == INT64_MAX
    assert WrapOptions(bucket_mb=1.0).bucket_cap_bytes == 2**20
    layout = _C.plan_buckets([300_000] * 4 + [10] * 2, [torch.float32] * 4 + [torch.float64] * 2,
                             WrapOptions(bucket_mb=float("inf")).bucket_cap_bytes, 2)
    # the small first bucket (1 MiB), then one per dtype
    assert [(b.first_param, b.num_params) for b in layout.buckets] == [(0, 1), (1, 3), (4, 2)]


def infinite_bucket_worker(rank, world_size):
    def run(schedule, update):
        torch.manual_seed(0)
        model = MixedNet()
        reference = copy.deepcopy(model)
        optimizer, ref_opt = make_optimizer("adamw", model), make_optimizer("adamw", reference)
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=float("inf"), schedule=schedule, update=update)
        for step, (x, y) in enumerate(batches(4, GLOBAL_BATCH)):
            step_on_slice(model, optimizer, x, y, rank, world_size)
            step_on_global_batch(reference, ref_opt, x, y)
            model.sync()
            assert_same_parameters(model, reference, f"step {step}")
        assert len(model._dear.engine.layout.buckets) == 1  # MixedNet fits in the first bucket
    return each_schedule(run)


def test_infinite_bucket_trains_like_one_process():
    assert_no_failures(run_workers(infinite_bucket_worker, 2, deadline=120))


# ---- item 11c: transformers' save_pretrained -------------------------------------------

def save_pretrained_worker(rank, world_size, directory):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.modeling_utils import unwrap_model

    def run(schedule, update):
        # 25 MiB: one bucket, every parameter a view of one flat buffer (sharded)
        for bucket_mb in (0.001, 25.0):
            torch.manual_seed(0)
            config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
            model = GPT2LMHeadModel(config)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=bucket_mb, schedule=schedule, update=update)
            assert type(model).__name__ == "GPT2LMHeadModel" and isinstance(model, DearModule)
            assert unwrap_model(model) is model  # transformers' own unwrapping ends at the model
            tokens = torch.randint(0, 50, (2 * world_size, 8), generator=torch.Generator().manual_seed(1))
            mine = local_slice(tokens, rank, world_size)
            for _ in range(2):
                model(input_ids=mine, labels=mine).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            model.sync()  # every rank: the rank-0-only save below then needs no collective
            path = os.path.join(directory, f"{schedule}-{update}-{bucket_mb:g}")
            if rank == 0:
                model.save_pretrained(path)
            torch.distributed.barrier()
            with open(os.path.join(path, "config.json")) as f:
                assert json.load(f)["architectures"] == ["GPT2LMHeadModel"]
            loaded = GPT2LMHeadModel.from_pretrained(path)
            assert type(loaded) is GPT2LMHeadModel and loaded.lm_head.weight is loaded.transformer.wte.weight
            torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
            # training goes on after the save
            model(input_ids=mine, labels=mine).loss.backward()
            optimizer.step()
            model.sync()
            assert not torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    return each_schedule(run)


def test_save_pretrained_writes_the_original_class(tmp_path):
    pytest.importorskip("transformers")
    assert_no_failures(run_workers(save_pretrained_worker, 2, str(tmp_path), deadline=180))


def step_hooks_worker(rank, world_size):
    """Step hooks, as torch runs them for one optimizer: once per step(),
    whether registered on the returned optimizer, on the user's optimizer
    before wrap() (a library's, say), or globally, though the updates step
    the user's optimizer once per bucket (replicated) or another instance of
    its class (sharded)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def run(schedule, update):
        calls = {"user": 0, "returned": 0, "global": 0}

        def counter(key):
            def hook(*args):
                calls[key] += 1
            return hook
        model = MixedNet()
        optimizer = make_optimizer("adamw", model)
        optimizer.register_step_post_hook(counter("user"))
        model, returned = dearcomm.wrap(model, optimizer, bucket_mb=0, schedule=schedule, update=update)
        returned.register_step_post_hook(counter("returned"))
        handle = register_optimizer_step_post_hook(counter("global"))
        try:
            for x, y in batches(3, 12):
                step_on_slice(model, returned, x, y, rank, world_size)
            model.sync()
        finally:
            handle.remove()
        assert calls == {"user": 3, "returned": 3, "global": 3}, calls
    return each_schedule_on_rank(rank, world_size, run)


def test_step_hooks_run_once_per_step():
    assert_no_failures(run_workers(step_hooks_worker, 2))


def original_optimizer_worker(rank, world_size):
    """The DDP habit of keeping one's own optimizer: `model, _ = wrap(model,
    optimizer)`, then optimizer.step(). Under dear that applied each rank's
    own gradient and the ranks drifted apart without a word; it raises, naming
    the fix, changes nothing, and the returned optimizer then steps as usual.
    After model.close() the optimizer is the user's again."""
    def run(schedule, update):
        model, returned, reference, ref_opt = wrapped_pair(schedule, update, 0, optim="sgd")
        optimizer = returned.optimizer  # the one given to wrap()
        for step, (x, y) in enumerate(batches(3, GLOBAL_BATCH)):
            F.cross_entropy(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            if step == 1:
                with pytest.raises(RuntimeError, match=r"step\(\) of the SGD given to wrap\(\); step the optimizer "
                                                       r"wrap\(\) returned"):
                    optimizer.step()
            returned.step()
            returned.zero_grad()
            step_on_global_batch(reference, ref_opt, x, y)
        model.sync()
        assert_same_parameters(model, reference, "after the refused step")
        model.close()
        assert not optimizer._optimizer_step_pre_hooks, "close() takes the refusal off the user's optimizer"
        optimizer.step()  # the user's once more
    return each_schedule_on_rank(rank, world_size, run)


def test_stepping_the_optimizer_given_to_wrap_raises_while_wrapped():
    assert_no_failures(run_workers(original_optimizer_worker, 2))
