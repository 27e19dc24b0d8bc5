"""Schedule policies on their own: no processes, no tensors. What each
registered policy decides at each event of one iteration, the invariants every
policy must keep (so a new schedule is checked by being registered), and that
the C++ registry is the one list of schedule names that wrap() accepts."""
import itertools

import pytest

from dearcomm import _C
from dearcomm._options import SCHEDULES, UPDATES, WrapOptions

REGISTRY = {entry["name"]: entry for entry in _C.schedules()}
COMBINATIONS = [(name, update) for name, entry in REGISTRY.items() for update in entry["updates"]]
B = 4
BACKWARD = [3, 2, 1, 0]  # eligibility order: descending bucket index, as the engine reports it


def ops_by_event(schedule, update, num_buckets=B, bucket_bytes=100, credit_bytes=0, drained=()):
    result = _C._testing.policy_ops(schedule, update, [bucket_bytes] * num_buckets,
                                    list(reversed(range(num_buckets))), credit_bytes, list(drained))
    return dict(result["events"]), result


def test_registry_lists_todays_schedules():
    assert {name: (entry["updates"], entry["default_update"]) for name, entry in REGISTRY.items()} == {
        "dear": ({"sharded": "sharded_at_step", "replicated": "replicated_before_use"}, "sharded"),
        "wfbp": ({"replicated": "full_after_reduction"}, "replicated"),
        "bytescheduler": ({"replicated": "replicated_before_use"}, "replicated"),
        "usbyte": ({"replicated": "replicated_before_use"}, "replicated"),
        "deft": ({"replicated": "full_after_reduction"}, "replicated"),
    }
    # US-Byte: the planner's blocks (wrap(blocks=)) are the only split; one block at a time, no credit.
    assert REGISTRY["usbyte"]["default_partition_bytes"] == 2**63 - 1
    assert REGISTRY["usbyte"]["default_credit_bytes"] == 0
    assert {name for name, entry in REGISTRY.items() if entry["takes_priorities"]} == {"usbyte"}
    assert {name for name, entry in REGISTRY.items() if entry["takes_delays"]} == {"deft"}
    # The ByteScheduler paper's all-reduce recommendation: 8 M and 16 M fp32 parameters.
    assert REGISTRY["bytescheduler"]["default_partition_bytes"] == 8 * 2**20 * 4
    assert REGISTRY["bytescheduler"]["default_credit_bytes"] == 16 * 2**20 * 4
    assert REGISTRY["dear"]["default_partition_bytes"] == 2**63 - 1  # never split unless asked
    assert REGISTRY["dear"]["default_credit_bytes"] == 0
    for entry in REGISTRY.values():
        assert entry["summary"] and "\n" not in entry["summary"]
        assert entry["default_update"] in entry["updates"]


@pytest.mark.parametrize("update", ["sharded", "replicated"])
def test_dear_reduce_scatters_each_eligible_bucket_and_gathers_all_at_step(update):
    events, result = ops_by_event("dear", update)
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("reduce_scatter", b)] for b in BACKWARD]
    assert events["end_of_backward"] == []
    assert events["step"] == [("all_gather", b) for b in range(B)]  # forward order: bucket 0 lands first
    assert result["reduction"] == "reduce_scatter"
    assert result["reductions_waited"] == "in_step"
    assert result["update_strategy"] == REGISTRY["dear"]["updates"][update]


def test_wfbp_all_reduces_each_eligible_bucket_and_finishes_them_when_backward_returns():
    events, result = ops_by_event("wfbp", "replicated")
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", b)] for b in BACKWARD]
    assert events["end_of_backward"] == []
    assert events["step"] == []  # nothing to gather: the user's optimizer updated full parameters
    assert result["reduction"] == "all_reduce"
    assert result["reductions_waited"] == "when_backward_returns"
    assert result["update_strategy"] == "full_after_reduction"


