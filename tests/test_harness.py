"""The multi-process harness (tests/multiprocess.py): its ranks see what the
test set up, as spawned processes would, though they fork from a server that
started before it."""
import os

import pytest

from tests.multiprocess import WorkerError, run_workers


def environment_and_cwd(rank, world_size):
    return os.environ.get("DEARCOMM_HARNESS_PROBE"), os.getcwd()


def raises_on_rank_1(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    return rank


def test_ranks_see_the_callers_environment_and_working_directory(monkeypatch, tmp_path):
    run_workers(environment_and_cwd, 2)  # the server is up before the test changes anything
    monkeypatch.setenv("DEARCOMM_HARNESS_PROBE", "set by the test")
    monkeypatch.chdir(tmp_path)
    assert run_workers(environment_and_cwd, 2) == [("set by the test", str(tmp_path))] * 2
    monkeypatch.delenv("DEARCOMM_HARNESS_PROBE")
    assert [value for value, _ in run_workers(environment_and_cwd, 3)] == [None] * 3


def test_a_rank_error_comes_back_with_its_traceback():
    with pytest.raises(WorkerError, match="(?s)rank 1 .*RuntimeError: rank 1 fails on purpose"):
        run_workers(raises_on_rank_1, 2)
