"""Processor sharing of one host's cores, for simulating devices that are
processes on a machine with fewer cores than busy threads (netlab: 3 ranks
and their gloo threads on 2 cores). Every running item of CPU work (a
task, a transfer's sending or receiving work) progresses at
min(1, cores / items) of full speed; work is in ms at full speed."""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional


class SharedCores:
    def __init__(self, cores: float) -> None:
        """cores may be fractional: what other load on the host leaves free."""
        if cores <= 0:
            raise ValueError(f"dearcomm: a host needs more than 0 cores, got {cores}")
        self.cores = cores
        self.left: Dict[Hashable, float] = {}   # running item -> work still to do
        self.now = 0.0

    def speed(self) -> float:
        return min(1.0, self.cores / len(self.left)) if self.left else 1.0

    def advance(self, t: float) -> None:
        step = (t - self.now) * self.speed()
        for key in self.left:
            self.left[key] -= step
        self.now = t

    def start(self, t: float, key: Hashable, work_ms: float) -> None:
        self.advance(t)
        self.left[key] = work_ms

    def next_end(self) -> Optional[float]:
        """When the first running item ends if nothing else starts; None if idle."""
        return self.now + min(self.left.values()) / self.speed() if self.left else None

    def finished(self, t: float, due: bool = False) -> List[Hashable]:
        """Items whose work is done at t (removed), in the order they started.
        due: t is the next_end() predicted with nothing started since, so the
        item with the least work left ends even if rounding left it a sliver
        (waiting for that sliver could repeat at the same t forever)."""
        self.advance(t)
        done = [k for k, v in self.left.items() if v <= 1e-9 * max(1.0, t)]
        if due and not done and self.left:
            done = [min(self.left, key=self.left.__getitem__)]
        for key in done:
            del self.left[key]
        return done
