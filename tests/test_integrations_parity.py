"""dearcomm under Lightning's Trainer and Hugging Face Accelerate, on real
processes (gloo, 2 and 3 ranks, with deadlines), each against the same loop
under the framework's own DDP: the default schedule uninterrupted, and a run
saved by one schedule after the first epoch (while training) and resumed by
another. All with gradient accumulation, clipping to a norm every step
reaches, and a per-step LR scheduler; Lightning also compares what
validation reads, the test loss and the checkpoint saved after fit. One
spawn per world size runs both frameworks: importing Lightning in every
rank costs more than the training."""
import importlib.util

import pytest

missing = [name for name in ("lightning", "accelerate") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"needs {missing}: pip install -r requirements-dev.txt")

from tests.integration_workers import frameworks_worker  # noqa: E402
from tests.multiprocess import run_workers  # noqa: E402


@pytest.mark.parametrize("world_size, saved_by, resumed_by, mixed_and_more", [
    # mixed_and_more: bf16 (Lightning also 16-mixed with its GradScaler), Lightning checkpoints moved
    # between DDP and dearcomm, the `dearcomm:` errors, and examples/lightning_train.py and
    # examples/accelerate_train.py run on these ranks
    (2, "dear", "bytescheduler", True),
    (3, "wfbp", "dear", False),
])
def test_same_parameters_as_the_frameworks_ddp(tmp_path, world_size, saved_by, resumed_by, mixed_and_more):
    run_workers(frameworks_worker, world_size, str(tmp_path), saved_by, resumed_by, mixed_and_more,
                mixed_and_more, deadline=300)


def test_lightning_manual_clipping_and_weight_averaging_match_ddp(tmp_path):
    from tests.lightning_workers import manual_and_averaging_worker
    run_workers(manual_and_averaging_worker, 2, str(tmp_path), deadline=300)


def test_lightning_a_rank_that_fails_ends_the_job_within_the_collective_timeout(tmp_path):
    """The deadline is under the workers' collective timeout (45 s): a
    teardown that waited for the failed rank fails it."""
    from tests.lightning_workers import failure_worker
    seen = run_workers(failure_worker, 2, str(tmp_path), deadline=40)
    assert "a bug on rank 1" in seen[1], seen
    assert seen[0] is not None and "dearcomm" in seen[0], seen
