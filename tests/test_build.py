"""The build: the CPU part always; the CUDA/NCCL part wherever its toolchain
exists, GPU or not. CI fails here if the CUDA part silently stopped compiling."""
import os
import shutil

import torch

import dearcomm


def cuda_toolchain_present():
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    try:
        import nvidia.nccl  # noqa: F401  (the wheel torch's CUDA build depends on)
        has_nccl = True
    except ImportError:
        has_nccl = False
    has_nvcc = os.path.exists(os.path.join(cuda_home, "bin", "nvcc")) or shutil.which("nvcc") is not None
    return torch.version.cuda is not None and has_nvcc and has_nccl and os.environ.get("DEARCOMM_CUDA") != "0"


def test_build_info_describes_the_build():
    info = dearcomm.build_info()
    assert info["torch"] == torch.__version__
    assert isinstance(info["cuda"], bool)
    assert (info["nccl_version"] is None) == (not info["cuda"])


def test_cuda_part_is_compiled_where_its_toolchain_is():
    if not cuda_toolchain_present():
        assert not dearcomm.build_info()["cuda"] or torch.version.cuda is not None
        return
    info = dearcomm.build_info()
    assert info["cuda"], "nvcc, NCCL and a CUDA torch are here, but dearcomm._C_cuda was not built or does not load"
    assert info["nccl_version"].count(".") == 2


def test_cuda_parameters_without_cuda_part_name_the_fix(monkeypatch):
    from dearcomm import _cuda
    monkeypatch.setattr(_cuda, "load", lambda: None)
    try:
        _cuda.nccl_backend(None, torch.device("cuda", 0), None)
    except NotImplementedError as e:
        assert "no CUDA/NCCL backend" in str(e) and "DEARCOMM_CUDA=1 pip install" in str(e)
    else:
        raise AssertionError("expected NotImplementedError")
