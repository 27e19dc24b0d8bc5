"""Optimizer checkpoints of the sharded update (sharded.py).

Each rank's optimizer state lives on *pieces*: the parts of parameters that
fall into this rank's shard of each bucket. Two forms:

- consolidated (``state_dict()``): torch's own format, full-size state per
  parameter, indexed as the user's optimizer indexes its parameters; loadable
  into a plain torch optimizer, and back at any world size. Per-element state
  (exp_avg, momentum_buffer, ...) is all-gathered bucket by bucket and each
  parameter is assembled from its pieces in every bucket; scalar state (Adam's
  step) is the same for every parameter, as every piece steps together, and
  is taken from whichever rank holds some.
- sharded (``sharded_state_dict()``): this rank's pieces only, no communication;
  loaded by the same rank at the same world size.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from .._torch_collectives import all_gather_single
from .base import hyperparameters


@dataclass
class Piece:
    bucket: int
    param: int          # index in the engine's (forward) order
    param_offset: int   # first element of the parameter that this piece holds
    bucket_offset: int  # where that element sits in the bucket
    master: torch.Tensor
    grad: torch.Tensor


def _is_per_element(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def assemble_params(layout, bucket: int, values: torch.Tensor, into: Dict[int, torch.Tensor]) -> None:
    """Copies each parameter's elements in ``bucket`` from ``values`` (the whole
    padded bucket) into ``into[param]``, a flat tensor of the parameter's size
    made on first sight. Called for every bucket, it rebuilds every parameter
    whether it lies in one bucket or spans several: elements are found only
    through ``layout.pieces``, never by assuming one bucket per parameter."""
    for piece in layout.pieces(bucket, 0, layout.buckets[bucket].padded_numel):
        flat = into.get(piece.param)
        if flat is None:
            flat = into[piece.param] = values.new_empty(layout.params[piece.param].numel)
        flat[piece.param_offset:piece.param_offset + piece.numel] = (
            values[piece.bucket_offset:piece.bucket_offset + piece.numel])


def consolidate(update) -> Dict[str, Any]:
    """``update``: the ShardedAtStep strategy."""
    runtime, inner = update.runtime, update.shard_optimizer
    group = runtime.group
    _every_rank_arrives(update, "optimizer.state_dict()")
    layout = runtime.engine.layout
    pieces: List[Piece] = update.pieces
    local = {piece.master: (inner.state.get(piece.master, {}) if inner is not None else {}) for piece in pieces}

    # Which keys exist is decided together: a rank may hold no piece at all.
    elem_keys, scalars = set(), {}
    for piece in pieces:
        for key, value in local[piece.master].items():
            if _is_per_element(value, piece.master.numel()):
                elem_keys.add((key, value.dtype))
            else:
                scalars.setdefault(key, value)
    everyone = [None] * runtime.world_size
    dist.all_gather_object(everyone, (sorted(elem_keys, key=str), {k: _to_cpu(v) for k, v in scalars.items()}),
                           group=group)
    elem_keys = sorted({k for keys, _ in everyone for k in keys}, key=str)
    scalars = {}
    for _, theirs in everyone:
        for key, value in theirs.items():
            scalars.setdefault(key, value)

    device = runtime.params[0].device
    full_state: Dict[int, Dict[str, Any]] = {}
    for key, dtype in elem_keys:
        flats: Dict[int, torch.Tensor] = {}
        for b, spec in enumerate(layout.buckets):
            shard = torch.zeros(spec.shard_numel, dtype=dtype, device=device)
            base = spec.shard_begin(runtime.rank)
            for piece in pieces:
                value = local[piece.master].get(key)
                if piece.bucket == b and value is not None:
                    start = piece.bucket_offset - base
                    shard[start:start + piece.master.numel()] = value.reshape(-1)
            full = torch.empty(spec.padded_numel, dtype=dtype, device=device)
            all_gather_single(full, shard, group=group)
            assemble_params(layout, b, full, flats)
        for i, flat in flats.items():
            full_state.setdefault(i, {})[key] = flat.view(runtime.params[i].shape)

    index = runtime.index  # parameter -> its engine (forward-order) index
    state, groups, next_index = {}, [], 0
    for g in update.param_groups:
        ids = []
        for param in g["params"]:
            i = index.get(param)
            if i is not None and i in full_state:
                state[next_index] = {**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                        for k, v in scalars.items()}, **full_state[i]}
            ids.append(next_index)
            next_index += 1
        groups.append({**hyperparameters(g), "params": ids})
    return {"state": state, "param_groups": groups}


# How long the ranks may arrive apart at a consolidated optimizer.state_dict()
# where wrap() got no timeout (the group's, 30 minutes on gloo, would hide a
# rank-0-only call that long).
ARRIVAL_SECONDS = 120.0

# Completed rendezvous per set of ranks, in this process: they name the
# store's keys, which outlive the optimizer that made them (a second wrap(),
# auto's change of update), so the count cannot be the optimizer's own.
_arrivals: Dict[str, int] = {}


def _every_rank_arrives(update, what: str) -> None:
    """The consolidated state is gathered from every rank. DDP scripts often
    call optimizer.state_dict() on rank 0 alone (DDP's is local), which here
    would wait in the gather for the whole collective timeout; a short
    rendezvous through the store turns that into an error that says so."""
    runtime = update.runtime
    store = dist.distributed_c10d._get_default_store()  # torch has no public accessor
    ranks = ",".join(map(str, dist.get_process_group_ranks(runtime.group)))
    key = f"dearcomm/arrivals/{ranks}/{_arrivals.get(ranks, 0) + 1}"
    store.add(key, 1)
    given = runtime.options.timeout  # wrap(timeout=): the user's own bound on how far apart ranks may be
    limit = given.total_seconds() if given is not None else min(ARRIVAL_SECONDS, runtime.timeout.total_seconds())
    deadline = time.monotonic() + limit
    while store.add(key, 0) < runtime.world_size:
        if time.monotonic() > deadline:
            arrived = store.add(key, -1) + 1  # not arrived after all: a later call on every rank uses this key again
            raise RuntimeError(
                f"dearcomm: [rank {runtime.rank}] {what} with update='sharded' gathers every rank's shard, but only "
                f"{arrived} of {runtime.world_size} ranks called it within {limit:.0f} s. Call it on every "
                "rank (then save on rank 0), or save optimizer.sharded_state_dict() on each rank. If every rank "
                "calls it and some arrive later than that (after a long rank-0-only evaluation), give "
                "wrap(timeout=) longer than the gap.")
        time.sleep(0.01)
    _arrivals[ranks] = _arrivals.get(ranks, 0) + 1


def _to_cpu(value):
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def load_consolidated(update, state_dict: Dict[str, Any]) -> None:
    """Scatters a torch-format state (from state_dict() at any world size, or a
    plain torch optimizer of the same class) onto this rank's pieces."""
    runtime, inner = update.runtime, update.shard_optimizer
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(update.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, update.param_groups)):
        raise ValueError("dearcomm: the optimizer state has groups of sizes "
                         f"{[len(s['params']) for s in saved_groups]}, this optimizer "
                         f"{[len(g['params']) for g in update.param_groups]}")
    saved_index = {}
    for saved, group in zip(saved_groups, update.param_groups):
        for saved_id, param in zip(saved["params"], group["params"]):
            saved_index[param] = saved_id
        group.update({k: v for k, v in saved.items() if k != "params"})
    if inner is None:
        return
    for piece in update.pieces:
        param = runtime.params[piece.param]
        saved = state_dict["state"].get(saved_index.get(param))
        if not saved:
            continue
        new = {}
        for key, value in saved.items():
            if _is_per_element(value, param.numel()):
                flat = value.reshape(-1)[piece.param_offset:piece.param_offset + piece.master.numel()]
                new[key] = flat.to(device=piece.master.device, copy=True)
            else:
                new[key] = value.clone() if isinstance(value, torch.Tensor) else value
        inner.state[piece.master] = new
