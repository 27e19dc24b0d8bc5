"""The CPU engine's own gloo connections.

On CUDA the engine talks over NCCL communicators of its own. Over the
training group on a CPU, everything else sent on that group would wait for
the gradient bytes queued before it, since gloo sends a pair's messages over
one TCP connection in order: the buffers' broadcast at each forward and a
user's ``dist.all_reduce(loss)`` after step() would start only once dear's
all-gathers (issued in step()) or deft's delayed all-reduce were through,
and the forward they were to overlap with would wait too (1.03-1.40x per
iteration at 1 Gbit/s: benchmarks/traffic_beside_gradients.py).

So the engine gets a gloo backend of its own over the same ranks, numbered
as in the training group, made from the training group's store under a key
of its own and kept out of c10d's registry of groups: ``dist.new_group``
must be called by every rank of the world (a subgroup's engine is made by
its ranks alone), and ``new_group(use_local_synchronization=True)``
advances c10d's group counter on the calling ranks only, after which a group
made by every rank gets a different name on each and its rendezvous waits
until it times out. The runtime keeps it across rebuilds of its engine
(auto) until close() or until it is collected.
"""
from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from ._rank0 import rank0s

logger = logging.getLogger("dearcomm")


def engine_group(group: dist.ProcessGroup, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks for the CPU engine's collectives,
    where ``group`` is a gloo group of more than one rank whose store c10d
    holds; ``group`` itself otherwise (MPI, UCC or another CPU backend keeps
    its own transport). A collective on ``group``: its ranks call it when
    they build their engine."""
    if dist.get_world_size(group) == 1 or not isinstance(group._get_backend(torch.device("cpu")),
                                                         dist.ProcessGroupGloo):
        return group
    try:
        store = dist.distributed_c10d._get_process_group_store(group)
    except KeyError:
        logger.debug("dearcomm: no store for the training group; the engine sends over it")
        return group
    # Rank 0 numbers it and every rank takes rank 0's number: processes that
    # made different numbers of engines before (a rank restarted in place,
    # models built in another order) still meet under one key.
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    number = rank0s(store.add("dearcomm/engine/made", 1) if rank == 0 else None, group)
    store = dist.PrefixStore(f"dearcomm/engine/{number}/", store)
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)  # connects to every rank of the group
    engine = dist.ProcessGroup(store, rank, size)
    engine._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    engine._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    engine._set_group_desc("dearcomm engine")
    return engine
