"""The CPU backend's poster thread on its own (dearcomm._C._testing): it
posts gloo's sends and receives for the training thread, in issue order, and
posts everything still queued before it goes. Every multi-process test runs
the backend through it."""
from dearcomm._C import _testing


def test_jobs_run_in_order_off_the_posting_thread_and_all_run_before_teardown():
    order, on_caller = _testing.run_poster(jobs=50, inline_jobs=False)
    # The first job sleeps, so the poster was destroyed with 49 still queued.
    assert order == list(range(50)), "jobs ran out of issue order, or were dropped at teardown"
    assert not any(on_caller), "a job ran on the posting (training) thread"


def test_inline_runs_each_job_at_once_on_the_posting_thread():
    """DEARCOMM_CPU_POSTER=0: the A/B switch posts as before the poster existed."""
    order, on_caller = _testing.run_poster(jobs=5, inline_jobs=True)
    assert order == list(range(5))
    assert all(on_caller)
