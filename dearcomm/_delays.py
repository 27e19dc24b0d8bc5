"""wrap(delays=) on a bucket layout: how many iterations late each bucket's
averages are applied (schedule="deft"). One function for the engine and the
simulator, so a prediction delays what training delays."""
from __future__ import annotations

from typing import List, Optional, Sequence


def bucket_delays(layout, param_delays: Sequence[int], names: Optional[Sequence[str]] = None) -> List[int]:
    """Per bucket, the delay its parameters share; ValueError, naming two of
    them, where one bucket holds parameters with different delays (they are
    reduced, and so applied, together)."""
    delays = []
    for b, spec in enumerate(layout.buckets):
        params = range(spec.first_param, spec.first_param + spec.num_params)
        values = {param_delays[p] for p in params}
        if len(values) > 1:
            first = next(p for p in params if param_delays[p] != param_delays[spec.first_param])
            a, z = (names[spec.first_param], names[first]) if names else (f"parameter {spec.first_param}",
                                                                         f"parameter {first}")
            raise ValueError(f"dearcomm: {a!r} (delay {param_delays[spec.first_param]}) and {z!r} (delay "
                             f"{param_delays[first]}) share bucket {b}, which is applied as a whole; give every "
                             f"parameter of a bucket the same delay, or use bucket_mb=0 (a bucket per tensor)")
        delays.append(values.pop())
    return delays
