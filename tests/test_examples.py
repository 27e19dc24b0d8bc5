"""The examples the README and docs point to, launched as they say (torchrun),
short. (examples/lightning_train.py and accelerate_train.py:
test_integrations_launch.py.)"""
import math
import os
import re
import subprocess
import sys

from tests.doc_snippets import ROOT


def torchrun(nproc: int, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={nproc}", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert result.returncode == 0, f"{args[0]} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


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
    assert re.search(r"^30 steps in [\d.]+ s$", out, re.M), out
