"""Published per-layer profiles and per-tensor parameter sizes, shipped in
the package (dearcomm/pipeline/data/, described in its README.md) and read
by name with importlib.resources, so planning works from any checkout or
install.

A user's own file of layer profiles is named by the `path` argument or the
DEARCOMM_PROFILES environment variable (the argument wins). It may use the
packaged format (a "columns" list, one row per layer, edges by layer index)
or one object per layer with the keys id, fwd_ms, bwd_ms, act_bytes and
param_bytes (edges by id); see docs/pipeline.md, "Profiles".
"""
from __future__ import annotations

import json
import os
from importlib import resources
from typing import Dict, List, Optional, Tuple

from .profile import LayerProfile, ModelProfile, from_graph

PROFILES_ENV = "DEARCOMM_PROFILES"
LAYER_FILE, TENSOR_FILE = "layer_profiles.json", "param_tensors.json"
_COLUMNS = ("id", "op", "forward_ms", "backward_ms", "activation_bytes", "param_bytes")
_OBJECT_KEYS = ("id", "fwd_ms", "bwd_ms", "act_bytes", "param_bytes")  # LayerProfile's fields, in its order


def _read(path: Optional[str], packaged: str) -> Tuple[Dict, str]:
    """(the parsed file, what to call it in errors): `path`, else
    $DEARCOMM_PROFILES for layer profiles, else the packaged file."""
    if path is None and packaged == LAYER_FILE:
        path = os.environ.get(PROFILES_ENV) or None
    if path is None:
        with resources.files(__package__).joinpath("data", packaged).open("r") as f:
            return json.load(f), f"the packaged {packaged}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dearcomm: no profile file {path!r}"
                                + (f" (from ${PROFILES_ENV})" if path == os.environ.get(PROFILES_ENV) else ""))
    with open(path) as f:
        try:
            return json.load(f), path
        except ValueError as e:  # JSONDecodeError, or an int past the digits Python converts
            raise ValueError(f"dearcomm: profile file {path!r} is not valid JSON (or holds a number Python does "
                             f"not read): {e}") from e


def _models(data: Dict, where: str) -> Dict:
    # The packaged format nests the models; a user's file may be the models themselves.
    models = data.get("models", data) if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise ValueError(f"dearcomm: {where} must hold a JSON object of models, got {type(data).__name__}")
    return models


def shared_profile_names(path: Optional[str] = None) -> List[str]:
    """The models a layer-profile file holds (default: the packaged one)."""
    data, where = _read(path, LAYER_FILE)
    return sorted(k for k, v in _models(data, where).items() if isinstance(v, dict) and "layers" in v)


def layer_records(name: str, path: Optional[str] = None) -> List[Dict]:
    """One model's layers as dicts with the keys id, op, fwd_ms, bwd_ms,
    act_bytes and param_bytes (ms per micro-batch, bytes), in topological order."""
    return [dict(r) for r in _entry(name, path)[0]]


def load_shared_profile(name: str, path: Optional[str] = None) -> ModelProfile:
    """One model's ModelProfile, e.g. 'pipedream/vgg16' (shared_profile_names()
    lists them); cuts carry every output a later layer reads."""
    records, edges, where = _entry(name, path)
    layers = [_layer(r, where) for r in records]
    return from_graph(name, layers, edges)


def param_tensors(model: str) -> List[Tuple[str, int]]:
    """(name, elements) of every parameter tensor of a packaged model
    ('bert-large', 'gpt2-small', 'resnet50', ...), in forward order."""
    data, where = _read(None, TENSOR_FILE)
    models = data["models"]
    if model not in models:
        raise ValueError(f"dearcomm: no model {model!r} in {where}; expected one of {sorted(models)}")
    return [(str(n), int(k)) for n, k in models[model]["tensors"]]


def param_tensor_models() -> Dict[str, str]:
    """{model: how its sizes were obtained} of the packaged parameter tensors."""
    data, _ = _read(None, TENSOR_FILE)
    return {k: v["description"] for k, v in data["models"].items()}


