"""Update strategies on their own: no processes. The Python registry against
the C++ one, and the element mapping that must not assume one bucket per
parameter (Layout v2 lets a parameter span buckets; SpanningLayout below
stands in for such a layout until the planner makes them)."""
from dataclasses import dataclass
from typing import List

import pytest
import torch

from dearcomm import _C
from dearcomm._runtime import buckets_of, completion_of
from dearcomm._update import STRATEGIES, UpdateStrategy, strategy_class
from dearcomm._update.sharded_state import assemble_params


def registered_strategies():
    """(strategy, schedule, update) for every pair the C++ registry reports."""
    return [(strategy, entry["name"], update)
            for entry in _C.schedules() for update, strategy in entry["updates"].items()]


def test_python_registry_covers_exactly_the_cpp_strategies():
    missing = {name: f"schedule={schedule!r} update={update!r}"
               for name, schedule, update in registered_strategies() if name not in STRATEGIES}
    assert not missing, f"C++ update strategies without a Python object in dearcomm._update: {missing}"
    assert set(STRATEGIES) == {name for name, _, _ in registered_strategies()}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_is_complete_and_registered_under_its_name(name):
    cls = strategy_class(name)
    assert issubclass(cls, UpdateStrategy) and cls.name == name
    model = torch.nn.Linear(2, 2)
    cls(torch.optim.SGD(model.parameters(), lr=0.1), runtime=None)  # no abstract method left
    assert cls.checks_grad_versions == (not cls.averaged_in_grad)  # true of today's strategies


def test_strategy_without_python_object_is_named_in_the_error():
    with pytest.raises(NotImplementedError, match="update strategy 'delayed_by_one'.*dearcomm/_update"):
        strategy_class("delayed_by_one")


# ---- a layout where parameters span buckets -------------------------------------------------


@dataclass
class Slot:
    bucket: int
    offset: int
    numel: int
    last_bucket: int


@dataclass
class Spec:
    first_param: int
    num_params: int
    numel: int
    padded_numel: int


@dataclass
class LayoutPiece:
    param: int
    param_offset: int
    numel: int
    bucket_offset: int


