"""What the strategies that keep the average outside .grad share (dear's
sharded and replicated, bytescheduler's replicated): a reduce-scatter leaves
each rank the average of its 1/p shard of every bucket, an all-reduce the
average of the whole bucket on every rank (padding is zero either way); that
is what GradScaler unscales and what clipping measures, while .grad keeps
this rank's local gradient."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .._torch_collectives import within
from .base import UpdateStrategy, refuse_nonfinite

# Clipping by optimizer.clip_grad_norm_ or wrap(max_grad_norm=): the error names both.
CLIP_NORM = ("the all-reduce of the gradient norm for clipping (optimizer.clip_grad_norm_ or wrap(max_grad_norm=); "
             "every rank must clip)")


NORM_CHUNK = 1 << 15
"""Elements per partial norm in flat_norm."""


def flat_norm(flat: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of a 1-d tensor, as the norm of the norms of
    its NORM_CHUNK-element pieces. torch's fp32 norm of a whole bucket shard
    sums millions of squares in one accumulator: 1.7e-4 off at 6M elements
    on a CPU (1e-5 at 1M), so clipping scaled by another factor than DDP's,
    whose norms are per tensor. In pieces: 2e-8, in half the time."""
    rows = flat.numel() // NORM_CHUNK
    parts = [flat.new_zeros(1)]  # the inf norm of nothing is an error, not 0
    if rows:
        parts.append(torch.linalg.vector_norm(flat[:rows * NORM_CHUNK].view(rows, NORM_CHUNK), norm_type, dim=1))
    if flat.numel() > rows * NORM_CHUNK:
        parts.append(torch.linalg.vector_norm(flat[rows * NORM_CHUNK:], norm_type).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts), norm_type)


class AveragesInShards(UpdateStrategy):
    averaged_in_grad = False
    checks_grad_versions = True

    @classmethod
    def grad_versions(cls, params: List[torch.Tensor]) -> Optional[List[Tuple[Optional[torch.Tensor], int]]]:
        return [(p.grad, p.grad._version if p.grad is not None else 0) for p in params]

    def averaged_tensors(self) -> List[torch.Tensor]:
        # Shards were never unscaled: scaler.unscale_ only touches the local .grad.
        engine = self.runtime.engine
        return [engine.grad_shard(b) for b in range(len(engine.layout.buckets))]

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool = False) -> torch.Tensor:
        total = self.grad_norm(norm_type)
        if error_if_nonfinite:
            refuse_nonfinite(total, norm_type)
        self.clip_to(max_norm, total)
        return total

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The global norm of the averages this step applies. Each rank's own
        parts are disjoint (a reduce-scatter's shards; the shard ranges of an
        all-reduced bucket that every rank holds whole): one scalar
        all-reduce of their norms gives it."""
        norm_type = float(norm_type)
        engine, group = self.runtime.engine, self.runtime.group
        parts = [engine.own_part(b) for b in range(len(engine.layout.buckets))]
        local = torch.stack([flat_norm(p.float(), norm_type) for p in parts])
        if norm_type == float("inf"):
            total = local.max()
            within(self.runtime.timeout, CLIP_NORM, dist.all_reduce, total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = local.pow(norm_type).sum()
            within(self.runtime.timeout, CLIP_NORM, dist.all_reduce, total, group=group)
            total = total.pow(1.0 / norm_type)
        return total

    def clip_to(self, max_norm: float, total: torch.Tensor) -> None:
        """Scales what this step applies (before any update or all-gather),
        whose global norm is ``total``, to at most ``max_norm``, as torch's
        clip_grad_norm_ does."""
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for shard in self.averaged_tensors():
            shard.mul_(coefficient.to(shard.dtype))
