"""The NCCL backend's device-free bookkeeping, on CPU with fake completions
(dearcomm._C._testing): the watchdog loop, the teardown order and the event
pool. On a GPU the same code runs with CUDA events (tests/test_gpu_nccl.py)."""
import gc
import threading
import time

import pytest

from dearcomm._C import _testing

POLL_MS = 10


def wait_until(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def in_thread(fn, seconds=5.0):
    """Runs fn in a thread; True if it returned within `seconds`."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_watch_never_waits_for_a_poll_in_progress():
    """Guards against the watchdog holding its lock while it queries events:
    watch() (called at every collective launch) then waits for earlier
    collectives to finish on the GPU, and nothing overlaps."""
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    slow = _testing.FakeCompletion()
    slow.set_blocking(True)  # its poll stays inside the event query
    watchdog.watch(slow, "slow collective")
    assert slow.wait_polls(1, 10.0), "the watchdog never polled"
    try:
        assert in_thread(lambda: watchdog.watch(_testing.FakeCompletion(), "next collective")), \
            "watch() blocked while the watchdog was polling an earlier collective"
    finally:
        slow.set_blocking(False)
        watchdog.stop()


def test_polls_sleep_between_rounds():
    """Guards against a watchdog that spins (millions of event queries a
    second, a core pegged per rank): rounds are poll_ms apart."""
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    running = _testing.FakeCompletion()
    watchdog.watch(running, "long collective")
    time.sleep(0.3)
    watchdog.stop()
    # 0.3 s / 10 ms = 30 rounds; a spinning loop does ~10^6.
    assert 1 <= running.polls <= 60, running.polls


def test_finished_collectives_are_dropped():
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    completions = [_testing.FakeCompletion() for _ in range(5)]
    for i, c in enumerate(completions):
        watchdog.watch(c, f"collective {i}")
    assert wait_until(lambda: all(c.polls > 0 for c in completions))
    assert watchdog.in_flight == 5
    for c in completions[1:]:  # out of order: not only the oldest is dropped
        c.set("done")
    assert wait_until(lambda: watchdog.in_flight == 1)
    completions[0].set("done")
    assert wait_until(lambda: watchdog.in_flight == 0)
    assert not watchdog.failed
    watchdog.check()
    watchdog.stop()


def test_a_collective_past_its_timeout_fails_once_and_check_raises():
    watchdog = _testing.Watchdog(timeout_ms=100, poll_ms=POLL_MS)
    watchdog.watch(_testing.FakeCompletion(), "all-gather")
    assert wait_until(lambda: watchdog.failed)
    with pytest.raises(RuntimeError, match=r"\[rank 0\] all-gather did not finish within 100 ms; \(test\)"):
        watchdog.check()
    watchdog.stop()
    assert watchdog.failures_handled == 1
    watchdog.watch(_testing.FakeCompletion(), "after the failure")  # ignored, not queued forever
    assert watchdog.in_flight == 0


def test_the_backend_acts_on_a_failure_before_check_raises():
    """Guards against publishing a failure before the backend handled it: in
    the default mode the backend ends the process, and an error raised on the
    training thread first could be caught and trained past."""
    watchdog = _testing.Watchdog(timeout_ms=50, poll_ms=POLL_MS)
    watchdog.watch(_testing.FakeCompletion(), "reduce-scatter")
    assert wait_until(lambda: watchdog.failed)
    watchdog.stop()
    assert watchdog.failures_handled == 1 and not watchdog.published_before_handled


def test_a_failed_collective_names_its_error():
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    failing = _testing.FakeCompletion()
    watchdog.watch(_testing.FakeCompletion(), "reduce-scatter")
    watchdog.watch(failing, "all-reduce")
    failing.set("failed", "an illegal memory access was encountered")
    assert wait_until(lambda: watchdog.failed)
    with pytest.raises(RuntimeError, match="all-reduce failed: an illegal memory access"):
        watchdog.check()
    watchdog.stop()
    assert watchdog.failures_handled == 1


def test_an_asynchronous_communicator_error_fails_even_when_idle():
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    watchdog.set_async_error("remote process exited or there was a network error")
    assert wait_until(lambda: watchdog.failed)
    with pytest.raises(RuntimeError, match="asynchronous error: remote process exited"):
        watchdog.check()
    watchdog.stop()


def test_the_thread_runs_its_start_hook_once():
    """The NCCL backend binds the thread to its device there (no context on GPU 0)."""
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    assert wait_until(lambda: watchdog.thread_starts == 1)
    watchdog.stop()
    assert watchdog.thread_starts == 1


def test_stop_is_prompt_and_final():
    watchdog = _testing.Watchdog(timeout_ms=100, poll_ms=1000)  # a long sleep between rounds
    assert in_thread(watchdog.stop, seconds=2.0), "stop() waited out the poll period"
    watchdog.watch(_testing.FakeCompletion(), "after stop")
    time.sleep(0.2)
    assert not watchdog.failed and watchdog.failures_handled == 0
    watchdog.stop()  # idempotent


def test_teardown_destroys_once_idle():
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    outcome, destroyed, aborted, queries = _testing.teardown(watchdog, idle_after_polls=3, grace_ms=10_000)
    assert (outcome, destroyed, aborted) == ("destroyed", 1, 0)
    assert queries == 4


def test_teardown_aborts_a_communicator_that_never_drains():
    """Guards against an unbounded stream synchronize on a dead peer."""
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    start = time.monotonic()
    outcome, destroyed, aborted, _ = _testing.teardown(watchdog, idle_after_polls=-1, grace_ms=200)
    assert (outcome, destroyed, aborted) == ("aborted after grace", 0, 1)
    assert time.monotonic() - start < 5.0


def test_teardown_aborts_at_once_when_the_stream_failed():
    """A stream with a sticky error never drains: waiting out the grace (the
    collective timeout, up to 30 minutes) would only delay the abort."""
    watchdog = _testing.Watchdog(timeout_ms=60_000, poll_ms=POLL_MS)
    outcome, destroyed, aborted, queries = _testing.teardown(watchdog, idle_after_polls=-1, grace_ms=600_000,
                                                             stream_failed=True)
    assert (outcome, destroyed, aborted, queries) == ("aborted after grace", 0, 1, 1)


def test_teardown_after_a_watchdog_abort_frees_nothing_more():
    """Guards against destroying communicators the watchdog already aborted:
    the watchdog is stopped first, then its verdict read."""
    watchdog = _testing.Watchdog(timeout_ms=50, poll_ms=POLL_MS)
    watchdog.watch(_testing.FakeCompletion(), "all-gather")
    assert wait_until(lambda: watchdog.failed)
    outcome, destroyed, aborted, queries = _testing.teardown(watchdog, idle_after_polls=0, grace_ms=1000)
    assert (outcome, destroyed, aborted, queries) == ("already aborted", 0, 0, 0)


def test_teardown_during_a_watchdog_abort_waits_for_it_and_frees_nothing_more():
    """Guards against reading the watchdog's verdict before stopping it: a
    timeout handled (communicator being aborted) while teardown starts would
    then be followed by a destroy of the aborted communicator."""
    watchdog = _testing.Watchdog(timeout_ms=20, poll_ms=5, on_failure_ms=300)
    watchdog.watch(_testing.FakeCompletion(), "reduce-scatter")
    assert wait_until(lambda: watchdog.failures_started == 1)  # the abort is in progress now
    outcome, destroyed, aborted, queries = _testing.teardown(watchdog, idle_after_polls=0, grace_ms=1000)
    assert watchdog.failures_handled == 1
    assert (outcome, destroyed, aborted, queries) == ("already aborted", 0, 0, 0)


def test_event_pool_reuses_events():
    """Guards against creating and destroying two CUDA events per collective."""
    pool, destroyed = _testing.fake_handle_pool()
    for _ in range(100):  # one collective at a time: ready + done events
        ready, done = _testing.acquire(pool), _testing.acquire(pool)
        del ready, done
    assert pool.created == 2
    held = [_testing.acquire(pool) for _ in range(5)]  # five in flight
    assert pool.created == 5 and pool.available == 0
    del held
    gc.collect()
    assert pool.available == 5 and destroyed.value == 0


def test_event_pool_outlives_its_owner_until_handles_return():
    """A pending collective may hold its event after the backend (and its
    reference to the pool) is gone: the event must go back to a live pool and
    be destroyed exactly once, with the pool."""
    pool, destroyed = _testing.fake_handle_pool()
    first, second = _testing.acquire(pool), _testing.acquire(pool)
    del first
    del pool  # the backend goes; `second` is still in flight
    gc.collect()
    assert destroyed.value == 0, "the pool destroyed events while one was still held"
    del second
    gc.collect()
    assert destroyed.value == 2, f"{destroyed.value} of 2 events destroyed after the last handle returned"
