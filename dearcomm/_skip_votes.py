"""Every rank skips the same steps.

zero_grad() of every parameter between backward and step() skips the step
(as a GradScaler skips one). A rank that skips issues no all-gathers where
the others do, so its next reduce-scatters would pair with their
all-gathers: gloo aborts the process on the size mismatch, or, where the
sizes match, training goes on with crossed data. DDP in the same loop lets
the ranks drift apart silently. So step() and a skip each cast a vote (one
all-reduce of a flag per rank on the training group, issued before any
other collective of the step): a rank that skips reads the votes at once,
before it issues anything else; a rank that steps reads them at once where
its step runs collectives of its own on that group (step pre-hooks,
GradScaler, max_grad_norm), which a skipping rank would not join, else at
the end of its step() if they have arrived (after an update they mostly
have), else at the next forward or sync(). So the skipping rank always
names the mismatch; a rank that stepped names it too unless a collective of
the loop's own (or auto's measurements) came first, which then fails as
the skipping rank exits.

CPU only: on CUDA, reading the votes would make the host wait for the GPU
at every step; there every rank must skip the same steps, as the guide says.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist


class SkipVotes:
    def __init__(self, group, rank: int, world_size: int, timeout: datetime.timedelta, device: torch.device) -> None:
        self._group, self._rank, self._world_size, self._timeout = group, rank, world_size, timeout
        self.enabled = device.type == "cpu" and world_size > 1
        self._steps = 0  # votes cast: the same count on every rank while they pair up
        self._pending: Optional[Tuple[dist.Work, torch.Tensor, int]] = None

    def cast(self, skipped: bool, read_now: bool = False) -> None:
        """This rank's vote for the step it is at: skipped (zero_grad()) or
        stepped; ``read_now`` where the step goes on to collectives of its own."""
        if not self.enabled:
            return
        self.read()
        votes = torch.zeros(self._world_size, dtype=torch.int32)
        votes[self._rank] = int(skipped)
        self._pending = (dist.all_reduce(votes, group=self._group, async_op=True), votes, self._steps)
        self._steps += 1
        if skipped or read_now:
            self.read()

    def read_if_arrived(self) -> None:
        """read() where the votes are in already: the end of step() checks
        without waiting (a blocking read there took 1.1 ms per step at 2 ranks
        and 3.5 at 4 on 2 cores, benchmarks/skip_vote_cost.py --gap-ms 0)."""
        if self._pending is not None and self._pending[0].is_completed():
            self.read()

    def read(self) -> None:
        """Waits for the last vote (if not read yet); raises on every rank
        where some ranks skipped that step and the others stepped."""
        if self._pending is None:
            return
        work, votes, step = self._pending
        self._pending = None
        try:
            work.wait(self._timeout)
        except RuntimeError as e:
            raise RuntimeError(
                f"dearcomm: [rank {self._rank}] the ranks' vote on step {step} (whether they skipped it) failed or "
                f"did not complete within {self._timeout.total_seconds():g} s (wrap()'s timeout): a peer stalled or "
                f"died, or called neither step() nor zero_grad() there: {e}") from e
        skipped: List[int] = votes.nonzero().flatten().tolist()
        if skipped and len(skipped) < self._world_size:
            stepped = [r for r in range(self._world_size) if r not in skipped]
            raise RuntimeError(
                f"dearcomm: [rank {self._rank}] rank(s) {skipped} skipped step {step} (zero_grad() of every "
                f"parameter between backward and step()) where rank(s) {stepped} called step(): every rank must "
                "skip the same steps, or their collectives no longer pair up and training cannot go on. Decide "
                "from a value every rank shares (the norm clip_grad_norm_ returns, a loss all-reduced), or let "
                "GradScaler skip the step")
