"""Ranks that measure together, as synchronous data-parallel training runs
them: each iteration's forward and optimizer step start on every rank at
once (dearcomm.profile(group=...), the contention measurement). A rank that
fails tells the others, and why, at the meeting they wait at, so that none
is left waiting on a collective and every rank raises."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _exit
from ._torch_collectives import peer_missing


class PeerFailed(ValueError):
    """Some rank of the group failed while measuring; the message says which
    and why. ``value_errors``: every failing rank's error was a ValueError
    of dearcomm's (a job it cannot measure, as opposed to the model's own
    error or a broken process or device)."""

    def __init__(self, message: str, value_errors: bool = False):
        super().__init__(message)
        self.value_errors = value_errors


class Lockstep:
    """The meetings of one measurement (``what``: its name in errors) on
    every rank of ``group``."""

    def __init__(self, group: Any, device: torch.device, what: str = "profile()"):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"dearcomm: {what} with a group needs torch.distributed initialised "
                             "(init_process_group) on every rank of the group")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"dearcomm: group must be a torch.distributed ProcessGroup (dist.group.WORLD or "
                            f"one from dist.new_group()), got {type(group).__name__}")
        _exit.install()  # its collectives run on c10d's workers, which must not outlive Python (_exit.py)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.what = what
        self.failed = False

    def _max(self, values: Sequence[int]) -> List[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:
            raise peer_missing(f"{self.what}: the ranks' meeting failed or timed out", e) from e
        return t.tolist()

    def start(self, iterations: int, *, steps: bool = False, failure: Optional[BaseException] = None) -> None:
        """The first meeting: every rank must run as many iterations and
        step an optimizer or not alike (as many meetings). A rank that
        failed before it could start passes its ``failure``, and every rank
        raises."""
        most, fewest, stepping, not_stepping, failed = self._max(
            [iterations, -iterations, int(steps), int(not steps), int(failure is not None)])
        if failed:
            self.failed = True
            raise self._peer_failed(failure) from failure
        if most != -fewest:
            self.failed = True
            raise ValueError(f"dearcomm: {self.what}: the ranks asked for {-fewest} to {most} iterations (warmup "
                             "included); give every rank of the group the same iterations and warmup")
        if stepping and not_stepping:
            self.failed = True
            raise ValueError(f"dearcomm: {self.what}: some ranks gave an optimizer and some did not; give every "
                             "rank of the group the same")

    def meet(self) -> None:
        """A barrier that also says whether some rank failed since the last one."""
        if self._max([0])[0]:
            self.failed = True
            raise self._peer_failed(None)

    def fail(self, error: BaseException) -> None:
        """Called by a rank that fails: the others learn it, and why, at the
        meeting they are waiting at. Not after a meeting that said so already."""
        if not self.failed:
            self.failed = True
            self._max([1])
            self._peer_failed(error)

    def _peer_failed(self, mine: Optional[BaseException]) -> PeerFailed:
        """Every rank's failure, if any, exchanged; the error the others raise."""
        reasons: List[Any] = [None] * self.world_size
        own = None if mine is None else (f"{type(mine).__name__}: {mine}", _refused_by_dearcomm(mine))
        dist.all_gather_object(reasons, own, group=self.group)
        failed = [(r, why) for r, why in enumerate(reasons) if why is not None]
        return PeerFailed(f"dearcomm: {self.what} failed on " + "; ".join(f"rank {r}: {why}" for r, (why, _) in failed),
                          value_errors=all(value_error for _, (_, value_error) in failed))

    def gather(self, mine: Any) -> List[Any]:
        """Every rank's ``mine`` (picklable), by rank; ``mine`` may be the
        ValueError this rank met, and then every rank raises alike."""
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, _Failure(str(mine)) if isinstance(mine, Exception) else mine,
                               group=self.group)
        errors = [f"rank {r}: {g.message}" for r, g in enumerate(gathered) if isinstance(g, _Failure)]
        if errors:
            raise ValueError(f"dearcomm: {self.what} failed on " + "; ".join(errors))
        return gathered


class _Failure:
    def __init__(self, message: str):
        self.message = message


def _refused_by_dearcomm(error: BaseException) -> bool:
    """A ValueError of dearcomm's own (a job it cannot measure, such as a
    parameter without a gradient), not one the model raised."""
    return isinstance(error, ValueError) and str(error).startswith("dearcomm:")