@pytest.mark.parametrize("schedule, update", COMBINATIONS)
@pytest.mark.parametrize("num_buckets", [1, 2, 7])
def test_every_policy_reduces_each_bucket_once_after_it_is_eligible(schedule, update, num_buckets):
    """What the executor relies on, for any registered policy: a bucket is
    reduced exactly once, with the policy's declared collective, never before
    it is eligible, and by the end of backward; step() only gathers reduced
    buckets; and the decisions are a function of the events alone."""
    order = list(reversed(range(num_buckets)))
    sizes = [100 * (b % 3 + 1) for b in range(num_buckets)]
    first = _C._testing.policy_ops(schedule, update, sizes, order)
    assert first == _C._testing.policy_ops(schedule, update, sizes, order), "not deterministic"
    eligible, reduced = set(), []
    for event, ops in first["events"]:
        if event.startswith("eligible "):
            eligible.add(int(event.split()[1]))
        if event == "step":
            assert all(kind == "all_gather" for kind, _ in ops), ops
            gathered = [b for _, b in ops]
            assert len(gathered) == len(set(gathered)) and set(gathered) <= set(range(num_buckets))
            # Only a reduce-scatter leaves something to gather.
            assert (first["reduction"] == "reduce_scatter") == bool(gathered)
            continue
        for kind, bucket in ops:
            assert kind == first["reduction"], (event, ops)
            assert bucket in eligible, f"{event}: reduces bucket {bucket} before it is eligible"
            reduced.append(bucket)
    assert sorted(reduced) == list(range(num_buckets))


def default_policy(name):
    return _C._testing.policy_ops(name, REGISTRY[name]["default_update"], [100], [0])


def test_bytescheduler_all_reduces_under_its_credit_and_leaves_them_to_the_next_forward():
    events, result = ops_by_event("bytescheduler", "replicated")  # default credit: 64 MiB in flight
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", b)] for b in BACKWARD]
    assert events["end_of_backward"] == [] and events["step"] == []
    assert result["reduction"] == "all_reduce" and result["update_strategy"] == "replicated_before_use"
    assert result["reductions_waited"] == "in_next_forward"  # step() does not wait: cross-iteration overlap
    assert result["uses_link_model"] is True
    assert not any(default_policy(name)["uses_link_model"] for name in ("dear", "wfbp"))


def test_bytescheduler_queue_lets_a_more_urgent_bucket_overtake():
    """Guards the priority queue: buckets of 100 bytes, 150 may be in flight.
    Bucket 3 goes at once; bucket 2 does not fit beside it and waits; by
    bucket 1's tick the link drained bucket 3, and bucket 1, more urgent,
    overtakes 2; bucket 0 does not fit beside 1 and waits; what is left goes
    when backward ends, input side first."""
    events, _ = ops_by_event("bytescheduler", "replicated", credit_bytes=150, drained=[0, 0, 100, 0])
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", 3)], [], [("all_reduce", 1)], []]
    assert events["end_of_backward"] == [("all_reduce", 0), ("all_reduce", 2)]


def test_bytescheduler_credit_bounds_bytes_in_flight_as_the_link_model_drains_them():
    # A link that drains 60 bytes between ticks, 200 bytes of credit: 3 goes;
    # 2 fits beside the 40 left of it; 1 waits (140 + 100 > 200) until the
    # next tick, when 80 are left; 0 then waits behind it (180 + 100 > 200).
    events, _ = ops_by_event("bytescheduler", "replicated", credit_bytes=200, drained=[0, 60, 60, 60])
    assert [events[f"eligible {b}"] for b in BACKWARD] == [
        [("all_reduce", 3)], [("all_reduce", 2)], [("all_reduce", 1)], []]
    assert events["end_of_backward"] == [("all_reduce", 0)]
    # A link that keeps up (drains a bucket per tick): each goes when ready, as in WFBP.
    events, _ = ops_by_event("bytescheduler", "replicated", credit_bytes=100, drained=[0, 100, 100, 100])
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", b)] for b in BACKWARD]
    # A link that drains nothing during backward: only the first goes, the rest input side first at its end.
    events, _ = ops_by_event("bytescheduler", "replicated", credit_bytes=150, drained=[0, 0, 0, 0])
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", 3)], [], [], []]
    assert events["end_of_backward"] == [("all_reduce", b) for b in range(3)]


