"""Marks a test module as needing a GPU and dearcomm's CUDA part."""
import pytest
import torch

import dearcomm

HAVE_GPU = torch.cuda.is_available() and dearcomm.build_info()["cuda"]
requires_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU and dearcomm's CUDA/NCCL part"),
]
