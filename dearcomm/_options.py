"""Options of :func:`dearcomm.wrap`, validated once, on construction."""
from __future__ import annotations

import dataclasses
import datetime
import operator
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C

# The C++ schedule registry is the one list of schedules, their updates and
# options; WrapOptions resolves the user's names against it once (choice).
_REGISTRY = _C.schedules()
SCHEDULES = tuple(entry["name"] for entry in _REGISTRY)
UPDATES = tuple(dict.fromkeys(u for entry in _REGISTRY for u in entry["updates"]))
_TAKES_PRIORITIES = {entry["name"]: entry["takes_priorities"] for entry in _REGISTRY}
_TAKES_DELAYS = {entry["name"]: entry["takes_delays"] for entry in _REGISTRY}
PLANNED_SCHEDULES = frozenset(n for n in SCHEDULES if _TAKES_PRIORITIES[n] or _TAKES_DELAYS[n])
"""Schedules whose pieces a planner sets (usbyte's blocks and order, deft's
delays): no partition_mb, and without their plans usbyte is bytescheduler
one block at a time and deft is wfbp."""
DEFAULT_MAX_DELAY = 1
INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class WrapOptions:
    bucket_mb: float = 25.0
    """Fusion threshold in MiB: a bucket closes once it holds this much. 0 gives
    one bucket per parameter tensor; float("inf") no cap (one bucket per dtype,
    after the small first bucket). Larger buckets amortise each collective's
    start-up latency; smaller ones start communication earlier. 25 is DDP's default."""

    partition_mb: Optional[float] = None
    """Partition size in MiB: no bucket is larger, so a tensor larger than it is
    split into parts of that size, each a bucket of its own (ByteScheduler's
    tensor partitioning; a large tensor's first parts can go out, or be used,
    before the rest); smaller tensors fuse up to it and are never cut. Split
    points fall on multiples of world_size x 64 bytes (_C.partition_unit), so
    the size is rounded down to that (at least one unit). None (default): the schedule's default: 32 MiB (8 M fp32 parameters,
    the ByteScheduler paper's recommendation for all-reduce) for
    "bytescheduler", never split for the others."""

    blocks: Optional[Mapping[str, Sequence[int]]] = None
    """Explicit pieces, as a planner chose them (US-Byte's unequal blocks):
    parameter name -> element counts of its consecutive pieces. Each piece is
    a bucket of its own; the counts add up to the parameter's size, and all
    but the last are multiples of _C.partition_unit(world_size, dtype)
    (world_size x 64 bytes). A named parameter closes the bucket before it and
    its pieces are taken as given (partition_mb does not apply to them); the
    others are bucketed as usual. Every rank must pass the same blocks."""

    priorities: Optional[Mapping[str, int]] = None
    """schedule="usbyte" only: the order in which ready buckets go, as a
    planner chose it (dearcomm.usbyte): parameter name -> rank, lower first.
    A bucket takes the lowest rank of its parameters; unnamed parameters come
    after every named one; ties go input side first. None: input side first.
    Every rank must pass the same priorities."""

    max_delay: Optional[int] = None
    """schedule="deft" only: at most how many iterations late a bucket's
    averaged gradient may be applied (default 1; 0: none is, and deft trains
    exactly as wfbp). Without delays, deft plans which buckets to delay at
    the first training forward (dearcomm.deft)."""

    delays: Optional[Mapping[str, int]] = None
    """schedule="deft" only: which parameters are applied late, as a planner
    chose them (dearcomm.deft): parameter name -> iterations late (0 to
    max_delay); unnamed parameters are applied on time. The parameters of
    one bucket share its delay (name all of them alike, or bucket_mb=0).
    Every rank must pass the same delays."""

    credit_mb: Optional[float] = None
    """schedule="bytescheduler" only: the credit, in MiB: how many bytes of
    all-reduces may be in flight. A ready all-reduce goes, most urgent
    (nearest the input) first, when it fits beside those in flight (or the
    link is idle); the rest wait in the queue, where a more urgent one can
    still overtake them, and all go when backward ends. The bytes in flight
    are modelled from a link rate and tick spacing that every rank measures
    and all agree on (csrc/engine/link_meter.h), from the fourth backward on;
    until then every all-reduce goes when ready. Small: more reordering;
    large: all-reduces go as soon as ready, as in WFBP. None: 64 MiB (16 M
    fp32 parameters, the paper's recommendation for all-reduce)."""

    schedule: str = "dear"
    """"dear": reduce-scatter during backward, all-gather during the next forward.
    "wfbp": bucketed all-reduce during backward, finished when backward returns
    (DDP's schedule). "bytescheduler": partitioned all-reduce under a priority
    queue and a credit, each parameter updated in the next forward once its
    partitions are reduced. "usbyte": all-reduce in a planner's unequal blocks
    (blocks, priorities; dearcomm.usbyte plans them), one at a time, updated
    as bytescheduler. dearcomm._C.schedules() lists every schedule."""

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

    choice: _C.ScheduleChoice = dataclasses.field(init=False, repr=False, compare=False)
    """schedule, update and credit_mb resolved against the registry: what the
    engine (or a simulation) is built from."""

    def __post_init__(self) -> None:
        if not isinstance(self.broadcast_buffers, bool):
            raise TypeError(f"dearcomm: broadcast_buffers must be True or False, got {self.broadcast_buffers!r}")
        if not isinstance(self.bucket_mb, (int, float)) or isinstance(self.bucket_mb, bool):
            raise TypeError(f"dearcomm: bucket_mb must be a number of MiB, got {type(self.bucket_mb).__name__}"
                            f"{_AUTO_HINT if isinstance(self.bucket_mb, str) else ''}")
        if not self.bucket_mb >= 0:  # also rejects NaN
            raise ValueError(f"dearcomm: bucket_mb must be >= 0 (0 = one bucket per tensor), got {self.bucket_mb}")
        _check_positive_mib_or_none("partition_mb", self.partition_mb)
        if self.blocks is not None:
            object.__setattr__(self, "blocks", _checked_blocks(self.blocks))  # a copy: later edits don't count
        if self.priorities is not None:
            object.__setattr__(self, "priorities", _checked_priorities(self.priorities))
        _check_positive_mib_or_none("credit_mb", self.credit_mb)
        if self.max_delay is not None and (not isinstance(self.max_delay, int) or isinstance(self.max_delay, bool)
                                           or self.max_delay < 0):
            raise ValueError(f"dearcomm: max_delay must be an int >= 0 (iterations), got {self.max_delay!r}")
        for name in ("schedule", "update"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "update" and value is None):
                raise TypeError(f"dearcomm: {name} must be a name (str), got {value!r}")
        choice = _C.resolve_schedule(self.schedule, self.update,
                                     None if self.credit_mb is None else max(1, _mib_to_bytes(self.credit_mb)))
        object.__setattr__(self, "choice", choice)
        object.__setattr__(self, "update", choice.update)
        if self.schedule == "usbyte" and self.partition_mb is not None:
            raise ValueError("dearcomm: schedule='usbyte' splits tensors into its planner's blocks (blocks=, or its "
                             "own plan); partition_mb does not apply to it")
        if _TAKES_DELAYS[self.schedule] and self.partition_mb is not None:
            raise ValueError(f"dearcomm: schedule={self.schedule!r} delays whole buckets of whole tensors; "
                             f"partition_mb does not apply to it")
        if self.priorities and not _TAKES_PRIORITIES[self.schedule]:
            takers = " or ".join(f"schedule={n!r}" for n, takes in _TAKES_PRIORITIES.items() if takes)
            raise ValueError(f"dearcomm: schedule={self.schedule!r} issues in its own order; priorities apply to "
                             f"{takers}")
        if (self.delays is not None or self.max_delay is not None) and not _TAKES_DELAYS[self.schedule]:
            takers = " or ".join(f"schedule={n!r}" for n, takes in _TAKES_DELAYS.items() if takes)
            option = "delays" if self.delays is not None else "max_delay"
            raise ValueError(f"dearcomm: schedule={self.schedule!r} applies every gradient in its own step; "
                             f"{option} applies to {takers}")
        if self.delays is not None:
            object.__setattr__(self, "delays", _checked_delays(self.delays, self.effective_max_delay))
        if self.comm_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dearcomm: comm_dtype must be torch.bfloat16, torch.float16, torch.float32 or None, "
                             f"got {self.comm_dtype!r}")
        if self.max_grad_norm is not None:
            check_clip_arguments(self.max_grad_norm, 2.0, "max_grad_norm")
            if self.max_grad_norm == 0:
                raise ValueError("dearcomm: max_grad_norm must be a positive number, got 0")
        if self.timeout is not None and (
            not isinstance(self.timeout, datetime.timedelta) or self.timeout.total_seconds() <= 0
        ):
            raise ValueError(f"dearcomm: timeout must be a positive datetime.timedelta, got {self.timeout!r}")

    @property
    def effective_max_delay(self) -> int:
        """max_delay with its default filled in (0 for a schedule without delays)."""
        if self.max_delay is not None:
            return self.max_delay
        return DEFAULT_MAX_DELAY if _TAKES_DELAYS.get(self.schedule) else 0

    @property
    def update_strategy(self) -> str:
        """When the optimizer runs, as the registry names it ("sharded_at_step",
        "replicated_before_use", "full_after_reduction"); dearcomm._update
        holds the object of each."""
        return self.choice.update_strategy

    @property
    def partition_bytes(self) -> int:
        """The planner's partition size (INT64_MAX: never split)."""
        if self.partition_mb is None:
            return self.choice.default_partition_bytes
        return max(1, _mib_to_bytes(self.partition_mb))

    @property
    def bucket_cap_bytes(self) -> int:
        return _mib_to_bytes(self.bucket_mb)


