"""Ranks that profile together, as synchronous data-parallel training runs
them: each iteration's forward and optimizer step start on every rank at
once (dearcomm.profile(group=...)). A rank that fails tells the others, and
why, at the meeting they wait at, so that none is left waiting on a
collective and every rank raises."""
from __future__ import annotations

from typing import Any, List, Sequence

import torch
import torch.distributed as dist


class PeerFailed(ValueError):
    """Another rank of the group failed while profiling; the message says why."""


class Lockstep:
    """The meetings of one profile() on every rank of ``group``."""

    def __init__(self, group: Any, device: torch.device):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("dearcomm: profile(group=...) needs torch.distributed initialised "
                             "(init_process_group) on every rank of the group")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"dearcomm: group must be a torch.distributed ProcessGroup (dist.group.WORLD or "
                            f"one from dist.new_group()), got {type(group).__name__}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.failed = False

    def _max(self, values: Sequence[int]) -> List[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def start(self, iterations: int) -> None:
        """Every rank must run as many iterations (as many meetings)."""
        most, fewest = self._max([iterations, -iterations])
        if most != -fewest:
            self.failed = True
            raise ValueError(f"dearcomm: profile(): the ranks asked for {-fewest} to {most} iterations (warmup "
                             "included); give every rank of the group the same iterations and warmup")

    def meet(self) -> None:
        """A barrier that also says whether some rank failed since the last one."""
        if self._max([0])[0]:
            self.failed = True
            raise PeerFailed("dearcomm: profile() failed on " + self._reasons(""))

    def fail(self, error: BaseException) -> None:
        """Called by a rank that fails: the others learn it, and why, at the
        meeting they are waiting at. Not after a meeting that said so already."""
        if not self.failed:
            self.failed = True
            self._max([1])
            self._reasons(f"{type(error).__name__}: {error}")

    def _reasons(self, mine: str) -> str:
        reasons: List[Any] = [None] * self.world_size
        dist.all_gather_object(reasons, mine, group=self.group)
        return "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why)

    def gather(self, mine: Any) -> List[Any]:
        """Every rank's ``mine`` (picklable), by rank; ``mine`` may be the
        ValueError this rank met, and then every rank raises alike."""
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, _Failure(str(mine)) if isinstance(mine, Exception) else mine,
                               group=self.group)
        errors = [f"rank {r}: {g.message}" for r, g in enumerate(gathered) if isinstance(g, _Failure)]
        if errors:
            raise ValueError("dearcomm: profile() failed on " + "; ".join(errors))
        return gathered


class _Failure:
    def __init__(self, message: str):
        self.message = message
