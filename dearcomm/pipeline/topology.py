"""Devices and the links between them: bandwidth, latency, and which shared
resources (a link, a NIC's sending or receiving side) a transfer occupies.

Connectivity is arbitrary: a pair with no direct link is routed over the
widest path (largest bottleneck bandwidth, then fewest hops), paying every
hop's latency and occupying every hop's resources. A device with no link at
all, or devices split into islands, are errors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from . import validate

GB = 1e9
MiB = float(1 << 20)
Resource = Hashable


@dataclass(frozen=True)
class TransferCpu:
    """CPU time (ms) a point-to-point transfer costs the devices at its two
    ends, on top of the link time: where devices are processes sharing a
    host's cores (gloo over TCP, emulated links), copying, the socket and the
    kernel's packet work take compute away from the stages. Zero (the
    default) is the usual accelerator model, where transfers are free for
    the compute. Calibrate with benchmarks/gloo_cpu_cost.py."""
    send_ms_per_message: float = 0.0
    send_ms_per_mib: float = 0.0
    recv_ms_per_message: float = 0.0
    recv_ms_per_mib: float = 0.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            validate.finite_nonnegative(value, name, "TransferCpu", kind="cost")

    def send_ms(self, nbytes: float) -> float:
        return self.send_ms_per_message + self.send_ms_per_mib * nbytes / MiB if nbytes > 0 else 0.0

    def recv_ms(self, nbytes: float) -> float:
        return self.recv_ms_per_message + self.recv_ms_per_mib * nbytes / MiB if nbytes > 0 else 0.0

    def __bool__(self) -> bool:
        return any(vars(self).values())


@dataclass(frozen=True)
class Topology:
    """bandwidth[i][j]: bytes/s of the direct link i -> j (0: none);
    latency[i][j]: seconds per message on it; resources[(i, j)]: what a
    transfer i -> j holds while it runs (default: the link itself), so that
    transfers sharing a NIC queue behind each other; transfer_cpu: the compute
    time a transfer takes from its sender and receiver (default: none);
    host_cores: if > 0, the devices are processes on one host with this many
    cores (fractional: what other load leaves), which their tasks and their
    transfers' CPU work share (default 0: every device computes on its own
    processor); compute_slowdown (κ) and comm_slowdown (λ): the other model
    of the same effect, as the data-parallel simulator takes it (Network's
    fields of those names, measured by dearcomm.contention): a device
    computes κ times slower while a transfer at it is on the link, which
    runs λ times slower while a device at one of its ends computes (an
    all-reduce runs after its stage's last backward, when its devices have
    nothing left to compute, so neither factor changes it) (default 1: no
    contention; not with transfer_cpu or host_cores, which model the same
    CPU work); memory_bytes: each device's memory for its stage's
    parameters, gradients, optimizer state and stashed activations (memory.py;
    default (): unlimited)."""
    bandwidth: Tuple[Tuple[float, ...], ...]
    latency: Tuple[Tuple[float, ...], ...]
    name: str = "custom"
    link_resources: Dict[Tuple[int, int], Tuple[Resource, ...]] = field(default_factory=dict, compare=False)
    transfer_cpu: TransferCpu = TransferCpu()
    host_cores: float = 0
    compute_slowdown: float = 1.0
    comm_slowdown: float = 1.0
    memory_bytes: Tuple[float, ...] = ()

    def __post_init__(self) -> None:
        where = f"topology {self.name!r}"
        validate.finite_nonnegative(self.host_cores, "host_cores", where)
        for name in ("compute_slowdown", "comm_slowdown"):
            validate.slowdown_factor(getattr(self, name), name, where)
        validate.sequence(self.memory_bytes, "memory_bytes", where)
        if self.memory_bytes and len(self.memory_bytes) != len(self.bandwidth):
            raise ValueError(f"dearcomm: topology {self.name!r}: memory_bytes must give one capacity per device "
                             f"({len(self.bandwidth)}) or be empty (unlimited), got {len(self.memory_bytes)}")
        for i, cap in enumerate(self.memory_bytes):
            validate.finite_positive(cap, f"memory_bytes[{i}]", where, kind="memory")
        validate.instance(self.transfer_cpu, TransferCpu, "transfer_cpu", where)
        if self.contended and (self.transfer_cpu or self.host_cores):
            raise ValueError(f"dearcomm: {where}: compute_slowdown/comm_slowdown and transfer_cpu/host_cores are two "
                             "models of the transfers' CPU work; set one of them, not both")
        validate.instance(self.link_resources, Mapping, "link_resources", where)
        validate.sequence(self.bandwidth, "bandwidth", where)
        n = len(self.bandwidth)
        if n < 1:
            raise ValueError("dearcomm: a topology needs at least one device, got an empty bandwidth matrix")
        for name, m in (("bandwidth", self.bandwidth), ("latency", self.latency)):
            validate.sequence(m, name, where)
            for row in m:
                validate.sequence(row, f"a row of {name}", where)
            if len(m) != n or any(len(row) != n for row in m):
                raise ValueError(f"dearcomm: topology {self.name!r}: {name} must be {n}x{n}, "
                                 f"got rows of lengths {[len(r) for r in m]}")
            note = " (0: no link)" if name == "bandwidth" else ""
            for i, row in enumerate(m):
                for j, v in enumerate(row):
                    validate.finite_nonnegative(v, f"{name}[{i}][{j}]", where, kind=name, note=note)
        if n > 1:
            lonely = [i for i in range(n) if not any(self.bandwidth[i][j] > 0 or self.bandwidth[j][i] > 0
                                                     for j in range(n) if j != i)]
            if lonely:
                raise ValueError(f"dearcomm: topology {self.name!r}: device(s) {lonely} have no link to any other "
                                 "device; give them a bandwidth > 0 to at least one device or leave them out")
        object.__setattr__(self, "_routes", _widest_routes(self.bandwidth))
        missing = [(i, j) for i in range(n) for j in range(n) if i != j and self._routes[i][j] is None]
        if missing:
            raise ValueError(f"dearcomm: topology {self.name!r} is disconnected: no path {missing[0][0]} -> "
                             f"{missing[0][1]} ({len(missing)} pairs without a route); connect the islands")

    @property
    def contended(self) -> bool:
        """Compute and transfers slow each other by the measured factors."""
        return self.compute_slowdown != 1 or self.comm_slowdown != 1

    @property
    def size(self) -> int:
        return len(self.bandwidth)

    def memory_of(self, device: int) -> float:
        """Bytes device `device` holds; infinite when the topology sets no limit."""
        return self.memory_bytes[device] if self.memory_bytes else math.inf

    def with_memory(self, capacity) -> "Topology":
        """This topology with a memory limit: one number of bytes for every
        device, or one per device; None removes the limit."""
        if capacity is None:
            return replace(self, memory_bytes=())
        if isinstance(capacity, (int, float)) or (hasattr(capacity, "ndim") and capacity.ndim == 0):
            return replace(self, memory_bytes=(capacity,) * self.size)
        if isinstance(capacity, (str, bytes)) or not hasattr(capacity, "__iter__"):
            return replace(self, memory_bytes=(capacity,) * self.size)  # refused, named, by the check of memory_bytes
        return replace(self, memory_bytes=tuple(capacity))  # a list, tuple or array: one per device

    def route(self, src: int, dst: int) -> List[int]:
        return self._routes[src][dst]

    def link_bandwidth(self, src: int, dst: int) -> float:
        """Bytes/s of the route src -> dst (its narrowest hop)."""
        hops = self.route(src, dst)
        return min(self.bandwidth[a][b] for a, b in zip(hops, hops[1:]))

    def link_latency(self, src: int, dst: int) -> float:
        hops = self.route(src, dst)
        return sum(self.latency[a][b] for a, b in zip(hops, hops[1:]))

    def resources(self, src: int, dst: int) -> Tuple[Resource, ...]:
        hops = self.route(src, dst)
        out: List[Resource] = []
        for a, b in zip(hops, hops[1:]):
            out.extend(self.link_resources.get((a, b), (("link", a, b),)))
        return tuple(out)

    def transfer_ms(self, src: int, dst: int, nbytes: float) -> Tuple[float, float]:
        """(occupancy, latency) in ms of sending nbytes src -> dst: the route's
        resources are busy for the occupancy; the data arrive latency later."""
        if src == dst or nbytes <= 0:
            return 0.0, 0.0
        bandwidth, latency = self.link_bandwidth(src, dst), self.link_latency(src, dst)
        occupancy = nbytes / bandwidth * 1e3 if bandwidth > 0 else math.inf
        self._check_finite(occupancy + latency * 1e3, nbytes, bandwidth, latency, f"{src} -> {dst}")
        return occupancy, latency * 1e3

    def _check_finite(self, ms: float, nbytes: float, bandwidth: float, latency: float, link: str) -> None:
        """A transfer that never ends (no bandwidth on the route, or so little,
        or so much latency, that the time overflows) is an error here, not an
        infinite time that a planner or the simulator would carry on with."""
        if not math.isfinite(ms):
            raise RuntimeError(f"dearcomm: topology {self.name!r}: {nbytes:g} bytes over {link} (bandwidth "
                               f"{bandwidth:g} bytes/s, latency {latency:g} s) never arrive; a route that a plan "
                               "uses needs a bandwidth > 0 and a latency that deliver its data in finite time")

    def allreduce_ms(self, devices: Sequence[int], nbytes: float) -> float:
        """Ring all-reduce over `devices` in that order: 2(r-1) steps of n/r
        bytes, each paced by the ring's slowest hop (α-β)."""
        r = len(devices)
        if r < 2 or nbytes <= 0:
            return 0.0
        ring = list(zip(devices, devices[1:] + devices[:1]))
        bw = min(self.link_bandwidth(a, b) for a, b in ring)
        alpha = max(self.link_latency(a, b) for a, b in ring)
        ms = (2 * (r - 1) * alpha + 2 * (r - 1) / r * nbytes / bw) * 1e3 if bw > 0 else math.inf
        self._check_finite(ms, nbytes, bw, alpha, f"the ring {' -> '.join(map(str, list(devices) + [devices[0]]))}")
        return ms

    def allreduce_resources(self, devices: Sequence[int]) -> Tuple[Resource, ...]:
        ring = list(zip(devices, list(devices[1:]) + list(devices[:1])))
        return tuple(dict.fromkeys(r for a, b in ring for r in self.resources(a, b)))


