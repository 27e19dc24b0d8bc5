"""Runs a function on N real processes joined by a gloo process group.

Every run has a deadline: a rank that hangs fails the test (and is killed)
instead of stalling CI. Exceptions in a rank come back with their traceback.

gloo ranks are forked from a server process that has imported torch and
dearcomm once (multiprocessing's forkserver): 0.1-0.2 s a run where spawning
fresh interpreters took 2.5 s for 2 ranks and 5 s for 4, hundreds of times a
suite. Each rank then takes the caller's environment, as a spawned one would
(a forked one has the server's, from its start; multiprocessing carries the
working directory and sys.path itself). NCCL ranks are spawned: nothing of
CUDA's may exist in a process before it forks.
"""
from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp

# Collective timeout inside the workers: well under the test's deadline, so a
# stuck collective raises in the worker before the harness kills it.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=45)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, backend, bind_device, args, results, environ):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share two cores
    try:
        os.environ.clear()
        os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = None
        if backend == "nccl":  # one GPU per rank
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=device if bind_device else None)
        try:
            # Serialised to bytes: tensors sent through a Queue live in shared
            # memory that vanishes when this process exits before the parent reads.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((rank, True, buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


_FORKSERVER = None


def _forked():
    """The forkserver context, its server importing torch and dearcomm once."""
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["torch", "torch.distributed", "dearcomm", "tests.multiprocess"])
    return _FORKSERVER


class WorkerError(AssertionError):
    pass


class Died:
    """The result of a rank that exited without returning (allow_death=True)."""

    def __init__(self, exitcode):
        self.exitcode = exitcode

    def __repr__(self):
        return f"Died(exitcode={self.exitcode})"


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, deadline: float = 180.0,
                backend: str = "gloo", allow_death: bool = False, bind_device: bool = True) -> List[Any]:
    """Calls fn(rank, world_size, *args) on every rank; returns the results by rank.

    fn must be importable (a module-level function): ranks are new processes.
    backend="nccl" gives each rank its own GPU. allow_death=True: a rank that
    exits without a result (a test killing it) gets a Died result instead of
    failing the run. bind_device=False: an NCCL group not bound to the rank's GPU."""
    ctx = _forked() if backend == "gloo" else mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, backend, bind_device, args, results,
                                              dict(os.environ)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, {}
    end = time.monotonic() + deadline
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                pending = sorted(set(range(world_size)) - set(out) - set(errors))
                for r in pending:
                    if procs[r].exitcode is not None and results.empty():
                        time.sleep(0.5)  # a result may still be in flight
                        if results.empty() and r not in out and r not in errors:
                            if allow_death:
                                out[r] = Died(procs[r].exitcode)
                            else:
                                errors[r] = f"exited with code {procs[r].exitcode} without a result"
                if time.monotonic() > end:
                    raise WorkerError(f"ranks {pending} did not finish within {deadline:.0f} s (hang?)")
                continue
            if ok:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise WorkerError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [out[r] for r in range(world_size)]
