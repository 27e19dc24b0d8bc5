"""What a collective costs the host's CPU (Network.host_ms, host_ms_per_mib).

On a CPU every collective spends CPU time of its own (gloo's worker threads
waking, its TCP exchanges, the engine's bookkeeping) whatever its size:
about 0.1-0.3 ms for a reduce-scatter or all-gather and 0.3-1.4 ms for an
all-reduce on the 4-rank 1 Gbit/s rows of docs/benchmarks.md. Where the
ranks' compute fills every core, that time comes out of compute, so a layout
of many small collectives (0.25 MiB partitions, US-Byte's blocks) trains
slower than its bytes say: on ResNet at 4 ranks each rank's wall time grew
by about 1.6 ms per ms of CPU its collectives took.

Two measured pieces make the cost:
  - the CPU per collective, c0: the part of a collective's CPU time that does
    not grow with its bytes (network_probe: the CPU of a 16 KiB call;
    fit_host_ms: a fit of CPU against the number of collectives and their
    bytes, from a benchmark's layouts);
  - how much per-rank wall time a CPU second costs (cores_share): the ranks
    on this host over its cores, where their compute threads fill every core
    (each rank's collectives take from the cores every rank computes on), and
    0 where cores are left over for the collectives to run on, or on a GPU.

The same fits give the CPU per byte, c1 (Network.host_ms_per_mib): the
simulator does not stretch compute by it (compute_slowdown, measured beside
large collectives, does that) but bounds the iteration by the CPU it needs.
On loopback, 2 ranks on 2 cores, DDP's process took 493 ms of CPU per
iteration of an MLP whose compute alone took 417 and whose all-reduces alone
took 38: twice their CPU alone (comm_slowdown there read 1.98). The
iteration measured 531 ms; the simulated timeline 503, the bound 541.
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, Mapping, Optional, Tuple

import numpy as np
import torch

from ._nnls import nnls2
from .prediction import COST_KINDS, MIB, _check_number


def cores_share(device: torch.device, local_ranks: Optional[int] = None, threads: Optional[int] = None,
                cores: Optional[int] = None) -> float:
    """Wall seconds of a rank's compute that one CPU second of its
    collectives costs: ``local_ranks / cores`` where ``local_ranks *
    threads`` (compute threads) fill the ``cores``, else 0; 0 on a GPU.
    Defaults: torchrun's LOCAL_WORLD_SIZE (1 without it), torch's intra-op
    threads, the cores this process may run on."""
    if device.type != "cpu":
        return 0.0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if local_ranks is None else local_ranks
    threads = torch.get_num_threads() if threads is None else threads
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for name, value in (("local_ranks", local_ranks), ("threads", threads), ("cores", cores)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"dearcomm: cores_share's {name} must be an int >= 1, got {value!r}")
    return local_ranks / cores if local_ranks * threads >= cores else 0.0


def fit_host_ms(samples: Mapping[str, Iterable[Tuple[float, float, float]]], share: float) -> Dict[str, float]:
    """Network.host_ms from measured CPU time: ``samples`` {kind: [(collectives,
    bytes, cpu_ms), ...]} (the CPU this process spent while they ran); per
    kind, the CPU per collective of a non-negative fit cpu = c0·collectives +
    c1·bytes, times ``share`` (cores_share). A kind whose samples cannot
    separate the two (one point, or collectives proportional to bytes) gets 0:
    nothing measured is charged."""
    return fit_host_cpu(samples, share)[0]


def fit_host_cpu(samples: Mapping[str, Iterable[Tuple[float, float, float]]],
                 share: float) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(Network.host_ms, Network.host_ms_per_mib) from fit_host_ms's
    ``samples``: per kind, c0 and c1 of the same fit (c1 per MiB), each times
    ``share``; both 0 for a kind whose samples cannot separate them."""
    _check_number("share", share, allow_zero=True)
    per_call, per_mib = {}, {}
    for kind, rows in samples.items():
        if kind not in COST_KINDS:
            raise ValueError(f"dearcomm: host CPU samples for {kind!r}; expected some of {list(COST_KINDS)}")
        rows = [tuple(r) for r in rows]
        for n, nbytes, cpu in rows:
            _check_number(f"{kind} collectives", n, allow_zero=False)
            _check_number(f"{kind} bytes", nbytes, allow_zero=True)
            _check_number(f"{kind} cpu_ms", cpu, allow_zero=True)
        A = np.array([[n, nbytes / MIB] for n, nbytes, _ in rows], dtype=float)
        if len(rows) < 2 or np.linalg.matrix_rank(A) < 2:
            per_call[kind] = per_mib[kind] = 0.0
            continue
        c0, c1 = nnls2(A, np.array([cpu for *_, cpu in rows], dtype=float))
        per_call[kind], per_mib[kind] = share * float(c0), share * float(c1)
    return per_call, per_mib
