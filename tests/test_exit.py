"""Short jobs must exit with code 0.

A job that trained correctly used to die now and then with SIGABRT
("terminate called without an active exception") while the interpreter was
finalizing: a gloo worker thread destroying a Work that holds a Python object
(csrc/backends/cpu/python_tls.h for dearcomm's own collectives, which hold
none; dearcomm/_exit.py for torch DDP's beside them). These tests launch many
short 2-rank jobs (tests/exit_worker.py, started the way torchrun starts them)
several at a time, so that the ranks compete for the cores as in the failing
runs, and require every exit code to be 0.

Also a stress tool: python -m tests.test_exit --runs 150 --parallel 3
(--matrix: every configuration of MATRIX in turn; --config "--compare": one).
The abort beside torch DDP depends on timing this launcher does not reproduce
(none in 100 runs of --compare without dearcomm/_exit.py); under torchrun it
does: scripts/exit_stress.sh.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
import torch

from tests.multiprocess import free_port, run_workers

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "exit_worker.py"
CONFIGS = [  # every abort seen before the fix was in a wfbp job: gloo all-reduces launched in backward
    ["--schedule", "dear"],  # sharded; all-gathers still in flight at exit
    ["--schedule", "wfbp"],
    ["--schedule", "dear", "--update", "replicated", "--destroy"],
    ["--schedule", "wfbp", "--sync", "--destroy"],
    ["--schedule", "dear", "--sync", "--destroy"],
    ["--schedule", "wfbp", "--destroy"],
    # torch DDP beside dearcomm, as in a comparison script: DDP's all-reduces
    # hold autograd's Python object (dearcomm/_exit.py)
    ["--schedule", "dear", "--ddp", "--scaler"],
    ["--schedule", "bytescheduler", "--ddp", "--drop"],
    ["--compare", "--schedule", "dear"],
]
# The broad matrix (marked slow; python -m tests.test_exit --matrix): every
# schedule and update, with and without GradScaler, DDP in the same process,
# destroy_process_group() and a dropped model; 64 jobs.
MATRIX = [
    [*base, *flags]
    for base in (["--schedule", "dear"], ["--schedule", "dear", "--update", "replicated"],
                 ["--schedule", "wfbp"], ["--schedule", "bytescheduler"])
    for flags in (list(itertools.compress(["--scaler", "--ddp", "--destroy", "--drop"], mask))
                  for mask in itertools.product([0, 1], repeat=4))
]
RUN_TIMEOUT = 90.0  # seconds for one job, both ranks

_ports_lock = threading.Lock()
_ports_used = set()


def _port() -> int:
    with _ports_lock:  # jobs run concurrently: never hand out one port twice
        while True:
            port = free_port()
            if port not in _ports_used:
                _ports_used.add(port)
                return port


def run_job(args: List[str], world_size: int = 2, timeout: float = RUN_TIMEOUT,
            pythonpath: Optional[str] = None) -> List[Tuple[int, int, str]]:
    """Runs one job; returns (rank, exit code, stderr) per rank. A rank that
    outlives `timeout` is killed and reported with exit code None."""
    port = _port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [pythonpath or str(ROOT), os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    results = []
    end = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(1.0, end - time.monotonic()))
            results.append((rank, proc.returncode, err))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            results.append((rank, None, f"killed after {timeout:.0f} s (hang?)\n{err}"))
    return results


def run_many(runs: int, parallel: int, pythonpath: Optional[str] = None, progress: bool = False,
             configs: Optional[List[List[str]]] = None):
    """Runs `runs` jobs cycling through `configs` (default CONFIGS), `parallel`
    at a time; returns the failures as (run, config, rank, exit code, stderr)."""
    failures = []
    configs = configs or CONFIGS

    def one(i):
        config = configs[i % len(configs)]
        return i, config, run_job(config, pythonpath=pythonpath)

    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        for done, future in enumerate(concurrent.futures.as_completed([pool.submit(one, i) for i in range(runs)]), 1):
            i, config, results = future.result()
            for rank, code, err in results:
                if code != 0:
                    failures.append((i, config, rank, code, err))
            if progress:
                print(f"\r{done}/{runs} jobs, {len({f[0] for f in failures})} failed", end="", flush=True)
    if progress:
        print()
    return failures


def describe(failures) -> str:
    return "\n".join(f"--- job {i} {' '.join(config)}: rank {rank} exited with {code} ---\n{err[-3000:]}"
                     for i, config, rank, code, err in failures)


def test_short_jobs_all_exit_zero():
    runs, parallel = int(os.environ.get("DEARCOMM_EXIT_RUNS", "20")), 3
    failures = run_many(runs, parallel)
    assert not failures, f"{len({f[0] for f in failures})} of {runs} jobs failed:\n{describe(failures)}"


@pytest.mark.slow
def test_every_configuration_exits_zero():
    failures = run_many(len(MATRIX), 3, configs=MATRIX)
    assert not failures, f"{len({f[0] for f in failures})} of {len(MATRIX)} jobs failed:\n{describe(failures)}"


def _exit_handler_probe(rank, world_size):
    """Whether dearcomm's exit handler lets a thread that waits for the GIL
    (as gloo's worker does to destroy a Work launched during backward) take it
    and drop its Python object, while this thread would otherwise keep the GIL."""
    from torch import nn

    import dearcomm
    from dearcomm import _C, _exit

    model = nn.Linear(4, 2)
    dearcomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    registered = _exit._installed

    class Held:
        pass

    held = Held()
    alive = weakref.ref(held)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # never handed over on request: only a release lets the thread in
    try:
        _C._testing.drop_on_another_thread(held)  # returns once that thread is about to take the GIL
        del held
        dropped_before = alive() is None
        _exit.let_collective_threads_finish()
        dropped_after = alive() is None
    finally:
        sys.setswitchinterval(previous)
    return registered, dropped_before, dropped_after


def test_exit_handler_lets_waiting_threads_take_the_gil():
    """The deterministic half of the tests with DDP beside dearcomm: the handler
    wrap() registers releases the GIL before the interpreter finalizes, so a
    thread that waits for it then destroys its Python object while Python can
    still run (dearcomm/_exit.py); without it the thread keeps waiting."""
    for rank, (registered, before, after) in enumerate(run_workers(_exit_handler_probe, 2)):
        assert registered, f"rank {rank}: wrap() registered no exit handler"
        assert not before, f"rank {rank}: the thread took the GIL before any release; the probe proves nothing"
        assert after, f"rank {rank}: the exit handler did not let the waiting thread take the GIL"


def _profile_in_step_probe(rank, world_size):
    from torch import nn

    import dearcomm
    from dearcomm import _exit

    before = _exit._installed
    model = nn.Linear(4, 2)
    dearcomm.profile(model, torch.randn(2, 4), iterations=1, warmup=0, group=torch.distributed.group.WORLD)
    return before, _exit._installed


def test_profiling_in_step_installs_the_exit_handler():
    """dearcomm.profile(group=) meets the other ranks with torch collectives
    (dearcomm/_lockstep.py), whose Works gloo's workers may still drop at exit:
    without the handler a job that only profiled aborted at exit under
    torchrun in 4 of 30 runs, with it in none of 30
    (bash scripts/exit_stress.sh 30 --profile-in-step). This launcher does not
    reproduce that timing, so the handler's registration is what is checked."""
    for rank, (before, after) in enumerate(run_workers(_profile_in_step_probe, 2)):
        assert not before, f"rank {rank}: the handler was registered before anything asked for it"
        assert after, f"rank {rank}: profile(group=) registered no exit handler"


@pytest.mark.parametrize("schedule", ["dear", "bytescheduler"])
def test_profiled_jobs_exit_zero(schedule):
    """Guards against c10d Works holding torch.profiler's records: a session
    that ended while step()'s collectives were in flight left them to end on
    gloo threads in freed profiler state, and the process crashed (SIGSEGV,
    or glibc "free(): invalid size") at the next garbage collection or at exit."""
    failures = [(0, ["--profile", schedule], rank, code, err)
                for rank, code, err in run_job(["--profile", "--schedule", schedule])
                if code != 0]
    assert not failures, describe(failures)


def _tls_probe(rank, world_size):
    """For each schedule: how many references to the Python object that autograd
    stashes in thread-local state during backward are still held, after that
    backward, by the collectives it launched."""
    from torch import nn

    import dearcomm

    held = {}
    for schedule, update in [("wfbp", "replicated"), ("dear", "sharded"), ("dear", "replicated")]:
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=0, schedule=schedule, update=update)
        stashed = []

        def grab(param):
            if torch._C._is_key_in_tls("context"):
                stashed.append(torch._C._get_obj_in_tls("context"))

        for step in range(3):
            optimizer.zero_grad()
            if step == 2:  # not the first backward, which builds the engine
                handle = next(iter(model.parameters())).register_post_accumulate_grad_hook(grab)
            model(torch.randn(4, 8)).sum().backward()
            if step == 2:
                handle.remove()
                if not stashed:
                    return None  # this torch stashes nothing during backward
                # Backward has dropped its own reference; the reductions it
                # launched are still pending (step() waits for them), so any
                # reference left is held by one of them, i.e. by a gloo Work.
                context = stashed.pop()
                held[f"{schedule}/{update}"] = sys.getrefcount(context) - 2  # minus `context`, the argument
            optimizer.step()
    return held