def test_bytescheduler_without_a_link_model_takes_the_link_to_keep_up():
    """No model yet (the first iterations) or a backend without completion
    times: the link is taken to send everything between ticks, so each tick
    releases up to a credit's worth, and a bucket bigger than the credit goes
    alone when nothing is in flight (never stuck)."""
    events, _ = ops_by_event("bytescheduler", "replicated", bucket_bytes=300, credit_bytes=100)
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", b)] for b in BACKWARD]
    assert events["end_of_backward"] == []


def in_flight_after(in_flight, drained):
    return max(0, in_flight - drained)


@pytest.mark.parametrize("seed", range(40))
def test_bytescheduler_queue_invariants_under_random_links(seed):
    """Whatever the sizes, credit and link model: every bucket is reduced
    once; at each tick the modelled bytes in flight stay within the credit
    unless a single bucket went onto an idle link; nothing goes while a more
    urgent bucket waits; and a tick leaves nothing waiting that would fit."""
    import random
    rng = random.Random(seed)
    num_buckets = rng.randint(1, 12)
    sizes = [rng.randint(1, 1000) for _ in range(num_buckets)]
    credit = rng.randint(1, 2000)
    drained = [0] + [rng.choice([0, rng.randint(0, 800), 10**9]) for _ in range(num_buckets - 1)]
    order = list(reversed(range(num_buckets)))
    result = _C._testing.policy_ops("bytescheduler", "replicated", sizes, order, credit, drained)
    events = result["events"]
    in_flight, waiting, reduced = 0, [], []
    for tick, (b, (event, ops)) in enumerate(zip(order, events)):
        assert event == f"eligible {b}"
        in_flight = in_flight_after(in_flight, drained[tick])
        waiting.append(b)
        started_idle = in_flight == 0
        for kind, bucket in ops:
            assert kind == "all_reduce" and bucket == min(waiting), f"tick {tick}: {bucket} went before {min(waiting)}"
            waiting.remove(bucket)
            in_flight += sizes[bucket]
            reduced.append(bucket)
        assert not ops or in_flight <= credit or (started_idle and len(ops) == 1), f"tick {tick}: {in_flight} > {credit}"
        if waiting:
            assert in_flight > 0 and in_flight + sizes[min(waiting)] > credit, f"tick {tick}: {min(waiting)} fits"
    end = dict(events)["end_of_backward"]
    assert [bucket for _, bucket in end] == sorted(waiting)
    assert sorted(reduced + sorted(waiting)) == list(range(num_buckets))


def usbyte_ops(drained=(), priorities=(), sizes=(100,) * B):
    result = _C._testing.policy_ops("usbyte", "replicated", list(sizes), list(reversed(range(len(sizes)))), 0,
                                    list(drained), list(priorities))
    return dict(result["events"]), result


def test_usbyte_sends_one_block_at_a_time_most_urgent_first():
    """The link drains nothing during backward: block 3 goes, the rest wait
    and go when backward ends in the planner's order, or input side first."""
    events, result = usbyte_ops(drained=[0, 0, 0, 0])
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", 3)], [], [], []]
    assert events["end_of_backward"] == [("all_reduce", b) for b in range(3)]
    assert events["step"] == [] and result["reductions_waited"] == "in_next_forward"
    assert result["update_strategy"] == "replicated_before_use" and result["uses_link_model"] is True
    events, _ = usbyte_ops(drained=[0, 0, 0, 0], priorities=[3, 0, 2, 1])  # bucket 1 first, then 3, 2, 0
    assert events["end_of_backward"] == [("all_reduce", 1), ("all_reduce", 2), ("all_reduce", 0)]
    # Bucket 1 is the most urgent, but block 3 is still on the link when 1 becomes ready: 1 waits
    # (one at a time) and goes first at the end; with the link drained by then, it goes at once.
    events, _ = usbyte_ops(drained=[0, 0, 100, 0], priorities=[3, 0, 2, 1])
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", 3)], [], [("all_reduce", 1)], []]
    assert events["end_of_backward"] == [("all_reduce", 2), ("all_reduce", 0)]


