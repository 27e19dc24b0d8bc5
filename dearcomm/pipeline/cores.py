"""Work that progresses at a speed set by what else runs beside it, for the
simulator's two models of compute and transfers taking from each other:

SharedCores: processor sharing of one host's cores, for devices that are
processes on a machine with fewer cores than busy threads (netlab: 3 ranks
and their gloo threads on 2 cores). Every running item of CPU work (a task,
a transfer's sending or receiving work) progresses at min(1, cores / items)
of full speed.

Contention: the data-parallel simulator's measured factors (Network's
compute_slowdown κ and comm_slowdown λ, fitted by dearcomm.contention):
while a transfer with a device at one of its ends is on the link, the
device's task progresses at 1/κ of full speed; while a device at one of its
ends computes, the transfer progresses at 1/λ. (An all-reduce is an item
with its members as ends; in a pipeline it runs when they have nothing left
to compute.)

Work is in ms at full speed."""
from __future__ import annotations

from typing import Dict, FrozenSet, Hashable, List, Optional


class _Progress:
    """Running items and the work each has left; a subclass says how fast
    each progresses beside the others."""

    def __init__(self) -> None:
        self.left: Dict[Hashable, float] = {}   # running item -> work still to do
        self.now = 0.0

    def speeds(self) -> Dict[Hashable, float]:
        raise NotImplementedError

    def advance(self, t: float) -> None:
        dt = t - self.now
        for key, speed in self.speeds().items():
            self.left[key] -= dt * speed
        self.now = t

    def _start(self, t: float, key: Hashable, work_ms: float) -> None:
        self.advance(t)
        self.left[key] = work_ms

    def next_end(self) -> Optional[float]:
        """When the first running item ends if nothing else starts; None if idle."""
        speeds = self.speeds()
        return self.now + min(left / speeds[key] for key, left in self.left.items()) if self.left else None

    def finished(self, t: float, due: bool = False) -> List[Hashable]:
        """Items whose work is done at t (removed), in the order they started.
        due: t is the next_end() predicted with nothing started since, so the
        item with the least time left ends even if rounding left it a sliver
        (waiting for that sliver could repeat at the same t forever)."""
        self.advance(t)
        speeds = self.speeds()  # done: the time left at the current speed is negligible
        done = [k for k, v in self.left.items() if v / speeds[k] <= 1e-9 * max(1.0, t)]
        if due and not done and self.left:
            done = [min(self.left, key=lambda k: self.left[k] / speeds[k])]
        for key in done:
            self._forget(key)
        return done

    def _forget(self, key: Hashable) -> None:
        del self.left[key]


class SharedCores(_Progress):
    def __init__(self, cores: float) -> None:
        """cores may be fractional: what other load on the host leaves free."""
        super().__init__()
        if cores <= 0:
            raise ValueError(f"dearcomm: a host needs more than 0 cores, got {cores}")
        self.cores = cores

    def speeds(self) -> Dict[Hashable, float]:
        speed = min(1.0, self.cores / len(self.left)) if self.left else 1.0
        return dict.fromkeys(self.left, speed)

    def start(self, t: float, key: Hashable, work_ms: float) -> None:
        self._start(t, key, work_ms)


class Contention(_Progress):
    def __init__(self, compute_slowdown: float, comm_slowdown: float) -> None:
        super().__init__()
        self.compute_rate, self.comm_rate = 1.0 / compute_slowdown, 1.0 / comm_slowdown
        self.computing: Dict[Hashable, int] = {}             # task item -> its device
        self.linking: Dict[Hashable, FrozenSet[int]] = {}    # transfer item -> the devices at its ends

    def start_task(self, t: float, key: Hashable, work_ms: float, device: int) -> None:
        self._start(t, key, work_ms)
        self.computing[key] = device

    def start_transfer(self, t: float, key: Hashable, work_ms: float, devices) -> None:
        self._start(t, key, work_ms)
        self.linking[key] = frozenset(devices)

    def speeds(self) -> Dict[Hashable, float]:
        busy = set(self.computing.values())
        linked = set().union(*self.linking.values()) if self.linking else set()
        out = {key: self.compute_rate if d in linked else 1.0 for key, d in self.computing.items()}
        out.update((key, self.comm_rate if ends & busy else 1.0) for key, ends in self.linking.items())
        return out

    def _forget(self, key: Hashable) -> None:
        super()._forget(key)
        self.computing.pop(key, None)
        self.linking.pop(key, None)