def test_collectives_hold_no_python_objects():
    """The deterministic half of the test above: no Work launched during backward
    holds a Python object, so whichever thread drops a Work last, at whatever
    point of interpreter shutdown, never needs the GIL."""
    held = run_workers(_tls_probe, 2)
    if held[0] is None:
        pytest.skip("this torch keeps no Python object in thread-local state during backward")
    for rank, counts in enumerate(held):
        assert not any(counts.values()), \
            f"rank {rank}: references held by the collectives launched during backward: {counts}"


def _primitive_probe(rank, world_size):
    """For each of the CPU backend's primitives (the benchmarks' _C calls on
    tensors made in Python): how many of the tensors passed in the pending
    collective keeps alive once Python dropped them; and, over 20 calls each
    on tensors whose storage Python has seen (as torch.save and from_numpy
    leave it), how often that storage outlived the collective's wait() and
    handle: then a gloo worker or the poster thread held it last; and over
    10 calls each on numpy memory dropped by the caller before wait(), how
    often it was freed on another thread than the waiting one."""
    import gc

    import numpy as np

    from dearcomm import _C

    freed_elsewhere = []

    class Tracked(np.ndarray):
        def __del__(self):
            if threading.get_ident() != main:
                freed_elsewhere.append(1)

    main = threading.get_ident()

    plain = _C.process_group_backend(torch.distributed.group.WORLD)
    ordered = _C.process_group_backend(torch.distributed.group.WORLD)
    _C.keep_issue_order(ordered)
    calls = {
        "all_reduce": lambda full, shard: _C.all_reduce(plain, full),
        "all_reduce (issue order)": lambda full, shard: _C.all_reduce(ordered, full),
        "reduce_scatter": lambda full, shard: _C.reduce_scatter(plain, full, shard),
        "all_gather": lambda full, shard: _C.all_gather(plain, shard, full),
    }
    alive, outlived, elsewhere = {}, {}, {}
    for name, call in calls.items():
        full, shard = torch.ones(4 * world_size), torch.ones(4)
        refs = [weakref.ref(full), weakref.ref(shard)]
        handle = call(full, shard)
        del full, shard
        gc.collect()
        alive[name] = sum(ref() is not None for ref in refs)
        handle.wait()
        outlived[name] = 0
        for i in range(20):
            full = torch.from_numpy(np.ones(4096 * world_size, dtype=np.float32)) if i % 2 else torch.ones(4096 * world_size)
            shard = torch.ones(4096)
            storages = [weakref.ref(full.untyped_storage()), weakref.ref(shard.untyped_storage())]
            handle = call(full, shard)
            handle.wait()
            del handle, full, shard
            outlived[name] += sum(ref() is not None for ref in storages)
        freed_elsewhere.clear()
        for _ in range(10):
            full = torch.from_numpy(np.ones(4096 * world_size, dtype=np.float32).view(Tracked))
            shard = torch.from_numpy(np.ones(4096, dtype=np.float32).view(Tracked))
            handle = call(full, shard)
            del full, shard
            handle.wait()
            del handle
        elsewhere[name] = len(freed_elsewhere)
    return alive, outlived, elsewhere


