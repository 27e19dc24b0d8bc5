"""Options of :func:`dearcomm.wrap`, validated once, on construction."""
from __future__ import annotations

import dataclasses
import datetime
from typing import Optional

import torch
import torch.distributed as dist

from . import _C

# The C++ schedule registry is the one list of schedules and their updates.
_REGISTRY = {entry["name"]: entry for entry in _C.schedules()}
SCHEDULES = tuple(_REGISTRY)
UPDATES = tuple(dict.fromkeys(u for entry in _REGISTRY.values() for u in entry["updates"]))
INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class WrapOptions:
    bucket_mb: float = 25.0
    """Fusion threshold in MiB: a bucket closes once it holds this much. 0 gives
    one bucket per parameter tensor; float("inf") no cap (one bucket per dtype,
    after the small first bucket). Larger buckets amortise each collective's
    start-up latency; smaller ones start communication earlier. 25 is DDP's default."""

    schedule: str = "dear"
    """"dear": reduce-scatter during backward, all-gather during the next forward.
    "wfbp": bucketed all-reduce during backward, finished when backward returns
    (DDP's schedule). dearcomm._C.schedules() lists every schedule."""

    update: Optional[str] = None
    """"sharded": each rank updates its 1/p shard of fp32 master parameters and the
    all-gather carries parameters (optimizer state is 1/p; element-wise optimizers).
    "replicated": the all-gather carries averaged gradients and every rank updates
    full parameters (layer-wise optimizers such as LAMB). None picks "sharded" for
    dear and "replicated" for wfbp, the only update wfbp has."""

    process_group: Optional[dist.ProcessGroup] = None
    """The ranks that train together; None is the default group."""

    timeout: Optional[datetime.timedelta] = None
    """How long to wait for one collective before raising; None takes the
    process group's timeout."""

    find_unused_parameters: bool = False
    """False: a parameter that gets no gradient in a backward is an error that
    names it (it would otherwise leave its bucket incomplete on this rank and
    hang its peers). True: at the end of backward such gradients count as zero,
    as in DDP; this costs nothing when every parameter is used."""

    max_grad_norm: Optional[float] = None
    """If set, every step() first clips gradients to this global L2 norm,
    computed from the reduce-scattered shards with one scalar all-reduce."""

    comm_dtype: Optional[torch.dtype] = None
    """Communicate gradients in this dtype: torch.bfloat16 or torch.float16 halve
    the bytes; None (default) uses the parameters' dtype. Master shards and the
    optimizer stay fp32. fp16 divides by the world size before the sum (its
    range is small), bf16 and fp32 after."""

    broadcast_buffers: bool = True
    """As DDP's option of the same name: every training forward (grad enabled,
    outside no_sync()) starts by broadcasting rank 0's buffers (BatchNorm's
    running statistics) to every rank, so all ranks keep the same. False: each
    rank keeps its own buffers."""

    def __post_init__(self) -> None:
        if not isinstance(self.broadcast_buffers, bool):
            raise TypeError(f"dearcomm: broadcast_buffers must be True or False, got {self.broadcast_buffers!r}")
        if not isinstance(self.bucket_mb, (int, float)) or isinstance(self.bucket_mb, bool):
            raise TypeError(f"dearcomm: bucket_mb must be a number of MiB, got {type(self.bucket_mb).__name__}")
        if not self.bucket_mb >= 0:  # also rejects NaN
            raise ValueError(f"dearcomm: bucket_mb must be >= 0 (0 = one bucket per tensor), got {self.bucket_mb}")
        if not isinstance(self.schedule, str) or self.schedule not in _REGISTRY:
            raise ValueError(f"dearcomm: unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")
        entry = _REGISTRY[self.schedule]
        if self.update is None:
            object.__setattr__(self, "update", entry["default_update"])
        if not isinstance(self.update, str) or self.update not in UPDATES:
            raise ValueError(f"dearcomm: unknown update {self.update!r}; expected one of {UPDATES}")
        if self.update not in entry["updates"]:
            raise NotImplementedError(
                f"dearcomm: schedule={self.schedule!r} with update={self.update!r} is not supported: "
                f"{self.schedule} ({entry['summary']}) has update={' or '.join(map(repr, entry['updates']))}. "
                f"Valid combinations: {_valid_combinations()}.")
        if self.comm_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dearcomm: comm_dtype must be torch.bfloat16, torch.float16, torch.float32 or None, "
                             f"got {self.comm_dtype!r}")
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm > 0):
            raise ValueError(f"dearcomm: max_grad_norm must be a positive number, got {self.max_grad_norm!r}")
        if self.timeout is not None and (
            not isinstance(self.timeout, datetime.timedelta) or self.timeout.total_seconds() <= 0
        ):
            raise ValueError(f"dearcomm: timeout must be a positive datetime.timedelta, got {self.timeout!r}")

    @property
    def update_strategy(self) -> str:
        """When the optimizer runs, as the registry names it ("sharded_at_step",
        "replicated_before_use", "full_after_reduction"); dearcomm._update
        holds the object of each."""
        return _REGISTRY[self.schedule]["updates"][self.update]

    @property
    def bucket_cap_bytes(self) -> int:
        # The planner takes an int64; inf (or any cap beyond it) means "no cap".
        cap = self.bucket_mb * 1024 * 1024
        return INT64_MAX if cap >= INT64_MAX else int(cap)


def _valid_combinations() -> str:
    return "; ".join(
        f"schedule={name!r} with update=" + " or ".join(
            repr(u) + (" (default)" if u == entry["default_update"] else "") for u in entry["updates"])
        for name, entry in _REGISTRY.items())
