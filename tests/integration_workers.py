"""One rank of tests/test_integrations_parity.py: both frameworks in one
process (importing Lightning costs more than the training)."""
import sys


def frameworks_worker(rank, world_size, tmp, saved_by, resumed_by, mixed, examples):
    import dearcomm  # noqa: F401
    import dearcomm.integrations  # noqa: F401
    imported = {"lightning", "pytorch_lightning", "accelerate"} & set(sys.modules)
    assert not imported, f"import dearcomm imported {imported}: the frameworks are optional extras"

    from tests import accelerate_workers, lightning_workers
    lightning_workers.parity_worker(rank, world_size, tmp, saved_by, resumed_by, mixed)
    accelerate_workers.parity_worker(rank, world_size, tmp, saved_by, resumed_by, mixed)
    if examples:
        lightning_workers.errors_worker(rank, world_size, tmp)
        accelerate_workers.errors_worker(rank, world_size, tmp)
        accelerate_workers.ddp_kwargs_worker(rank, world_size)
        lightning_workers.example_worker(rank, world_size)
        accelerate_workers.example_worker(rank, world_size)
