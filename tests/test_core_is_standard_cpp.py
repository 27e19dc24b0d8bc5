"""The executor (csrc/core/), the simulated device (csrc/sim/) and the policy
interface hold no tensors and link no ATen or c10: each file compiles with
the standard library alone on the include path, so nothing in them can read
a tensor, a stream or a clock by accident."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "core", "*.cpp")) +
               glob.glob(os.path.join(ROOT, "csrc", "sim", "*.cpp")) +
               [os.path.join(ROOT, "csrc", "schedule", "policy.cpp")])


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_compiles_with_the_standard_library_alone(path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    result = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                             "-I", os.path.join(ROOT, "csrc"), path], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