def _mib_to_bytes(mib: float) -> int:
    """MiB to the int64 bytes the engine takes; inf (or any size beyond int64) is INT64_MAX: no limit."""
    size = mib * 1024 * 1024
    return INT64_MAX if size >= INT64_MAX else int(size)


def _check_positive_mib_or_none(name: str, value) -> None:
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
        raise ValueError(f"dearcomm: {name} must be a positive number of MiB or None, got {value!r}"
                         f"{_AUTO_HINT if isinstance(value, str) else ''}")


_AUTO_HINT = " (wrap() also takes 'auto', in lower case, for bucket_mb, partition_mb, credit_mb and schedule)"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_clip_arguments(max_norm, norm_type, name: str = "max_norm") -> None:
    """As torch.nn.utils.clip_grad_norm_ takes them, without the NaN that would
    silently turn every gradient into NaN: max_norm >= 0 (inf: report the norm,
    clip nothing), norm_type > 0 or inf."""
    if not _is_number(max_norm) or not max_norm >= 0:
        raise ValueError(f"dearcomm: {name} must be a number >= 0 (inf clips nothing), got {max_norm!r}")
    if not _is_number(norm_type) or not norm_type > 0:
        raise ValueError(f"dearcomm: norm_type must be a positive number or inf, got {norm_type!r}")


