"""Simulation profiles of published models, for predicting schedules at 8–128
workers (benchmarks/at_scale.py): a list of dearcomm.ModuleProfile per model,
in forward order, with the optimizer step's time.

Sources (the figures dearcomm.pipeline ships, docs/pipeline.md):

- parameters: dearcomm.pipeline.param_tensors, the per-tensor element counts of each model
  in forward order; every tensor is one simulated parameter (fp32);
- per-layer times: dearcomm.pipeline.layer_records where the model has a per-layer
  profile (ResNet-50 and VGG-16: PipeDream's profiler, batch ≈ 128, GPU not
  stated; BERT-large: DAPPLE's, V100, 6 sequences per GPU). Each profiled
  layer with parameters takes the next tensors in order until their bytes add
  up to the layer's; if that fails, the layers' times are spread over the
  tensors by byte position instead (distribute_by_bytes) and `how` says so.
  Layers without parameters stay as modules of their own (their compute
  counts); PipeDream's "Input" node (loading the batch: 18–19 ms) is left out,
  as a tuned job loads the next batch while the GPU computes;
- BERT-base and GPT-2 have no per-layer profile: their times are derived
  (derived_transformer) from DAPPLE's BERT-large, at the same batch.

Every assumption a profile rests on is in its `assumptions`, which
at_scale.py prints beside the results.

    from benchmarks.scale_profiles import build, MODELS
    p = build("bert-large")
    dearcomm.simulate(list(p.modules), world_size=64, network=dearcomm.network_preset("10gbe"), step_ms=p.step_ms)
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

from dearcomm import ModuleProfile
from dearcomm.pipeline import layer_records, param_tensors

FP32_BYTES = 4

ADAM_BYTES_PER_PARAM = 28
"""Memory traffic of one fp32 Adam step per parameter: it reads the
parameter, its gradient and both moments and writes the parameter and both
moments, 7 × 4 bytes. The step is memory-bound, so its time is these bytes
over the memory bandwidth."""

STEP_MEMORY_GB_S = 800.0
"""Memory bandwidth the optimizer step reaches, GB/s: a V100's HBM2 peaks at
900 GB/s; a fused element-wise kernel reaches about 90% of it. (The DeAR
reference code steps with SGD, which moves fewer bytes; Adam is the common
case for the transformers here.)"""

REFERENCE_TRANSFORMER = "dapple/bert-24-pbs-6"
"""The per-layer profile whose encoder layers give the derived models' time
per parameter: DAPPLE's BERT-large on a V100, 6 sequences per GPU."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    label: str
    param_key: str
    """The model's name for dearcomm.pipeline.param_tensors."""
    layer_key: Optional[str]
    """Its per-layer profile (dearcomm.pipeline.layer_records); None: derived from REFERENCE_TRANSFORMER."""


MODELS: Dict[str, ModelSpec] = {
    "resnet50": ModelSpec("ResNet-50", "resnet50", "pipedream/resnet50"),
    "vgg16": ModelSpec("VGG-16", "vgg16", "pipedream/vgg16"),
    "bert-base": ModelSpec("BERT-base", "bert-base", None),
    "bert-large": ModelSpec("BERT-large", "bert-large", "dapple/bert-24-pbs-6"),
    "gpt2-small": ModelSpec("GPT-2 small", "gpt2-small", None),
    "gpt2-medium": ModelSpec("GPT-2 medium", "gpt2-medium", None),
    "gpt2-large": ModelSpec("GPT-2 large", "gpt2-large", None),
}


@dataclasses.dataclass(frozen=True)
class ScaleProfile:
    """One model, ready for dearcomm.simulate(list(modules), step_ms=step_ms, ...)."""
    name: str
    modules: Tuple[ModuleProfile, ...]
    step_ms: float
    """The optimizer over the whole model on one rank (see ADAM_BYTES_PER_PARAM)."""
    how: str
    """One line: where the sizes and times come from and how they were joined."""
    assumptions: Tuple[str, ...]

    @property
    def numel(self) -> int:
        return sum(sum(m.param_numels) for m in self.modules)

    @property
    def num_tensors(self) -> int:
        return sum(len(m.param_numels) for m in self.modules)

    @property
    def forward_ms(self) -> float:
        return sum(m.forward_ms for m in self.modules)

    @property
    def backward_ms(self) -> float:
        return sum(m.backward_ms for m in self.modules)


