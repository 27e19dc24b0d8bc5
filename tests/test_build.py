"""The build: the CPU part always; the CUDA/NCCL part wherever its toolchain
exists, GPU or not. CI fails here if the CUDA part silently stopped compiling."""
import os
import shutil

import pytest
import torch

import dearcomm


def cuda_toolchain_missing():
    """What of the CUDA part's toolchain is missing here (empty: nvcc, NCCL's
    headers and a CUDA torch are all present), found as setup.py finds them."""
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is a CPU-only build")
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")) and shutil.which("nvcc") is None:
        missing.append("no nvcc")
    try:
        import nvidia.nccl  # the wheel torch's CUDA build depends on
        has_headers = any(os.path.exists(os.path.join(base, "include", "nccl.h")) for base in nvidia.nccl.__path__)
    except ImportError:
        has_headers = False
    if not has_headers:
        missing.append("no NCCL headers (nvidia-nccl-cu13)")
    return missing


def cuda_build_verdict(info, missing):
    """("pass" | "skip" | "fail", why) for a build described by build_info()
    on a machine where `missing` (cuda_toolchain_missing()) lacks those parts.
    Only a build recorded as DEARCOMM_CUDA=0 may lack the CUDA part where its
    toolchain exists; the environment at test time does not excuse it."""
    if info["cuda"]:
        return "pass", f"dearcomm._C_cuda loads (NCCL {info['nccl_version']})"
    if info.get("cuda_requested") == "0":
        return "skip", "this build was made with DEARCOMM_CUDA=0 (recorded by setup.py): no CUDA part, on purpose"
    if missing:
        return "skip", "no CUDA toolchain here to build the CUDA part: " + "; ".join(missing)
    if info.get("cuda_requested") is None:
        why = "the build recorded nothing about it (dearcomm/_build_config.py is missing: not built by setup.py?)"
    elif info.get("cuda_skipped"):
        why = f"setup.py skipped it (DEARCOMM_CUDA={info['cuda_requested']}): {info['cuda_skipped']}"
    else:
        why = f"setup.py built it (DEARCOMM_CUDA={info['cuda_requested']}) but it does not load: {info.get('cuda_error')}"
    return "fail", (f"nvcc, NCCL's headers and a CUDA torch ({torch.version.cuda}) are here, but "
                    f"dearcomm.build_info()['cuda'] is False: {why}. Rebuild: pip install --no-build-isolation -e . "
                    "(DEARCOMM_CUDA=1 makes a missing piece fail the build)")


def test_build_info_describes_the_build():
    info = dearcomm.build_info()
    assert info["torch"] == torch.__version__
    assert isinstance(info["cuda"], bool)
    assert (info["nccl_version"] is None) == (not info["cuda"])
    assert info["cuda_requested"] in ("0", "1", "auto", None)  # None: not built by setup.py
    assert (info["cuda_error"] is None) == info["cuda"]


def test_cuda_part_is_compiled_where_its_toolchain_is():
    info = dearcomm.build_info()
    verdict, why = cuda_build_verdict(info, cuda_toolchain_missing())
    if verdict == "skip":
        pytest.skip(why)
    assert verdict == "pass", why
    assert info["nccl_version"].count(".") == 2


GOOD_TOOLCHAIN = []


@pytest.mark.parametrize("info, missing, expected, reason", [
    (dict(cuda=False, cuda_requested="0", cuda_skipped="DEARCOMM_CUDA=0"), GOOD_TOOLCHAIN, "skip", "DEARCOMM_CUDA=0"),
    (dict(cuda=False, cuda_requested="auto", cuda_skipped="nvcc was not found"), GOOD_TOOLCHAIN, "fail",
     "setup.py skipped it (DEARCOMM_CUDA=auto): nvcc was not found"),
    (dict(cuda=False, cuda_requested="auto", cuda_skipped=None, cuda_error="undefined symbol: ncclSend"),
     GOOD_TOOLCHAIN, "fail", "does not load: undefined symbol: ncclSend"),
    (dict(cuda=False, cuda_requested=None, cuda_skipped=None), GOOD_TOOLCHAIN, "fail", "recorded nothing"),
    (dict(cuda=False, cuda_requested="auto", cuda_skipped="no nvcc"), ["no nvcc"], "skip", "no CUDA toolchain"),
    (dict(cuda=True, nccl_version="2.30.7", cuda_requested="auto", cuda_skipped=None), GOOD_TOOLCHAIN, "pass", ""),
], ids=["disabled-on-purpose", "skipped-by-setup", "built-but-does-not-load", "no-record", "no-toolchain", "built"])
def test_the_build_check_fails_only_a_build_that_lost_its_cuda_part(monkeypatch, info, missing, expected, reason):
    """The check above, on builds it does not see here: a build that should
    have its CUDA part but lacks it fails, saying why, whatever DEARCOMM_CUDA
    is set to when the tests run; DEARCOMM_CUDA=0 at build time skips."""
    monkeypatch.setenv("DEARCOMM_CUDA", "0")
    verdict, why = cuda_build_verdict(info, missing)
    assert verdict == expected and reason in why, (verdict, why)


def test_cuda_parameters_without_cuda_part_name_the_fix(monkeypatch):
    from dearcomm import _cuda
    monkeypatch.setattr(_cuda, "load", lambda: None)
    try:
        _cuda.nccl_backend(None, torch.device("cuda", 0), None)
    except NotImplementedError as e:
        assert "no CUDA/NCCL backend" in str(e) and "DEARCOMM_CUDA=1 pip install" in str(e)
    else:
        raise AssertionError("expected NotImplementedError")