def _widest_routes(bw: Sequence[Sequence[float]]) -> List[List[Optional[List[int]]]]:
    n = len(bw)
    routes: List[List[Optional[List[int]]]] = [[None] * n for _ in range(n)]
    for s in range(n):
        # Dijkstra-like: maximise the bottleneck, then minimise hops.
        best = {s: (float("inf"), 0)}
        prev: Dict[int, int] = {}
        done = set()
        while True:  # ends within n passes: each one finishes a device not finished before
            cands = [(v, k) for k, v in best.items() if k not in done]
            if not cands:
                break
            (width, hops), u = max(cands, key=lambda c: (c[0][0], -c[0][1], -c[1]))
            done.add(u)
            for v in range(n):
                if v != u and bw[u][v] > 0 and v not in done:
                    cand = (min(width, bw[u][v]), hops + 1)
                    if v not in best or (cand[0], -cand[1]) > (best[v][0], -best[v][1]):
                        best[v], prev[v] = cand, u
        for t in range(n):
            if t == s:
                routes[s][t] = [s]
            elif t in done:
                path = [t]
                while path[-1] != s:  # prev leads to devices finished earlier, back to s
                    path.append(prev[path[-1]])
                routes[s][t] = path[::-1]
    return routes


# ---- presets ----------------------------------------------------------------------

