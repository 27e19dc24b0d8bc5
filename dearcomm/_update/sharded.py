"""update="sharded" (schedule="dear"): each rank updates its 1/p shard of the
fp32 master parameters at step(), and the all-gathers then carry parameters.

A second instance of the user's optimizer class, with the same
hyper-parameters and group structure, steps over this rank's *pieces*: the
parts of parameters that fall into this rank's shard of each bucket (views
into the engine's master and gradient shards). A parameter may span buckets
and shards, so it may have several pieces, on several ranks; element-wise
optimizers (SGD, Adam, AdamW, ...) do not notice. Optimizer state is 1/p of
the full state; sharded_state.py turns it into checkpoints.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional

import torch
from torch.optim import Optimizer

from . import sharded_state
from .._step_hooks import step_without_hooks
from .base import hyperparameters
from .shard_averages import AveragesInShards
from .sharded_state import Piece


class ShardedAtStep(AveragesInShards):
    name = "sharded_at_step"

    def __init__(self, optimizer, runtime) -> None:
        super().__init__(optimizer, runtime)
        self.shard_optimizer: Optional[Optimizer] = None  # None until the engine exists, or if this rank has no piece
        self.pieces: List[Piece] = []
        self._pending_state: Optional[Dict[str, Any]] = None  # loaded before the engine existed
        self._versions: List[int] = []  # the parameters' version counters when the master shards last matched them

    def on_engine_built(self, engine) -> None:
        self._build_shard_optimizer(engine)
        self._versions = _versions(self.runtime.params)
        if self._pending_state is not None:  # loaded before the pieces existed
            pending, self._pending_state = self._pending_state, None
            self.load_state_dict(pending)

    def mark_written(self) -> None:
        super().mark_written()
        self._versions = _versions(self.runtime.params)  # the step's own write is not the user's

    def adopt_parameter_writes(self) -> None:
        # The optimizer updates the master shards and the all-gathers then
        # overwrite every parameter from them: a write into a parameter since
        # (model.encoder.load_state_dict(), nn.init, weight.copy_(), clamping)
        # would be lost. The engine writes the parameters through its flat
        # buffers, whose version counters are their own: a parameter's version
        # moves only where the user's code wrote it.
        versions = _versions(self.runtime.params)
        written = [i for i, (now, then) in enumerate(zip(versions, self._versions)) if now != then]
        if written:
            self.runtime.engine.reload_master_shards(written)
        self._versions = versions

    def _build_shard_optimizer(self, engine) -> None:
        layout, rank, params = engine.layout, self.runtime.rank, self.runtime.params
        group_of = self.group_of()
        groups: List[List[torch.Tensor]] = [[] for _ in self.param_groups]
        for b, spec in enumerate(layout.buckets):
            begin = spec.shard_begin(rank)
            master, grad = engine.master_shard(b), engine.grad_shard(b)
            for piece in layout.pieces(b, begin, begin + spec.shard_numel):
                group = group_of.get(params[piece.param])
                if group is None:
                    continue  # trains nowhere: its master copy just stays as it is
                lo = piece.bucket_offset - begin
                entry = Piece(b, piece.param, piece.param_offset, piece.bucket_offset,
                              master[lo:lo + piece.numel], grad[lo:lo + piece.numel])
                groups[group].append(entry.master)
                self.pieces.append(entry)
        if not self.pieces:
            return  # this rank's shards hold only padding (tiny model, many ranks)
        # Each group carries every hyper-parameter; the constructor's keyword
        # arguments only satisfy required ones (defaults may hold derived keys).
        cls = type(self.optimizer)
        shard_groups = [dict(hyperparameters(g), params=pieces) for g, pieces in zip(self.param_groups, groups)]
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in self.optimizer.defaults.items() if k in accepted}
        try:
            self.shard_optimizer = cls(shard_groups, **kwargs)
        except TypeError as e:
            raise TypeError(
                f"dearcomm: update='sharded' re-creates {cls.__name__} over parameter shards "
                f"as {cls.__name__}(param_groups, **hyperparameters), which failed: {e}. "
                "Use update='replicated' for this optimizer."
            ) from e

    def apply(self) -> None:
        if self.shard_optimizer is None:
            return
        for shard_group, group in zip(self.shard_optimizer.param_groups, self.param_groups):
            shard_group.update(hyperparameters(group))  # LR schedulers edit the user's groups
        unused = self.runtime.unused_everywhere  # find_unused_parameters: skipped, as torch skips a .grad of None
        for piece in self.pieces:
            piece.master.grad = None if piece.param in unused else piece.grad
        step_without_hooks(self.shard_optimizer)

    # ---- checkpoints --------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        if self.runtime.engine is None:  # torch's format, loadable back: the groups with their parameters
            return self._pending_state or self.optimizer.state_dict()
        return sharded_state.consolidate(self)

    def sharded_state_dict(self) -> Dict[str, Any]:
        return {
            "dearcomm_sharded": True,
            "rank": self.runtime.rank,
            "world_size": self.runtime.world_size,
            "shard": self.shard_optimizer.state_dict() if self.shard_optimizer is not None else None,
            "param_groups": [hyperparameters(g) for g in self.param_groups],
            "layout": self._layout_signature(),
        }

    def _layout_signature(self):
        """Where each parameter's elements sit in the shards: a shard's state
        only means something under the same bucket layout (bucket_mb, the
        parameters, dearcomm's alignment rules)."""
        engine = self.runtime.engine
        if engine is None:
            return None
        layout = engine.layout
        return ([(s.bucket, s.offset, s.numel, s.last_bucket) for s in layout.params],
                [b.shard_numel for b in layout.buckets])

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.runtime.engine is None:
            self._pending_state = state_dict  # pieces exist once the first backward planned the buckets
            return
        if not state_dict.get("dearcomm_sharded"):
            sharded_state.load_consolidated(self, state_dict)
            return
        rank, world = self.runtime.rank, self.runtime.world_size
        if (state_dict["rank"], state_dict["world_size"]) != (rank, world):
            raise ValueError(
                f"dearcomm: [rank {rank}] this optimizer state is the shard of rank {state_dict['rank']} of "
                f"{state_dict['world_size']}; each rank must load its own shard at the same world size ({world}), "
                "or use state_dict() (consolidated) instead")
        saved_layout, layout = state_dict.get("layout"), self._layout_signature()
        if saved_layout is not None and layout is not None and _as_lists(saved_layout) != _as_lists(layout):
            raise ValueError(
                f"dearcomm: [rank {rank}] this sharded optimizer state was saved under another bucket layout "
                "(a different bucket_mb, model or dearcomm version); its shards would land on the wrong elements. "
                "Save and load state_dict() (consolidated) instead, which does not depend on the layout")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        if self.shard_optimizer is not None and state_dict["shard"] is not None:
            self.shard_optimizer.load_state_dict(state_dict["shard"])


def _versions(params: List[torch.Tensor]) -> List[int]:
    return [p._version for p in params]


def _as_lists(value):
    """Tuples and lists compare equal after a round trip through torch.save."""
    return [_as_lists(v) for v in value] if isinstance(value, (list, tuple)) else value
