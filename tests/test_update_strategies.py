"""Update strategies on their own: no processes. The Python registry against
the C++ one."""
import pytest
import torch

from dearcomm import _C
from dearcomm._update import STRATEGIES, UpdateStrategy, strategy_class


def registered_strategies():
    """(strategy, schedule, update) for every pair the C++ registry reports."""
    return [(strategy, entry["name"], update)
            for entry in _C.schedules() for update, strategy in entry["updates"].items()]


def test_python_registry_covers_exactly_the_cpp_strategies():
    missing = {name: f"schedule={schedule!r} update={update!r}"
               for name, schedule, update in registered_strategies() if name not in STRATEGIES}
    assert not missing, f"C++ update strategies without a Python object in dearcomm._update: {missing}"
    assert set(STRATEGIES) == {name for name, _, _ in registered_strategies()}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_is_complete_and_registered_under_its_name(name):
    cls = strategy_class(name)
    assert issubclass(cls, UpdateStrategy) and cls.name == name
    model = torch.nn.Linear(2, 2)
    cls(torch.optim.SGD(model.parameters(), lr=0.1), runtime=None)  # no abstract method left
    assert cls.checks_grad_versions == (not cls.averaged_in_grad)  # true of today's strategies


def test_strategy_without_python_object_is_named_in_the_error():
    with pytest.raises(NotImplementedError, match="update strategy 'delayed_by_one'.*dearcomm/_update"):
        strategy_class("delayed_by_one")