class SpanningLayout:
    """Parameters packed back to back into buckets of ``capacity`` elements,
    each bucket padded to a multiple of ``world_size``: a parameter continues
    in the next bucket where one fills up (Layout v2's fields and pieces())."""

    def __init__(self, numels: List[int], capacity: int, world_size: int) -> None:
        starts = [sum(numels[:i]) for i in range(len(numels))]
        total = sum(numels)
        self.params = [Slot(s // capacity, s % capacity, n, (s + n - 1) // capacity) for s, n in zip(starts, numels)]
        self.buckets = []
        for b in range((total + capacity - 1) // capacity):
            overlapping = [i for i, s in enumerate(self.params) if s.bucket <= b <= s.last_bucket]
            numel = min(capacity, total - b * capacity)
            padded = (numel + world_size - 1) // world_size * world_size
            self.buckets.append(Spec(overlapping[0], len(overlapping), numel, padded))
        self._starts, self._capacity = starts, capacity

    def pieces(self, bucket: int, begin: int, end: int) -> List[LayoutPiece]:
        spec, base = self.buckets[bucket], bucket * self._capacity
        result = []
        for p in range(spec.first_param, spec.first_param + spec.num_params):
            lo = max(base + begin, self._starts[p])
            hi = min(base + end, self._starts[p] + self.params[p].numel)
            if lo < hi:
                result.append(LayoutPiece(p, lo - self._starts[p], hi - lo, lo - base))
        return result


def buckets_from_stream(values: List[torch.Tensor], layout: SpanningLayout, capacity: int) -> List[torch.Tensor]:
    """The buckets' contents, cut from the parameters' concatenation (not through pieces())."""
    stream = torch.cat([v.reshape(-1) for v in values])
    out = []
    for b, spec in enumerate(layout.buckets):
        bucket = torch.full((spec.padded_numel,), float("nan"))  # padding must never be read
        bucket[:spec.numel] = stream[b * capacity:b * capacity + spec.numel]
        out.append(bucket)
    return out


def test_spanning_layout_spans():
    layout = SpanningLayout([5, 10, 3], capacity=8, world_size=3)
    assert [(s.bucket, s.offset, s.last_bucket) for s in layout.params] == [(0, 0, 0), (0, 5, 1), (1, 7, 2)]
    assert [(b.first_param, b.num_params) for b in layout.buckets] == [(0, 2), (1, 2), (2, 1)]


@pytest.mark.parametrize("numels, capacity", [
    ([5, 10, 3], 8),             # the middle parameter spans two buckets, the last two
    ([17 * 257, 17, 7 * 15, 1], 100),  # one parameter over 44 buckets
    ([3], 1),                    # a bucket per element
    ([4, 4], 4),                 # parameters ending exactly at bucket ends
])
def test_consolidation_assembles_each_parameter_from_every_bucket(numels, capacity):
    layout = SpanningLayout(numels, capacity, world_size=3)
    expected = [torch.randn(n) for n in numels]
    flats = {}
    for b, values in enumerate(buckets_from_stream(expected, layout, capacity)):
        assemble_params(layout, b, values, flats)
    assert sorted(flats) == list(range(len(numels)))
    for i, value in enumerate(expected):
        assert torch.equal(flats[i], value)


def test_consolidation_assembles_from_a_planned_layout():
    numels = [17 * 257, 17, 7 * 15, 1]
    layout = _C.plan_buckets(numels, [torch.float32] * len(numels), 1000, 3)
    expected = [torch.randn(n) for n in numels]
    flats = {}
    for b, spec in enumerate(layout.buckets):
        values = torch.full((spec.padded_numel,), float("nan"))
        for i in range(spec.first_param, spec.first_param + spec.num_params):
            slot = layout.params[i]
            values[slot.offset:slot.offset + slot.numel] = expected[i]
        assemble_params(layout, b, values, flats)
    assert all(torch.equal(flats[i], value) for i, value in enumerate(expected))


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 0, 2], [1, 2, 0]])
def test_update_hooks_name_each_parameter_once_with_the_last_of_its_buckets(order):
    layout = SpanningLayout([5, 10, 3], capacity=8, world_size=2)
    unreported, reported, completion = list(range(len(layout.buckets))), [], completion_of(layout)
    for bucket in order:
        unreported.remove(bucket)
        for i in completion.done(bucket):
            assert bucket in buckets_of(layout.params[i])
            assert not set(buckets_of(layout.params[i])) & set(unreported)
            reported.append(i)
    assert sorted(reported) == [0, 1, 2]


# ---- which optimizers may be sharded ---------------------------------------------------

def optimizer_choice_worker(rank, world_size):
    """Adafactor (factored second moment) is not element-wise: wrap() trains
    it with the replicated update by default, equal to one process on the
    global batch, and refuses update="sharded" by name; a class registered as
    element-wise keeps the sharded default."""
    import copy

    import dearcomm
    from tests.models import MixedNet, batches, step_on_global_batch, step_on_slice

    torch.manual_seed(0)
    model = MixedNet()
    reference = copy.deepcopy(model)
    make = lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01)  # noqa: E731
    try:
        dearcomm.wrap(copy.deepcopy(model), make(model), update="sharded")
        refused = None
    except ValueError as e:
        refused = str(e)
    model, optimizer = dearcomm.wrap(model, make(model))
    ref_opt = make(reference)
    for x, y in batches(4, 12):
        step_on_slice(model, optimizer, x, y, rank, world_size)
        step_on_global_batch(reference, ref_opt, x, y)
    model.sync()
    difference = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))

    @dearcomm.register_elementwise_optimizer
    class Sign(torch.optim.Optimizer):  # signSGD: element-wise
        def __init__(self, params, lr=0.01):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.sub_(group["lr"] * p.grad.sign())

    other = MixedNet()
    other, _ = dearcomm.wrap(other, Sign(other.parameters()))
    return refused, model._dear.options.update, difference, other._dear.options.update


def test_only_element_wise_optimizers_are_sharded():
    from tests.multiprocess import run_workers
    for rank, (refused, update, difference, registered) in enumerate(run_workers(optimizer_choice_worker, 2)):
        assert refused is not None and "Adafactor is not known to be one" in refused, refused
        assert "update='replicated'" in refused and "register_elementwise_optimizer(Adafactor)" in refused, refused
        assert update == "replicated", f"rank {rank}: Adafactor trained with update={update!r}"
        assert difference < 1e-5, f"rank {rank}: Adafactor differs from one process by {difference:.2e}"
        assert registered == "sharded", f"rank {rank}: a registered element-wise optimizer got {registered!r}"
