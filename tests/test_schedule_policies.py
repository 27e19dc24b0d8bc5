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


def ops_by_event(schedule, update, num_buckets=B):
    result = _C._testing.policy_ops(schedule, update, num_buckets, list(reversed(range(num_buckets))))
    return dict(result["events"]), result


def test_registry_lists_todays_schedules():
    assert {name: (entry["updates"], entry["default_update"]) for name, entry in REGISTRY.items()} == {
        "dear": ({"sharded": "sharded_at_step", "replicated": "replicated_before_use"}, "sharded"),
        "wfbp": ({"replicated": "full_after_reduction"}, "replicated"),
    }
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
    assert result["finish_reductions_at_end_of_backward"] is False  # step() waits for them
    assert result["update_strategy"] == REGISTRY["dear"]["updates"][update]


def test_wfbp_all_reduces_each_eligible_bucket_and_finishes_them_when_backward_returns():
    events, result = ops_by_event("wfbp", "replicated")
    assert [events[f"eligible {b}"] for b in BACKWARD] == [[("all_reduce", b)] for b in BACKWARD]
    assert events["end_of_backward"] == []
    assert events["step"] == []  # nothing to gather: the user's optimizer updated full parameters
    assert result["reduction"] == "all_reduce"
    assert result["finish_reductions_at_end_of_backward"] is True
    assert result["update_strategy"] == "full_after_reduction"


@pytest.mark.parametrize("schedule, update", COMBINATIONS)
@pytest.mark.parametrize("num_buckets", [1, 2, 7])
def test_every_policy_reduces_each_bucket_once_after_it_is_eligible(schedule, update, num_buckets):
    """What the executor relies on, for any registered policy: a bucket is
    reduced exactly once, with the policy's declared collective, never before
    it is eligible, and by the end of backward; step() only gathers reduced
    buckets; and the decisions are a function of the events alone."""
    order = list(reversed(range(num_buckets)))
    first = _C._testing.policy_ops(schedule, update, num_buckets, order)
    assert first == _C._testing.policy_ops(schedule, update, num_buckets, order), "not deterministic"
    eligible, reduced = set(), []
    for event, ops in first["events"]:
        if event.startswith("eligible "):
            eligible.add(int(event.split()[1]))
        if event == "step":
            assert all(kind == "all_gather" for kind, _ in ops), ops
            gathered = [b for _, b in ops]
            assert len(gathered) == len(set(gathered)) and set(gathered) <= set(range(num_buckets))
            assert (first["update_strategy"] == "full_after_reduction") == (not gathered)
            continue
        for kind, bucket in ops:
            assert kind == first["reduction"], (event, ops)
            assert bucket in eligible, f"{event}: reduces bucket {bucket} before it is eligible"
            reduced.append(bucket)
    assert sorted(reduced) == list(range(num_buckets))


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


@pytest.mark.parametrize("schedule, update, error, message", [
    ("ring", "sharded", ValueError, "unknown schedule 'ring'"),
    ("dear", "lazy", ValueError, "unknown update 'lazy'"),
    ("wfbp", "sharded", NotImplementedError, "schedule='wfbp' with update='sharded' is not supported"),
])
def test_engine_side_resolves_names_through_the_same_registry(schedule, update, error, message):
    # make_engine and policy_ops both build their policy with make_policy.
    with pytest.raises(error, match=message):
        _C._testing.policy_ops(schedule, update, 1, [0])