def test_usbyte_fills_the_gap_until_the_next_gradient():
    """Buckets of 100 bytes; the link sends 300 between the second and third
    gradient: at the second, block 2 joins block 3 on the link (both fit in
    that gap); at the third, the link is idle again and block 1 goes alone
    (nothing is sent before the last gradient); block 0 waits for the end."""
    events, _ = usbyte_ops(drained=[0, 0, 300, 0])
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", 3)], [("all_reduce", 2)],
                                                          [("all_reduce", 1)], []]
    assert events["end_of_backward"] == [("all_reduce", 0)]


def test_usbyte_starts_a_block_that_runs_past_the_gap():
    """A block goes if the link would start it before the next gradient, even
    if it ends after (the planner sizes blocks to end at or just after it):
    block 2 starts 100 bytes into a 150-byte gap; then 50 bytes are still in
    flight when a gap of 0 begins, so 1 waits, and 0, 1 go when backward ends."""
    events, _ = usbyte_ops(drained=[0, 0, 150, 0])
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", 3)], [("all_reduce", 2)], [], []]
    assert events["end_of_backward"] == [("all_reduce", 0), ("all_reduce", 1)]


def test_usbyte_takes_the_link_to_keep_up_without_a_link_model():
    # The first iterations (no model yet): every block goes when ready, as in WFBP.
    events, _ = usbyte_ops(sizes=(100, 5000, 7, 100))
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", b)] for b in BACKWARD]


def test_priorities_are_refused_where_they_do_not_fit():
    with pytest.raises(ValueError, match="usbyte got priorities for 3 buckets, but the layout has 4"):
        usbyte_ops(priorities=[0, 1, 2])
    with pytest.raises(ValueError, match="schedule='dear' issues in its own order; priorities apply to "
                                         "schedule='usbyte'"):
        _C._testing.policy_ops("dear", "sharded", [100], [0], 0, [], [0])
    with pytest.raises(ValueError, match="schedule='wfbp' issues in its own order"):
        WrapOptions(schedule="wfbp", priorities={"fc.weight": 0})
    with pytest.raises(ValueError, match=r"priorities\['fc.weight'\] must be an int rank"):
        WrapOptions(schedule="usbyte", priorities={"fc.weight": 0.5})
    with pytest.raises(TypeError, match="priorities must map parameter names to ranks"):
        WrapOptions(schedule="usbyte", priorities=[0, 1])


def test_a_credit_is_refused_where_the_schedule_has_none():
    with pytest.raises(ValueError, match="schedule='dear' has no credit"):
        _C._testing.policy_ops("dear", "sharded", [100], [0], 10)
    with pytest.raises(ValueError, match="schedule='wfbp' has no credit; credit_mb applies to schedule='bytescheduler'"):
        WrapOptions(schedule="wfbp", credit_mb=1.0)
    with pytest.raises(ValueError, match="credit_mb must be a positive number"):
        WrapOptions(schedule="bytescheduler", credit_mb=0)
    with pytest.raises(ValueError, match="partition_mb must be a positive number"):
        WrapOptions(partition_mb=-1.0)
    assert WrapOptions(schedule="bytescheduler").partition_bytes == 8 * 2**20 * 4
    assert WrapOptions(schedule="bytescheduler", partition_mb=1.0).partition_bytes == 2**20
    assert WrapOptions(schedule="dear").partition_bytes == 2**63 - 1


# ---- the registry is the one list of names ----------------------------------