def step_ms(numel: int) -> float:
    """The fp32 Adam step over `numel` parameters on one rank, memory-bound."""
    return numel * ADAM_BYTES_PER_PARAM / (STEP_MEMORY_GB_S * 1e9) * 1e3


STEP_ASSUMPTION = (f"step: fp32 Adam, {ADAM_BYTES_PER_PARAM} bytes of memory traffic per parameter at "
                   f"{STEP_MEMORY_GB_S:.0f} GB/s (V100 HBM2, ~90% of peak); a sharded update steps 1/p of it")


# ---- reading the shared files ---------------------------------------------------------

def load_tensors(spec: ModelSpec) -> List[Tuple[str, int]]:
    """(name, elements) of every parameter tensor of the model, in forward
    order (the figures dearcomm.pipeline ships)."""
    return param_tensors(spec.param_key)


def load_layers(key: str) -> List[Dict]:
    """The per-layer entries (id, op, fwd_ms, bwd_ms, param_bytes, ...) of one
    model, in topological order (the figures dearcomm.pipeline ships)."""
    return layer_records(key)


# ---- joining layers and tensors -------------------------------------------------------

def match_in_order(layers: Sequence[Dict], numels: Sequence[int]) -> Optional[List[ModuleProfile]]:
    """One module per layer, each taking the next tensors in order until
    their fp32 bytes equal the layer's parameter bytes; None if some layer's
    bytes are not a run of whole tensors or tensors are left over."""
    modules, i = [], 0
    for layer in layers:
        want, taken = int(round(layer["param_bytes"])), []
        while want > 0 and i < len(numels):
            taken.append(int(numels[i]))
            want -= FP32_BYTES * int(numels[i])
            i += 1
        if want != 0:
            return None
        modules.append(ModuleProfile(str(layer.get("op", layer["id"]))[:40], float(layer["fwd_ms"]),
                                     float(layer["bwd_ms"]), taken))
    return modules if i == len(numels) else None


def distribute_by_bytes(layers: Sequence[Dict], numels: Sequence[int]) -> List[ModuleProfile]:
    """One module per tensor; each layer's forward and backward time is spread
    over the tensors its parameter bytes overlap, by byte position (both
    sequences laid end to end, the layers' bytes scaled to the tensors'
    total), in proportion to the overlap. A layer without parameters gives its
    time to the tensor at its position. The total times are kept."""
    total_t = FP32_BYTES * sum(numels)
    total_l = sum(float(l["param_bytes"]) for l in layers)
    if total_t <= 0 or total_l <= 0:
        raise ValueError(f"dearcomm: cannot spread times by bytes: tensors hold {total_t} bytes, layers {total_l}")
    scale = total_t / total_l
    ends, acc = [], 0
    for n in numels:
        acc += FP32_BYTES * n
        ends.append(acc)
    fwd, bwd = [0.0] * len(numels), [0.0] * len(numels)
    pos = 0.0
    for layer in layers:
        begin, end = pos, pos + float(layer["param_bytes"]) * scale
        pos = end
        if end <= begin:  # no parameters: the tensor at this position
            k = next((j for j, e in enumerate(ends) if e > begin), len(numels) - 1)
            fwd[k] += float(layer["fwd_ms"])
            bwd[k] += float(layer["bwd_ms"])
            continue
        start = 0.0
        for j, e in enumerate(ends):
            overlap = min(end, e) - max(begin, start)
            if overlap > 0:
                share = overlap / (end - begin)
                fwd[j] += float(layer["fwd_ms"]) * share
                bwd[j] += float(layer["bwd_ms"]) * share
            start = e
    return [ModuleProfile(f"t{j}", fwd[j], bwd[j], [int(n)]) for j, n in enumerate(numels)]


# ---- derived transformer profiles -----------------------------------------------------

_BLOCK = re.compile(r"^(encoder\.layer\.\d+|h\.\d+)\.")


def _module_of(name: str) -> str:
    """The module a transformer tensor belongs to: its block (encoder.layer.i,
    h.i), else its first name component, GPT-2's wte and wpe as embeddings."""
    m = _BLOCK.match(name)
    if m:
        return m.group(1)
    head = name.split(".")[0]
    return "embeddings" if head in ("wte", "wpe") else head