def uniform(n: int, gbytes_per_s: float = 10.0, latency_us: float = 5.0, name: str = "") -> Topology:
    """Every pair on its own link of the same speed."""
    validate.positive_int(n, "n", "uniform()")
    validate.finite_positive(gbytes_per_s, "gbytes_per_s", "uniform()")
    validate.finite_nonnegative(latency_us, "latency_us", "uniform()")
    bw = tuple(tuple(0.0 if i == j else gbytes_per_s * GB for j in range(n)) for i in range(n))
    lat = tuple(tuple(0.0 if i == j else latency_us * 1e-6 for j in range(n)) for i in range(n))
    return Topology(bw, lat, name or f"uniform-{gbytes_per_s:g}GB/s")


def switched(rates: Sequence[float], latency_us: float = 30.0, name: str = "") -> Topology:
    """One NIC per device into a switch: rates[i] bytes/s each way. A transfer
    i -> j runs at min(rate_i, rate_j) and holds i's sending side and j's
    receiving side, as netlab's tbf on both ends of every veth does."""
    validate.sequence(rates, "rates", "switched()")
    for i, rate in enumerate(rates):  # a device without a NIC rate would have no link at all
        validate.finite_positive(rate, f"rates[{i}]", "switched()")
    validate.finite_nonnegative(latency_us, "latency_us", "switched()")
    n = len(rates)
    bw = tuple(tuple(0.0 if i == j else min(rates[i], rates[j]) for j in range(n)) for i in range(n))
    lat = tuple(tuple(0.0 if i == j else latency_us * 1e-6 for j in range(n)) for i in range(n))
    res = {(i, j): (("out", i), ("in", j)) for i in range(n) for j in range(n) if i != j}
    return Topology(bw, lat, name or "switched", res)


