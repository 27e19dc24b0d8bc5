"""The link model bytescheduler's credit runs on (csrc/engine/link_meter.h),
without processes: one rank's figures from its reductions and ticks, and the
model every rank derives from the figures summed over ranks.
tests/test_schedule_sequences.py checks that real ranks agree on it."""
import pytest

from dearcomm import _C

MS = 1_000_000  # ns
MIB = 2**20


def meter_after_one_backward(num_ticks, reductions, ticks_ms):
    """Reductions recorded in iteration i (completed in the next forward),
    then backward i+1 with ticks at `ticks_ms`."""
    meter = _C._testing.LinkMeter(num_ticks)
    meter.begin_backward()
    for launched_ms, completed_ms, nbytes in reductions:
        meter.reduction_done(int(launched_ms * MS), int(completed_ms * MS), nbytes)
    meter.begin_backward()
    for t in ticks_ms:
        meter.tick(int(t * MS))
    return meter


def test_rate_is_the_bytes_over_the_time_some_reduction_was_in_flight():
    # Two overlapping 4 MiB reductions (0-10 ms, 5-15 ms) and a 2 MiB one
    # (20-30 ms): busy 15 + 10 = 25 ms, not 30 (the sum of their durations).
    meter = meter_after_one_backward(4, [(5, 15, 4 * MIB), (0, 10, 4 * MIB), (20, 30, 2 * MIB)],
                                     [100, 102, 102, 107])
    assert meter.figures() == [1, 10 * MIB // 25, 0, 2000, 0, 5000]  # has a rate; bytes/ms; gaps in µs


def test_the_model_is_the_ranks_mean_rate_times_their_mean_gap():
    a = meter_after_one_backward(3, [(0, 10, 10 * MIB)], [0, 4, 6]).figures()   # 1 MiB/ms; gaps 4, 2 ms
    b = meter_after_one_backward(3, [(0, 10, 30 * MIB)], [0, 8, 8]).figures()   # 3 MiB/ms; gaps 8, 0 ms
    summed = [x + y for x, y in zip(a, b)]
    model = _C._testing.LinkMeter(3).model(summed, 2)
    # 2 MiB/ms; gaps 6 ms and 1 ms: 12 MiB and 2 MiB drained; nothing before the first tick.
    assert model == [0, 12 * MIB, 2 * MIB]


def test_no_model_until_every_rank_has_a_rate():
    with_rate = meter_after_one_backward(2, [(0, 10, MIB)], [0, 1]).figures()
    first_backward = _C._testing.LinkMeter(2)
    first_backward.begin_backward()
    for t in (0, 1):
        first_backward.tick(t * MS)
    without = first_backward.figures()
    assert without[0] == 0
    assert _C._testing.LinkMeter(2).model([x + y for x, y in zip(with_rate, without)], 2) == []
    assert _C._testing.LinkMeter(2).model([2 * x for x in with_rate], 2) != []


def test_a_completion_before_its_launch_is_ignored_and_a_backward_without_reductions_keeps_the_rate():
    meter = meter_after_one_backward(2, [(0, 10, MIB), (12, 11, 100 * MIB)], [0, 1])
    assert meter.figures()[:2] == [1, MIB // 10]
    meter.begin_backward()  # no reductions recorded since the last one
    for t in (0, 3):
        meter.tick(t * MS)
    assert meter.figures() == [1, MIB // 10, 0, 3000]


def test_stamps_without_a_time_yet_count_once_they_have_one():
    """A GPU's stamps get their times when the device passes them, often an
    iteration after the host recorded them: the rate comes from the reductions
    timed so far, the spacing from the latest backward whose ticks are all timed."""
    late = _C._testing.LateStamp
    meter = _C._testing.LinkMeter(2)
    meter.begin_backward()
    launched, completed = late(), late()
    meter.reduction_done(launched, completed, 10 * MIB)
    first = [late(), late()]
    for stamp in first:
        meter.tick(stamp)
    assert meter.figures()[0] == 0  # nothing timed yet

    meter.begin_backward()  # the reduction still has no time: no rate
    second = [late(), late()]
    for stamp in second:
        meter.tick(stamp)
    assert meter.figures()[0] == 0

    launched.set(0)
    completed.set(10 * MS)  # 1 MiB/ms
    for stamp, ms in zip(first, (0, 4)):
        stamp.set(ms * MS)
    meter.begin_backward()
    third = [late(), late()]
    for stamp in third:
        meter.tick(stamp)
    # The first backward's spacing (the only one timed), the reduction's rate.
    assert meter.figures() == [1, MIB, 0, 4000]

    for stamp, ms in zip(second, (20, 26)):
        stamp.set(ms * MS)
    meter.begin_backward()
    for t in (40, 41):
        meter.tick(t * MS)  # timed at once: the newest wins
    assert meter.figures() == [1, MIB, 0, 1000]
    # The third backward's stamps got no time before a newer backward was
    # timed: they are never used, even once they get one.
    for stamp, ms in zip(third, (30, 39)):
        stamp.set(ms * MS)
    meter.begin_backward()
    for t in (50, 52):
        meter.tick(t * MS)
    assert meter.figures() == [1, MIB, 0, 2000]


def test_a_backwards_reductions_are_measured_together_once_all_have_a_time():
    """Part of a batch would undercount: on one NCCL stream a reduction's
    launch-to-completion time includes its wait behind the others."""
    meter = _C._testing.LinkMeter(1)
    meter.begin_backward()
    launched, completed = _C._testing.LateStamp(), _C._testing.LateStamp()
    meter.reduction_done(0, 10 * MS, MIB)
    meter.reduction_done(launched, completed, MIB)
    meter.begin_backward()
    meter.tick(0)
    assert meter.figures()[0] == 0  # one of the two has no time yet: neither counts
    launched.set(5 * MS)
    completed.set(20 * MS)
    meter.begin_backward()
    meter.tick(0)
    assert meter.figures()[:2] == [1, 2 * MIB // 20]  # busy 0-20 ms


def test_a_reduction_that_never_gets_a_time_is_given_up_after_a_few_backwards():
    """Stamps that never get a time (a backend that cannot tell) hold their
    batch back for kKeepBackwards (4) backwards; then the rest of it counts."""
    meter = _C._testing.LinkMeter(1)
    meter.begin_backward()
    launched, completed = _C._testing.LateStamp(), _C._testing.LateStamp()
    meter.reduction_done(launched, completed, 100 * MIB)
    meter.reduction_done(0, 10 * MS, MIB)
    for _ in range(3):
        meter.begin_backward()
        meter.tick(0)
        assert meter.figures()[0] == 0
    meter.begin_backward()
    meter.tick(0)
    assert meter.figures()[:2] == [1, MIB // 10]
    launched.set(0)
    completed.set(10 * MS)  # too late: 10 MiB/ms would be counted if it were kept
    meter.begin_backward()
    meter.tick(0)
    assert meter.figures()[:2] == [1, MIB // 10]


def test_figures_need_every_tick_of_the_backward():
    meter = meter_after_one_backward(3, [(0, 1, 1)], [0, 1])
    with pytest.raises(RuntimeError, match="saw 2 of 3 ticks"):
        meter.figures()