def reference_rates() -> Dict[str, float]:
    """From REFERENCE_TRANSFORMER: forward and backward ms per parameter of an
    encoder layer, and its embeddings layer's times."""
    layers = load_layers(REFERENCE_TRANSFORMER)
    blocks = [l for l in layers if str(l["op"]).startswith("layer_")]
    numel = sum(l["param_bytes"] for l in blocks) / FP32_BYTES
    embed = next(l for l in layers if l["op"] == "embeddings")
    return dict(fwd_ms_per_param=sum(l["fwd_ms"] for l in blocks) / numel,
                bwd_ms_per_param=sum(l["bwd_ms"] for l in blocks) / numel,
                embed_fwd_ms=float(embed["fwd_ms"]), embed_bwd_ms=float(embed["bwd_ms"]))


def derived_transformer(tensors: Sequence[Tuple[str, int]], tied_head: bool) -> Tuple[List[ModuleProfile], List[str]]:
    """Modules of a transformer without a per-layer profile, and the
    assumptions made. Block time = its parameters × the reference's encoder
    time per parameter (a block's matmul work per token is proportional to its
    parameters; same tokens per batch as the reference); the embeddings take
    the reference's embedding time; the pooler or final LayerNorm takes 0 ms
    (as DAPPLE's pooler); a tied LM head (GPT-2) is a module of its own at the
    end of the forward, with the time of a matmul over the embedding table's
    parameters and no parameters of its own (the table belongs to the
    embeddings, its first reader, whose gradient is complete only at the end
    of backward)."""
    r = reference_rates()
    groups: Dict[str, List[int]] = {}
    for name, n in tensors:
        groups.setdefault(_module_of(name), []).append(int(n))
    modules = []
    for name, numels in groups.items():
        if _BLOCK.match(name + "."):
            f, b = sum(numels) * r["fwd_ms_per_param"], sum(numels) * r["bwd_ms_per_param"]
        elif name == "embeddings":
            f, b = r["embed_fwd_ms"], r["embed_bwd_ms"]
        else:
            f = b = 0.0
        modules.append(ModuleProfile(name, f, b, numels))
    assumptions = [
        f"derived from {REFERENCE_TRANSFORMER} (V100, 6 sequences per GPU): a block's forward/backward = its "
        f"parameters x {r['fwd_ms_per_param'] * 1e6:.3f} / {r['bwd_ms_per_param'] * 1e6:.3f} ms per million "
        f"parameters (BERT-large's encoder layers; backward/forward = "
        f"{r['bwd_ms_per_param'] / r['fwd_ms_per_param']:.2f}), same batch; embeddings "
        f"{r['embed_fwd_ms']:.3f}/{r['embed_bwd_ms']:.3f} ms as profiled; pooler / final LayerNorm 0 ms"]
    if tied_head:
        wte = dict(tensors)["wte"]
        modules.append(ModuleProfile("lm_head (tied to wte)", wte * r["fwd_ms_per_param"],
                                     wte * r["bwd_ms_per_param"], []))
        assumptions.append("LM head tied to wte: a parameterless module at the end of the forward, timed as "
                           "a block of wte's size; wte's gradient is ready when the embeddings' backward ends")
    return modules, assumptions


# ---- the entry point -------------------------------------------------------------------

def build(model: str) -> ScaleProfile:
    """The simulation profile of `model` (a key of MODELS)."""
    if model not in MODELS:
        raise ValueError(f"dearcomm: unknown model {model!r}; expected one of {sorted(MODELS)}")
    spec = MODELS[model]
    tensors = load_tensors(spec)
    numels = [n for _, n in tensors]
    if spec.layer_key is None:
        modules, assumptions = derived_transformer(tensors, tied_head=model.startswith("gpt2"))
        how = f"{len(numels)} parameter tensors; times derived from {REFERENCE_TRANSFORMER}"
    else:
        layers = [l for l in load_layers(spec.layer_key) if l.get("op") != "Input"]
        matched = match_in_order(layers, numels)
        if matched is not None:
            modules = matched
            how = (f"{len(numels)} parameter tensors matched exactly, in order, to the "
                   f"{sum(1 for l in layers if l['param_bytes'] > 0)} parameter layers of {spec.layer_key}")
        else:
            modules = distribute_by_bytes(layers, numels)
            how = (f"{len(numels)} parameter tensors could not be matched to the layers of "
                   f"{spec.layer_key}: each layer's time spread over the tensors by bytes")
        assumptions = [f"{spec.layer_key}: per-layer times as profiled"
                       + ("; the Input node (batch loading) left out" if spec.layer_key.startswith("pipedream")
                          else "")]
    numel = sum(numels)
    return ScaleProfile(spec.label, tuple(modules), step_ms(numel), how, tuple(assumptions) + (STEP_ASSUMPTION,))