def test_wrap_options_accept_exactly_the_registered_combinations():
    assert SCHEDULES == tuple(REGISTRY)
    assert set(UPDATES) == {u for entry in REGISTRY.values() for u in entry["updates"]}
    for schedule, update in itertools.product(SCHEDULES, UPDATES):
        if update in REGISTRY[schedule]["updates"]:
            options = WrapOptions(schedule=schedule, update=update)
            assert options.update_strategy == REGISTRY[schedule]["updates"][update]
        else:
            with pytest.raises(NotImplementedError, match="Valid combinations: schedule='dear'"):
                WrapOptions(schedule=schedule, update=update)
    for schedule, entry in REGISTRY.items():
        assert WrapOptions(schedule=schedule).update == entry["default_update"]


def test_wrap_options_copy_and_pickle_with_their_resolved_schedule():
    import copy
    import pickle
    for options in (WrapOptions(), WrapOptions(schedule="bytescheduler", credit_mb=1.0),
                    WrapOptions(schedule="wfbp", bucket_mb=0),
                    WrapOptions(schedule="usbyte", priorities={"fc.weight": 1, "embed.weight": 0})):
        for copied in (copy.copy(options), copy.deepcopy(options), pickle.loads(pickle.dumps(options))):
            assert copied == options
            assert repr(copied.choice) == repr(options.choice)
            assert copied.update_strategy == options.update_strategy


@pytest.mark.parametrize("schedule, update, error, message", [
    ("ring", "sharded", ValueError, "unknown schedule 'ring'"),
    ("dear", "lazy", ValueError, "unknown update 'lazy'"),
    ("wfbp", "sharded", NotImplementedError, "schedule='wfbp' with update='sharded' is not supported"),
])
def test_engine_side_resolves_names_through_the_same_registry(schedule, update, error, message):
    # Engines, simulations and policy_ops all resolve names with resolve_schedule.
    with pytest.raises(error, match=message):
        _C._testing.policy_ops(schedule, update, [100], [0])


@pytest.mark.parametrize("blocks, error, message", [
    ([100], TypeError, "blocks must map parameter names to lists of element counts, got list"),
    ({"fc.weight": []}, ValueError, r"blocks\['fc.weight'\] must be a non-empty list of positive element counts"),
    ({"fc.weight": [64, -1]}, ValueError, "non-empty list of positive element counts"),
    ({"fc.weight": "64"}, ValueError, "non-empty list of positive element counts"),
])
def test_bad_blocks_are_refused_with_their_name(blocks, error, message):
    with pytest.raises(error, match=message):
        WrapOptions(blocks=blocks)


def test_deft_all_reduces_as_wfbp_and_delays_the_buckets_it_was_given():
    result = _C._testing.policy_ops("deft", "replicated", [100] * B, list(reversed(range(B))), delays=[1, 1, 0, 0])
    assert [ops for _, ops in result["events"]] == [[("all_reduce", b)] for b in reversed(range(B))] + [[], []]
    assert result["delays"] == [1, 1, 0, 0]
    assert result["reductions_waited"] == "when_backward_returns"  # .grad holds what step() applies
    assert _C._testing.policy_ops("deft", "replicated", [100] * B, list(reversed(range(B))))["delays"] == [0] * B
    with pytest.raises(ValueError, match="deft got delays for 2 buckets, but the layout has 4"):
        _C._testing.policy_ops("deft", "replicated", [100] * B, list(reversed(range(B))), delays=[1, 0])
    with pytest.raises(ValueError, match="schedule='wfbp' applies every bucket in the step of its backward; delays "
                                         "apply to schedule='deft'"):
        _C._testing.policy_ops("wfbp", "replicated", [100] * B, list(reversed(range(B))), delays=[1, 0, 0, 0])
    with pytest.raises(ValueError, match="bucket 1 has delay -1"):
        _C.resolve_schedule("deft").with_bucket_delays([0, -1])
