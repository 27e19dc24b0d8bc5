"""wrap(priorities=) on a bucket layout: the per-bucket order a queueing
schedule (usbyte) issues in. One function for the engine and the simulator,
so a prediction issues what training issues."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence


def bucket_priorities(layout, param_ranks: Sequence[Optional[int]]) -> List[int]:
    """Per bucket, its position in issue order: a bucket takes the lowest rank
    of its parameters (None: after every ranked one). Among equal ranks the
    pieces of a parameter go in the order they become ready, last piece first
    (backward reports buckets in descending order), so a planner lists a
    parameter's blocks back to front; unranked buckets go input side first."""
    def key(b: int):
        spec = layout.buckets[b]
        ranks = [param_ranks[p] for p in range(spec.first_param, spec.first_param + spec.num_params)]
        ranked = [r for r in ranks if r is not None]
        return (min(ranked), -b) if ranked else (math.inf, b)
    order = sorted(range(len(layout.buckets)), key=key)
    position = [0] * len(order)
    for i, b in enumerate(order):
        position[b] = i
    return position