def servers(n: int, per_server: int, nvlink_pairs: bool, intra_gbps: float, nvlink_gbps: float,
            nic_gbps: float, intra_latency_us: float = 2.0, nic_latency_us: float = 30.0,
            name: str = "") -> Topology:
    """Servers of `per_server` devices: NVLink between devices 2k and 2k+1 of a
    server (if nvlink_pairs), the intra-server bus (PCIe) between the others, and
    one NIC per server shared by every transfer that leaves or enters it.
    A zero rate is allowed (that kind of link is missing); the topology then
    refuses devices it leaves unreachable."""
    validate.positive_int(n, "n", "servers()")
    validate.positive_int(per_server, "per_server", "servers()")
    for field_name, value in (("intra_gbps", intra_gbps), ("nvlink_gbps", nvlink_gbps), ("nic_gbps", nic_gbps),
                              ("intra_latency_us", intra_latency_us), ("nic_latency_us", nic_latency_us)):
        validate.finite_nonnegative(value, field_name, "servers()")
    bw = [[0.0] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    res: Dict[Tuple[int, int], Tuple[Resource, ...]] = {}
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            si, sj = i // per_server, j // per_server
            if si == sj and nvlink_pairs and i // 2 == j // 2:
                bw[i][j], lat[i][j] = nvlink_gbps * GB, intra_latency_us * 1e-6
            elif si == sj:
                bw[i][j], lat[i][j] = intra_gbps * GB, intra_latency_us * 1e-6
                res[(i, j)] = (("bus", si, i, j),)
            else:
                bw[i][j], lat[i][j] = nic_gbps * GB, nic_latency_us * 1e-6
                res[(i, j)] = (("nic-out", si), ("nic-in", sj))
    return Topology(tuple(map(tuple, bw)), tuple(map(tuple, lat)), name or f"servers-{per_server}", res)


PRESETS = ("nvlink-pairs", "ethernet-10g")


def preset(name: str, n: int) -> Topology:
    """The two connectivity presets of the benchmark:
    - nvlink-pairs: servers of 4 GPUs, NVLink pairs (~100 GB/s), PCIe between
      the pairs (~12 GB/s), one 10GbE NIC (~1.1 GB/s, 30 µs) per server;
    - ethernet-10g: one GPU per host, every host on 10GbE (~1.1 GB/s, 30 µs)."""
    validate.positive_int(n, "n", f"preset({name!r})")
    if name == "nvlink-pairs":
        return servers(n, 4, True, intra_gbps=12.0, nvlink_gbps=100.0, nic_gbps=1.1, name=name)
    if name == "ethernet-10g":
        return switched([1.1 * GB] * n, latency_us=30.0, name=name)
    raise ValueError(f"dearcomm: unknown topology preset {name!r}; expected one of {PRESETS}")
