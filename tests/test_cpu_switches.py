"""The CPU backend's environment switches (DEARCOMM_CPU_ORDERED,
DEARCOMM_CPU_POSTER) choose which collectives it issues: ranks that set them
differently would each wait for collectives the other never issues. They
are compared between ranks first (dearcomm/_cpu_switches.py)."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dearcomm
from dearcomm._cpu_switches import _meaning
from tests.multiprocess import run_workers


def test_values_compare_by_what_the_backend_makes_of_them():
    assert _meaning("DEARCOMM_CPU_ORDERED", "1") == _meaning("DEARCOMM_CPU_ORDERED", "yes") == "1"
    assert _meaning("DEARCOMM_CPU_ORDERED", "0") == "0"
    assert _meaning("DEARCOMM_CPU_ORDERED", None) == "unset" != _meaning("DEARCOMM_CPU_ORDERED", "1")
    assert _meaning("DEARCOMM_CPU_POSTER", "1") == _meaning("DEARCOMM_CPU_POSTER", "on") != _meaning(
        "DEARCOMM_CPU_POSTER", "0")


def _train_with(rank, world_size, values, schedule):
    """Rank r trains two steps with DEARCOMM_CPU_ORDERED=values[r] (None:
    unset); returns the error it raised, or None."""
    if values[rank] is None:
        os.environ.pop("DEARCOMM_CPU_ORDERED", None)
    else:
        os.environ["DEARCOMM_CPU_ORDERED"] = values[rank]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model, optimizer = dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), schedule=schedule)
    try:
        for _ in range(2):
            F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,))).backward()
            optimizer.step()
            optimizer.zero_grad()
        model.sync()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("schedule", ["dear", "deft"])
def test_ranks_that_set_a_switch_differently_fail_with_its_name(schedule):
    # deft asks the backend for ordered all-reduces: unset on one rank and
    # "0" on another would issue gloo's allreduce against tagged transfers.
    errors = run_workers(_train_with, 3, [None, "0", None], schedule, deadline=90)
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} trained"
        assert ("the ranks set DEARCOMM_CPU_ORDERED differently (DEARCOMM_CPU_ORDERED: rank 0 unset, rank 1 0, "
                "rank 2 unset)") in error, error


def test_ranks_that_set_a_switch_alike_train():
    assert run_workers(_train_with, 2, ["1", "yes"], "dear", deadline=90) == [None, None]
