"""Builds dearcomm._C: the C++ engine and its c10d (CPU/gloo) backend.

    pip install --no-build-isolation .     # build isolation would install a second torch
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources(*patterns):
    found = []
    for pattern in patterns:
        found += sorted(glob.glob(os.path.join("csrc", pattern), recursive=True))
    return found


# -O2 -g0: the default -g makes a 12 MB library and a slower build.
CXX_FLAGS = ["-O2", "-g0", "-Wall", "-Wno-unused-function"]

setup(
    name="dearcomm",
    version="0.1.0",
    description="DeAR: decoupled all-reduce (reduce-scatter in backward, all-gather in forward) for PyTorch",
    packages=find_packages(include=["dearcomm", "dearcomm.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.14.1"],
    ext_modules=[
        CppExtension(
            "dearcomm._C",
            sources("bindings.cpp", "engine/*.cpp", "backends/cpu/*.cpp"),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": CXX_FLAGS},
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