def _entry(name: str, path: Optional[str]) -> Tuple[List[Dict], List[Tuple[str, str]], str]:
    """A model's layer records (dicts keyed as in _OBJECT_KEYS, plus op),
    its edges as (source id, destination id), and where it came from."""
    data, file_where = _read(path, LAYER_FILE)
    models = _models(data, file_where)
    where = f"profile {name!r} in {file_where}"
    if name not in models:
        raise ValueError(f"dearcomm: no profile {name!r} in {file_where}; expected one of "
                         f"{sorted(k for k in models if isinstance(models[k], dict))}")
    entry = models[name]
    if not isinstance(entry, dict) or not isinstance(entry.get("layers"), list):
        raise ValueError(f"dearcomm: {where}: expected an object with a list of layers")
    columns = data.get("columns") if isinstance(data, dict) else None
    edges = entry.get("edges", [])
    if not isinstance(edges, list):
        raise ValueError(f"dearcomm: {where}: edges must be a list of [source, destination] pairs, got {edges!r:.40}")
    if columns is None:  # one object per layer, edges by id
        for i, layer in enumerate(entry["layers"]):
            if not isinstance(layer, dict):
                raise ValueError(f"dearcomm: {where}: layer {i} must be an object with the keys "
                                 f"{', '.join(_OBJECT_KEYS)}, got {layer!r:.60}")
        ids = [layer.get("id") for layer in entry["layers"]]
        return entry["layers"], _edges(edges, ids, {i: k for k, i in enumerate(ids)}, "ids", where), where
    if not isinstance(columns, list) or tuple(columns) != _COLUMNS:
        raise ValueError(f"dearcomm: {file_where}: columns must be {list(_COLUMNS)}, got {columns}")
    records = []
    for i, row in enumerate(entry["layers"]):
        if not isinstance(row, list) or len(row) != len(_COLUMNS):
            raise ValueError(f"dearcomm: {where}: layer row {i} must list {len(_COLUMNS)} values "
                             f"({', '.join(_COLUMNS)}), got {row!r:.80}")
        records.append(dict(zip(("id", "op") + _OBJECT_KEYS[1:], row)))
    ids = [r["id"] for r in records]
    _unique(ids, where)  # the edges name layers by index, but the profile joins them by id
    for e in edges:  # indices are ints (1.0 would pass as a key of the positions, then fail as a list index)
        if isinstance(e, list) and any(not isinstance(x, int) or isinstance(x, bool) for x in e):
            raise ValueError(f"dearcomm: {where}: edge {e!r:.40} must be two layer indices of this profile (ints)")
    by_index = {i: i for i in range(len(ids))}
    return records, [(ids[a], ids[b]) for a, b in _edges(edges, list(range(len(ids))), by_index, "indices", where)], where


def _edges(edges: List, ids: List, position: Dict, named_by: str, where: str) -> List[Tuple]:
    """The edges, checked: pairs of known layer ids (or indices), each from an
    earlier layer to a later one, the ids unique."""
    _unique(ids, where)
    out = []
    for e in edges:
        if not (isinstance(e, list) and len(e) == 2 and all(not isinstance(x, (bool, list, dict)) and x in position
                                                            for x in e)):
            raise ValueError(f"dearcomm: {where}: edge {e!r:.40} must be two layer {named_by} of this profile")
        if position[e[0]] >= position[e[1]]:
            raise ValueError(f"dearcomm: {where}: edge {e!r:.40} runs from a layer to an earlier one (or itself); "
                             "layers are in topological order, so every edge runs forward")
        out.append(tuple(e))
    return out


def _unique(ids: List, where: str) -> None:
    """Layer ids are unique: a repeated id would take another layer's edges
    (and so the cut sizes of other layers' outputs)."""
    seen = set()
    for i, layer_id in enumerate(ids):
        if not isinstance(layer_id, (str, int)) or isinstance(layer_id, bool):
            continue  # _layer names what is wrong with it
        if layer_id in seen:
            raise ValueError(f"dearcomm: {where}: layer id {layer_id!r} appears twice (layer {i}); ids must be unique")
        seen.add(layer_id)


def _layer(entry: Dict, where: str) -> LayerProfile:
    """One layer record; its errors say which file and model."""
    missing = [k for k in _OBJECT_KEYS if k not in entry]
    if missing:
        raise ValueError(f"dearcomm: {where}: layer {entry.get('id', '?')!r} lacks {missing}; "
                         f"expected keys {_OBJECT_KEYS}")
    try:
        return LayerProfile(*(entry[k] for k in _OBJECT_KEYS))
    except (TypeError, ValueError) as e:  # a value LayerProfile refuses: NaN, null, "12", ...
        raise type(e)(f"dearcomm: {where}: {str(e).removeprefix('dearcomm: ')}") from e
