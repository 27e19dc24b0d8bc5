"""At interpreter exit, let c10d's worker threads drop their Works while Python
still runs.

A gloo worker thread is the last owner of every Work whose handle Python did
not keep: torch DDP's all-reduces, for one (DDP keeps only their futures). A
Work launched during backward holds the Python object that autograd keeps in
thread-local state for the whole backward, so destroying it takes the GIL. A
script that ends within a few milliseconds of DDP's last backward can keep the
GIL until the interpreter starts finalizing; the worker is still waiting for it
then, CPython ends the waiting thread with pthread_exit, and its unwinding
through a noexcept destructor aborts the process ("terminate called without an
active exception", SIGABRT; core: ProcessGroupGloo::runLoop ->
~AsyncAllreduceWork -> ~ThreadLocalState -> SafePyObject -> gil_scoped_acquire
-> PyThread_exit_thread -> std::terminate). torch DDP alone, without dearcomm,
aborts like that in 7 of 60 runs of a two-step script (README, *Exit*).

dearcomm's own collectives hold no Python object (csrc/backends/cpu/python_tls.h);
this handler covers the ones it does not launch, in any process that wrapped a
model or measured in lockstep (profile(group=), measure_contention: their
meetings are torch collectives; a job that only profiled aborted at exit in 4
of 30 torchrun runs without it): it releases the GIL once, briefly, before
finalization, so that a worker
waiting for it finishes then. Also after destroy_process_group(): it shuts the
backends down, but gloo's has no shutdown of its own, and its workers live on
until the last reference to the group goes (a DDP model keeps one), which may
be during finalization.
"""
from __future__ import annotations

import atexit
import time

# Enough for a worker that completed its Work to be scheduled and take the GIL
# (it was already waiting for it in every abort seen); short enough not to be
# noticed at exit.
GRACE_SECONDS = 0.05

_installed = False


def install() -> None:
    """Registers the handler once per process (wrap() and Lockstep call it)."""
    global _installed
    if not _installed:
        atexit.register(let_collective_threads_finish)
        _installed = True


def let_collective_threads_finish() -> None:
    time.sleep(GRACE_SECONDS)  # releases the GIL: a worker waiting for it takes it now
