"""What the strategies that keep the average outside .grad share (dear's
sharded and replicated, bytescheduler's replicated): a reduce-scatter leaves
each rank the average of its 1/p shard of every bucket, an all-reduce the
average of the whole bucket on every rank (padding is zero either way); that
is what GradScaler unscales and what clipping measures, while .grad keeps
this rank's local gradient."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .base import UpdateStrategy


class AveragesInShards(UpdateStrategy):
    averaged_in_grad = False
    checks_grad_versions = True

    def averaged_tensors(self) -> List[torch.Tensor]:
        # Shards were never unscaled: scaler.unscale_ only touches the local .grad.
        engine = self.runtime.engine
        return [engine.grad_shard(b) for b in range(len(engine.layout.buckets))]

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        # Shards of a reduce-scatter are disjoint: one scalar all-reduce gives
        # the global norm. All-reduced buckets are whole on every rank: the
        # local norm is the global one. Scaled before any update or all-gather.
        norm_type = float(norm_type)
        shards = self.averaged_tensors()
        group = self.runtime.group
        disjoint = self.runtime.engine.reduction == "reduce_scatter"
        local = torch.stack([torch.linalg.vector_norm(s.float(), norm_type) for s in shards])
        if norm_type == float("inf"):
            total = local.max()
            if disjoint:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = local.pow(norm_type).sum()
            if disjoint:
                dist.all_reduce(total, group=group)
            total = total.pow(1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for shard in shards:
            shard.mul_(coefficient.to(shard.dtype))
        return total
