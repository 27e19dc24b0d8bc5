"""The examples the README and docs point to, launched as they say (torchrun),
short. (examples/lightning_train.py and accelerate_train.py run on the ranks
of test_integrations_parity.py, and under their frameworks' launchers in
test_integrations_launch.py, marked slow.)"""
import math
import re

from tests.launch import torchrun


def test_train_example_matches_ddp():
    """`make train`'s script: DDP, then dearcomm, on the same data; the
    parameters must agree (the script prints the largest difference)."""
    out = torchrun(2, "examples/train.py", "--compare", "--steps", "30")
    assert re.search(r"^ddp\s+[\d.]+\s+[\d.]+$", out, re.M) and re.search(r"^dear\s+[\d.]+\s+[\d.]+$", out, re.M), out
    difference = float(re.search(r"largest parameter difference after 30 steps: (\S+)", out)[1])
    assert difference <= 1e-5, out


def test_pipeline_example_plans_and_trains():
    out = torchrun(3, "examples/pipeline_train.py", "--steps", "30")
    assert re.search(r"^plan for 3 processes: ", out, re.M), out
    losses = [float(v) for v in re.findall(r"step\s+\d+\s+loss (\S+)", out)]
    assert losses and all(math.isfinite(v) for v in losses), out
    assert re.search(r"^30 steps in [\d.]+ s; after the first 6, [\d.]+ ms a step \(predicted [\d.]+\)$", out, re.M), out
