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
until it times out. Its connections and threads go with the engine.
"""
from __future__ import annotations

import datetime
import itertools
import logging
from typing import Dict

import torch
import torch.distributed as dist

logger = logging.getLogger("dearcomm")

_made: Dict[str, "itertools.count[int]"] = {}
"""Per training group (by name), how many engine groups this process made on
it: every rank of the group makes them in the same order (at the first
training forward of each model), so the count names each on all of them."""


def engine_group(group: dist.ProcessGroup, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks for the CPU engine's collectives;
    ``group`` itself where it has a single rank or c10d holds no store for it
    (a group made outside ``dist.new_group``)."""
    if dist.get_world_size(group) == 1:
        return group
    try:
        store = dist.distributed_c10d._get_process_group_store(group)
    except KeyError:
        logger.debug("dearcomm: no store for the training group; the engine sends over it")
        return group
    number = next(_made.setdefault(group.group_name, itertools.count()))
    store = dist.PrefixStore(f"dearcomm/engine/{number}/", store)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)  # connects to every rank of the group
    engine = dist.ProcessGroup(store, rank, size)
    engine._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    engine._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    engine._set_group_desc("dearcomm engine")
    return engine
