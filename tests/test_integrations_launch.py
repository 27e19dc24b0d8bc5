"""The example scripts under the frameworks' own launchers, with the commands
the README gives: Lightning starts the second process itself, `accelerate
launch` starts both. Slow (each process imports its framework), so not in the
default suite: `pytest -m slow tests/test_integrations_launch.py`; the same
scripts run in-process in tests/test_integrations_parity.py."""
import importlib.util
import os
import re
import sys

import pytest

from tests.launch import launch

BIN = os.path.dirname(sys.executable)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
def test_lightning_example_under_lightnings_launcher():
    out = launch([sys.executable, "examples/lightning_train.py", "--epochs", "1"])
    accuracy = float(re.search(r"dear \(schedule=dear\): 2 processes, \d+ steps, val_loss [\d.]+, "
                               r"val_acc ([\d.]+)", out).group(1))
    assert accuracy > 0.9, out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_accelerate_example_under_accelerate_launch():
    out = launch([os.path.join(BIN, "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
                  "examples/accelerate_train.py", "--epochs", "1", "--schedule", "wfbp"], ACCELERATE_USE_CPU="1")
    accuracy = float(re.search(r"wfbp: 2 processes, val_acc ([\d.]+)", out).group(1))
    assert accuracy > 0.9, out