def test_primitives_leave_nothing_python_owns_to_other_threads():
    """A gloo worker or the poster thread may drop a collective's Works last;
    if they held a tensor made in Python, or memory whose storage Python has
    seen, that thread took the GIL to free it, and at interpreter exit the
    process aborted ("terminate called without an active exception"): a
    2-rank script of _C.all_reduce calls on Python tensors, then exiting, did
    so in 6 of 10 runs, and on tensors from torch.from_numpy in 7 of 10 after
    a first fix that left their storage to those threads. Collectives hold
    tensors over the caller's memory that refer to no Python object, and the
    waiting thread drops the last of them."""
    for rank, (alive, outlived, elsewhere) in enumerate(run_workers(_primitive_probe, 2)):
        assert not any(alive.values()), f"rank {rank}: tensors kept alive by pending collectives: {alive}"
        assert not any(outlived.values()), f"rank {rank}: storages that outlived wait() and the handle: {outlived}"
        assert not any(elsewhere.values()), f"rank {rank}: memory dropped before wait() freed off its thread: {elsewhere}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Runs many short jobs and counts those that do not exit with 0.")
    parser.add_argument("--runs", type=int, default=150)
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--pythonpath", default=None, help="where to import dearcomm from (default: this checkout)")
    parser.add_argument("--matrix", action="store_true", help="cycle through MATRIX instead of CONFIGS")
    parser.add_argument("--config", default=None, help='one configuration, e.g. "--schedule dear --ddp --scaler"')
    options = parser.parse_args()
    start = time.monotonic()
    chosen = [options.config.split()] if options.config else MATRIX if options.matrix else CONFIGS
    failed = run_many(options.runs, options.parallel, options.pythonpath, progress=True, configs=chosen)
    print(describe(failed))
    print(f"{len({f[0] for f in failed})} of {options.runs} jobs failed "
          f"({len(failed)} ranks) in {time.monotonic() - start:.0f} s")
