"""Builds dearcomm's extensions.

    pip install --no-build-isolation -e .     # build isolation would install a second torch

- dearcomm._C       the C++ engine and its c10d (CPU/gloo) backend; always.
- dearcomm._C_cuda  the NCCL backend and CUDA kernels; when nvcc, NCCL's headers
                    (the nvidia-nccl-cu13 wheel torch depends on) and a CUDA
                    build of torch are found. No GPU is needed to build it.

DEARCOMM_CUDA=0 skips the CUDA part, DEARCOMM_CUDA=1 requires it (fails loudly
if something is missing). TORCH_CUDA_ARCH_LIST overrides the arches (default
"8.0;9.0+PTX": A100, H100/H200, and PTX for newer GPUs; CUDA 13 has no sm_70).
"""
import glob
import os
import shutil
import sys

# torch.utils.cpp_extension reads these at import. /usr/local/bin/nvcc may be a
# wrapper script, from which torch would guess CUDA_HOME=/usr/local.
if "CUDA_HOME" not in os.environ:
    for candidate in ("/usr/local/cuda", os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc") or "/")))):
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")) and os.path.exists(os.path.join(candidate, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = candidate
            break
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O2", "-g0", "-Wall", "-Wno-unused-function"]  # the default -g makes a 12 MB library
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]


def sources(*patterns):
    return [f for pattern in patterns for f in sorted(glob.glob(os.path.join("csrc", pattern)))]


def find_nccl():
    """NCCL's include and lib directories from the nvidia-nccl wheel, or None."""
    try:
        import nvidia.nccl
    except ImportError:
        return None
    for base in nvidia.nccl.__path__:
        if os.path.exists(os.path.join(base, "include", "nccl.h")):
            return os.path.join(base, "include"), os.path.join(base, "lib")
    return None


def cuda_part():
    """(include, lib) of NCCL if the CUDA part should be built, else None; and
    why it is not built (None if it is)."""
    wanted = os.environ.get("DEARCOMM_CUDA", "auto")
    if wanted == "0":
        return None, "DEARCOMM_CUDA=0"
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is a CPU-only build")
    cuda_home = os.environ.get("CUDA_HOME")
    if not cuda_home or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        missing.append("nvcc was not found (set CUDA_HOME)")
    nccl = find_nccl()
    if nccl is None:
        missing.append("NCCL headers were not found (pip install nvidia-nccl-cu13)")
    if missing:
        message = "dearcomm: not building the CUDA/NCCL backend: " + "; ".join(missing)
        if wanted == "1":
            sys.exit(message + " (DEARCOMM_CUDA=1 requires it)")
        print(message, file=sys.stderr)
        return None, "; ".join(missing)
    return nccl, None


CUDA_REQUESTED = os.environ.get("DEARCOMM_CUDA", "auto")
BUILD_CONFIG = os.path.join("dearcomm", "_build_config.py")


def write_build_config(directory, skipped):
    """Records what this build was asked for and did, for build_info() (and
    tests/test_build.py, which must tell a DEARCOMM_CUDA=0 build from one
    that silently lost its CUDA part)."""
    path = os.path.join(directory, BUILD_CONFIG)
    text = (
        '"""Written by setup.py when dearcomm was built; not in git."""\n'
        f"CUDA_REQUESTED = {CUDA_REQUESTED!r}  # DEARCOMM_CUDA at build time: '0', '1' or 'auto'\n"
        f"CUDA_SKIPPED = {skipped!r}  # why the CUDA part was not built; None: it was\n"
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


class BuildExtensionRecordingConfig(BuildExtension.with_options(use_ninja=True)):
    def run(self):
        write_build_config(ROOT, cuda_skipped)  # in place (editable installs, build_ext --inplace)
        if not self.inplace:
            write_build_config(self.build_lib, cuda_skipped)  # into the wheel
        super().run()


extensions = [
    CppExtension(
        "dearcomm._C",
        sources("bindings.cpp", "sim_bindings.cpp", "common_testing.cpp", "common/*.cpp", "core/*.cpp", "sim/*.cpp", "engine/*.cpp", "schedule/*.cpp", "update/*.cpp", "backends/cpu/*.cpp"),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": CXX_FLAGS},
    )
]
nccl, cuda_skipped = cuda_part()
if nccl is not None:
    nccl_include, nccl_lib = nccl
    extensions.append(
        CUDAExtension(
            "dearcomm._C_cuda",
            sources("cuda_bindings.cpp", "common/*.cpp", "backends/nccl/*.cpp", "kernels/*.cu"),
            include_dirs=[os.path.join(ROOT, "csrc"), nccl_include],
            library_dirs=[nccl_lib],
            # The wheel ships only libnccl.so.2; the rpaths find it installed
            # (site-packages/dearcomm -> site-packages/nvidia/nccl/lib) and in place.
            extra_link_args=["-l:libnccl.so.2", "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib", f"-Wl,-rpath,{nccl_lib}"],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
        )
    )

setup(
    name="dearcomm",
    version="0.1.0",
    description="DeAR: decoupled all-reduce (reduce-scatter in backward, all-gather in forward) for PyTorch",
    packages=find_packages(include=["dearcomm", "dearcomm.*"]),
    package_data={"dearcomm.pipeline": ["data/*.json"]},  # the profiles the pipeline planner loads by name
    python_requires=">=3.10",
    install_requires=["torch==2.14.1"],
    # dearcomm.integrations.lightning / .accelerate; tested with lightning 2.6.6 and accelerate 1.15.0
    extras_require={"lightning": ["lightning>=2.6,<2.7"], "accelerate": ["accelerate>=1.15,<1.16"]},
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExtensionRecordingConfig},
)