def _by_parameter_name(mapping, option: str, values: str):
    """The (name, value) entries of a wrap() option keyed by parameter name,
    each key checked as it comes; a TypeError names what is wrong."""
    if not isinstance(mapping, Mapping):
        raise TypeError(f"dearcomm: {option} must map parameter names to {values}, got {type(mapping).__name__}")
    for name, value in mapping.items():
        if not isinstance(name, str):
            raise TypeError(f"dearcomm: {option} keys must be parameter names (str), got {name!r}")
        yield name, value


def _checked_blocks(blocks) -> Dict[str, Tuple[int, ...]]:
    """A copy of `blocks` with plain ints (a planner's numpy or torch integers
    are fine), or an error naming the entry."""
    checked = {}
    for name, pieces in _by_parameter_name(blocks, "blocks", "lists of element counts"):
        try:
            plain = not isinstance(pieces, (str, bytes)) and not any(isinstance(n, bool) for n in pieces)
            counts = tuple(operator.index(n) for n in pieces) if plain else ()
        except TypeError:
            counts = ()
        if not counts or any(n <= 0 for n in counts):
            raise ValueError(f"dearcomm: blocks[{name!r}] must be a non-empty list of positive element counts, "
                             f"got {pieces!r}")
        checked[name] = counts
    return checked


def _plain_int(value, error: str) -> int:
    """`value` as a plain int (a planner's numpy or torch integers are fine;
    bool is not), or ValueError(error)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(error) from None


def checked_delay(delay, max_delay: int, what: str) -> int:
    """One delay as a plain int in [0, max_delay], or a ValueError naming `what`."""
    value = _plain_int(delay, f"dearcomm: {what} must be an int number of iterations, got {delay!r}")
    if not 0 <= value <= max_delay:
        raise ValueError(f"dearcomm: {what} is {value}; it must be between 0 and max_delay ({max_delay})")
    return value


def _checked_delays(delays, max_delay: int) -> Dict[str, int]:
    """A copy of `delays` with plain ints, each in [0, max_delay], or an error naming the entry."""
    return {name: checked_delay(delay, max_delay, f"delays[{name!r}]")
            for name, delay in _by_parameter_name(delays, "delays", "iterations late (int)")}


def _checked_priorities(priorities) -> Dict[str, int]:
    """A copy of `priorities` with plain ints, or an error naming the entry."""
    return {name: _plain_int(rank, f"dearcomm: priorities[{name!r}] must be an int rank (lower goes first), "
                                   f"got {rank!r}")
            for name, rank in _by_parameter_name(priorities, "priorities", "ranks (int, lower goes first)")}
