"""Per-layer costs of a model: what the planner, the baselines and the
simulator all read. Times are milliseconds for ONE micro-batch, sizes are bytes.

A profile is a chain of layers (topological order). `cut_bytes[i]` is what
crosses the boundary after layer i when the model is split there: the outputs
of every layer at or before i that a layer after i consumes (skip connections
included), and the same number of gradient bytes flow back.

Published profiles ship with the package: profile_data.load_shared_profile.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import validate


@dataclass(frozen=True)
class LayerProfile:
    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: float  # this layer's output, per micro-batch
    param_bytes: float

    def __post_init__(self) -> None:
        where = f"layer {self.name!r}"
        for field in ("forward_ms", "backward_ms"):
            validate.finite_nonnegative(getattr(self, field), field, where, kind="cost")
        for field in ("activation_bytes", "param_bytes"):
            validate.finite_nonnegative(getattr(self, field), field, where, kind="size")


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: Tuple[LayerProfile, ...]
    cut_bytes: Tuple[float, ...]  # len(layers) - 1 entries, see the module docstring

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        validate.sequence(self.layers, "layers", where)
        validate.sequence(self.cut_bytes, "cut_bytes", where)
        if not self.layers:
            raise ValueError(f"dearcomm: profile {self.name!r} has no layers; expected at least one")
        if len(self.cut_bytes) != len(self.layers) - 1:
            raise ValueError(f"dearcomm: profile {self.name!r}: expected {len(self.layers) - 1} cut sizes "
                             f"(one per boundary between layers), got {len(self.cut_bytes)}")
        for i, layer in enumerate(self.layers):  # its numbers were checked when it was made
            validate.instance(layer, LayerProfile, f"layers[{i}]", where)
        for i, nbytes in enumerate(self.cut_bytes):
            validate.finite_nonnegative(nbytes, f"cut_bytes[{i}]", where, kind="size")
        # Stages add their layers up: finite layers whose sum overflows would be an infinite stage.
        validate.finite_sum([l.forward_ms + l.backward_ms for l in self.layers],
                            "the layers' forward_ms + backward_ms", where)
        validate.finite_sum([l.param_bytes for l in self.layers], "the layers' param_bytes", where)

    def __len__(self) -> int:
        return len(self.layers)

    # Stage costs: layers [a, b).
    def forward_ms(self, a: int, b: int) -> float:
        return sum(l.forward_ms for l in self.layers[a:b])

    def backward_ms(self, a: int, b: int) -> float:
        return sum(l.backward_ms for l in self.layers[a:b])

    def param_bytes(self, a: int, b: int) -> float:
        return sum(l.param_bytes for l in self.layers[a:b])

    def boundary_bytes(self, b: int) -> float:
        """Bytes that cross a split before layer b (0 < b < len)."""
        return self.cut_bytes[b - 1]

    def total_ms(self) -> float:
        return sum(l.forward_ms + l.backward_ms for l in self.layers)


def chain(name: str, layers: Sequence[LayerProfile]) -> ModelProfile:
    """A profile whose layers feed only their successor."""
    validate.sequence(layers, "layers", f"chain({name!r})")
    return ModelProfile(name, tuple(layers), tuple(l.activation_bytes for l in layers[:-1]))


def from_graph(name: str, layers: Sequence[LayerProfile], edges: Sequence[Tuple[str, str]]) -> ModelProfile:
    """A profile of a layer graph in topological order: a split carries every
    output that some later layer reads. Edges naming layers that are not in
    `layers` are ignored; a boundary that no known edge crosses falls back to
    the chain assumption (the last layer's output)."""
    index = {l.name: i for i, l in enumerate(layers)}
    last_reader: Dict[int, int] = {}
    for src, dst in edges:
        if src in index and dst in index and index[dst] > index[src]:
            last_reader[index[src]] = max(last_reader.get(index[src], -1), index[dst])
    cuts = []
    for b in range(1, len(layers)):
        live = [i for i, reader in last_reader.items() if i < b <= reader]
        cuts.append(sum(layers[i].activation_bytes for i in live) if live else layers[b - 1].activation_bytes)
    return ModelProfile(name, tuple(layers), tuple(cuts))


def coarsen(profile: ModelProfile, max_layers: int) -> ModelProfile:
    """Merges neighbouring layers into at most `max_layers` blocks of similar
    compute, so that planning stays fast on 100-400-layer graphs. Among the
    cut points near each equal-time mark, the one with the fewest bytes wins
    (planners only split at block boundaries, so cheap cuts must survive).
    A block's activation_bytes is the sum of its layers' outputs: a stage
    stashes every layer's output (memory.stash_bytes), not only the last;
    the cuts between blocks keep their own sizes."""
    validate.instance(profile, ModelProfile, "profile", "coarsen()")
    validate.positive_int(max_layers, "max_layers", "coarsen()")
    n = len(profile)
    if n <= max_layers:
        return profile
    total = profile.total_ms() or float(n)
    prefix = [0.0]
    for l in profile.layers:
        prefix.append(prefix[-1] + ((l.forward_ms + l.backward_ms) if profile.total_ms() else 1.0))
    cuts, start = [], 0
    for k in range(1, max_layers):
        target = total * k / max_layers
        # Candidate cuts b (split before layer b) whose prefix time is near the mark.
        window = [b for b in range(start + 1, n) if abs(prefix[b] - target) <= 0.5 * total / max_layers]
        if not window:
            window = [min(range(start + 1, n), key=lambda b: abs(prefix[b] - target))] if start + 1 < n else []
        if not window:
            break
        b = min(window, key=lambda b: (profile.boundary_bytes(b), abs(prefix[b] - target), b))
        if b > start and b not in cuts:
            cuts.append(b)
            start = b
    bounds = [0] + cuts + [n]
    layers, cut_bytes = [], []
    for a, b in zip(bounds, bounds[1:]):
        group = profile.layers[a:b]
        name = group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}"
        layers.append(LayerProfile(name, profile.forward_ms(a, b), profile.backward_ms(a, b),
                                   sum(l.activation_bytes for l in group), profile.param_bytes(a, b)))
        if b < n:
            cut_bytes.append(profile.boundary_bytes(b))
    return ModelProfile(profile.name, tuple(layers), tuple(cut_bytes))


