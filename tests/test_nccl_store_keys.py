"""The NCCL backend's ids meet in the default store under keys every member of a
group must name alike. Checked with gloo groups (the keys need no GPU): a rank
in two groups builds engines on both, its partners on one each."""
import datetime

import torch.distributed as dist

from dearcomm import _cuda
from tests.multiprocess import run_workers


def _exchange_like_nccl(rank, world_size):
    first, second = dist.new_group([0, 1]), dist.new_group([0, 2])
    mine = [g for g, members in ((first, (0, 1)), (second, (0, 2))) if rank in members]
    store = dist.distributed_c10d._get_default_store()
    seen = []
    for group in mine:  # as nccl_backend: the group's rank 0 publishes, the others wait for it
        key = _cuda.store_prefix(group) + "/comm"
        if dist.get_rank(group) == 0:
            store.set(key, f"from {rank}")
        store.wait([key], datetime.timedelta(seconds=10))
        seen.append(store.get(key).decode())
    again = _cuda.store_prefix(dist.group.WORLD), _cuda.store_prefix(dist.group.WORLD)
    return seen, again


def test_a_rank_in_two_groups_meets_each_group_under_the_same_keys():
    seen = run_workers(_exchange_like_nccl, 3, deadline=90)
    assert [s for s, _ in seen] == [["from 0", "from 0"], ["from 0"], ["from 0"]]
    world = {again for _, again in seen}
    assert len(world) == 1, f"the world group's keys differ between ranks: {world}"
    (first, second), = world
    assert first != second, "two engines on one group share their keys"
