"""A pipeline plan: stage boundaries, the devices of each stage, and the order
of forward (F) and backward (B) tasks on every device.

Replication: a stage on r devices is data-parallel; micro-batch m runs on its
replica m % r, so every task costs exactly what the profile says, and the
replicas all-reduce the stage's gradients after their last backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import validate

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True, order=True)
class Task:
    kind: str  # FORWARD or BACKWARD
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}s{self.stage}"


@dataclass(frozen=True)
class Plan:
    bounds: Tuple[int, ...]                 # stage s = layers [bounds[s], bounds[s+1])
    devices: Tuple[Tuple[int, ...], ...]    # stage s -> its replicas' devices
    orders: Dict[int, Tuple[Task, ...]]     # device -> its tasks in execution order
    num_microbatches: int
    name: str = "plan"
    predicted_ms: Optional[float] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Types and counts only; validate() checks them against a profile and a topology.
        where = f"plan {self.name!r}"
        validate.positive_int(self.num_microbatches, "num_microbatches", where)
        validate.stage_bounds(self.bounds, where)
        validate.stage_devices(self.devices, where)
        validate.instance(self.orders, Mapping, "orders", where)
        if self.predicted_ms is not None:
            validate.finite_nonnegative(self.predicted_ms, "predicted_ms", where)

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    def stage_layers(self, s: int) -> Tuple[int, int]:
        return self.bounds[s], self.bounds[s + 1]

    def device_of(self, stage: int, microbatch: int) -> int:
        group = self.devices[stage]
        return group[microbatch % len(group)]

    def stage_of_device(self, device: int) -> Optional[Tuple[int, int]]:
        """(stage, replica index) of a device, None if it is unused."""
        for s, group in enumerate(self.devices):
            if device in group:
                return s, group.index(device)
        return None

    def microbatches_of(self, stage: int, replica: int) -> List[int]:
        r = len(self.devices[stage])
        return [m for m in range(self.num_microbatches) if m % r == replica]

    def with_orders(self, orders: Dict[int, Sequence[Task]], name: Optional[str] = None) -> "Plan":
        return replace(self, orders={d: tuple(o) for d, o in orders.items()}, name=name or self.name,
                       predicted_ms=None)

    def describe(self) -> str:
        parts = [f"[{a}:{b})@{','.join(map(str, g))}" for (a, b), g in
                 zip(zip(self.bounds, self.bounds[1:]), self.devices)]
        t = f" {self.predicted_ms:.1f} ms" if self.predicted_ms is not None else ""
        return f"{self.name}: {' '.join(parts)}{t}"

    def validate(self, num_layers: int, num_devices: int) -> None:
        """Structure only (the simulator finds orders that deadlock)."""
        where = f"plan {self.name!r}"
        check_sizes(num_layers, num_devices, self.num_stages, self.num_microbatches, where)
        seen = check_stages(self.bounds, self.devices, num_layers, num_devices, where)
        for d in self.orders:
            if d not in seen:
                raise ValueError(f"dearcomm: plan {self.name!r}: device {d} has tasks but holds no stage")
        for s, group in enumerate(self.devices):
            for j, d in enumerate(group):
                mine = self.microbatches_of(s, j)
                want = sorted(Task(k, s, m) for k in (FORWARD, BACKWARD) for m in mine)
                validate.sequence(self.orders.get(d, ()), f"orders[{d}]", where)
                got = list(self.orders.get(d, ()))
                for i, task in enumerate(got):
                    validate.instance(task, Task, f"orders[{d}][{i}]", where)
                if sorted(got) != want:
                    raise ValueError(f"dearcomm: plan {self.name!r}: device {d} (stage {s}, replica {j}) must run "
                                     f"F and B of micro-batches {mine} once each; got {[str(t) for t in got]}")
                pos = {t: i for i, t in enumerate(got)}
                for m in mine:
                    if pos[Task(BACKWARD, s, m)] < pos[Task(FORWARD, s, m)]:
                        raise ValueError(f"dearcomm: plan {self.name!r}: device {d} runs B{m} before F{m}")


def check_stages(bounds: Any, devices: Any, num_layers: int, num_devices: int, where: str) -> Dict[int, int]:
    """Stage bounds that rise from 0 to num_layers, and one non-empty group of
    distinct devices of the topology per stage; returns {device: its stage}."""
    validate.stage_bounds(bounds, where)
    validate.stage_devices(devices, where)
    b, S = bounds, len(devices)
    if len(b) != S + 1 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"dearcomm: {where}: stage bounds {tuple(b)} must rise strictly from 0 to "
                         f"{num_layers} with one more entry than the {S} stages")
    seen: Dict[int, int] = {}
    for s, group in enumerate(devices):
        for d in group:
            if not 0 <= d < num_devices:
                raise ValueError(f"dearcomm: {where}: stage {s} uses device {d}; "
                                 f"the topology has devices 0..{num_devices - 1}")
            if d in seen:
                raise ValueError(f"dearcomm: {where}: device {d} is in stages {seen[d]} and {s}; "
                                 "a device holds one stage")
            seen[d] = s
    return seen


def check_sizes(num_layers: int, num_devices: int, num_stages: Optional[int], num_microbatches: int,
                where: str) -> None:
    """The errors every entry point shares: named values, expected vs got."""
    validate.positive_int(num_microbatches, "num_microbatches", where)
    if num_layers < 1:
        raise ValueError(f"dearcomm: {where}: the profile must have at least one layer, got {num_layers}")
    if num_devices < 1:
        raise ValueError(f"dearcomm: {where}: the topology must have at least one device, got {num_devices}")
    if num_stages is not None:
        validate.positive_int(num_stages, "num_stages", where)
        if num_stages > num_layers:
            raise ValueError(f"dearcomm: {where}: {num_stages} stages but only {num_layers} layers; a stage needs "
                             f"at least one layer, so use at most {num_layers} stages")
        if num_stages > num_devices:
            raise ValueError(f"dearcomm: {where}: {num_stages} stages but only {num_devices} devices; a device "
                             f"holds one stage, so use at most {num_devices} stages")


def check_runs_through(plan: Plan) -> None:
    """Raises ValueError if the devices' orders deadlock, whatever the times:
    a forward needs the stage before's forward of its micro-batch, a backward
    the stage after's backward (the last stage's, its own forward), and
    each device runs its tasks in its order. The simulator finds the same
    with times; this check needs none (the runtime runs it)."""
    S = plan.num_stages
    done, pos = set(), {d: 0 for d in plan.orders}

    def needs(task: Task) -> Optional[Task]:
        if task.kind == FORWARD:
            return Task(FORWARD, task.stage - 1, task.microbatch) if task.stage > 0 else None
        if task.stage < S - 1:
            return Task(BACKWARD, task.stage + 1, task.microbatch)
        return Task(FORWARD, task.stage, task.microbatch)

    moved = True
    while moved:
        moved = False
        for d, order in plan.orders.items():
            while pos[d] < len(order) and (needs(order[pos[d]]) is None or needs(order[pos[d]]) in done):
                done.add(order[pos[d]])
                pos[d] += 1
                moved = True
    stuck = {d: order[pos[d]] for d, order in plan.orders.items() if pos[d] < len(order)}
    if stuck:
        waits = "; ".join(f"device {d} waits to run {t} for {needs(t)}" for d, t in sorted(stuck.items()))
        raise ValueError(f"dearcomm: plan {plan.name!r} deadlocks: {waits}. Each device's order must let every "
                         "micro-batch's forward reach the last stage and its backward come back")