def sequential_children(model, where: str) -> list:
    """The children of an nn.Sequential, in the order its forward chains them.
    Any other module is refused: its forward may do more than chain its
    children (a residual, a position embedding, a pooling), so the chain of
    its children would be profiled and trained as another network."""
    from torch import nn

    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        raise TypeError(f"dearcomm: {where} takes an nn.Sequential whose forward only chains its children; got "
                        f"{type(model).__name__}, whose forward may do more (a residual, an embedding added, a "
                        "pooling), so its children run one after the other would be another network. Build "
                        "the model as an nn.Sequential of blocks, each holding such a step whole (a residual "
                        "block as one child)")
    children = list(model)  # as forward runs them: children() would drop a module listed twice
    if not children:
        raise ValueError(f"dearcomm: {where} got an nn.Sequential without children; nothing to split")
    seen = {}
    for i, child in enumerate(children):
        if id(child) in seen:
            raise ValueError(f"dearcomm: {where}: the nn.Sequential runs one module ({type(child).__name__}) as layers "
                             f"{seen[id(child)]} and {i}; a layer's weights live on one stage, so each layer must be "
                             "a module of its own")
        seen[id(child)] = i
    return children


def first_input(x):
    """What a stage's (or a profiled layer's) first layer receives: a leaf
    that collects the input's gradient, passed on as a copy, so that a first
    layer writing its input in place (nn.ReLU(inplace=True)) writes the copy;
    autograd refuses in-place writes to a leaf that requires grad."""
    leaf = x.detach().requires_grad_(x.is_floating_point())
    return leaf, (leaf.clone() if leaf.requires_grad else leaf)


def profile_sequential(model, sample, target=None, loss_fn: Optional[Callable] = None,
                       repeats: int = 5, warmup: int = 2, name: str = "sequential",
                       clock: Callable[[], float] = time.perf_counter) -> ModelProfile:
    """Times every child of an nn.Sequential on CPU for one micro-batch
    `sample`: forward per child, backward per child (the gradient of its output
    fed back by hand), median of `repeats`. The last child's backward includes
    the loss when `loss_fn(output, target)` is given. clock=time.thread_time
    measures the work itself (CPU time), without the waits for a core that a
    busy machine adds to wall time; the simulator's shared-cores model wants that."""
    validate.positive_int(repeats, "repeats", "profile_sequential()")  # the median of none is an error
    validate.nonnegative_int(warmup, "warmup", "profile_sequential()")
    import statistics

    import torch

    children = sequential_children(model, "profile_sequential()")
    check_microbatch(sample, "profile_sequential()'s `sample`")
    fwd = [[] for _ in children]
    bwd = [[] for _ in children]
    acts: List[float] = [0.0] * len(children)
    # Profiling trains nothing: what its passes change (BatchNorm's running
    # statistics, gradients the caller holds) is put back afterwards.
    kept_state = copy.deepcopy(model.state_dict())
    kept_grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    for it in range(warmup + repeats):
        x = sample
        for i, child in enumerate(children):
            _, x_in = first_input(x)
            t0 = clock()
            out = child(x_in)
            t1 = clock()
            if it >= warmup:
                fwd[i].append((t1 - t0) * 1e3)
            acts[i] = float(out.numel() * out.element_size())
            if i == len(children) - 1 and loss_fn is not None:
                t0 = clock()
                loss_fn(out, target).backward()
            else:
                grad = torch.ones_like(out)
                t0 = clock()
                out.backward(grad)
            t1 = clock()
            if it >= warmup:
                bwd[i].append((t1 - t0) * 1e3)
            x = out.detach()
    model.load_state_dict(kept_state)
    for p, grad in kept_grads:
        p.grad = grad
    layers = [LayerProfile(f"{i}:{type(c).__name__}", statistics.median(f), statistics.median(b), a,
                           float(sum(p.numel() * p.element_size() for p in c.parameters())))
              for i, (c, f, b, a) in enumerate(zip(children, fwd, bwd, acts))]
    return chain(name, layers)


def check_microbatch(sample, what: str) -> None:
    """One micro-batch of inputs, as the profiler and the runtime take it: a
    tensor with at least one sample along dim 0."""
    import torch

    if not isinstance(sample, torch.Tensor) or sample.dim() == 0 or sample.shape[0] == 0:
        shape = getattr(sample, "shape", None)
        got = f"shape {tuple(shape)}" if shape is not None else type(sample).__name__
        raise ValueError(f"dearcomm: {what} is one micro-batch of inputs: a tensor with at least one sample along "
                         f"dim 0, got {got}")
